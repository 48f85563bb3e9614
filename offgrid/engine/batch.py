"""BatchDecoder: the one llama_context of a model's sessions, and the decodes they share.

Each ChatSession of a worker is a few sequences of one context (session.py:
its prompt, a scratch sequence, the sliding-window pin), in one unified KV
cache sized for all of them, or with --no-kv-unified in a cache stream of
the session's own (``streams``: libllama then evaluates a step one part per
stream, in ascending runs of streams, so a step's parts go in member order,
and an idle member's stream between two in the step may get a token, cut
again after it, that makes the run one: ``_fill``).  Each decode step packs the work of every
session that has some into one llama_batch: the next token (and draft) of
each generating session and a bounded share of the prompt of each one that
is evaluating (continuous batching: a session joins at the next step and
leaves when it stops asking).  On a CPU a step of four tokens costs little
more than a step of one, since the weights are read once per step.

Threads: each session runs on its own thread and calls ``Member.decode``,
which queues its part and waits.  Whoever finds the context free becomes
the leader: it takes every queued part, makes the decode, hands each part
its status and the batch index of its logits, and wakes the others.  There
is no scheduler thread, so a lone session decodes with no hand-over.

The rules that keep libllama safe and the batches full:
- A part's logits live in the context's output buffer until the next
  decode, so no decode starts while a member still reads its last ones
  (``holding``).  A member stops holding when it asks for its next decode
  or calls ``release``; generating members therefore all ask again before
  the next step starts, and their next tokens go in one batch, with no
  timer.
- Every memory operation of a session (cutting, copying, moving cells) and
  every llama_decode take ``lock``: they touch the one cache.
- The abort flag belongs to the context: it is set only when a member of the
  decode under way is cancelled.  The others' parts of an aborted step are
  dropped from the cache and decoded again in the next step, not lost.
- A decode that applies moved keys' rotation must not be cut short (see
  ContextHandle.set_abortable); a session that moved keys says so with
  ``moved()``, and the next step runs without the abort callback.
- The context applies one set of LoRA adapters at a time: a step holds only
  parts of one adapter key (``Member.adapters``, engine/adapters.py), that
  of the oldest part waiting, and applies it before its decode.
"""

import contextlib
import logging
import threading
import time

from ..libllama import ContextHandle
from ..protocol import WorkerSettings

OUT_NONE, OUT_LAST, OUT_ALL = ContextHandle.OUT_NONE, ContextHandle.OUT_LAST, ContextHandle.OUT_ALL

# Sequences per session (session.py: SEQ_PROMPT, SEQ_GAP, SEQ_PIN).
SEQS_PER_SESSION = 3

log = logging.getLogger("offgrid.batch")


class _Part:
    """One member's tokens waiting for (or in) a decode step."""

    __slots__ = ("member", "tokens", "pos", "seqs", "outputs", "prompt", "done_n",
                 "status", "offset", "done", "run", "adapters")

    def __init__(self, member, tokens, pos, seqs, outputs, prompt):
        self.member = member
        self.tokens = tokens
        self.pos = pos
        self.seqs = seqs
        self.outputs = outputs
        self.prompt = prompt        # prompt work: may be split over several steps
        self.done_n = 0             # tokens decoded so far
        self.status = 0
        self.offset = -1            # batch index of the part's first output
        self.done = False
        self.run = None             # a decode of its own (run_alone), instead of tokens
        self.adapters = member.adapters     # its LoRA adapter key


class _Filler(_Part):
    """A token in an idle member's stream that keeps a step's streams one run
    (BatchDecoder._fill): cut again before the step lets go of the lock; no
    member waits for it."""

    __slots__ = ()


