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
"""


class PromptLookup:
    """The n-grams of one request's tokens, and the drafts they give."""

    def __init__(self, tokens, n_max=3, n_min=2):
        self.tokens = list(tokens)
        self.sizes = list(range(n_max, n_min - 1, -1))
        # n -> {n-gram: index of the token that followed its latest occurrence}
        self._after = {n: {} for n in self.sizes}
        for i in range(1, len(self.tokens)):
            self._index(i)

    def _index(self, i):
        """Record that tokens[i] followed the n-grams ending at i - 1."""
        t = self.tokens
        for n in self.sizes:
            if i >= n:
                self._after[n][tuple(t[i - n:i])] = i

    def append(self, token):
        self.tokens.append(token)
        self._index(len(self.tokens) - 1)

    def draft(self, k):
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
