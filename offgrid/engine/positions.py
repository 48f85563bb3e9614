"""Positions: which KV position each token of a session's prompt holds.

For every model without M-RoPE media, token i of a session's tokens sits at
position i, and this module is the identity (``IDENTITY``).  A projector that
places an image by M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: libmtmd's
``mtmd_decode_use_mrope``) breaks that: an image chunk of ``n_tokens`` at
position P is decoded by libmtmd's helper with every token's first (temporal)
section at P and its row and column in the others, so all of its KV cells
hold position P (``llama_memory_seq_pos_max`` reads back P after it), and the
text after it goes on at P + n_pos, ``n_pos`` being
``mtmd_input_chunk_get_n_pos`` (max(rows, columns): fewer than its tokens).
llama-server keeps the same two counts apart (server_tokens::pos_next).

A session holds one Positions for its cached tokens and the prompt it
evaluates (a prefix of both has the same images, so the same positions),
and every decode, cut and read-back asks it: ``at(i)`` the position of
token i (the image's P for a token inside one), ``last(n)`` the position the
first n tokens' last cell holds (what seq_pos_max must read back), and
``index(p, i)``, the token a position stands for in the text run of token i.

What cannot work with such positions (moving keys: chunk reuse, context
shift) is turned off through the model's MemoryClass (``mrope_media``).  A
recurrent state's cuts and checkpoints (engine/recurrent.py) ask it too.
"""

import bisect


class Positions:
    """Token index <-> position over a token list whose M-RoPE images are ``runs``:
    [(start, end, n_pos)] in order, token indices [start, end) of each."""

    __slots__ = ("_starts", "_runs")

    def __init__(self, runs=()):
        self._starts = [r[0] for r in runs]
        # (start, end, position of the image, position of the token at end)
        out, lag = [], 0
        for start, end, n_pos in runs:
            p = start - lag
            out.append((start, end, p, p + n_pos))
            lag = end - (p + n_pos)
        self._runs = out

    def __bool__(self):
        """Whether any token is not at its own index."""
        return bool(self._runs)

    def at(self, i):
        """The position of token ``i`` (of the token that would come at ``i``)."""
        k = bisect.bisect_right(self._starts, i) - 1
        if k < 0:
            return i
        start, end, p, after = self._runs[k]
        return p if i < end else after + (i - end)

    def last(self, n):
        """The position of the last cell of the first ``n`` tokens (-1 for none)."""
        return self.at(n - 1) if n > 0 else -1

    def index(self, pos, i):
        """The token index at position ``pos`` in the text run of token ``i`` (a run of
        text tokens takes consecutive positions)."""
        return i + (pos - self.at(i))


IDENTITY = Positions()