class Member:
    """One session's place at a BatchDecoder: its sequences' decodes and its cancel."""

    def __init__(self, decoder, index):
        self.decoder = decoder
        self.index = index
        self.holding = False        # reads the logits of its last decode
        self.cancelled = False
        self._cancel = None
        self.adapters = ()          # the LoRA adapter key its decodes run with

    def decode(self, tokens, pos, seqs, outputs, prompt=False):
        """Decode ``tokens`` at positions pos... into ``seqs`` in the next step(s).

        ``outputs``: OUT_NONE, OUT_LAST or OUT_ALL.  ``prompt``: the tokens are
        prompt work, which the decoder may split over several steps so that
        generating members keep their pace.  Returns (llama_decode's status,
        the batch index of the first kept output); the logits stay readable
        until this member decodes again or calls release().  A member whose
        request is cancelled gets status 2, as an aborted decode.
        """
        return self.decoder._decode(_Part(self, tokens, pos, seqs, outputs, prompt))

    def run_alone(self, run, n, pos, seqs):
        """Make ``run()`` a step of its own: a decode offgrid does not lay out, of
        ``n`` positions from ``pos`` into ``seqs`` (an image's embeddings, through
        libmtmd's helper, engine/media.py).  Returns its status; an aborted one's
        cells are dropped as a token part's are.  No logits are kept."""
        part = _Part(self, range(n), pos, seqs, OUT_NONE, True)
        part.run = run
        return self.decoder._decode(part)[0]

    def release(self):
        """Done reading the last decode's logits (the next step may start)."""
        d = self.decoder
        with d._cond:
            if self.holding:
                self.holding = False
                d._holding -= 1
                d._cond.notify_all()

    def watch(self, cancel):
        """Tie this member's decodes to ``cancel`` (a RequestCancel) until unwatch()."""
        self.cancelled = False
        self._cancel = cancel
        cancel.attach(self._on_cancel)

    def unwatch(self):
        cancel, self._cancel = self._cancel, None
        if cancel is not None:
            cancel.detach(self._on_cancel)
        self.cancelled = False

    def _on_cancel(self):
        self.decoder._abort(self)


