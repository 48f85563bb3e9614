"""Checkpoints: a session's recurrent state at points a later prompt comes back to.

A model with recurrent state (engine/memory.py: hybrid, recurrent) cannot cut
its cache back to an earlier position: the state is that of the last token.
So while a prompt is evaluated the session copies the part a cut cannot give
back (``llama_state_seq_get_data_ext`` with PARTIAL_ONLY: the recurrent state,
a few MB at most, not the attention's cells) a few tokens before the prompt's
end, where the next turn of a chat or the next keystroke of an editor
diverges, and every ``step`` tokens of a long prompt.  A later prompt that
diverges inside the cached tokens restores the latest checkpoint at or before
the divergence, cuts the attention's cells after it, and evaluates from
there, as llama-server's ``--ctx-checkpoints`` do.

Each checkpoint keeps the tokens it holds, so one is used only for a prompt
that starts with them; bounded in count and bytes, the oldest goes first (the
one near the prompt's end is the newest).  Owned by one ChatSession.
"""

from . import cachereuse

# tokens before the prompt's end that the last checkpoint is made at: the
# template's closing of a turn and the opening of the next differ there
NEAR_END = 4


class Checkpoint:
    __slots__ = ("tokens", "data")

    def __init__(self, tokens, data):
        self.tokens = tokens        # the prompt tokens the state is after
        self.data = data            # the partial state (bytearray)


class Checkpoints:
    """A session's checkpoints, newest last."""

    def __init__(self, max_count=8, max_bytes=256 << 20, step=256):
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.step = step            # tokens between checkpoints inside a long prompt
        self._list = []
        self.bytes = 0
        self.made = 0               # counters for /slots and tests
        self.restored = 0

    def __len__(self):
        return len(self._list)

    def points(self, start, n_tokens):
        """Where a prompt of ``n_tokens`` evaluated from ``start`` gets checkpoints:
        every ``step`` tokens and NEAR_END before its end (ascending)."""
        out = list(range((start // self.step + 1) * self.step, n_tokens - NEAR_END, self.step))
        if n_tokens - NEAR_END > start:
            out.append(n_tokens - NEAR_END)
        return out

    def add(self, tokens, data):
        """Keep ``data`` as the state after ``tokens`` (replacing one at the same point)."""
        n = len(tokens)
        self._list = [c for c in self._list if len(c.tokens) != n]
        self._list.append(Checkpoint(list(tokens), data))
        self.made += 1
        self._bound()

    def best(self, tokens, limit):
        """The latest checkpoint whose tokens ``tokens`` start with, holding at most
        ``limit`` of them; None if none does."""
        for c in reversed(sorted(self._list, key=lambda c: len(c.tokens))):
            n = len(c.tokens)
            if 0 < n <= limit and cachereuse.common_prefix(c.tokens, tokens) == n:
                return c
        return None

    def on(self, tokens):
        """The checkpoints that lie on ``tokens`` (for a kept state of them)."""
        return [c for c in self._list
                if cachereuse.common_prefix(c.tokens, tokens) == len(c.tokens)]

    def clear(self):
        """Forget them all (the cache they lie on is gone: another adapter set)."""
        self._list = []
        self._recount()

    def forget(self, checkpoint):
        """A checkpoint libllama refused to restore."""
        self._list = [c for c in self._list if c is not checkpoint]
        self._recount()

    def _bound(self):
        self._recount()
        while self._list and (len(self._list) > self.max_count or self.bytes > self.max_bytes):
            self._list.pop(0)
            self._recount()

    def _recount(self):
        self.bytes = sum(len(c.data) for c in self._list)
