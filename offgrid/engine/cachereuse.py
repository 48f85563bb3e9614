"""Planning KV-cache reuse beyond the common prefix (chunk reuse).

An editor's next prompt is mostly its last one: the extra-context chunks are
rotated, the prefix window slides, and the line being typed changes in the
middle of the prompt while the ~500 tokens of suffix after it stay the same.
Keeping only the longest common prefix re-evaluates everything after the
first difference.  plan() finds, after that prefix, runs of at least
``min_run`` tokens that the cache already holds at other positions, so the
session can move their keys and values to where the new prompt needs them
(``llama_memory_seq_add``) instead of computing them again.

llama-server's ``--cache-reuse`` does this only for runs that close up with
the prefix (pieces removed from the old prompt).  plan() also allows new
tokens before a reused run (text inserted, as when a line is typed above the
suffix); the session evaluates such gaps in a second sequence and merges
them (see ChatSession._apply_plan).

A reused run keeps the keys and values it was computed with, i.e. attending
to the old text before it; that is the approximation every cache-reuse scheme
makes, and it is small for a keystroke's worth of change.
"""

import bisect
from dataclasses import dataclass, field
from typing import List, Tuple


@dataclass
class ReusePlan:
    """How to turn the cache into the new prompt.

    ``keep``: leading tokens kept in place.  ``runs``: (new_pos, old_pos, n)
    chunks moved from old_pos to new_pos, in prompt order.  Every position of
    the prompt not covered by keep or a run is evaluated.
    """
    keep: int
    runs: List[Tuple[int, int, int]] = field(default_factory=list)

    @property
    def reused(self):
        """Prompt tokens whose KV comes from the cache."""
        return self.keep + sum(n for _, _, n in self.runs)

    def gaps(self, n_prompt):
        """(start, end) ranges of the prompt to evaluate, in order; the last is the tail."""
        out, pos = [], self.keep
        for new, _, n in self.runs:
            if new > pos:
                out.append((pos, new))
            pos = new + n
        if pos < n_prompt:
            out.append((pos, n_prompt))
        return out


def common_prefix(a, b):
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    # compare in slices first: prompts of thousands of tokens share long
    # runs, and slice equality runs in C
    step = 256
    while i + step <= n and a[i:i + step] == b[i:i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def plan(cached, prompt, min_run=0, need_logits=True):
    """A ReusePlan for evaluating ``prompt`` on a cache holding ``cached``.

    The last prompt token is not reused when ``need_logits``: its logits are
    what the first generated token is sampled from.  With ``min_run`` 0 only
    the common prefix is kept.
    """
    keep = min(common_prefix(cached, prompt), len(prompt) - (1 if need_logits else 0))
    result = ReusePlan(max(keep, 0))
    if min_run <= 0 or keep < 0 or not cached:
        return result
    last = len(prompt) - 1          # runs must end before the last token
    # Where each short key (the first few tokens of a possible run) starts in
    # the cache after the prefix; candidates are then extended and checked
    # against min_run.  Short keys keep building the index cheap.
    k = min(min_run, 8)
    index = {}
    for c in range(keep, len(cached) - k + 1):
        index.setdefault(tuple(cached[c:c + k]), []).append(c)
    head_c = keep
    p = keep
    while p + min_run <= last:
        best = None
        starts = index.get(tuple(prompt[p:p + k]), ())
        first = bisect.bisect_left(starts, head_c)     # runs keep the cache's order
        for c in starts[first:first + _MAX_CANDIDATES]:
            n = 0
            while p + n < last and c + n < len(cached) and cached[c + n] == prompt[p + n]:
                n += 1
            if n >= min_run and (best is None or n > best[1]):
                best = (c, n)
        if best is None:
            p += 1
            continue
        c, n = best
        result.runs.append((p, c, n))
        p += n
        head_c = c + n
    return result


# Candidates examined per prompt position: repetitive text (indentation, long
# runs of one token) can put a key at hundreds of places.
_MAX_CANDIDATES = 16