class BatchDecoder:
    """Owns the shared ContextHandle of a model's sessions and makes their decode steps."""

    # A prompt beside streams (--stream-pace): the prompt goes in chunks
    # between the streams' tokens, sized from what the decoder has measured (a
    # step of that many generated tokens alone, a prompt token's cost).  A
    # chunk is a whole number of ``prompt_quantum`` tokens: ggml-cpu's flash
    # attention takes its tiled (GEMM) path only for 64 query tokens or more
    # and tiles them by 64, and a 63- or 68-token step cost 1.3x per token
    # what a 64-token one did (gemma-3-270m, one thread, CPU time).  Such a
    # chunk is a step of its own, sized to last up to ``longest_step``
    # periods of the pace (one quantum at least while that lasts under
    # ``longest_gap`` periods: the longest a stream waits for a token), and
    # the streams' tokens wait for the next step: beside a generated token of
    # another sequence every query tile of the chunk attends to that
    # sequence's cells too (one unified cache), and 63 prompt tokens + 1
    # generated one + a step of 1 cost 2.6 ms a prompt token where 64 alone +
    # two steps of 1 cost 2.1-2.3 (2,000-token prompt, a 400-token stream,
    # gemma-3-270m, 2 threads).  Steps of the streams' tokens alone (a small
    # model's take 15-20 ms) then catch them up to the pace (``_behind``): a
    # stream keeps the pace on average and the prompt gets the rest of the
    # time.  Less than a quantum of prompt left rides in the streams' step.
    # A model whose step of generated tokens takes over half the period cannot
    # catch up that way: each step then carries the streams' tokens and as
    # much of the prompt as fits in one period, and at least ``prompt_share``
    # of a generation step's cost, so the prompt keeps near half its speed;
    # but prompts that fit whole in a step of ``longest_step`` periods beside
    # them (eight clients' next turns) go whole, so that each ends in the step
    # it came to, as the others that came with it.  A
    # generation step's cost is kept per number of generated tokens in it
    # (one of 8 took 48 ms, one of 1 21 ms).  Until both costs are known a
    # step takes ``first_prompt_share`` prompt tokens beside the streams'.
    first_prompt_share = 16
    min_prompt_share = 4
    prompt_share = 0.8
    prompt_quantum = 64
    longest_step = 2.0          # periods of the pace
    longest_gap = 3.0           # periods: the longest step of one quantum
    stream_pace = WorkerSettings.stream_pace   # tok/s (--stream-pace); 0: prompts take whole batches
    learn_prompt_alone = 64     # prompt tokens a step of them alone must have to teach

    def __init__(self, ctx, threads, turn, streams=False, has_state=False):
        """``ctx``: the ContextHandle (owned from here on); ``threads``: the
        DecodeThreads of its decodes; ``turn()``: the lock every decode of the
        process takes (session.decode_turn), looked up at each step;
        ``streams``: each member's sequences have a cache stream of their own
        (session.shared_decoder's kv_unified=False); ``has_state``: the
        memory holds recurrent states, which a decode cut short may leave
        half written, so a step is aborted only when every member in it is
        cancelled (engine/memory.py)."""
        self.ctx = ctx
        self.streams = streams
        self.has_state = has_state
        self.memory = None          # its MemoryClass (session.shared_decoder sets it)
        self.adapters = None        # its model's engine.adapters.Adapters (Loaded sets it)
        self.kv_unified = not streams
        self.threads = threads
        self._turn = turn
        self.lock = MemoryFirstLock()       # llama_decode and every memory operation
        self._cond = threading.Condition(threading.Lock())     # the queue and the step
        self._pending = []
        self._running = None                # the parts of the decode under way
        self._holding = 0                   # members reading their last logits
        self._shift = False                 # keys moved: the next decode applies them
        self._members = []
        # a step's streams are one run: idle members' streams between get a
        # filler token (_fill); off where a cut token would leave a trace
        self.fills = False
        self._gen_step = {}                 # generated tokens -> seconds of such a step
        self._prompt_token = None           # seconds a prompt token adds to a step
        self._behind = 0.0                  # seconds the streams are behind their pace
        self._streams_wait = False          # the step under way left their tokens out
        self.n_steps = 0                    # decode steps made (for tests and /metrics)
        self.n_shared_steps = 0             # steps that held several members' parts
        self.n_step_members = 0             # members' parts summed over the steps
        self.n_fillers = 0                  # filler tokens decoded (_fill)
        self.closed = False

    def member(self):
        """A new Member (a session's place; its sequences are its own)."""
        m = Member(self, len(self._members))
        self._members.append(m)
        return m

    def moved(self):
        """Keys were moved (llama_memory_seq_add): the next decode rotates them."""
        self._shift = True

    def shift_pending(self):
        """Whether moved keys wait for the next decode to re-rotate them (read
        holding ``lock``): a copy of the cache now would hold them unrotated."""
        return self._shift

    def close(self):
        if not self.closed:
            self.closed = True
            self.ctx.close()

    # -- the step ----------------------------------------------------------
    def _decode(self, part):
        member = part.member
        with self._cond:
            if member.holding:
                member.holding = False
                self._holding -= 1
                self._cond.notify_all()     # a leader may wait for these logits to go
            if member.cancelled:
                return 2, -1
            self._pending.append(part)
            while not part.done:
                if member.cancelled and not self._is_running(member):
                    self._pending.remove(part)
                    return 2, -1
                if self._running is None and self._holding == 0 and self._pending:
                    self._lead()
                else:
                    self._cond.wait()
            return part.status, part.offset

    def _is_running(self, member):
        return self._running is not None and any(
            p.member is member and not isinstance(p, _Filler) for p, _, _ in self._running)

    def _lead(self):
        """Make one decode step of the queued parts (called holding _cond, which
        it lets go of during the decode)."""
        if self.lock.wants_first():
            # a session preparing its prompt's cache: the step waits for that,
            # and takes the prompt it then queues (MemoryFirstLock)
            self._running = ()              # no other leader meanwhile
            self._cond.release()
            try:
                self.lock.memory_first()
            finally:
                self._cond.acquire()
                self._running = None
                self._cond.notify_all()
        step = self._take()
        if not step:
            return
        if self.streams:
            # libllama's split_equal takes streams in ascending runs (0, 1, 2
            # in one ubatch; 1, 0 in two): the members' parts in their order
            step.sort(key=lambda s: s[0].member.index)
        self._running = step
        self.ctx.clear_abort()
        status = -1000          # an exception out of the decode: every part fails
        self._cond.release()
        try:
            run = step[0][0].run
            with self._turn(), self.lock.step():
                fillers = self._fill(step) if self.fills and not run else ()
                n = sum(b - a for _, a, b in step)
                shifted = self._shift       # read under the lock moved() is called in
                if self.adapters is not None:
                    self.adapters.apply(self.ctx, step[0][0].adapters)
                started = self.threads.before(self.ctx, n)
                if shifted:
                    self.ctx.set_abortable(False)
                try:
                    status = run() if run else self.ctx.decode_parts(_layout(step))
                    if status == 1 and fillers:
                        # no free cell for a filler (llama_decode placed nothing):
                        # the step as it came
                        step[:] = [s for s in step if not isinstance(s[0], _Filler)]
                        fillers = ()
                        status = self.ctx.decode_parts(_layout(step))
                finally:
                    if shifted:
                        self.ctx.set_abortable(True)
                    if fillers:
                        self._unfill(fillers)
                if status == 0:
                    self.threads.after(n, started)
                    self._learn(step, time.perf_counter() - started[1])
                    if shifted:
                        self._shift = False
                elif status == 2:
                    self._undo(step)
        finally:
            self._cond.acquire()
            self._finish(step, status)
            self._running = None
            self._cond.notify_all()

    def _fill(self, step):
        """With a cache stream per member, libllama evaluates a step in runs of
        consecutive streams (split_equal: 0, 1, 2 in one ubatch; 0, 2 in two),
        each run reading the weights again.  So an idle member's stream
        between two of the step's gets one token at the end of its prompt
        sequence, cut again after the decode (_unfill), where that makes one
        ubatch of more tokens rather than several smaller.  A step of single
        tokens, qwen2.5-0.5B, 2 threads, ms by streams in one run: 1: 23,
        2: 40, 3: 49, 4: 53, 5: 75, 7: 86, 8: 88; streams 0 2 4 6 took 93
        (79 filled), 0-2 and 4-7 102 (88 filled), but 0 3 6 70 (80 filled).
        Hence fillers only where there are no more of them than tokens.  A
        member whose stream is full gets none.  Adds the fillers to ``step``
        in member order; returns them.  Called holding ``lock``."""
        if len(step) < 2:
            return ()
        present = {p.member.index for p, _, _ in step}
        gaps = [i for i in range(min(present) + 1, max(present)) if i not in present]
        if not gaps or len(gaps) > sum(b - a for _, a, b in step):
            return ()
        mem = self.ctx.memory
        fillers = []
        for i in gaps:
            seq = SEQS_PER_SESSION * i
            pos = mem.seq_pos_max(seq) + 1
            if pos + 1 > self.n_ctx_session:
                continue
            f = _Filler(self._members[i], (0,), pos, (seq,), OUT_NONE, False)
            fillers.append(f)
            step.append((f, 0, 1))
        if fillers:
            step.sort(key=lambda s: s[0].member.index)
        return fillers

    def _unfill(self, fillers):
        """Cut the fillers' tokens, read back: a cell left would be a token the
        member's session does not know of (held lock)."""
        mem = self.ctx.memory
        self.n_fillers += len(fillers)
        for f in fillers:
            seq = f.seqs[0]
            mem.seq_rm(seq, f.pos, -1)
            if mem.seq_pos_max(seq) >= f.pos:
                self.fills = False
                log.warning("a filler token in sequence %d at %d was not cut: no more fillers",
                            seq, f.pos)

    def _learn(self, step, seconds):
        """Keep the cost of a generation step (per number of generated tokens)
        and of a prompt token beside them (moving averages), which size the
        prompt's share of the next steps."""
        n_prompt = sum(b - a for p, a, b in step if p.prompt)
        n_gen = sum(b - a for p, a, b in step if not p.prompt)
        if n_gen and self.stream_pace:
            # each step gives every stream a token: the pace's period a step,
            # no more than one period ahead (streams idle then are not owed)
            period = 1.0 / self.stream_pace
            self._behind = max(self._behind + seconds - period, -period)
        elif self._streams_wait:
            self._behind += seconds         # a prompt's chunk: they got no token
        else:
            self._behind = 0.0
        if n_prompt == 0:
            self._gen_step[n_gen] = _average(self._gen_step.get(n_gen), seconds)
        elif n_gen == 0:
            # alone, a prompt token costs its share of what every step costs
            # (each weight read once): that hides in a large batch only
            if n_prompt >= self.learn_prompt_alone:
                self._prompt_token = _average(self._prompt_token, seconds / n_prompt)
        elif n_gen in self._gen_step:
            extra = max(seconds - self._gen_step[n_gen], 0.0)
            self._prompt_token = _average(self._prompt_token, extra / n_prompt)

    def _take(self):
        """The slices (part, start, end) of the next step: every generating
        member's tokens that fit and a share of the prompt work, or a chunk of
        the prompt alone (_prompt_share)."""
        cap = self.ctx.n_batch
        step = []
        # one adapter key a step: the oldest waiting part's
        live = [p for p in self._pending if not p.member.cancelled]
        pending = [p for p in live if p.adapters == live[0].adapters] if live else []
        for p in pending:
            if p.run is not None:
                return [(p, 0, len(p.tokens))]      # alone, whole, with its adapters
        if self.has_state:
            # one member a step: sequences of recurrent state decoded in one
            # llama_decode beside others gave wrong tokens now and then
            # (1 in 32 batched requests on lfm2, under load; 0 alone)
            for p in pending:
                if not p.member.cancelled:
                    k = min(len(p.tokens) - p.done_n, cap) if p.prompt else len(p.tokens)
                    return [(p, p.done_n if p.prompt else 0, (p.done_n if p.prompt else 0) + k)]
            return step
        gen = [p for p in pending if not p.prompt]
        for p in gen:
            if len(p.tokens) <= cap:
                step.append((p, 0, len(p.tokens)))
                cap -= len(p.tokens)
        self._streams_wait = False
        if not step:
            share = cap
        else:
            left = sum(len(p.tokens) - p.done_n for p in pending if p.prompt)
            share, alone = self._prompt_share(self.ctx.n_batch - cap, left)
            if alone and left >= self.prompt_quantum:
                # a chunk of whole quanta, a step of its own (class comment)
                step, cap, share = [], self.ctx.n_batch, min(share, self.ctx.n_batch)
                self._streams_wait = True
            elif alone:
                share = left                # the rest rides with the streams
            share = min(cap, share)
        prompts = [p for p in pending if p.prompt]
        needs = [len(p.tokens) - p.done_n for p in prompts]
        for p, k in zip(prompts, _even_shares(needs, share, whole=not self.streams)):
            if k:
                step.append((p, p.done_n, p.done_n + k))
        return step

    def _prompt_share(self, n_gen, left=None):
        """(prompt tokens for a step beside n_gen generated ones, whether that
        chunk is a step of its own, the generated tokens waiting for the next):
        (0, False) for a step of the generated tokens alone, the streams being
        behind their pace.  ``left``: the prompt tokens waiting."""
        if not self.stream_pace:
            return self.ctx.n_batch, False
        gen_step = self._gen_step.get(n_gen)
        if gen_step is None and self._gen_step:
            # a step of a draft's length not seen yet: as the nearest one seen
            gen_step = self._gen_step[min(self._gen_step, key=lambda n: abs(n - n_gen))]
        if gen_step is None or self._prompt_token is None:
            return self.first_prompt_share, False
        period = 1.0 / self.stream_pace
        token = max(self._prompt_token, 1e-6)
        if gen_step <= period / 2:
            if self._behind > 0:
                return 0, False
            q = self.prompt_quantum
            whole = int(self.longest_step * period / token) // q * q
            if whole >= q or q * token <= self.longest_gap * period:
                return max(whole, q), True
            # a quantum would keep the streams waiting too long: what fits
            fit = int((self.longest_step * period - gen_step) / token)
            return max(self.min_prompt_share, fit), False
        if left is not None and gen_step + left * token <= self.longest_step * period:
            # a short prompt (a client's next turn among many streams) whole, in
            # a step no longer than a chunk's: split, it ended steps after the
            # others that came with it, and their streams never met again
            return left, False
        share = int(max(period - gen_step, self.prompt_share * gen_step) / token)
        return max(self.min_prompt_share, share), False

    def _undo(self, step):
        """After an aborted step: drop what it left of every part from the cache
        (held lock), so a part decoded again starts where it did."""
        mem = self.ctx.memory
        for part, a, _ in step:
            if not part.member.cancelled:
                for s in part.seqs:
                    mem.seq_rm(s, part.pos + a, -1)

    def _finish(self, batch, status):
        """Hand each part of the step its status and output offset (``batch``:
        the step's slices as decoded, fillers and all)."""
        step = [s for s in batch if not isinstance(s[0], _Filler)]
        self.n_steps += 1
        members = len({id(p.member) for p, _, _ in step})
        self.n_step_members += members
        if members > 1:
            self.n_shared_steps += 1
        # an abort nobody in the step asked for: give it to them all, rather
        # than decode the step again and again
        redo = status == 2 and any(p.member.cancelled for p, _, _ in step)
        for part, a, b in step:
            if redo and not part.member.cancelled:
                continue                    # decoded again in the next step
            if status != 0:
                part.status, part.done = status, True
                self._pending.remove(part)
                continue
            part.done_n = b
            if b < len(part.tokens):
                continue
            part.done = True
            self._pending.remove(part)
            if part.outputs != OUT_NONE:
                part.offset = self._offset_in(batch, part)
                if not part.member.holding:
                    part.member.holding = True
                    self._holding += 1

    @staticmethod
    def _offset_in(step, part):
        n = 0
        for p, a, b in step:
            if p is part:
                return n + (b - a - 1 if part.outputs == OUT_LAST else 0)
            n += b - a
        return -1

    def _abort(self, member):
        with self._cond:
            member.cancelled = True
            if self._is_running(member) and (not self.has_state or all(
                    p.member.cancelled for p, _, _ in self._running)):
                self.ctx.request_abort()
            self._cond.notify_all()


