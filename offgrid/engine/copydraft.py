"""Drafts for answers that copy their prompt: edits, rewrites, next-edit windows.

An editor that asks for a window rewritten, or a chat client that asks for a
function back with a name changed, gets an answer that is mostly a copy of
text the prompt already holds, with a few changes in it.  PromptLookup
(engine/lookup.py) drafts a few tokens after the latest short n-gram that
matches; a copy wants more: the right place in the prompt (the longest match
of the text's end, not the latest of a common bigram such as an indent), and
from there long drafts along the prompt's own text while they come true.

So, over the whole context (prompt and output so far):

* Every bigram's positions are indexed as tokens arrive (a dict keyed by the
  pair, as llama.cpp's ngram-mod hashes its n-grams, but keeping every
  position).  A lookup takes the positions of the end's bigram, measures
  how far back each matches the end (up to ``match_max`` tokens) and copies
  from the best: the longest match, with a bonus for the place the copy was
  at (``_src``: where the last draft would have gone on), so that after an
  edit (a renamed name, an inserted line) the copy picks up where it left
  off rather than at an older place that matches as well.  Right after an
  edit the end's bigram may be new (the new name and what follows it); a
  single token that follows the copy's place a little further on resumes it.
* Drafts are only made from matches of at least ``min_match`` tokens (raised
  to ``need_max`` by doubling after each draft none of which came true, as
  where the answer leaves the code for prose, and halved back after one
  that all came true), and a short match drafts short (up to 3 tokens under
  4 matched, up to 7 under 8).  The lengths are those whose verify decode
  is cheap for its size (``SIZES``: 1 + k a multiple of 4, as the repacked
  Q4_K products take columns in fours): from ``k_start``, two sizes up after
  a draft that came true entirely (7, 31, 63), so a copy's long runs soon
  get long drafts; after one that did not, what came true and one more, at
  most ``k_after_miss`` (whether the copy goes on past a change is not yet
  known: a probe first).  On 2 EPYC cores a verify decode of 8, 32 and 64
  tokens costs about 4.1, 8.2 and 13 single ones (under load; 4.4 for 8 on
  a quiet host), so a draft of 63 that comes true gives ~4.8 tokens for one
  token's time, where a verify decode of 8 gives at most ~1.9.
* Whether drafting pays is judged per request as PromptLookup judges it:
  drafted steps' tokens per second against plain steps' (the steps with no
  match), after ``judge_after`` of each; a request that loses stops drafting.
  The session's own rule (draft_probation) is not applied: a draft of 63
  that fails would end a copy's drafts after one miss.

Lines out of order.  An answer may take the prompt's lines in another order
(docstrings put into stubs, methods moved, lines of its own between), and a
copy that goes on in the prompt's order fails at nearly every line end.  So
the drafter watches the line ends the text takes from the copy (``newline``:
which tokens hold a line break; the session passes it): whether the next
line follows the copy there too, told by the next line's first token that
is not an indent (``blank``: an indent the copy's next line shares says
nothing, most lines of a block start with one).  While each of the latest
four did (``in_order``, and at first), drafts go on across line ends as
above; once one did not, each line is drafted on its own (``_lookup_line``):
once a token or two of it match somewhere in the prompt or the text so far,
the rest of the matching line, up to and with its line break.  The match is
counted on the line's own tokens (the line break's token, "]:\n" or a
docstring's closing quotes with their line break, tells of the line before,
not of where this one comes from);
where several places match as well, only what they all go on with is
drafted (a later step, with more of the line, tells them apart), and the
one nearest after the latest lines' places is where the copy is taken to go
on.  Two things use the copy's order line by line: the line just after the
latest line's place is drafted whole from the line's first token, where the
latest line end of the same kind (the same line break token) went on in
order; and a whole line drafted from near a recent line's place goes on
into the lines after it while their kinds of line end did.  (An apply-edit
answer that puts docstrings into stubs: each stub's "pass" line and the
next stub come in the stubs' order, each docstring from elsewhere.)  A
change of mode starts the judge (below) afresh: the drafts are of another
kind from there.

The session verifies a draft as it verifies PromptLookup's (each drafted
token kept only while it equals what the sampler picks there, with the
same random draws in the same order), so greedy output is plain decoding's
and sampled output keeps its distribution, up to the rounding of a batched
decode (its logits differ from a single token's by up to ~0.3 here: a
near-tie may go the other way, as tests/test_speculation.py shows).
"""

