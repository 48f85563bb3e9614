"""StateCache: prompt states kept beside a worker's sessions, to be restored into any of them.

A session keeps one prompt in its KV cache (session.py).  On a CPU the
prompt's evaluation is most of a request's time, so two clients taking turns
on one session (two conversations, an editor and a chat on ``-np 1``) each
pay their whole prompt again every turn: each request's prompt overwrites
the other's.  llama-server keeps recent prompt states in host memory
(``--cache-ram``); so does this: when a session is about to lose most of
what it holds, it copies that sequence's cells out first (libllama's
``llama_state_seq_get_data``: positions, keys and values), and when a
request's prompt shares more with a kept state than with the session's own
cache, the session restores that state first (``llama_state_seq_set_data``)
and then goes on as usual: prefix, chunk reuse, the new tail.

A state is of one LoRA adapter set (``adapters``, its key: engine/adapters.py)
and serves only a request of that set: the same tokens under another set
have other keys and values.  States of an adapter set stay in memory; only
the base model's go to disk (their files name no adapter).

A state is only ever restored into a context of the worker that saved it
(same model, same ``-c``, same cache types: one ``llama_context`` for all
its sessions), into whichever session asks.  The states on disk
(statedisk.py) carry what they need to check the same before they come back.

Size: a state is the sequence's whole cache, a few KiB to a few hundred KiB
per token (Qwen2.5-Coder-0.5B: 12 KiB a token, f16 keys and values of 24
layers of 2 heads of 64), so the cache is bounded in bytes; the least
recently used states go first.  A state that another contains (its tokens a
prefix of the other's) is dropped when the other is kept, as llama-server
does, and so is one that differs from the other in its last few tokens only
(``replaces``): a conversation's next turn behind the same long prompt,
which would otherwise keep that prompt twice for a tail that costs little
to evaluate.  The new copy is written into the dropped one's memory.

Threads: every session of the worker calls in, each on its own request's
thread; one lock guards the table.  The copies themselves run under the
decoder's lock (the session's memory operations), not this one.
"""

import collections
import logging
import threading
import time

from . import cachereuse

log = logging.getLogger("offgrid.statecache")

MIB = 1 << 20
# The default bound: llama-server's --cache-ram default, and no more than a
# quarter of the memory free when the worker starts (server/models/launch.py).
DEFAULT_LIMIT_MIB = 8192
# A session keeps what it holds unless a new prompt would keep less than
# this share of it (llama-server's f_keep < 0.5: an editor's next keystroke
# keeps most of the last prompt and saves nothing).
SAVE_BELOW = 0.5
# States shorter than this are not worth a copy: they cost little to evaluate.
MIN_TOKENS = 32
# A kept state is replaced by a new one that shares all of it but at most
# this many tokens at its end (and an eighth of it): re-evaluating them costs
# a fraction of a second at most, keeping both a whole state's memory.
TAIL_REPLACED = 64
# States whose chunk-reuse plan a lookup works out (those sharing the longest
# prefix); the others count their common prefix only.
PLANNED = 4