class MemoryFirstLock:
    """The decoder's lock: each decode step holds it for the whole llama_decode,
    and every memory operation of a session takes it (a cut, a copy of a state
    out to the StateCache or into the cache); those waiting or under way go
    before the next step, and so does what a session queues right after them.

    A plain lock let the thread that ended a step take it again for the next
    one before the woken waiter ran, so a session preparing a new prompt's
    cache waited a whole step per operation, often more (8 clients, gemma-3,
    a KV stream each: 85 ms p50, up to 186, from a request's start in the
    worker to its first decode, while the others' steps took 60; the waits on
    this lock 5.6 s over a 34 s run).  Serving only those waiting still let a
    step in between a session's operations (a state copied out, then the
    cut: two steps' wait) and before the prompt they prepared was queued (a
    third), so a step also waits while one is under way, and ``linger``
    seconds after another thread's last one (its prompt then comes in that
    step): 8 clients, gemma-3, one cache, from a request's prompt made in
    the worker to the step that takes it 108 ms p50 -> 58 (the step under
    way when it came: 55), and from a session's last token to its next
    request's first step 120 ms p50, 220 p90 -> 74, 86.  Each operation
    takes microseconds to a few milliseconds, and a step waits
    at most ``max_defer`` seconds, so a session that keeps asking cannot hold
    the others' tokens back.  A step does not linger after its own thread's
    operations: a lone session's request starts at once."""

    max_defer = 0.05
    linger = 0.002

    def __init__(self):
        self._lock = threading.Lock()
        self._cond = threading.Condition(threading.Lock())
        self._busy = 0              # memory operations waiting for the lock or holding it
        self._last = (0.0, None)    # when the last one let go, and its thread

    def __enter__(self):
        with self._cond:
            self._busy += 1
        try:
            self._lock.acquire()
        except BaseException:
            self._let_go()
            raise
        return self

    def __exit__(self, *exc):
        self._lock.release()
        self._let_go()

    def _let_go(self):
        with self._cond:
            self._busy -= 1
            self._last = (time.perf_counter(), threading.get_ident())
            self._cond.notify_all()

    def wants_first(self):
        """Whether memory operations go before a step now (read without the lock:
        a hint, which memory_first() settles)."""
        t, thread = self._last
        return bool(self._busy) or (thread != threading.get_ident()
                                    and time.perf_counter() - t < self.linger)

    def memory_first(self):
        """Before a step is packed: let the memory operations waiting or under
        way have the lock first, and what follows them closely."""
        deadline = time.perf_counter() + self.max_defer
        with self._cond:
            while self.wants_first():
                now = time.perf_counter()
                if now >= deadline:
                    return
                wait = deadline - now if self._busy else self._last[0] + self.linger - now
                self._cond.wait(min(max(wait, 0.0), deadline - now))

    @contextlib.contextmanager
    def step(self):
        """The lock, for a decode step (not counted as a memory operation)."""
        with self._lock:
            yield