import bisect
import time

from .lookup import PromptLookup

# draft lengths: a verify decode of 1 + k tokens, a multiple of 4
SIZES = (3, 7, 15, 31, 63)


class CopyDraft(PromptLookup):
    """The drafts of one request whose answer copies its prompt (see the module
    docstring); the session drives it as a PromptLookup: ``draft``, ``append``."""

    k_start = 7
    k_max = 63
    judge_after = 6         # drafted and plain steps before judging
    win = 1.0
    judges_itself = True    # the session's draft_probation rule is not applied
    match_max = 32          # tokens compared backwards from the end
    min_match = 2           # the shortest match that drafts
    k_after_miss = 7        # the longest draft after one that did not all come true
    need_max = 16           # ... and the longest it is raised to after drafts that fail
    near_bonus = 8          # a candidate near the copy's place counts as this much longer
    near_window = 48        # tokens after the copy's place that count as near it
    max_candidates = 64     # the latest positions of a bigram looked at
    long_match = 24         # a match this long drafts at the longest size at once
    rule_max = 8            # the longest change (in tokens) made again
    max_rules = 8           # changes kept

    # lines out of order (see the module docstring's last part)
    cross_window = 4        # the latest line ends on the copy that decide in_order()
    anchors_kept = 3        # places recent lines were copied from, kept as "near"

    def __init__(self, tokens, k_max=None, clock=time.perf_counter, newline=None, blank=None):
        # newline(token): whether a token's text holds a line break (None: the
        # drafter knows no lines, and copies as if they came in order);
        # blank(token): whether its text is only white space (an indent),
        # which says nothing of which line comes next
        self._newline = newline
        self._blank = blank
        self._nl_cache = {}
        self._blank_cache = {}
        self._crossings = []    # recent line ends on the copy: did the next line follow?
        self._cross_at = None   # the copy's place after a line end just taken from it
        self._in_order = True   # see in_order()
        self._anchors = []      # where the copy was at the latest line ends, latest last
        # the line break token (its text: ":\n", "\n\n", ...) -> whether the
        # latest line end of that kind on the copy went on in the copy's order
        self._kind_order = {}
        self._cross_kind = None
        self._pairs = {}        # (a, b) -> [i: tokens[i-2:i] == (a, b)], ascending
        self._firsts = {}       # a -> [i: tokens[i-1] == a], ascending (resyncing only)
        self._src = None        # the copy's place: the token of the prompt due next
        self._after = []        # the copy's place after each token of the last draft
        self._div = None        # (copy's place, index in tokens) where the text left it
        self._rules = []        # [(old, new)]: changes the text made to the copy, latest first
        self._last_match = 0
        self._need = self.min_match     # the match a draft needs now (see _adapt)
        self._guessed = False   # the last draft was a line's by its order alone
        self._cap = self.k_max
        super().__init__(tokens, clock=clock)
        if k_max is not None:
            self.k_max = k_max
        self.k = min(self.k_start, self.k_max)

    def draft(self, k):
        self._cap = k       # the session's cap: lookup() may draft up to it at once
        return super().draft(k)

    def _index(self, i):
        t = self.tokens
        self._firsts.setdefault(t[i - 1], []).append(i)
        if i >= 2:
            self._pairs.setdefault((t[i - 2], t[i - 1]), []).append(i)

    def append(self, token):
        step = self._step
        j = step[2] if step is not None else 0
        on_draft = step is not None and step[3] == j and j < len(step[1]) \
            and step[1][j] == token
        super().append(token)
        # the copy's place moves on with each token the text takes from it,
        # and stays where the text departs from it (an edit), until a lookup
        # finds the copy again a little further on (see _resync)
        if on_draft:
            self._src, self._div = self._after[j], None
        elif self._src is not None and self._div is None:
            i = len(self.tokens) - 1
            if self._src < i and self.tokens[self._src] == token:
                self._src += 1
            else:
                self._div = (self._src, i)
        if self._newline is not None:
            self._watch_lines(token)

    def _is_newline(self, token):
        nl = self._nl_cache.get(token)
        if nl is None:
            nl = self._nl_cache[token] = bool(self._newline(token))
        return nl

    def _is_blank(self, token):
        if self._blank is None:
            return False
        b = self._blank_cache.get(token)
        if b is None:
            b = self._blank_cache[token] = bool(self._blank(token))
        return b

    def _watch_lines(self, token):
        """After a line end the text took from the copy, whether the next line
        follows it there too (the copy comes in order) or not: told by the
        line's first token that is not an indent (an indent the copy's next
        line shares says nothing: most lines of a block start with it)."""
        at, self._cross_at = self._cross_at, None
        if at is not None and at + 1 < len(self.tokens) and self.tokens[at] == token \
                and self._is_blank(token) and not self._is_newline(token):
            self._cross_at = at + 1     # the verdict waits for the line's first word
        elif at is not None:
            c = self._crossings
            c.append(self.tokens[at] == token)
            self._kind_order[self._cross_kind] = c[-1]
            del c[:-self.cross_window]
            was, self._in_order = self._in_order, all(c)
            if was != self._in_order:
                # drafts of another kind from here: judged afresh
                self.paying, self._plain_wanted = True, 0
                self._seen = {True: [0, 0, 0.0], False: [0, 0, 0.0]}
        if self._is_newline(token) and self._src is not None and self._div is None:
            self._cross_at, self._cross_kind = self._src, token
            self._anchors = self._anchors[-(self.anchors_kept - 1):] + [self._src]

    def in_order(self):
        """Whether lines come in the copy's order: at first, and while each of
        the latest ``cross_window`` line ends on the copy was followed by the
        copy's next line (one that was not makes it False, until as many in a
        row were again)."""
        return self._in_order

    def _adapt(self, d, hits):
        if hits == len(d):
            self.k = _size_above(_size_above(len(d), self.k_max), self.k_max)
            self._need = max(self.min_match, self._need // 2)
        else:
            # whether the copy goes on past this change is not known: a
            # probe first, and long drafts again once it comes true
            self.k = min(_size_at_least(hits + 1, self.k_max), self.k_after_miss)
            if hits == 0 and not self._guessed:
                # (a line guessed by the copy's order alone that was not: its
                # kind of line end learns that, not the matches)
                # the text has left the copy (prose after the code, a new
                # line of the model's own): only a longer match drafts now
                self._need = min(self.need_max, self._need * 2)

    def _match_len(self, i, limit):
        """How many tokens before position i equal the ones before the end."""
        t = self.tokens
        n, end = 0, len(t)
        while n < limit and i - 1 - n >= 0 and t[i - 1 - n] == t[end - 1 - n]:
            n += 1
        return n

    def lookup(self, k):
        """Up to k tokens copied from the best place the end matches."""
        t = self.tokens
        end = len(t)
        if k <= 0 or end < 2:
            return []
        if self._newline is not None and not self.in_order():
            return self._lookup_line(k)
        src = self._src
        best, best_score, best_len = None, -1, 0
        cands = self._pairs.get((t[-2], t[-1]), ())
        look = cands[-self.max_candidates:]
        if src is not None and len(cands) > self.max_candidates:
            # the ones near the copy's place, however many there are
            a = bisect.bisect_left(cands, src)
            look = cands[a:bisect.bisect_right(cands, src + self.near_window, a)] + look
        for i in look:
            if i >= end:
                continue
            n = self._match_len(i, self.match_max)
            score = n + (self.near_bonus if src is not None and src <= i <= src + self.near_window
                         else 0)
            if score > best_score or (score == best_score and i > best):
                best, best_score, best_len = i, score, n
        matched = best_len
        if src is not None and (best is None or best_score < self.near_bonus + self.min_match):
            # after an edit: the end's last token a little past the copy's place
            firsts = self._firsts.get(t[-1], ())
            j = bisect.bisect_left(firsts, src)
            if j < len(firsts) and firsts[j] <= min(src + self.near_window, end - 1):
                if best is None or best_score < 1 + self.near_bonus:
                    best, best_len, matched = firsts[j], self.min_match, 1
        self._last_match = best_len
        if best is None or best_len < self._need:
            return []
        if best_len < 4:
            k = min(k, SIZES[0])
        elif best_len < 8:
            k = min(k, SIZES[1])
        elif best_len >= self.long_match:
            # a long stretch already copied: the copy is sure, draft long at once
            k = max(k, min(self._cap, self.k_max))
        if self._div is None or src <= best <= src + self.near_window:
            self._resync(best, matched)
            self._src = best
        # else a jump elsewhere while the text is away from the copy: the
        # copy's place stays for the resync, unless the jump's draft comes true
        d, self._after = self._copy(best, k)
        return d

    def _lookup_line(self, k):
        """Lines out of order: the rest of the line the current line matches from
        its start (or from anywhere in it), wherever that line is, and no further.

        Once the line has a token or two of its own, the places those match
        are its candidates (a single token: the places it starts a line),
        counted only back to the line break (the last line says nothing about
        which comes next), the nearest after one of the latest lines' places
        counting as nearer.  The one just after the latest line's place is the
        copy's order: it is drafted where the latest line end of this kind went
        on in order.  Otherwise, where the best candidates go on differently,
        only what they share is drafted: a later step, with more of the line,
        tells them apart.
        """
        t = self.tokens
        end = len(t)
        ls = end - 1
        while ls >= 0 and end - ls < self.match_max and not self._is_newline(t[ls]):
            ls -= 1
        n_line = end - ls           # the line so far, with the line break before it
        n_own = n_line - 1          # ... without it: the break's token ("]:\n",
        # '."""\n') tells of the line before, not of where this one comes from
        if n_own < 1:
            self._last_match = 0
            return []
        near = self._anchors + ([self._src] if self._src is not None else [])
        if n_own == 1:
            # one token of the line: the places it starts a line
            cands = self._firsts.get(t[-1], ())
        else:
            cands = self._pairs.get((t[-2], t[-1]), ())
        look = list(cands[-self.max_candidates:])
        if len(cands) > self.max_candidates:
            for a in near:
                lo = bisect.bisect_left(cands, a)
                look += cands[lo:bisect.bisect_right(cands, a + self.near_window, lo)]
        # the longest matches (the copy goes on at the one nearest after the
        # latest lines' places, the latest of them, where there is one)
        far = self.near_window + 1
        best_score, best = (-1, -far, -1), []
        for i in set(look):
            if i >= end or (n_own == 1 and not (i >= 2 and self._is_newline(t[i - 2]))):
                continue
            n = self._match_len(i, n_own)
            if n < best_score[0]:
                continue
            gap = min([i - a for a in near if a <= i <= a + self.near_window] or [far])
            score = (n, -gap, i)
            if n > best_score[0]:
                best = []
            best.append(i)
            best_score = max(best_score, score)
        if not best:
            self._last_match = 0
            return []
        n, gap, p = best_score
        self._last_match = n
        # the line the copy's order gives (the one after the latest line's
        # place) among the best, where the latest line end of this kind went
        # on in order: the copy goes on there, from the line's first token
        kind = t[ls] if ls >= 0 else None
        follows = self._anchors[-1] + n_own if self._anchors else None
        self._guessed = False
        if follows in best and self._kind_order.get(kind, True):
            # (the order told it from other places as like it: a guess)
            self._guessed = len(best) > 1
            p, best = follows, [follows]
        elif n + (n_own == 1) < max(self.min_match, self._need):
            # (a line's first token counts with its place at a line start:
            # as a match of two tokens)
            return []
        # the line's rest whatever self.k is now: a miss in one line says
        # little about the next one's, and the line's end bounds the draft
        d, after = self._copy(p, min(self._cap, self.k_max))
        # to the end of the source's line: the next line may come from anywhere
        for j, tok in enumerate(d):
            if self._is_newline(tok):
                del d[j + 1:], after[j + 1:]
                break
        # only what every best candidate would draft
        for q in best:
            m = 0
            while m < len(d) and q + m < end and t[q + m] == d[m]:
                m += 1
            del d[m:], after[m:]
        # a whole line (the text's line is the start of the source's) drafted
        # from a place near the latest lines': on into
        # the lines after it while the latest line end of each kind went on in
        # order there (a block's lines that come as they are, after a line of
        # the model's own or from elsewhere)
        whole = n == n_own and p - n_own >= 1 and self._is_newline(t[p - n_own - 1])
        if d and whole and gap > -far and self._is_newline(d[-1]):
            limit = min(self._cap, self.k_max)
            while len(d) < limit and self._kind_order.get(d[-1]) and after[-1] < end:
                more, more_after = self._copy(after[-1], limit - len(d))
                for j, tok in enumerate(more):
                    if self._is_newline(tok):
                        del more[j + 1:], more_after[j + 1:]
                        break
                if not more:
                    break
                d += more
                after += more_after
                if not self._is_newline(d[-1]):
                    break
        if len(d) < 2:
            return []
        self._src, self._div = p, None
        self._after = after
        return d

    def _resync(self, p1, matched):
        """The copy goes on at p1, after ``matched`` tokens that match the end:
        where the text had left it a little before, what it wrote instead of
        the prompt's tokens in between is a change it may make again (a name
        renamed, a call changed), and later drafts make it (see _copy)."""
        div, self._div = self._div, None
        if div is None:
            return
        p0, o0 = div
        end = len(self.tokens)
        if not p0 <= p1 - matched or o0 > end - matched:
            return
        old = tuple(self.tokens[p0:p1 - matched])
        new = tuple(self.tokens[o0:end - matched])
        # a deletion or a long span is more likely a wrong resync than a change
        # worth making again
        if old and new and old != new and len(old) <= self.rule_max \
                and len(new) <= self.rule_max:
            self._rules = [(old, new)] + [r for r in self._rules if r[0] != old]
            del self._rules[self.max_rules:]

    def _copy(self, p, k):
        """Up to k tokens of the prompt from p on, with the changes the text made
        before made again; and the copy's place after each."""
        t, rules = self.tokens, self._rules
        end = len(t)
        d, after = [], []
        q = p
        while len(d) < k and q < end:
            for old, new in rules:
                if t[q] == old[0] and tuple(t[q:q + len(old)]) == old:
                    part = new[:k - len(d)]
                    d.extend(part)
                    after.extend([q] * len(part))
                    if len(part) == len(new):
                        q += len(old)
                        if part:
                            after[-1] = q
                    break
            else:
                d.append(t[q])
                after.append(q + 1)
                q += 1
                continue
            if len(d) >= k:
                break
        return d, after


def _size_above(n, k_max):
    for s in SIZES:
        if s > n:
            return min(s, k_max)
    return min(SIZES[-1], k_max)


def _size_at_least(n, k_max):
    for s in SIZES:
        if s >= n:
            return min(s, k_max)
    return min(SIZES[-1], k_max)


# -- which requests draft, and with what ------------------------------------

# markers of the editors' next-edit prompts: a window of a file to write out
# again (Sweep's and Zed's <|file_sep|> blocks, Zeta's editable region)
EDIT_MARKERS = ("<|file_sep|>", "<|editable_region_start|>", "<|user_cursor_is_here|>")
FENCE_MIN_LINES = 5     # a quoted code block at least this long


def carries_answer(text):
    """Whether a prompt holds most of its answer: an editor's next-edit window
    or code quoted in full (a fenced block of FENCE_MIN_LINES lines or more),
    as an apply-edit or rewrite request quotes what it wants back changed."""
    if any(m in text for m in EDIT_MARKERS):
        return True
    start = text.find("```")
    while start >= 0:
        body = text.find("\n", start)
        end = text.find("```", body + 1) if body >= 0 else -1
        if end < 0:
            return False
        if text.count("\n", body, end) >= FENCE_MIN_LINES:
            return True
        start = text.find("```", end + 3)
    return False


def drafter_for(spec_type, chat, fim, prompt_text):
    """The drafter a request gets under --spec-type (request.SPEC_TYPES):
    "copy", "lookup" or "" (none).  ``prompt_text()`` gives the prompt's text.

    Every type but none drafts a prompt that carries its answer with
    CopyDraft; the others keep their meaning for the rest: ``edits`` (the
    default) drafts nothing else, ``auto`` looks up drafts for /completion
    and fill-in-the-middle, ``ngram-simple`` for every request, ``ngram-mod``
    drafts every request as a copy, ``draft-simple`` the others with the
    draft model (-md; "lookup": the session's own drafter, which is then the
    draft model's).
    """
    if spec_type == "none":
        return ""
    if spec_type == "ngram-mod":
        return "copy"
    if not fim and carries_answer(prompt_text()):
        return "copy"
    if spec_type in ("ngram-simple", "draft-simple") or (spec_type == "auto" and not chat):
        return "lookup"
    return ""
