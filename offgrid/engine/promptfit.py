"""A fill-in-the-middle prompt fitted into a time budget (``t_max_prompt_ms``).

llama.vscode and llama.vim send ``t_max_prompt_ms`` (500 ms) with every
completion and mark it "not yet supported": llama-server ignores it, so a
cold request with 16 extra chunks spends seconds in prompt evaluation while
the user waits.  Here the worker estimates how long the prompt's uncached
part will take, from the prompt speed its decodes have shown (PromptRate),
and when that is over the budget drops, in this order, until it fits:

1. ``input_extra`` chunks, oldest (first) first;
2. prefix lines, farthest from the cursor first;
3. suffix lines, farthest from the cursor first;

each only where it costs something: a part already in the cache is free to
keep, and dropping it would move what follows it out of the cache's reach.
What was dropped comes back while the worker is idle (engine/fill.py), so
an editor's prompt grows back to its whole context between keystrokes.

The cursor's line (the last line of the prefix, the prompt, and the suffix
up to its first newline) is never dropped.  A request with ``n_predict`` 0
is an editor's warm-up, sent to bring the chunks into the cache off the
typing path: the budget does not apply to it (llama.vim sends those with
``t_max_prompt_ms`` 1).

The cost of evaluating the token at position p is taken as 1 + p/p_half
token-equivalents: attention over the p tokens before it grows with p,
and ``p_half`` (where attention costs as much as the matrix products) is
worked out from the model's shape.  Which tokens are uncached comes from
the cache plan (cachereuse.py) of the session that will most likely serve
the request.  Nothing here touches libllama: the worker hands in the
tokenizer, the layout function and the plan.
"""

import collections
import statistics

# The share of the budget an estimate aims at: the speed it rests on is the
# last requests', and a machine that got busier since then is slower.
TARGET = 0.85
# Evaluations shorter than this say little of the prompt speed: the fixed
# cost of a decode call and its output row weigh too much in them.
MIN_OBSERVED = 64
# Attention on the CPU runs at about this share of the matrix products'
# speed per flop (measured on Qwen2.5-Coder-0.5B: 1.2x the time per token
# at position 1280 as at 256, 1.7x at 2300).
ATTENTION_EFFICIENCY = 0.35
# Prompt speed assumed before any prompt was measured: this many flops per
# second per thread, well under what a current core does, so that a first
# request rather drops too much than blows its budget.
PRIOR_FLOPS_PER_THREAD = 40e9