def _even_shares(needs, total, whole=True):
    """``total`` prompt tokens dealt to prompts that need ``needs``: each as much as
    the others, less only where it needs less (its rest goes to the others).

    Prompts that arrive together end together, so their streams start in one
    step and stay in step: first come, first served started them a step or
    more apart, and apart they kept costing (with a cache stream each,
    libllama evaluates a step's streams in runs of consecutive ones, one
    weight read a run; seven 21-token prompts took six steps, and every
    later round's prompts came in apart).  A short prompt that comes while a
    long one is under way goes in the next step, not after the rest of the
    long one's part (up to a batch).  ``whole``:
    what does not divide evenly goes to the first ones; else it is left for
    the next step (unless nothing else is dealt), since slices of unequal
    length make libllama's split_equal (cache streams) evaluate the step in
    more ubatches."""
    shares = [0] * len(needs)
    left = sorted(range(len(needs)), key=lambda i: needs[i])
    while left and total > 0:
        each = total // len(left)
        if each == 0:
            if whole or not any(shares):       # (never a step without prompt work)
                for i in sorted(left)[:total]:
                    shares[i] += 1
            break
        if needs[left[0]] - shares[left[0]] <= each:
            i = left.pop(0)             # the least in need: all of it
            total -= needs[i] - shares[i]
            shares[i] = needs[i]
            continue
        for i in left:
            shares[i] += each
        total -= each * len(left)
    return shares


def _average(old, new, weight=0.3):
    return new if old is None else old + weight * (new - old)


def _layout(step):
    """decode_parts' parts of a step's slices: a prompt's chunk keeps no logits
    but at its end."""
    return [(p.tokens[a:b], p.pos + a, p.seqs, p.outputs if b == len(p.tokens) else OUT_NONE)
            for p, a, b in step]
