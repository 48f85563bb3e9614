"""RecurrentCache: a ChatSession's cache where the model's memory holds a recurrent state.

A hybrid (Qwen3.5, LFM2, Granite-4.0-H, ...) or recurrent (Mamba) model's
state is that of its last token (engine/memory.py): a prompt is reused only
where it goes on from the cached tokens, and a cut back is made natively only
right after a decode whose last tokens the context snapshotted (a draft's
check), else from a checkpoint the session made while evaluating
(engine/checkpoints.py), else not at all.  Every cut is read back
(``llama_memory_seq_pos_max``) before it is trusted: libllama answers true to
cuts it did not make.

Everything here reads and writes the session's state (engine/session.py:
``cached``, its sequences, its memory's lock), so it is a base class of
ChatSession, as engine/generate.py's Generation is.
"""

import logging

from ..errors import DecodeError
from . import cachereuse

log = logging.getLogger("offgrid.session")


class RecurrentCache:
    """ChatSession's cache for a memory with recurrent state."""

    def _prepare_state(self, tokens, cache_prompt, need_logits):
        """_prepare_cache where the memory holds a recurrent state: only a prefix
        of the cache is reused, and a state cannot be cut back (beyond the
        last draft's snapshots), so a prompt that diverges inside the cached
        tokens restarts from the latest checkpoint at or before the divergence
        (or from nothing).  Every cut is read back before it is trusted."""
        if cache_prompt and self.states is not None:
            self._swap_state(tokens, 0, need_logits)
        if not cache_prompt or not self.cached:
            return self._clear_plan()
        last = len(tokens) - (1 if need_logits else 0)
        keep = min(self.common_prefix(tokens), last)
        if keep < len(self.cached):
            if not (len(self.cached) - keep <= self._rollback_ok and self._cut_state(keep)):
                keep = self._restore_checkpoint(tokens, keep)
        self._rollback_ok = 0
        if keep <= 0:
            return self._clear_plan()
        self.cached = list(tokens[:keep])
        return cachereuse.ReusePlan(keep)

    def _cut_state(self, n):
        """Cut the session's sequences back to their first ``n`` tokens; True
        only where the cut is made and reads back as made (at the positions
        of engine/positions.py, which M-RoPE images make other than indices)."""
        at = self.positions.at
        with self._mem.locked() as memory:
            ok = all([memory.seq_rm(q, at(n), -1) for q in (self._seq, self._gap, self._pin)])
            return ok and memory.seq_pos_max(self._seq) == self.positions.last(n)

    def _checkpoint(self, n):
        """Keep the recurrent part of the state after the first ``n`` cached tokens."""
        with self._mem.locked() as memory:
            if memory.seq_pos_max(self._seq) != self.positions.last(n):
                return
            data = self._ctx.seq_state(self._seq, partial=True)
        if data is not None:
            self.checkpoints.add(self.cached[:n], data)

    def _restore_checkpoint(self, tokens, limit):
        """Bring the sequence back to the latest checkpoint that ``tokens`` start
        with, at most ``limit`` tokens in; how many tokens it holds (0: none)."""
        c = self.checkpoints.best(tokens, limit) if self.checkpoints is not None else None
        if c is None:
            return 0
        n = len(c.tokens)
        # (a prefix of the prompt: its images' positions are known)
        placed = self._positions_of(c.tokens)
        with self._mem.locked() as memory:
            for q in (self._gap, self._pin):
                memory.seq_rm(q, -1, -1)
            ok = placed is not None \
                and self._ctx.set_seq_state(self._seq, c.data, partial=True) \
                and memory.seq_rm(self._seq, placed.at(n), -1) \
                and memory.seq_pos_max(self._seq) == placed.last(n)
        if not ok:
            log.warning("libllama refused a checkpoint of %d tokens; it is dropped", n)
            self.checkpoints.forget(c)
            self._mem.rm(-1, -1)
            return 0
        self.checkpoints.restored += 1
        self.positions = placed
        return n

    def _usable(self, tokens, need_logits):
        """How many of ``tokens`` a recurrent model's cache gives them (_prepare_state):
        all it shares where they go on from its end, else its latest checkpoint."""
        last = len(tokens) - (1 if need_logits else 0)
        n = min(self.common_prefix(tokens), last)
        if n == len(self.cached):
            return n
        c = self.checkpoints.best(tokens, n) if self.checkpoints is not None else None
        return len(c.tokens) if c is not None else 0

    def _checkpoint_before_check(self, pos):
        """Before a draft's check at ``pos`` where the state keeps no snapshots
        (memory.replays): the state after the first ``pos`` tokens, for
        _replay_to; False where it cannot be had."""
        with self._mem.locked() as memory:
            data = self._ctx.seq_state(self._seq, partial=True) \
                if memory.seq_pos_max(self._seq) == self.positions.last(pos) else None
        self._verify = (pos, data) if data is not None else None
        return data is not None

    def _replay_to(self, n):
        """Take a recurrent state back to its first n tokens from the checkpoint made
        before the draft's check (session._decode_one): restore it, cut the
        attention's cells after it, decode the accepted tokens again."""
        verify, self._verify = self._verify, None
        ok = verify is not None and verify[0] <= n
        if ok:
            pos, data = verify
            with self._mem.locked() as memory:
                ok = self._ctx.set_seq_state(self._seq, data, partial=True) \
                    and memory.seq_rm(self._seq, self.positions.at(pos), -1) \
                    and memory.seq_pos_max(self._seq) == self.positions.last(pos)
            replay = self.cached[pos:n]
            if ok and replay:
                ok = self._decode(replay, pos, False) == 0
            ok = ok and self._mem.seq_pos_max(self._seq) == self.positions.last(n)
        if not ok:
            self.reset()
            raise DecodeError("libllama could not take a draft back", -1)
        del self.cached[n:]