class PromptRate:
    """A worker's prompt speed, in token-equivalents per second.

    ``observe(usage)`` after each request (any endpoint) with a long enough
    evaluation; the estimate is the median of the last few, so that a
    machine that stays busier is seen within a request or two, and one slow
    request (a page fault, a neighbour's burst) does not make the next ones
    drop what they need not.
    """

    recent = 5      # observations the median is taken over

    def __init__(self, model, n_threads):
        meta, arch = model.meta, model.meta.get("general.architecture", "")
        n_layer = _num(meta, "%s.block_count" % arch, 1) or 1
        # matrix products per token: the weights less the embedding and output rows
        weights = max(model.n_params - 2 * model.n_vocab * model.n_embd, model.n_params // 4)
        attention = 4 * n_layer * model.n_embd / ATTENTION_EFFICIENCY
        self.p_half = max(256.0, 2.0 * weights / attention)
        self.prior = n_threads * PRIOR_FLOPS_PER_THREAD / (2.0 * weights)
        self.rate = None        # measured; None until a prompt was
        self._rates = collections.deque(maxlen=self.recent)

    def cost(self, start, end):
        """Token-equivalents of evaluating positions start..end-1."""
        n = end - start
        return n * (1.0 + (start + end - 1) / 2.0 / self.p_half)

    def weight(self, pos):
        return 1.0 + pos / self.p_half

    def observe(self, usage):
        n = usage.evaluated_tokens
        if n < MIN_OBSERVED or usage.prompt_ms <= 0:
            return
        # the evaluated tokens are taken to be the prompt's last ones
        end = usage.prompt_tokens
        self._rates.append(self.cost(end - n, end) / (usage.prompt_ms / 1000.0))
        self.rate = statistics.median(self._rates)

    def ms(self, cost):
        """Milliseconds ``cost`` token-equivalents take at the current estimate."""
        return 1000.0 * cost / (self.rate or self.prior)

    def cost_of(self, ms):
        """Token-equivalents that take ``ms`` milliseconds at the current estimate."""
        return ms / 1000.0 * (self.rate or self.prior)

    def gaps_ms(self, gaps):
        return self.ms(sum(self.cost(a, b) for a, b in gaps))


def _num(meta, key, default):
    try:
        return int(meta.get(key, default))
    except (TypeError, ValueError):
        return default


def _runs(req, tokens, spans, token_bytes):
    """The prompt cut into (key, tokens) runs, in prompt order: an extra chunk
    (key ``("c", i)``), a prefix or suffix line (``("p", j)``, ``("s", j)``,
    a token going to the line its first byte is in), or what is always kept
    (None: markers, the cursor's line)."""
    lines = req.input_prefix.split("\n")
    prefix, prefix_tail = [q + "\n" for q in lines[:-1]], lines[-1]
    lines = req.input_suffix.split("\n")
    suffix_head = lines[0] + ("\n" if len(lines) > 1 else "")
    suffix = [q + "\n" for q in lines[1:-1]] + ([lines[-1]] if len(lines) > 1 else [])
    cuts = [(("c", i), a, b) for i, (a, b) in enumerate(spans["chunks"]) if b > a]
    cuts += _by_line(tokens, spans["prefix"], prefix, "p", token_bytes,
                     after=len(prefix_tail.encode()), keeps_end=True)
    cuts += _by_line(tokens, spans["suffix"], suffix, "s", token_bytes,
                     before=len(suffix_head.encode()))
    cuts.sort(key=lambda r: r[1])
    runs, pos = [], 0
    for key, a, b in cuts:
        if a > pos:
            runs.append((None, tokens[pos:a]))
        runs.append((key, tokens[a:b]))
        pos = b
    if pos < len(tokens):
        runs.append((None, tokens[pos:]))
    return runs


def _by_line(tokens, span, lines, kind, token_bytes, before=0, after=0, keeps_end=False):
    """The (key, start, end) cuts of ``span`` that belong to each line.  The
    span holds the text of ``lines`` with ``before`` bytes of kept text ahead
    of them and ``after`` behind, cut at the front if ``keeps_end`` (the
    prefix keeps its end), else at the back."""
    a, b = span
    if b <= a or not lines:
        return []
    starts, acc = [], before
    for line in lines:
        starts.append(acc)
        acc += len(line.encode("utf-8"))
    pos = 0
    if keeps_end:
        # the span is the text's end: where its first byte sits in the text
        pos = acc + after - sum(len(token_bytes(t)) for t in tokens[a:b])
    cuts, j = [], -1
    for k in range(a, b):
        if pos >= acc:
            break           # the kept text behind the lines
        while j + 1 < len(lines) and starts[j + 1] <= pos:
            j += 1
        if j >= 0:
            if cuts and cuts[-1][0] == (kind, j):
                cuts[-1][2] = k + 1
            else:
                cuts.append([(kind, j), k, k + 1])
        pos += len(token_bytes(tokens[k]))
    return [tuple(c) for c in cuts]


def _split_at(runs, keep):
    """``runs`` with the chunk that the cached prefix ends inside cut in two:
    its cached head is kept (key None) and only its tail may go.  The idle
    fill (engine/fill.py) gets a chunk into the cache a few tokens at a
    time, and a request between two of its steps must not drop the part it
    has done.  (A line, a few tokens, is not cut: at most it is done again.)"""
    pos = 0
    for i, (key, toks) in enumerate(runs):
        a, b = pos, pos + len(toks)
        if key is not None and key[0] == "c" and a < keep < b:
            return runs[:i] + [(None, toks[:keep - a]), (key, toks[keep - a:])] + runs[i + 1:]
        pos = b
    return runs


class _Costs:
    """What each run of a prompt costs under one cache plan: its tokens, its
    uncached tokens and the sum of their positions, so that the cost of
    dropping any set of runs, positions shifted down by what goes before
    them, is a sum over runs rather than tokens."""

    def __init__(self, runs, plan):
        gaps = plan.gaps(sum(len(t) for _, t in runs))
        self.rows, pos, g = [], 0, 0
        for key, toks in runs:
            a, b = pos, pos + len(toks)
            pos = b
            n_unc = pos_sum = 0
            while g < len(gaps) and gaps[g][1] <= a:
                g += 1
            k = g
            while k < len(gaps) and gaps[k][0] < b:
                lo, hi = max(a, gaps[k][0]), min(b, gaps[k][1])
                if hi > lo:
                    n_unc += hi - lo
                    pos_sum += (lo + hi - 1) * (hi - lo) // 2
                k += 1
            self.rows.append((key, b - a, n_unc, pos_sum))
        self.costly = {key for key, _, n_unc, _ in self.rows if n_unc and key is not None}

    def order(self):
        """The runs to drop, in turn, of those that cost something (a run in
        the cache is free to keep, and dropping it would move what follows
        out of the cache's reach): chunks, oldest first; prefix lines from
        the farthest; suffix lines from the farthest."""
        chunks = sorted(k for k in self.costly if k[0] == "c")
        prefix = sorted(k for k in self.costly if k[0] == "p")
        suffix = sorted((k for k in self.costly if k[0] == "s"), reverse=True)
        return chunks + prefix + suffix

    def cost(self, rate, gone):
        """Token-equivalents of the prompt without the runs in ``gone``."""
        total, shift = 0.0, 0
        for key, n, n_unc, pos_sum in self.rows:
            if key is not None and key in gone:
                shift += n
            elif n_unc:
                total += n_unc + (pos_sum - shift * n_unc) / rate.p_half
        return total

    def fewest(self, order, rate, target):
        """How many runs of ``order`` to drop, from its start, for a cost within
        ``target`` (all of them if even that is not enough): the cost falls as
        more go, so a binary search finds it."""
        lo, hi = 0, len(order)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.cost(rate, set(order[:mid])) <= target:
                hi = mid
            else:
                lo = mid + 1
        return lo


def fit(model, req, layout, plan_of, rate, budget_ms, rounds=3):
    """The FIM prompt of ``req`` fitted into ``budget_ms``: (tokens, dropped).

    ``layout(req)``: (tokens, spans) as infill.layout_infill gives them;
    ``plan_of(tokens)``: the cachereuse.ReusePlan the serving session would
    make.  What is dropped is cut out of the laid-out tokens (each run as it
    was tokenized), so the next request that drops the same finds them in
    the cache.  ``dropped`` is None when nothing was, else
    {"input_extra": n, "prefix_lines": n, "suffix_lines": n,
    "estimate_ms": the estimate for what is left}.
    """
    tokens, spans = layout(req)
    plan = plan_of(tokens)
    est = rate.gaps_ms(plan.gaps(len(tokens)))
    limit = budget_ms * TARGET
    if est <= limit:
        return tokens, None
    runs = _runs(req, tokens, spans, model.token_bytes)
    dropped = {"c": 0, "p": 0, "s": 0}
    for _ in range(rounds):
        runs = _split_at(runs, plan.keep)
        costs = _Costs(runs, plan)
        order = costs.order()
        # aim a little under: a cut can move a run out of the cache plan's reach
        k = costs.fewest(order, rate, rate.cost_of(limit) * 0.95)
        if k == 0:
            break       # nothing left that costs anything but the cursor's line
        gone = set(order[:k])
        for key in gone:
            dropped[key[0]] += 1
        runs = [(key, t) for key, t in runs if key not in gone]
        tokens = [t for _, toks in runs for t in toks]
        plan = plan_of(tokens)
        est = rate.gaps_ms(plan.gaps(len(tokens)))
        if est <= limit:
            break
    if not any(dropped.values()):
        return tokens, None
    return tokens, {"input_extra": dropped["c"], "prefix_lines": dropped["p"],
                    "suffix_lines": dropped["s"], "estimate_ms": round(est, 1)}
