"""ChatSession: one llama_context that runs one request at a time.

A session keeps the tokens whose keys and values sit in its KV cache
(``cached``), so the next request only evaluates what differs: the longest
common prefix is kept, the rest of the cache is dropped, the new tail is
decoded in ``n_batch`` chunks.  Editors send a request per keystroke with a
prompt that mostly repeats the last one, so this is where their latency goes.

Generation (``complete``: sampling, drafts, text) is engine/generate.py's
part of the class, and the cache of a model with recurrent state (prefix,
checkpoints, drafts taken back) engine/recurrent.py's.

Sessions of one worker share one llama_context (engine/batch.py): each is
three sequences of its unified KV cache, and their decodes go through the
BatchDecoder, which packs the sessions that generate at the same time into
one batch per step.  A session made alone (tests, tools) gets a context of
its own.

Threading: a session is used by one thread at a time (the server's pool
hands it out); ``RequestCancel.cancel()`` may be called from any thread.
"""

import contextlib
import logging
import threading
import time

from .. import libllama
from . import cachereuse
from ..errors import ContextError, ContextFull, DecodeError, InvalidRequest
# the request's types, for the session's callers (tools and tests) to take from here
from ..request import (Completion, FinishReason, GenerationParams, RequestCancel,  # noqa: F401
                       SamplingParams, TokenProb, Usage)
from .batch import OUT_ALL, OUT_LAST, OUT_NONE, SEQS_PER_SESSION, BatchDecoder
from .checkpoints import Checkpoints
from .generate import Generation
from .media import floor_to_media
from .memory import KV_TYPES, kv_head_size_set
from .positions import IDENTITY
from .recurrent import RecurrentCache
from .placement import Placement
from .threads import DecodeThreads
from .statecache import SAVE_BELOW

log = logging.getLogger("offgrid.session")


# One decode at a time in the whole process.  ggml's worker threads spin
# while they wait at a barrier; two contexts decoding at once on the same
# cores starve each other's spinning threads, and measured here two 2-thread
# decodes on 2 cores ran 50 to 100 times slower than one.  Taking turns keeps
# each decode at full speed; a model's sessions share each step instead
# (batch.py), and its embedding context and other models take turns with it.
_DECODE_LOCK = threading.Lock()


def take_turns_with(lock):
    """Make decodes also take turns with other processes' (a context manager such as
    the worker's flock on a file the front shares among a server's workers)."""
    global _DECODE_LOCK
    _DECODE_LOCK = lock


def decode_turn():
    """The lock every decode of this process takes, whoever makes it (a session,
    the embedding context of engine/embed.py): ``with decode_turn(): ...``."""
    return _DECODE_LOCK

# Because decodes take turns, every context can run them on the same
# persistent ggml thread pool (one per thread count), rather than on threads
# ggml starts and joins inside each llama_decode.  Measured with 2 sessions
# on 2 cores: 45 tok/s with per-decode threads, 88 with one shared pool (a
# pool per context is far worse: idle pools' threads poll and steal cores).
# Pools live as long as the process, like the library: a context holds a raw
# pointer to its pool, and freeing one under a live context would crash.
# They are keyed by count and placement: -C/-Cb and the like may place the
# generation's and the batch's threads apart (engine/placement.py).
_POOLS = {}
_POOLS_LOCK = threading.Lock()
_PLACEMENTS = (Placement(), Placement())     # (generation, batch): place_threads


def place_threads(generation, batch):
    """The worker's Placements for its generation and its batch pools (from its
    settings), before any pool is made: every DecodeThreads of the process uses them."""
    global _PLACEMENTS
    _PLACEMENTS = (generation, batch)


def shared_pool(lib, n_threads, placement=Placement()):
    """The process's ThreadPool of ``n_threads`` placed so (made on first use), for any
    context."""
    with _POOLS_LOCK:
        pool = _POOLS.get((n_threads, placement))
        if pool is None:
            pool = _POOLS[n_threads, placement] = libllama.ThreadPool(
                lib, n_threads, poll=placement.poll, cpus=placement.cpus,
                strict=placement.strict, prio=placement.prio)
        return pool


