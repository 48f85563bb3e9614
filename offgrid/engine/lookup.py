"""Drafts for speculative decoding, looked up in the request's own tokens.

Code completions repeat their context: identifiers, the line above, the
suffix the user is typing towards, the extra chunks of other files.  So the
draft for the next tokens is what followed the last time the request's text
(prompt and output so far) ended the way it ends now: the latest earlier
occurrence of its last ``n`` tokens (``n`` from ``n_max`` down to ``n_min``),
and the tokens after it.  This is llama.cpp's prompt lookup (ngram-simple),
kept in dicts so that each step costs a few lookups rather than a scan.

The session verifies a draft in one decode and keeps the drafted tokens only
while each equals the token its sampler picks at that position
(engine/session.py), so what is generated is what plain decoding gives.

Whether that pays depends on the text and on the machine: a decode of 1 + k
tokens costs more than one of a single token, and buys 1 + the drafted
tokens that come true.  On a CPU with few cores it costs a lot more: on 2
EPYC cores, Qwen2.5-Coder-0.5B at ~600 tokens of context, 2.3 times a
single token's decode for k = 1, 3.1 for k = 3, 4.4 for k = 7 and 5.9 for
k = 15 (every output kept; a multiple of 4 tokens is cheaper than its
neighbours, as the repacked Q4_K products take columns in fours); on a
2-core Xeon VM where generation is memory-bound, 1.4 for k = 1, 1.9 for
k = 3 and 5.3 for k = 15.  A draft must mostly come true to win
(bench/spec_bound.py measures how much drafting could win at best), so
each request learns as it goes, from the calls the session makes anyway
(``draft`` before each decode, ``append`` for each token):

* The draft length adapts: it starts at ``k_start``, doubles after a draft
  that came true entirely, and shrinks to one more than what came true
  after one that did not, so that a text whose drafts fail costs short
  verify decodes.
* Each step (the time from one ``draft`` call to the next: the decode and
  the sampling of every token it gave) is timed, drafted or not.  Once
  there are ``judge_after`` steps of each kind (steps where no n-gram
  matched are plain ones; if there are none, a few drafts are skipped to
  get them), drafting stops for the request if its tokens per second do
  not beat plain decoding's by ``win``.
"""

import time


class PromptLookup:
    """The n-grams of one request's tokens, the drafts they give, and whether
    drafting pays for this request (see the module docstring)."""

    k_start = 2         # the first drafts' length
    k_max = 64          # (the session caps each draft at its --spec-draft-n-max)
    judge_after = 4     # steps of each kind (drafted, plain) before judging
    win = 1.05          # drafting must beat plain decoding's tokens/s by this
    judges_itself = False   # the session's draft_probation rule applies too

    def __init__(self, tokens, n_max=3, n_min=2, clock=time.perf_counter):
        self.tokens = list(tokens)
        self.sizes = list(range(n_max, n_min - 1, -1))
        # n -> {n-gram: index of the token that followed its latest occurrence}
        self._after = {n: {} for n in self.sizes}
        for i in range(1, len(self.tokens)):
            self._index(i)
        self.clock = clock
        self.k = self.k_start
        self.paying = True          # False: drafting did not pay; no more drafts
        self._plain_wanted = 0      # drafts to skip, to time plain steps
        # the step since the last draft() call: its start, draft, tokens, hits
        self._step = None
        # per kind (True: drafted), [steps, tokens, seconds]
        self._seen = {True: [0, 0, 0.0], False: [0, 0, 0.0]}

    def _index(self, i):
        """Record that tokens[i] followed the n-grams ending at i - 1."""
        t = self.tokens
        for n in self.sizes:
            if i >= n:
                self._after[n][tuple(t[i - n:i])] = i

    def append(self, token):
        self.tokens.append(token)
        self._index(len(self.tokens) - 1)
        step = self._step
        if step is not None:
            draft = step[1]
            if step[3] == step[2] and step[2] < len(draft) and draft[step[2]] == token:
                step[3] += 1            # the draft came true up to here
            step[2] += 1

    def draft(self, k):
        """Up to k tokens to check with the next decode: what followed the
        latest earlier occurrence of the end, as far as drafting pays."""
        now = self.clock()
        if self._step is not None:
            self._end_step(now)
        d = []
        if self.paying and k > 0:
            if self._plain_wanted > 0:
                self._plain_wanted -= 1
            else:
                d = self.lookup(min(k, self.k))
        self._step = [now, d, 0, 0]
        return d

    def _end_step(self, now):
        start, d, n_tokens, hits = self._step
        seen = self._seen[bool(d)]
        seen[0] += 1
        seen[1] += n_tokens
        seen[2] += now - start
        if d:
            self._adapt(d, hits)
        drafted, plain = self._seen[True], self._seen[False]
        if drafted[0] < self.judge_after:
            return
        if plain[0] < self.judge_after:
            if self._plain_wanted == 0:     # time a few plain steps
                self._plain_wanted = self.judge_after - plain[0]
            return
        if drafted[2] > 0 and plain[2] > 0 and \
                drafted[1] / drafted[2] < self.win * plain[1] / plain[2]:
            self.paying = False

    def _adapt(self, d, hits):
        """The next draft's length, after draft ``d`` of which ``hits`` came true."""
        self.k = min(2 * self.k, self.k_max) if hits == len(d) else hits + 1

    def lookup(self, k):
        """Up to k tokens that followed the latest earlier occurrence of the end."""
        t = self.tokens
        if k <= 0:
            return []
        for n in self.sizes:
            if len(t) <= n:
                continue
            i = self._after[n].get(tuple(t[-n:]))
            if i is not None:
                return t[i:i + k]
        return []