def replaces(tokens, old):
    """Whether a state of ``tokens`` makes the kept state of ``old`` not worth
    keeping: it contains it, or shares all of it but a short tail."""
    if len(old) > len(tokens) + TAIL_REPLACED:
        return False
    common = cachereuse.common_prefix(old, tokens)
    return len(old) - common <= min(TAIL_REPLACED, len(old) // 8)


def default_limit_mib(mem_available):
    """The bound when --cache-ram is not given: a quarter of ``mem_available``
    bytes, at most llama-server's 8 GiB."""
    if mem_available is None:
        return 1024
    return max(0, min(DEFAULT_LIMIT_MIB, int(mem_available // 4 // MIB)))


def mem_available():
    """MemAvailable from /proc/meminfo in bytes, or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class SavedState:
    """One sequence's cells as libllama wrote them, and the tokens they hold
    (positions 0..len-1).  ``data`` is None while the state is only on disk
    (``key``: its file, statedisk.py).  ``checkpoints``: a recurrent model's
    session checkpoints (engine/checkpoints.py) that lie on its tokens, which
    go with it, so that a prompt diverging inside it can still use it."""

    __slots__ = ("tokens", "data", "nbytes", "key", "checkpoints", "adapters")

    def __init__(self, tokens, data, nbytes=None, key=None, checkpoints=(), adapters=()):
        self.adapters = adapters        # the LoRA adapter key it was computed with
        self.tokens = tokens
        self.data = data
        self.nbytes = len(data) if data is not None else nbytes
        self.key = key
        self.checkpoints = list(checkpoints)

    def usable(self, tokens, n, last):
        """Of a recurrent model's state sharing ``n`` tokens with a prompt, how many
        a restore gives it: the whole state where the prompt goes on from it,
        else its latest checkpoint on the prompt (at most ``last`` tokens)."""
        if n == len(self.tokens) and n <= last:
            return n
        best = 0
        for c in self.checkpoints:
            k = len(c.tokens)
            if best < k <= min(n, last) and cachereuse.common_prefix(c.tokens, tokens) == k:
                best = k
        return best


class StateCache:
    """The states of one worker's sessions, at most ``limit`` bytes in memory."""

    def __init__(self, limit_bytes, disk=None):
        """``limit_bytes``: the bound in memory (< 0: none; 0 keeps nothing in
        memory).  ``disk``: a statedisk.StateDisk, or None."""
        self.limit = limit_bytes
        self.disk = disk
        self._lock = threading.Lock()
        self._states = collections.OrderedDict()     # id -> SavedState, least recent first
        self._next = 0
        self.bytes = 0
        # counters for /metrics and /slots
        self.hits = 0           # restores that gave a request its prompt
        self.misses = 0         # lookups that found nothing better than the session had
        self.saves = 0
        self.evictions = 0
        self.reclaims = 0       # saves written into the buffer of the state they replace
        self.failures = 0       # states libllama refused (dropped)
        # what a restore costs against what it saves: seconds per byte copied,
        # seconds per prompt token evaluated (moving averages, measured)
        self.s_per_byte = None
        self.s_per_token = None

    @property
    def enabled(self):
        return self.limit != 0 or self.disk is not None

    def __len__(self):
        with self._lock:
            return sum(1 for s in self._states.values() if s.data is not None)

    # -- measuring ------------------------------------------------------------
    def observe_copy(self, nbytes, seconds):
        if nbytes > 1 << 16:
            self.s_per_byte = _average(self.s_per_byte, seconds / nbytes)

    def observe_prompt(self, n_tokens, seconds):
        if n_tokens >= 16:
            self.s_per_token = _average(self.s_per_token, seconds / n_tokens)

    def worth_restoring(self, gain_tokens, nbytes):
        """Whether copying ``nbytes`` in beats evaluating ``gain_tokens``: by the
        measured speeds, and before they are measured whenever there is a gain
        (a copy runs at memory speed, a prompt token costs the model's every weight)."""
        if gain_tokens <= 0:
            return False
        if self.s_per_byte is None or self.s_per_token is None:
            return True
        return gain_tokens * self.s_per_token > nbytes * self.s_per_byte

    # -- the table ------------------------------------------------------------
    def wants(self, tokens, adapters=()):
        """Whether a state of ``tokens`` (under the adapter key ``adapters``) would be
        kept (not one already kept, nor contained in one kept, nor too small)."""
        if len(tokens) < MIN_TOKENS or None in tokens:
            return False
        with self._lock:
            for s in self._states.values():
                if s.adapters == adapters and len(s.tokens) >= len(tokens) and \
                        cachereuse.common_prefix(s.tokens, tokens) == len(tokens):
                    return False
        return True

    def reclaim(self, tokens, adapters=()):
        """The buffer of a kept state that a state of ``tokens`` replaces (put()
        would drop it), taken out of the cache for the new copy to be written
        into; None if there is none.  A fresh buffer of a
        4,000-token state (47 MB on Qwen2.5-Coder-0.5B) costs ~22 ms in page
        faults, libllama's copy into a used one 3 ms, and a conversation taking
        turns replaces its own older state every turn."""
        with self._lock:
            for k, s in self._states.items():
                if isinstance(s.data, bytearray) and s.adapters == adapters \
                        and replaces(tokens, s.tokens):
                    self._drop(k)
                    self.reclaims += 1
                    return s.data
        return None

    def put(self, tokens, data, checkpoints=(), adapters=()):
        """Keep ``data``, the state of ``tokens`` (with a recurrent model's
        ``checkpoints`` on them); states it replaces go, then the least
        recently used ones until it fits.  False if it does not fit at all."""
        n = len(data) + sum(len(c.data) for c in checkpoints)
        if self.limit >= 0 and n > self.limit:
            return False
        tokens = list(tokens)
        with self._lock:
            for k, s in list(self._states.items()):
                if s.adapters == adapters and replaces(tokens, s.tokens):
                    self._drop(k)
            if self.limit >= 0:
                while self.bytes + n > self.limit and self._evict_oldest():
                    pass
            self._states[self._next] = SavedState(tokens, data, checkpoints=checkpoints,
                                                  adapters=adapters)
            self._next += 1
            self.bytes += n
            self.saves += 1
        return True

    def best(self, tokens, min_run, need_logits, have, exact_tail=False, whole=False,
             adapters=()):
        """The kept state that would give ``tokens`` the most from the cache, and
        how many (its cachereuse plan's ``reused``), if more than ``have`` (what
        the session's own cache gives); else (None, have).  ``exact_tail``: a
        state helps only where ``tokens`` go on from its last token or the one
        before (a model whose window cache keeps only the state's last window).
        ``whole``: only where ``tokens`` go on past its last token (a recurrent
        state is its last token's: engine/memory.py).  Only states of the adapter
        key ``adapters``."""
        with self._lock:
            states = [(k, s) for k, s in self._states.items() if s.adapters == adapters]
        # the common prefix first (slices compared in C); a chunk-reuse plan, which
        # indexes a state's every position, only for the few that share the most
        last = len(tokens) - (1 if need_logits else 0)
        scored = []
        for k, s in states:
            n = cachereuse.common_prefix(s.tokens, tokens)
            if exact_tail and n < len(s.tokens) - 1:
                continue
            if whole:
                n = s.usable(tokens, n, last)
                if n <= 0:
                    continue
            scored.append((min(n, last), k, s))
        scored.sort(key=lambda x: -x[0])
        best, best_n = None, have
        for i, (n, k, s) in enumerate(scored):
            if min_run > 0 and not exact_tail and not whole and i < PLANNED:
                n = cachereuse.plan(s.tokens, tokens, min_run, need_logits).reused
            if n > best_n:
                best, best_n = (k, s), n
        return best, best_n

    def take(self, key):
        """The state ``key`` to restore (marked most recently used), or None if it
        went meanwhile; a state only on disk is read back first (None if it
        cannot be)."""
        with self._lock:
            s = self._states.get(key)
            if s is None:
                return None
            self._states.move_to_end(key)
        if s.data is None and self.disk is not None:
            data = self.disk.read(s.key, s.tokens)
            with self._lock:
                if data is None:
                    self._drop(key)
                    return None
                if self._states.get(key) is s:
                    s.data = data
                    self.bytes += len(data)
                    while self.limit >= 0 and self.bytes > self.limit \
                            and self._evict_oldest(but=key):
                        pass
        return s

    def drop(self, key):
        """Forget a state libllama refused."""
        with self._lock:
            self.failures += 1
            self._drop(key)

    def _drop(self, key):
        s = self._states.pop(key, None)
        if s is not None and s.data is not None:
            self.bytes -= len(s.data) + sum(len(c.data) for c in s.checkpoints)

    def _evict_oldest(self, but=None):
        """Let the least recently used state in memory go; False if none.  (States
        reach the disk only when the worker goes: statedisk.py.)"""
        for k, s in self._states.items():
            if s.data is not None and k != but:
                break
        else:
            return False
        self.evictions += 1
        self._drop(k)
        return True

    def count(self, hit):
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1

    # -- on disk -------------------------------------------------------------
    def adopt_disk(self):
        """Know the states on disk (statedisk.py), not read until one is wanted."""
        if self.disk is None:
            return
        for key, tokens, nbytes in self.disk.index():
            with self._lock:
                if any(s.key == key for s in self._states.values()):
                    continue
                self._states[self._next] = SavedState(tokens, None, nbytes, key)
                self._states.move_to_end(self._next, last=False)    # oldest
                self._next += 1

    def to_disk(self, live=()):
        """Write the most recently used states (after ``live``: (tokens, data) of the
        sessions' caches now) to disk, within its bound: before the worker goes.
        States read from disk and still there stay as they are."""
        if self.disk is None:
            return 0
        with self._lock:
            kept = [(s.tokens, s.data, s.key) for s in reversed(self._states.values())
                    if not s.adapters]
        return self.disk.write_all([(t, d, None) for t, d in live] + kept)

    def stats(self):
        with self._lock:
            in_mem = [s for s in self._states.values() if s.data is not None]
            out = {"states": len(in_mem), "bytes": self.bytes,
                   "tokens": sum(len(s.tokens) for s in in_mem),
                   "hits": self.hits, "misses": self.misses, "saves": self.saves,
                   "evictions": self.evictions, "failures": self.failures,
                   "reclaims": self.reclaims}
        if self.disk is not None:
            out["disk"] = self.disk.stats()
        return out


def _average(old, new, weight=0.3):
    return new if old is None else old + weight * (new - old)


def timed():
    return time.perf_counter()