def pause_pools():
    """Every pool's workers to sleep until its next decode (ThreadPool.pause).
    The caller holds the decode turn (no decode runs on a pool it pauses):
    the worker's FileTurns, when another model's worker waits for the turn."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
    for pool in pools:
        pool.pause()


def decode_threads(model, n_threads=None, n_threads_batch=None):
    """One worker's DecodeThreads (engine/threads.py), on the shared pools:
    its sessions take turns, so they share one choice of thread counts."""
    return DecodeThreads(lambda n, placement: shared_pool(model.lib, n, placement), n_threads,
                         n_threads_batch, placements=_PLACEMENTS)


# The sequences of a session's cache, numbered from the session's first
# (SEQS_PER_SESSION per session in a shared context).  They share cells: a
# cell holds one position's keys and values for every sequence it belongs to.
SEQ_PROMPT = 0  # the prompt and generated tokens, at positions 0..len(cached)-1
SEQ_GAP = 1     # scratch for text inserted before a reused run (_evaluate_gap)
# Every cell of SEQ_PROMPT, in a model with sliding-window attention and a
# full-size window cache (swa_full).  Such a model (gemma-3: 512 tokens) has a
# second, windowed cache, and libllama reuses any of its cells that belong to
# one sequence only and lie a window behind that sequence's last position,
# then drops the sequence's positions from its start up to that cell, even
# when the cache has room for everything.  Prompt decodes put each token in
# both sequences, so no prompt cell is ever alone, and the windowed cache
# keeps the whole prompt, as the full one does: a later request that keeps a
# prefix, or moves a run, finds the window before its first new token there.
# (Without swa_full the windowed cache holds little more than a window and
# must recycle; prefix reuse then mostly fails _window_intact.)
SEQ_PIN = 2


def context_size(model, n_ctx):
    """The cells of one session's context: -c, 0 for the model's own, never past what its
    positions are meant for (model.n_ctx_max: the trained context, or more under RoPE
    scaling)."""
    n_max = getattr(model, "n_ctx_max", model.n_ctx_train)
    if not n_ctx or n_ctx <= 0:     # 0: the model's own context, as llama-server's -c 0
        n_ctx = model.n_ctx_train if model.n_ctx_train > 0 else 4096
    return min(n_ctx, n_max) if n_max > 0 else n_ctx


def shared_decoder(model, n_sessions, n_ctx=4096, n_batch=512, n_ubatch=None, swa_full=True,
                   threads=None, n_threads=None, n_threads_batch=None, flash_attn=None,
                   kv_unified=True, n_rs_seq=0, state_copies=True, type_k="f16",
                   type_v="f16", control_vector=None):
    """The BatchDecoder of ``n_sessions`` sessions of ``n_ctx`` tokens each: one
    context whose unified cache holds n_sessions * n_ctx cells, which its
    sessions (ChatSession(..., decoder=it)) share.

    kv_unified=False (--no-kv-unified) gives each session a cache stream of
    its own instead, n_ctx cells that only its SEQS_PER_SESSION sequences see
    (libllama's llama_init_from_model_streams, scripts/patches/0005).  Where
    one session's cells lie then does not depend on the others', so its
    attention sums, and a greedy reply, are the same in every session
    (llama-server's -np without -kvu); the price is that a decode step takes
    one sequence set per stream at a time, in runs of consecutive streams
    (llama.cpp's split_equal), where the unified cache takes any mix.

    swa_full: models with sliding-window attention (gemma-3) otherwise keep
    only the last window of keys, and llama_memory_seq_rm cannot cut such a
    cache at an earlier position: every request would re-evaluate its whole
    prompt.  The full cache costs memory (n_ctx keys for every layer instead
    of a window) and buys reuse.

    n_rs_seq: on a model with recurrent state, snapshots of each sequence's
    last n_rs_seq states, so that a wrong draft of up to that many tokens is
    taken back natively (libllama keeps it 0 where the architecture cannot;
    ``decoder.memory.rollback`` says what it kept).  Each costs a copy of the
    recurrent state per sequence.  ``state_copies``: False where a sequence's
    state cannot be copied out (layers on --rpc devices): no checkpoints.
    ``type_k``, ``type_v``: the KV cache's types (-ctk, -ctv; memory.KV_TYPES).
    ``control_vector``: the model's ControlVector (engine/controlvector.py), or None.
    """
    if model.vocab_only:
        # libllama makes the context, then aborts the process at the first decode
        raise ContextError("%s was loaded vocab-only: it can tokenize but not generate"
                           % model.name)
    if threads is None:
        threads = decode_threads(model, n_threads, n_threads_batch)
    n_ctx = context_size(model, n_ctx)
    check_cache_types(model, type_k, type_v, flash_attn)
    n_gen, n_batch_threads = threads.generation.max_threads, threads.batch.max_threads
    ctx = libllama.ContextHandle(
        model.lib, model.handle, n_ctx * n_sessions, n_batch, n_ubatch or n_batch, n_gen,
        n_batch_threads, swa_full=swa_full, n_seq_max=SEQS_PER_SESSION * n_sessions,
        seq_width=2, flash_attn=flash_attn,
        seq_per_stream=0 if kv_unified or n_sessions == 1 else SEQS_PER_SESSION,
        n_rs_seq=n_rs_seq if model.memory.has_state else 0,
        type_k=KV_TYPES[type_k][0], type_v=KV_TYPES[type_v][0])
    if not ctx.ptr:
        raise ContextError("libllama could not create a context of %d tokens "
                           "(not enough memory?)" % (n_ctx * n_sessions))
    ctx.attach_threadpool(threads.pool(n_gen), threads.pool(n_batch_threads, batch=True))
    if control_vector is not None:
        try:
            control_vector.apply(ctx)
        except BaseException:
            ctx.close()
            raise
    memory = model.memory.with_context(ctx, copies=state_copies)
    decoder = BatchDecoder(ctx, threads, decode_turn, streams=not kv_unified and n_sessions > 1,
                           has_state=memory.has_state)
    decoder.memory = memory
    decoder.fills = decoder.streams and memory.leaves_no_trace
    decoder.n_ctx_session = n_ctx if n_sessions > 1 else ctx.n_ctx
    decoder.swa_full = swa_full
    decoder.type_k, decoder.type_v = type_k, type_v
    return decoder


def check_cache_types(model, type_k, type_v, flash_attn, flags=("-ctk", "-ctv")):
    """Raise ContextError for KV cache types libllama would refuse with a null context
    (llama_init_from_model's checks), naming the flag: a quantized value cache needs
    flash attention, whose quantized rows must divide each head, and a model of
    latent attention (DeepSeek-V2/V3) keeps keys and values of one type.  ``flags``: the
    two flags that gave them (a draft model's are -ctkd, -ctvd)."""
    sizes = kv_head_size_set(model.kv_meta)
    arch = model.meta.get("general.architecture", "")
    if type_k != type_v and model.meta.get("%s.attention.kv_lora_rank" % arch) is not None:
        raise ContextError("%s keeps its keys and values in one latent cache: give %s "
                           "and %s the same type, not %s and %s"
                           % (model.name, flags[0], flags[1], type_k, type_v))
    if KV_TYPES[type_v][2] > 1 and flash_attn is False:
        raise ContextError("%s %s (a quantized value cache) needs flash attention, which "
                           "-fa off turns off" % (flags[1], type_v))
    for flag, kind, size in [(flags[0], type_k, k) for k, _ in sizes] + [
            (flags[1], type_v, v) for _, v in sizes]:
        block = KV_TYPES[kind][2]
        if flash_attn is not False and size % block:
            raise ContextError("%s %s: its blocks of %d values do not divide %s's heads of "
                               "%d under flash attention (-fa off takes a quantized key cache "
                               "of any size)" % (flag, kind, block, model.name, size))


class ChatSession(Generation, RecurrentCache):
    """A share of a llama_context (its sequences of the KV cache), serving one request at a time."""

    def __init__(self, model, n_ctx=4096, n_batch=512, n_ubatch=None, n_threads=None,
                 n_threads_batch=None, swa_full=True, threads=None, draft_max=0,
                 context_shift=False, decoder=None, copy_draft_max=63, draft_model=None,
                 ctx_checkpoints=8, checkpoint_step=256):
        """``decoder``: the BatchDecoder (shared_decoder) this session is one
        member of; without it the session has a context of its own, made from
        n_ctx, n_batch, n_ubatch, swa_full and threads (the worker's
        DecodeThreads) or n_threads / n_threads_batch (None or "auto":
        adaptive, engine/threads.py).  ``draft_max``: speculative drafts of up
        to this many tokens from the request's own text (0: none; --spec-type
        ngram-simple); ``copy_draft_max`` the same for the drafts of a request
        whose answer copies its prompt (engine/copydraft.py), which are worth
        making longer; or from ``draft_model`` (an engine.draftmodel.DraftModel
        whose sequence ``index`` of this session is this session's: -md).
        ``context_shift``: a full context drops part of its past instead of
        ending the reply (--context-shift).  ``ctx_checkpoints``: a recurrent
        state's checkpoints kept (-ctxcp; 0: none), ``checkpoint_step`` tokens
        apart inside a long prompt (-cms; 0: a batch apart)."""
        self._owns_decoder = decoder is None
        if decoder is None:
            decoder = shared_decoder(model, 1, n_ctx, n_batch, n_ubatch, swa_full, threads,
                                     n_threads, n_threads_batch)
        self.model = model
        self.decoder = decoder
        self._member = decoder.member()
        self.threads = decoder.threads
        self.draft_max = draft_max
        self.copy_draft_max = copy_draft_max
        self.draft_model = draft_model
        self._ctx = decoder.ctx
        base = SEQS_PER_SESSION * self._member.index
        self._seq, self._gap, self._pin = base + SEQ_PROMPT, base + SEQ_GAP, base + SEQ_PIN
        # (not with a recurrent state: a token in two sequences couples their
        # states, which must then stay equal, and a checkpoint restores one)
        pin = decoder.swa_full and model.n_swa > 0 and not decoder.memory.has_state
        self._prompt_seqs = (self._seq, self._pin) if pin else (self._seq,)
        self._mem = _SessionMemory(decoder, (self._seq, self._gap, self._pin))
        self.n_ctx = decoder.n_ctx_session
        self.n_batch = self._ctx.n_batch
        # what the cache may do (engine/memory.py): chunk reuse moves cached
        # keys to new positions, only where the memory can cut anywhere and
        # re-rotate them (not where it holds a recurrent state)
        self.memory = decoder.memory
        self._can_shift = self.memory.moves_keys
        # a recurrent state cut back restarts from one of these (checkpoints.py)
        self.checkpoints = Checkpoints(ctx_checkpoints, step=checkpoint_step or self.n_batch) \
            if self.memory.needs_checkpoints and ctx_checkpoints > 0 else None
        # tokens of the prompt sequence that can be taken back natively now:
        # a recurrent state's snapshots are those of the last decode's tokens,
        # single use (engine/memory.py), so only after a decode with a draft
        self._rollback_ok = 0
        # (tokens, partial state) before the last draft's check, where a wrong
        # draft is taken back by a restore and a replay (memory.replays)
        self._verify = None
        # libllama.Candidates for grammar sampling and token probabilities, made on first use
        self._candidates = None
        self.cached = []        # tokens whose KV is in the cache, at positions 0..len-1
        # where those tokens sit (engine/positions.py): their indices, unless an
        # image placed by M-RoPE takes fewer positions than tokens; it describes
        # ``cached`` and the prompt under way, and every decode, cut and check asks it
        self.positions = IDENTITY
        self.n_decodes = 0              # llama_decode calls so far (for /metrics)
        # a full context drops the older half of what follows n_keep and goes on
        # (llama-server's --context-shift), where the memory can move keys
        self.context_shift = context_shift and self._can_shift
        self._progress = None           # _Progress of the prompt being evaluated, if asked
        # the Usage of the request under way; with params.timings_per_token its
        # generated count and time are kept up to date as each piece goes out
        # (the worker puts them on the piece's frame)
        self.usage = None
        self._out = -1                  # batch index of the last decode's (first) output
        self.states = None              # the worker's StateCache (use_states)
        self.media = None               # the worker's MediaStore (--mmproj; engine/media.py)
        self._spans = ()                # the media runs of the prompt being evaluated
        # the LoRA adapter key its cache was computed with (engine/adapters.py)
        self.adapters = ()
        self.closed = False

    # -- lifetime ------------------------------------------------------------
    def close(self):
        """Done with the session; a context of its own is freed (a shared one
        is its decoder's owner's to close)."""
        if not self.closed:
            self.closed = True
            if self._owns_decoder:
                self.decoder.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check_open(self):
        # a freed context is a dangling pointer to libllama: refuse, do not crash
        if self.closed:
            raise ContextError("the session is closed")

    # -- cache ---------------------------------------------------------------
    def reset(self):
        """Forget the KV cache (after a failure, the cache may be inconsistent)."""
        self._check_open()
        self._mem.rm(-1, -1)
        self.cached = []
        self.positions = IDENTITY
        self._rollback_ok = 0

    def common_prefix(self, tokens):
        """How many leading tokens of ``tokens`` this session has cached."""
        return cachereuse.common_prefix(self.cached, tokens)

    def _prepare_cache(self, tokens, cache_prompt, min_run, need_logits=True):
        """Cut and rearrange the cache for ``tokens``; returns the ReusePlan applied.

        Afterwards SEQ_PROMPT holds the plan's kept prefix at positions
        0..keep-1 and each reused run at its new position; every other cell
        is gone.  Any step libllama refuses falls back to an empty cache.
        """
        mem = self._mem
        if self.memory.has_state:
            return self._prepare_state(tokens, cache_prompt, need_logits)
        if min_run > 0 and not self._can_shift:
            min_run = 0
        plan = None
        if cache_prompt and self.states is not None:
            plan = self._swap_state(tokens, min_run, need_logits)
        if not cache_prompt or not self.cached:
            return self._clear_plan()
        if plan is None:
            plan = cachereuse.plan(self.cached, tokens, min_run, need_logits)
        if plan.keep == 0 and not plan.runs:
            return self._clear_plan()
        if self.model.n_swa > 0 and not self.decoder.swa_full \
                and (plan.runs or plan.keep < len(self.cached)):
            # a window cache that keeps only the window (--no-swa-full): a cut
            # back into it gave another text than a fresh evaluation, with
            # every position it needs still reported there (measured on a tiny
            # gemma3), so only a prompt that goes on from the cache reuses it
            return self._clear_plan()
        # drop what the plan does not keep, from the cached tokens' positions
        # (in every sequence of the session, SEQ_PROMPT and SEQ_PIN alike)
        # (runs only where keys move, so positions are indices there: memory.py)
        cursor = plan.keep
        for _, old, n in plan.runs:
            if old > cursor and not mem.rm(cursor, old):
                return self._clear_plan()
            cursor = old + n
        if not mem.rm(self.positions.at(cursor), -1):
            return self._clear_plan()   # this memory cannot be cut in the middle
        # Move the runs (SEQ_PIN shares the cells, so it moves with them).
        # Runs keep their order, so a run moving left never lands on one not
        # yet moved if those go left to right, and runs moving right go right
        # to left for the same reason.
        left = [r for r in plan.runs if r[0] < r[1]]
        right = [r for r in plan.runs if r[0] > r[1]]
        for new, old, n in left + right[::-1]:
            mem.seq_add(self._seq, old, old + n, new - old)
        if not self._window_intact(plan, len(tokens)):
            return self._clear_plan()
        self.cached = list(tokens[:plan.keep])
        return plan

    def use_adapters(self, key):
        """Run from now on with the LoRA adapter key ``key`` (engine/adapters.py).
        A cache of another key is kept as a state of that key (where the
        StateCache wants it), then dropped: its keys and values are not this
        set's, so no prefix of it may serve the next prompt."""
        if key == self.adapters:
            return
        self._check_open()
        if self.cached and self.states is not None:
            self._save_state()
        self._clear_plan()
        if self.checkpoints is not None:
            self.checkpoints.clear()
        self.adapters = key
        self._member.adapters = key

    def restored_adapters(self, key):
        """The cache just loaded (a slot file) was computed with adapter key ``key``."""
        self.adapters = key
        self._member.adapters = key

    def use_media(self, media):
        """Take images and audio through ``media`` (the worker's MediaStore).  A
        projector that places images by M-RoPE positions makes this session's
        memory one whose keys never move (engine/memory.py): no chunk reuse, no
        context shift."""
        self.media = media
        if media is not None and media.mrope and not self.memory.mrope_media:
            self.memory = self.memory.with_media(True)
            self._can_shift = self.memory.moves_keys
            self.context_shift = self.context_shift and self._can_shift

    # -- states kept beside the sessions (statecache.py) ------------------------
    def use_states(self, states):
        """Keep states in ``states`` (a StateCache shared by the worker's sessions)
        before losing most of the cache, and restore one that serves a prompt
        better than the cache does: every memory class.  Where keys cannot move
        (M-RoPE positions, or libllama says so) a state serves the prompts that
        share a prefix with it (_prepare_cache plans no moved runs); a recurrent
        model's state is its last token's, not a prefix's: restored only whole,
        for a prompt that goes on from it."""
        self.states = states if states is not None and states.enabled else None

    def _swap_state(self, tokens, min_run, need_logits):
        """Before _prepare_cache plans ``tokens``: restore the kept state that gives
        them more from the cache than this session's own cache would, where the
        copy costs less than evaluating the difference; and keep this session's
        state first if the prompt would lose most of it (or a restore replaces it).
        Returns the session's own plan for ``tokens`` where the cache is still its
        own (None after a restore, or with nothing cached)."""
        states = self.states
        plan = cachereuse.plan(self.cached, tokens, min_run, need_logits) if self.cached \
            else None
        own = plan.reused if plan is not None else 0
        if self.memory.has_state and self.cached:
            own = self._usable(tokens, need_logits)
        want = len(tokens) - (1 if need_logits else 0)
        found, n = (None, own) if own >= want else \
            states.best(tokens, min_run, need_logits, own, whole=self.memory.has_state,
                        exact_tail=self.model.n_swa > 0 and not self.memory.has_state,
                        adapters=self.adapters)
        restore = found is not None and states.worth_restoring(n - own, found[1].nbytes)
        if restore or (self.cached and own < SAVE_BELOW * len(self.cached)):
            self._save_state()
        if own >= want:
            return plan
        state = states.take(found[0]) if restore else None
        if state is None:
            states.count(False)
            return plan
        if self._restore_state(state):
            states.count(True)
        else:
            log.warning("libllama refused a kept state of %d tokens; it is dropped",
                        len(state.tokens))
            states.drop(found[0])
            states.count(False)
        return None

    def keep_prompt_state(self):
        """Copy what the cache holds into the StateCache now (if it wants it), for
        another session to restore: the choices of one prompt (engine/worker.py)."""
        if self.states is not None and not self.memory.has_state:
            self._save_state()

    def _save_state(self):
        """Copy this session's prompt sequence into the StateCache (if it wants it)."""
        tokens = self.cached
        key = self.adapters
        if not self.states.wants(tokens, key):
            return
        data = self.copy_state(reuse=lambda t: self.states.reclaim(t, key))
        if data is not None:
            self.states.put(list(tokens), data, self.checkpoints.on(tokens)
                            if self.checkpoints is not None else (), adapters=key)

    def copy_state(self, reuse=None):
        """A copy of this session's cache (ContextHandle.seq_state) that holds exactly
        ``cached``; None where there is nothing to copy, or no such copy now.
        ``reuse(tokens)``: a bytearray to write it into, or None.  Not while
        the session runs a request."""
        self._check_open()
        tokens = self.cached
        if not tokens or None in tokens:
            return None
        t0 = time.perf_counter()
        with self._mem.locked() as memory:
            # keys moved and not yet re-rotated (the next decode does that) would
            # be copied as they are, unrotated: not kept; nor a cache whose cells
            # do not hold exactly these tokens
            if self.decoder.shift_pending() \
                    or memory.seq_pos_max(self._seq) != self.positions.last(len(tokens)) \
                    or (self.memory.kind == "dense" and memory.seq_pos_min(self._seq) != 0):
                return None
            data = self._ctx.seq_state(self._seq, reuse(tokens) if reuse else None)
        if data is not None and self.states is not None:
            self.states.observe_copy(len(data), time.perf_counter() - t0)
        return data

    def load_state(self, tokens, data):
        """Make the cache hold ``data`` (a copy_state() of a session of this worker's
        context, or one checked to be of the same model and settings) as ``tokens``;
        False, and an empty cache, where libllama refuses it or its cells do not
        hold len(tokens) positions from 0."""
        self._check_open()
        if not tokens or len(tokens) >= self.n_ctx:
            self.reset()
            return False
        placed = self._positions_of(tokens)
        if placed is None:
            # an image whose positions this worker does not know: the cells'
            # positions cannot be checked, nor the text after them placed
            self.reset()
            return False
        t0 = time.perf_counter()
        n = len(tokens)
        with self._mem.locked() as memory:
            for q in (self._seq, self._gap, self._pin):
                memory.seq_rm(q, -1, -1)
            ok = self._ctx.set_seq_state(self._seq, data) \
                and memory.seq_pos_max(self._seq) == placed.last(n) \
                and (self.memory.kind != "dense" or memory.seq_pos_min(self._seq) == 0)
            if ok and self._pin in self._prompt_seqs:
                memory.seq_cp(self._seq, self._pin, -1, -1)
            if not ok:
                memory.seq_rm(self._seq, -1, -1)
        self.cached = list(tokens) if ok else []
        self.positions = placed if ok else IDENTITY
        self._rollback_ok = 0
        if ok and self.states is not None:
            self.states.observe_copy(len(data), time.perf_counter() - t0)
        return ok

    def _restore_state(self, state):
        """Make this session's sequences hold ``state`` (a SavedState) and nothing
        else, with its checkpoints; False (and an empty cache) where libllama
        refuses it."""
        ok = self.load_state(state.tokens, state.data)
        if ok and self.checkpoints is not None:
            for c in state.checkpoints:
                self.checkpoints.add(c.tokens, c.data)
        return ok

    def _window_intact(self, plan, n_tokens):
        """Whether the windowed cache, if any, holds what the first token to
        evaluate attends to: [first - n_swa + 1, first).

        SEQ_PIN keeps libllama from dropping prompt cells; this checks that
        it did not, rather than evaluate with keys missing.  (llama-server
        checks only that something before ``first`` is left.)  Runs move in
        order, so what a windowed cache lacks is every position below
        llama_memory_seq_pos_min.
        """
        gaps = plan.gaps(n_tokens)
        n_swa = self.model.n_swa
        if not gaps or plan.reused == 0 or n_swa <= 0:
            return True         # nothing to evaluate, nothing reused, or no window
        pos_min = self._mem.seq_pos_min(self._seq)
        return 0 <= pos_min <= max(0, gaps[0][0] - n_swa + 1)

    def _clear_plan(self):
        # cells only, as llama-server's seq_rm: an empty cell is masked out,
        # and zeroing 72 MiB of gemma's cache took ~1 ms per cold request
        self._mem.rm(-1, -1)
        self.cached = []
        self.positions = IDENTITY
        self._rollback_ok = 0
        return cachereuse.ReusePlan(0)

    # -- running a request ---------------------------------------------------
    def evaluate(self, tokens, cancel=None, cache_prompt=True, cache_reuse=0, need_logits=True,
                 on_progress=None):
        """Bring the KV cache to ``tokens`` (see _evaluate); returns how many came
        from the cache.  A cancel (``cancel``, a RequestCancel or anything with
        ``.cancelled``) is seen between batches."""
        self._check_open()
        watch = isinstance(cancel, RequestCancel)
        if watch:
            self._member.watch(cancel)
        try:
            return self._evaluate(tokens, cancel, cache_prompt, cache_reuse, need_logits,
                                  on_progress)
        finally:
            if watch:
                self._member.unwatch()
            self._member.release()

    def fill(self, tokens, cancel, cache_reuse=0, step=16):
        """Bring the cache to ``tokens`` ``step`` tokens a decode, each step kept
        once done; returns whether all of it is cached now.

        The idle-time work of engine/fill.py: a request cuts it short at any
        point (``cancel``, a RequestCancel, is the decode's abort), and loses
        at most the step under way, where evaluate() would lose a whole batch
        (or a whole gap before a reused run).  Nothing is sampled.
        """
        self._check_open()
        self.model.check_tokens(tokens)
        if not tokens or len(tokens) >= self.n_ctx:
            return False
        self._member.watch(cancel)
        try:
            plan = self._prepare_cache(tokens, True, cache_reuse, need_logits=False)
            self.positions = IDENTITY   # (no media here: check_tokens refuses their ids)
            gaps = plan.gaps(len(tokens))
            if plan.runs:
                self.cached = _with_holes(tokens, plan, gaps)
            for start, end in gaps:
                for pos in range(start, end, step):
                    stop = min(pos + step, end)
                    if cancel.cancelled:
                        return False
                    if end == len(tokens):
                        # the gaps before are filled by now: the cache is a prefix
                        # a checkpoint at the end of the whole prompt only, not
                        # of each step's slice of it
                        done = self._evaluate_tail(tokens[:stop], pos, cancel, logits=False,
                                                   checkpoints=stop == len(tokens))
                    else:
                        done = self._evaluate_gap(tokens, pos, stop, cancel)
                        if done:
                            self.cached[pos:stop] = tokens[pos:stop]
                    if not done:
                        return False
            self.cached = list(tokens)
            return True
        finally:
            self._member.unwatch()
            self._member.release()

    def _evaluate(self, tokens, cancel=None, cache_prompt=True, cache_reuse=0, need_logits=True,
                  on_progress=None):
        """Bring the KV cache to ``tokens``; returns how many came from the cache.

        ``cache_reuse`` > 0 also reuses cached runs of at least that many
        tokens after the common prefix (see cachereuse.py).  Raises
        InvalidRequest if ``tokens`` is empty, ContextFull if it cannot fit,
        InvalidToken for an id outside the vocabulary (before anything
        reaches libllama), DecodeError on a libllama failure (the cache is
        reset).  Returns early, with a partial cache, if ``cancel`` fires.
        Without ``need_logits`` (a warm-up) a fully cached prompt decodes
        nothing at all.  ``on_progress(dict)`` gets llama-server's prompt_progress
        (``total``, ``cache``, ``processed``, ``time_ms``) before the first
        batch and after each.
        """
        self._check_open()
        spans = self._check_prompt(tokens, need_logits)     # their chunks held
        try:
            return self._evaluate_prompt(tokens, spans, cancel, cache_prompt, cache_reuse,
                                         need_logits, on_progress)
        finally:
            if spans:
                self.media.release(spans)

    def _evaluate_prompt(self, tokens, spans, cancel, cache_prompt, cache_reuse, need_logits,
                         on_progress):
        """_evaluate's work, with the prompt's media runs ``spans`` (checked)."""
        if not tokens:
            raise InvalidRequest("the prompt is empty")
        if len(tokens) >= self.n_ctx:
            raise ContextFull("the prompt has %d tokens but the context holds %d; "
                              "shorten the prompt or start the server with a larger -c"
                              % (len(tokens), self.n_ctx))
        placed = self._positions_of(tokens)     # known: its media are held
        # a media run is decoded whole, in place: no runs moved around one
        plan = self._prepare_cache(tokens, cache_prompt, 0 if spans else cache_reuse,
                                   need_logits)
        if spans:
            plan = self._media_plan(plan, spans)
        # the kept prefix is the prompt's too, its images the same, so it sits
        # where the prompt's map says
        self.positions = placed
        self._spans = spans
        gaps = plan.gaps(len(tokens))
        self._progress = _Progress(on_progress, len(tokens), plan.reused) if on_progress else None
        t0 = time.perf_counter()
        try:
            for i, (start, end) in enumerate(gaps):
                if end == len(tokens):
                    done = self._evaluate_tail(tokens, start, cancel)
                else:
                    done = self._evaluate_gap(tokens, start, end, cancel)
                    if not done:
                        self.cached = _with_holes(tokens, plan, gaps[i:])
                if not done:
                    return plan.reused
        finally:
            self._progress = None
            self._spans = ()
        self.cached = list(tokens)
        if self.states is not None:
            # the prompt speed a restore is weighed against
            self.states.observe_prompt(len(tokens) - plan.reused, time.perf_counter() - t0)
        return plan.reused

    # -- media (engine/media.py) -----------------------------------------------------
    def _check_prompt(self, tokens, need_logits):
        """Check a prompt's ids (InvalidToken before libllama sees one); returns its
        media runs, [(start, end, Span)], where the worker holds media: their chunks
        held until the caller's media.release(spans)."""
        if self.media is None or not tokens or min(tokens) >= 0:
            self.model.check_tokens(tokens)
            return []
        self.model.check_tokens([t for t in tokens if t >= 0])
        spans = self.media.layout(tokens, hold=True)
        if need_logits and spans[-1][1] == len(tokens):
            self.media.release(spans)
            raise InvalidRequest("the prompt ends with an image or audio clip: put some "
                                 "text after it")
        return spans

    def _positions_of(self, tokens):
        """The Positions of ``tokens`` (engine/positions.py), None where they hold an
        image whose positions this worker does not know."""
        return IDENTITY if self.media is None else self.media.positions(tokens)

    def _media_plan(self, plan, spans):
        """``plan`` with its kept prefix cut back to the start of a media run it
        ends inside (a run's tokens are decoded together, or not at all)."""
        keep = floor_to_media(spans, plan.keep)
        if keep == plan.keep:
            return plan
        if self.memory.has_state or not self._mem.rm(self.positions.at(keep), -1):
            return self._clear_plan()
        self.cached = self.cached[:keep]
        return cachereuse.ReusePlan(keep)

    def _decode_media(self, start, end, span):
        """Decode a media run, tokens start..end-1, from the position of ``start`` (a
        step alone); returns the status.  Encoding, when its embeddings are not kept,
        comes first, outside the step."""
        embd = self.media.embeddings(span)
        self.n_decodes += 1
        self._rollback_ok = 0
        ctx = self._ctx
        at = self.positions.at
        pos = at(start)
        status = self._member.run_alone(
            lambda: self.media.decode(ctx.ptr, span, embd, pos, self._seq),
            end - start, pos, (self._seq,))
        if status == 0 and self._pin in self._prompt_seqs:
            self._mem.seq_cp(self._seq, self._pin, pos, at(end))
        return status

    def _decode(self, chunk, i, want_logits, seq=None):
        """A prompt chunk's decode, tokens from index ``i``, into the prompt sequences
        (or ``seq`` alone); returns llama_decode's status (the logits, if asked:
        batch index _out)."""
        self.n_decodes += 1
        self._rollback_ok = 0
        seqs = self._prompt_seqs if seq is None else (seq,)
        status, self._out = self._member.decode(chunk, self.positions.at(i), seqs,
                                                OUT_LAST if want_logits else OUT_NONE, True)
        return status

    def _decode_one(self, token, pos, draft=()):
        """One generated token's decode, the token at index ``pos``, with a
        speculative draft after it (every output kept then); the token's logits
        are at batch index _out, the draft's after it."""
        self.n_decodes += 1
        self._verify = None
        if draft and self.memory.replays and not self._checkpoint_before_check(pos):
            draft = ()      # no checkpoint to take a wrong draft back to
        if draft:
            status, self._out = self._member.decode([token] + list(draft),
                                                    self.positions.at(pos),
                                                    self._prompt_seqs, OUT_ALL)
        else:
            status, self._out = self._member.decode([token], self.positions.at(pos),
                                                    self._prompt_seqs, OUT_LAST)
        # one part of a step is one ubatch (its tail is kept whole for the
        # snapshots), so a recurrent state can be taken back over its draft
        self._rollback_ok = min(len(draft), self.memory.rollback) if status == 0 else 0
        if status == 2 and self.memory.has_state:
            self.reset()        # see _evaluate_tail
        return status

    def _shift_context(self, params, n_prompt):
        """Make room in a full context, as llama-server's context shift: keep the first
        ``n_keep`` tokens (-1: the prompt; BOS always), drop ``n_discard`` after them
        (0: half of the rest) and move the others back.  False if it cannot."""
        if not self.context_shift:
            return False
        n_keep = n_prompt if params.n_keep < 0 else params.n_keep
        n_keep = min(self.n_ctx - 4, n_keep + (1 if self.model.add_bos else 0))
        n_left = len(self.cached) - n_keep
        n_discard = params.n_discard or n_left // 2
        n_discard = max(0, min(n_discard, n_left - 1))
        if n_discard <= 0:
            return False
        mem = self._mem
        if not mem.rm(n_keep, n_keep + n_discard):
            return False
        # SEQ_PIN shares the cells of SEQ_PROMPT, so it moves with them
        mem.seq_add(self._seq, n_keep + n_discard, len(self.cached), -n_discard)
        del self.cached[n_keep:n_keep + n_discard]
        return True

    def _evaluate_tail(self, tokens, start, cancel, logits=True, checkpoints=True):
        """Decode tokens[start:] in SEQ_PROMPT (the last token's logits kept,
        with ``logits``); False if cancelled part way."""
        mem = self._mem
        pos = start
        # where a recurrent state is kept for later prompts (checkpoints.py)
        marks = self.checkpoints.points(start, len(tokens)) \
            if self.checkpoints is not None and checkpoints else []
        while pos < len(tokens):
            if cancel is not None and cancel.cancelled:
                self.cached = list(tokens[:pos])
                return False
            end = min(pos + self.n_batch, len(tokens))
            media = [s for s in self._spans if s[1] > pos]
            if media and media[0][0] <= pos:
                start, stop, span = media[0]
                status = self._decode_media(pos, stop, span)
                if status != 0:
                    self._mem.rm(self.positions.at(pos), -1)
                    self.cached = list(tokens[:pos])
                    if status == 2:
                        return False
                    self._fail(status)
                pos = stop
                self.cached = list(tokens[:pos])
                if self._progress is not None:
                    self._progress.advance(stop - start)
                continue
            if media:
                end = min(end, media[0][0])     # text up to the next media run
            while marks and marks[0] <= pos:
                marks.pop(0)
            if marks and marks[0] < end:
                end = marks[0]
            chunk = tokens[pos:end]
            status = self._decode(chunk, pos, logits and pos + len(chunk) == len(tokens))
            if status == 2 and self.memory.has_state:
                # an aborted decode may have written part of the state's layers:
                # nothing of it can be trusted (the checkpoints still can)
                self.reset()
                return False
            if status == 2:     # aborted: keep what libllama did get into the cache
                # libllama drops the aborted ubatch's positions from the
                # token's first sequence only, whichever it takes that to be
                kept = min(mem.seq_pos_max(s) for s in self._prompt_seqs) + 1
                kept = max(pos, min(self.positions.index(kept, pos), pos + len(chunk)))
                mem.rm(self.positions.at(kept), -1)
                self.cached = list(tokens[:kept])
                return False
            if status != 0:
                self._fail(status)
            pos += len(chunk)
            self.cached = list(tokens[:pos])
            if marks and marks[0] == pos:
                self._checkpoint(pos)
            if self._progress is not None:
                self._progress.advance(len(chunk))
        return True

    def _evaluate_gap(self, tokens, start, end, cancel):
        """Decode tokens[start:end], which lie before a reused run, into SEQ_PROMPT.

        libllama only appends to a sequence (a batch must start at the
        sequence's last position + 1), and SEQ_PROMPT already holds the run
        after the gap.  So the gap is decoded in SEQ_GAP, which first gets
        every cell before the gap (shared, not copied), then its new cells
        are added to SEQ_PROMPT and SEQ_GAP is emptied again.

        The gap's cells are pinned after each ubatch (see SEQ_PIN): a gap
        longer than the attention window would otherwise lose its start.
        """
        mem = self._mem
        mem.seq_cp(self._seq, self._gap, 0, start)
        step = min(self.n_batch, self._ctx.n_ubatch)
        pos, status = start, 0
        try:
            while pos < end:
                if cancel is not None and cancel.cancelled:
                    status = 2
                    break
                chunk = tokens[pos:min(pos + step, end)]
                status = self._decode(chunk, pos, False, seq=self._gap)
                if status != 0:
                    break
                if self._pin in self._prompt_seqs:
                    mem.seq_cp(self._gap, self._pin, pos, pos + len(chunk))
                pos += len(chunk)
                if self._progress is not None:
                    self._progress.advance(len(chunk))
            if status == 0:
                mem.seq_cp(self._gap, self._seq, start, end)
            else:
                mem.seq_rm(self._pin, start, end)
        finally:
            mem.seq_rm(self._gap, -1, -1)
        if status == 0:
            return True
        if status != 2:
            self._fail(status)
        # Cancelled: SEQ_PROMPT still holds the prefix and the moved runs,
        # with a hole where the gap was; the caller records the hole, and
        # the next request reuses the runs again.  Editors cancel requests
        # all the time, often right here.
        return False

    def _fail(self, status):
        """A libllama decode failure: reset the cache so the session stays usable."""
        self.reset()
        if status == 1:
            raise ContextFull("no room left in the KV cache for this request")
        raise DecodeError("llama_decode failed with status %d" % status, status)


class _SessionMemory:
    """A session's view of the shared cache: its own sequences, each operation
    under the decoder's lock (no cell changes while a decode runs)."""

    def __init__(self, decoder, seqs):
        self._decoder = decoder
        self._memory = decoder.ctx.memory
        self._lock = decoder.lock
        self._seqs = seqs

    def rm(self, p0, p1):
        """Remove [p0, p1) from every sequence of the session; False where the
        memory cannot cut there."""
        with self._lock:
            return all([self._memory.seq_rm(s, p0, p1) for s in self._seqs])

    def seq_rm(self, seq, p0, p1):
        with self._lock:
            return self._memory.seq_rm(seq, p0, p1)

    def seq_cp(self, src, dst, p0, p1):
        with self._lock:
            self._memory.seq_cp(src, dst, p0, p1)

    def seq_add(self, seq, p0, p1, delta):
        with self._lock:
            self._memory.seq_add(seq, p0, p1, delta)
            self._decoder.moved()

    def seq_pos_min(self, seq):
        with self._lock:
            return self._memory.seq_pos_min(seq)

    def seq_pos_max(self, seq):
        with self._lock:
            return self._memory.seq_pos_max(seq)

    @contextlib.contextmanager
    def locked(self):
        """The Memory itself, under the decoder's lock, for several operations that
        must see no decode between them (a state's copy and its checks)."""
        with self._lock:
            yield self._memory


class _Progress:
    """llama-server's prompt_progress of one evaluation, reported as it advances."""

    def __init__(self, send, total, cached):
        self.send, self.total, self.cache, self.processed = send, total, cached, cached
        self.t0 = time.perf_counter()
        self._report()

    def advance(self, n):
        self.processed += n
        self._report()

    def _report(self):
        self.send({"total": self.total, "cache": self.cache, "processed": self.processed,
                   "time_ms": (time.perf_counter() - self.t0) * 1000.0})


def _with_holes(tokens, plan, unfinished):
    """What SEQ_PROMPT holds after a cancelled gap: ``tokens`` up to the last
    moved run, with None at the positions of the gaps not evaluated.

    None matches no token, so the next plan keeps the part before the first
    hole as its prefix and finds the runs after it again.
    """
    end = max(new + n for new, _, n in plan.runs)
    cached = list(tokens[:end])
    for start, stop in unfinished:
        for i in range(start, min(stop, end)):
            cached[i] = None
    return cached

