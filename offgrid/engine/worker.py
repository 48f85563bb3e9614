"""A model's worker process: one loaded model, its sessions, and the front on a pipe.

    python -m offgrid.engine.worker --settings JSON    (started by server/models/worker_client.py)

The front (``offgrid.server``) never loads libllama; each model runs here, so
an abort, a segfault or a runaway allocation inside libllama costs this
model's requests in flight, not the server.  Frames (``offgrid/protocol.py``)
come in on stdin and go out on stdout; stderr is the front's terminal.

Threads:
  main      waits for the front to go away
  request   one per call or generation at a time, kept for the next one when
            done (offgrid/jobs.py); one of them at a time reads frames: it
            runs the next "call" or "generate" itself, after handing the
            reading to another; "cancel" flips the request's RequestCancel
            at once, which sets libllama's abort flag, so a decode in
            progress stops within one graph node.  Requests answer with
            frames (under one lock, so frames never interleave)
When stdin ends the front is gone (or closed us): the process exits at once,
whatever is running, so no worker outlives its front.  SIGINT and SIGTERM
are ignored: a Ctrl-C or a service manager's SIGTERM to the whole process
group reaches the front, whose shutdown lets running requests finish first.
"""

import argparse
import base64
import dataclasses
import fcntl
import functools
import json
import logging
import os
import signal
import sys
import threading
import time

from .. import libllama, protocol
from ..jobs import Threads
from ..chat.gbnf import check_grammar
from ..chat.prompt import prepare_chat
from ..chat.reply import Delta as ReplyDelta, ReplyStream, parse_reply
from ..chat.jsonschema import schema_to_grammar
from ..chat.select import template_for
from ..chat.template import ReplyFormat, new_tool_call_id
from ..errors import EncoderOnly, InvalidRequest, OffgridError, PromptTooLong
from ..request import RequestCancel
from .copydraft import drafter_for
from .embed import to_le
from . import cachereuse, promptfit, rpc, slotfile
from .fill import IdleFill
from .infill import layout_infill
from .loaded import Loaded
from .pacing import StreamPacer
from . import placement
from .placement import Placement
from .session import pause_pools, place_threads, take_turns_with
from .thinkbudget import NO_BOUND


def parse_args(argv=None):
    """The worker's one argument: ``--settings JSON``, the front's parse of its flags."""
    p = argparse.ArgumentParser(prog="offgrid.engine.worker")
    p.add_argument("--settings", required=True, help="a protocol.WorkerSettings, as JSON")
    return protocol.decode_settings(json.loads(p.parse_args(argv).settings))


class FileTurns:
    """A lock shared with the other workers of this server: a thread lock, then flock.

    ggml's threads spin at barriers: two models decoding at once on the same
    cores starve each other (engine/session.py measures 50 to 100 times
    slower), so decodes take turns across processes as within one.

    A worker that finds the turn taken marks the lock file's first byte
    before it waits, and the holder, seeing the mark as it lets go, calls
    ``on_handoff()`` first (still holding the turn): the worker puts its
    ggml threads to sleep there, which would otherwise poll for their next
    graph through the start of the other's decode, on its cores.  A mark
    that comes too late for one holder is seen by the next: at worst one
    pause nobody needed, which costs the next decode a wake-up.
    """

    WAITING, FREE = b"\x01", b"\x00"

    def __init__(self, path, on_handoff=None):
        self._fd = os.open(path, os.O_RDWR)     # our own open file: flock is per open file
        self._thread_lock = threading.Lock()
        self._on_handoff = on_handoff

    def __enter__(self):
        self._thread_lock.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.pwrite(self._fd, self.WAITING, 0)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        try:
            if self._on_handoff is not None and os.pread(self._fd, 1, 0) == self.WAITING:
                os.pwrite(self._fd, self.FREE, 0)
                self._on_handoff()
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._thread_lock.release()


# Seconds call_save_states waits for running generations to end: the front
# asks once the requests it waits for have been answered.
SAVE_WAIT = 1.0


class Worker:
    """Answers the front's frames for one Loaded model."""

    def __init__(self, loaded, out, reasoning="auto", reasoning_format="auto", out_lock=None,
                 spec_type="none", stream_interval=0.0, spm_infill=False,
                 tool_call_rescue=True, template_kwargs=None, reasoning_budget=-1,
                 reasoning_budget_message=""):
        """``stream_interval``: seconds a streamed request's pieces are gathered
        over (engine/pacing.py; --stream-interval-ms).  ``tool_call_rescue``:
        chat/rescue.py (off with --no-tool-call-rescue).  ``template_kwargs``:
        --chat-template-kwargs, under each request's own; ``reasoning_budget`` and
        its message: --reasoning-budget's, for a chat request that does not say."""
        self.loaded = loaded
        self.tool_call_rescue = tool_call_rescue
        self.stream_interval = stream_interval
        self.spm_infill = spm_infill        # --spm-infill: FIM prompts suffix first
        self.model = loaded.model
        # --spec-type: which requests draft, and how (copydraft.drafter_for)
        self.spec_type = spec_type
        # what a chat request that does not say gets: enable_thinking (None: as
        # the template does by default) and how its reasoning is returned
        # (-rea on/off, else --chat-template-kwargs' enable_thinking)
        self.template_kwargs = dict(template_kwargs or {})
        self.reasoning_budget = reasoning_budget
        self.reasoning_budget_message = reasoning_budget_message
        self.enable_thinking = {"on": True, "off": False}.get(
            reasoning, self.template_kwargs.get("enable_thinking"))
        self.reasoning_format = reasoning_format
        self._out = out
        self._out_lock = out_lock or threading.Lock()
        self._cancels = {}              # request id -> RequestCancel of a running generation
        self._jobs = Threads("request")
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)     # a generation left _cancels
        self._groups = {}               # GenerationParams.prompt_group -> Event: evaluated
        # the prompt speed decodes show, for FIM's t_max_prompt_ms (engine/promptfit.py)
        first = loaded.sessions[0]
        self.prompt_rate = promptfit.PromptRate(self.model, first.threads.batch.max_threads)
        # what a budget dropped goes into the cache while no frame is served (fill.py)
        self.fill = IdleFill(self._jobs, self.prompt_rate)
        self._last_fit = None           # (fitted tokens, whole prompt) of the last fit
        self.slot_save_path = None      # --slot-save-path: POST /slots/ID?action=save|restore

    # -- frames out ---------------------------------------------------------------
    def send(self, obj):
        self.send_many((obj,))

    def send_many(self, objs):
        """Frames in one write: the front's reader wakes once for them all."""
        data = b"".join(protocol.encode(o) for o in objs)
        with self._out_lock:
            self._out.write(data)
            self._out.flush()

    # -- frames in -----------------------------------------------------------------
    def serve(self, inp):
        """Read frames until the front goes away."""
        gone = threading.Event()
        self._jobs.submit(self._read, inp, gone)
        gone.wait()

    def _read(self, inp, gone):
        """Read frames; the first call or generate this thread reads, it runs.

        Before it runs one, it hands the reading on to a kept request thread
        (jobs.py), which wakes while this one works: the request does not
        wait for a thread to wake first, 0.06 ms of each here.  One thread
        reads at a time, so frames keep their order: a request's cancel is
        read after its generate, whose RequestCancel is in place by then.
        """
        try:
            job = self._next_job(inp)
        except BaseException:
            gone.set()          # unreadable frames: the process ends, as the front sees
            raise
        if job is None:
            gone.set()
            return
        self._jobs.submit(self._read, inp, gone)
        job()

    def _next_job(self, inp):
        """The next call or generate frame's job (cancels done on the way); None at EOF."""
        while True:
            try:
                frame = protocol.read_frame(inp)
            except protocol.ProtocolError:
                frame = None
            if frame is None:
                return None
            op = frame.get("op")
            if op == "ping":
                # the front's heartbeat (server/workers.py), answered by the thread
                # that reads frames: neither libllama (its calls release the GIL)
                # nor a template (Python switches threads every 5 ms) holds it up.
                # It carries the decode steps made so far and the generations
                # running, so the front also sees a decode that stopped moving.
                self.send(self.pong(frame.get("seq")))
            elif op == "cancel":
                with self._lock:
                    cancel = self._cancels.get(frame["id"])
                if cancel is not None:
                    cancel.cancel(frame.get("reason") or "cancelled")
            elif op == "control":
                # a running generation's control (engine/generate.py hooks it)
                with self._lock:
                    cancel = self._cancels.get(frame["id"])
                if cancel is not None:
                    cancel.control(frame.get("action"))
            elif op == "generate":
                cancel = RequestCancel()
                with self._lock:
                    self._cancels[frame["id"]] = cancel
                self.fill.busy()
                return functools.partial(self._generate, frame, cancel)
            elif op == "call":
                self.fill.busy()
                return functools.partial(self._call, frame)

    def pong(self, seq):
        d = self.loaded.decoder
        with self._lock:
            running = len(self._cancels)
        # no shared decoder (a test's sessions of their own): no steps to report
        return {"op": "pong", "seq": seq, "steps": d.n_steps if d is not None else None,
                "running": running}

    def _answer(self, rid, fn, *args):
        try:
            value = fn(*args)
        except BaseException as e:  # the request's error, never the worker's end
            self.send({"op": "error", "id": rid, "error": protocol.encode_error(e)})
        else:
            self.send({"op": "result", "id": rid, "value": value})

    # -- calls ------------------------------------------------------------------------
    def _call(self, frame):
        try:
            self.fill.wait()
            method = getattr(self, "call_" + str(frame.get("method")), None)
            if method is None:
                err = OffgridError("no worker method %r" % frame.get("method"))
                self.send({"op": "error", "id": frame["id"],
                           "error": protocol.encode_error(err)})
                return
            args = frame.get("args", {})
            self._answer(frame["id"], lambda: method(**args))
        finally:
            self.fill.done()

    def call_tokenize(self, text, add_special=False, parse_special=True, with_pieces=False):
        m = self.model
        tokens = m.tokenize(text, add_special=add_special, parse_special=parse_special)
        if not with_pieces:
            return {"tokens": tokens}
        # The body, built here from one cached fragment per distinct token:
        # a list of dicts per token cost 1.4 GB for an 8 MiB body.
        frags = {}
        parts = []
        for t in tokens:
            frag = frags.get(t)
            if frag is None:
                piece = m.token_text(t)
                try:
                    p = json.dumps(piece.decode("utf-8"), ensure_ascii=False)
                except UnicodeDecodeError:
                    p = json.dumps(list(piece))
                frag = frags[t] = '{"id":%d,"piece":%s}' % (t, p)
            parts.append(frag)
        return {"body": '{"tokens":[' + ",".join(parts) + "]}"}

    def call_slots(self):
        """How many tokens each session's cache holds now (a request may be running)."""
        return [len(s.cached) for s in self.loaded.sessions]

    def call_states(self):
        """The kept prompt states (engine/statecache.py): counts and bytes; None when off."""
        st = self.loaded.states
        return st.stats() if st is not None else None

    def call_save_states(self):
        """Write the kept prompt states, and the sessions' own caches where no request
        runs, to --cache-dir (the front asks before the worker goes: sleep, unload,
        shutdown); how many files were written."""
        st = self.loaded.states
        if st is None or st.disk is None:
            return {"written": 0}
        live = []
        with self._lock:
            # a generation whose answer is sent is still in _cancels until its
            # job ends: a server stopped right after a reply (its SIGTERM reached
            # here within a millisecond) left that session's cache off disk
            running = not self._ended.wait_for(lambda: not self._cancels, SAVE_WAIT)
        if not running:
            for s in self.loaded.sessions:
                # a cache of an adapter set stays off disk (statecache.py)
                data = None if s.adapters else s.copy_state()
                if data is not None:
                    live.append((list(s.cached), data))
        return {"written": st.to_disk(live)}

    def call_slot_action(self, action):
        """POST /slots/ID?action=save|restore|erase (protocol.SlotAction) on a session
        the front holds for it: llama-server's result object."""
        a = protocol.decode_slot_action(action)
        session = self.loaded.sessions[a.id_slot]
        t0 = time.perf_counter()
        if a.action == "erase":
            n = len(session.cached)
            session.reset()
            return {"id_slot": a.id_slot, "n_erased": n}
        folder = self.slot_save_path
        if not folder or not slotfile.valid_filename(a.filename):
            raise InvalidRequest("Invalid filename")
        path = os.path.join(folder, a.filename)
        if a.action == "save":
            tokens = list(session.cached)
            state = session.copy_state() if tokens else None
            if state is None:
                raise OffgridError("Unable to save slot: it holds no cache to save"
                                   if not tokens else "Unable to save slot")
            try:
                n_bytes = slotfile.write(path, tokens, state)
                slotfile.write_adapters(path, session.adapters)
                slotfile.write_control_vector(path, self._control_identity())
                media = self.loaded.media
                slotfile.write_media(path, media.identity if media is not None
                                     and min(tokens) < 0 else None,
                                     media.placed(tokens) if media is not None else [])
            except OSError as e:
                raise OffgridError("Unable to save slot: %s" % e.strerror)
            return {"id_slot": a.id_slot, "filename": a.filename, "n_saved": len(tokens),
                    "n_written": n_bytes,
                    "timings": {"save_ms": (time.perf_counter() - t0) * 1000.0}}
        try:
            tokens, state, n_read = slotfile.read(path, self.model.n_vocab,
                                                  media=self.loaded.media is not None)
            key = slotfile.read_adapters(path, len(self.loaded.adapters))
            slotfile.check_control_vector(path, self._control_identity())
            media = self.loaded.media
            if tokens and min(tokens) < 0:
                # its images' cells are its projector's: refused under another
                placed = slotfile.read_media(path, media.identity if media is not None
                                             else None)
                media.learn(placed)
            if len(tokens) > session.n_ctx:
                raise slotfile.SlotFileError("Restored prompt does not fit in the slot context")
            if not session.load_state(tokens, state):
                raise slotfile.SlotFileError("No available space in KV cache or invalid slot "
                                             "save file")
            session.restored_adapters(key)
        except (OSError, slotfile.SlotFileError) as e:
            session.reset()
            raise InvalidRequest("Unable to restore slot: %s"
                                 % (e.strerror if isinstance(e, OSError) else e))
        return {"id_slot": a.id_slot, "filename": a.filename, "n_restored": len(tokens),
                "n_read": n_read, "cached": tokens,
                "timings": {"restore_ms": (time.perf_counter() - t0) * 1000.0}}

    def _control_identity(self):
        """The identity of the model's control vector (engine/controlvector.py), None
        without one: what its slot files are computed under."""
        cv = self.loaded.control_vector
        return cv.identity if cv is not None else None

    def call_batching(self):
        """Decode steps made so far, how many of them carried several sessions' work, and
        the sessions they carried in all."""
        d = self.loaded.decoder
        return {"steps": d.n_steps if d else 0, "shared_steps": d.n_shared_steps if d else 0,
                "members": d.n_step_members if d else 0}

    def call_threads(self):
        """The thread counts decodes use now and how often they changed (engine/threads.py)."""
        return self.loaded.sessions[0].threads.snapshot()

    def call_detokenize(self, tokens):
        return {"content": self.model.detokenize(tokens, special=True)}

    def _tokens_of(self, parts, add_special=True):
        """Token ids of text and token-id parts; BOS (where the model wants it) only
        before text that comes first."""
        m = self.model
        tokens = []
        for i, part in enumerate(parts):
            if isinstance(part, str):
                tokens += m.tokenize(part, add_special=add_special and i == 0,
                                     parse_special=True)
            else:
                m.check_tokens(part)
                tokens += part
        return tokens

    def call_prepare_completion(self, parts, add_special=True, schema=None, grammar=None,
                                media=()):
        """Token ids of a prompt given as text and token-id parts; BOS only before text.
        ``media``: images and audio (base64) for the text's media markers, in order."""
        if media:
            if not all(isinstance(p, str) for p in parts):
                raise InvalidRequest("a prompt with images or audio must be text, "
                                     "not token ids")
            tokens = self._media_tokens("".join(parts), media, add_special)
        else:
            tokens = self._tokens_of(parts, add_special)
        if not tokens:
            raise InvalidRequest("the prompt is empty: send some text or token ids")
        return {"tokens": tokens, "grammar": self._constraint(schema, grammar)}

    # -- embeddings (engine/embed.py) ---------------------------------------------
    def call_embed(self, inputs, normalize=2, truncate=False, first=0, lora=None):
        """One embedding per input (each a list of text and token-id parts).

        ``vectors``: per input protocol.encode_vector() of its pooled vector,
        or with pooling none a list of them, one per token; ``n_tokens``: the
        tokens of each.  ``truncate`` cuts an input to what the context takes
        (Ollama's default) instead of refusing it; ``first`` is the request's
        index of inputs[0] (the front sends a long request as several calls),
        for error messages.  ``lora``: the LoRA adapter scales to run with (the
        global ones: llama-server applies them to an embedding too).
        """
        e = self.loaded.embedder
        work = _EmbedWork(e)
        out, counts = e.embed([self._tokens_of(parts) for parts in inputs], normalize,
                              truncate, first, self.loaded.adapters.key(lora))
        if e.pooling == "none":
            vectors = [[protocol.encode_vector(to_le(row)) for row in rows] for rows in out]
        else:
            vectors = [protocol.encode_vector(to_le(v)) for v in out]
        return dict(work.done(), vectors=vectors, n_tokens=counts)

    def call_rerank(self, query, documents, lora=None):
        """The relevance score of each document to ``query`` (pooling rank), as
        llama-server lays out each pair: the model's "rerank" template if it
        has one, else BOS? query EOS? SEP? document EOS?."""
        m = self.model
        template = m.handle.chat_template("rerank")
        eos = m.eos if m.eos is not None else m.sep
        lists = []
        for doc in documents:
            if template:
                text = template.replace("{query}", query).replace("{document}", doc)
                lists.append(m.tokenize(text, add_special=False, parse_special=True))
                continue
            end = [eos] if m.add_eos and eos is not None else []
            tokens = [m.bos] if m.add_bos and m.bos is not None else []
            tokens += m.tokenize(query, add_special=False, parse_special=False) + end
            tokens += [m.sep] if m.add_sep and m.sep is not None else []
            tokens += m.tokenize(doc, add_special=False, parse_special=False) + end
            lists.append(tokens)
        work = _EmbedWork(self.loaded.embedder)
        scores, counts = self.loaded.embedder.scores(lists, self.loaded.adapters.key(lora))
        return dict(work.done(), scores=scores, n_tokens=counts)

    def call_prepare_infill(self, request, reserve, schema=None, grammar=None,
                            t_max_prompt_ms=0, id_slot=-1, cache_reuse=0):
        """The FIM prompt's tokens and checked grammar; with ``t_max_prompt_ms``
        fitted into that budget (``dropped`` says what went, or is None)."""
        s = self.loaded.sessions[0]
        req = protocol.decode_infill(request)
        req.spm_infill = self.spm_infill

        laid = []

        def layout(r):
            laid.append(layout_infill(self.model, r, s.n_ctx, s.n_batch, reserve))
            return laid[-1]
        if t_max_prompt_ms > 0:
            tokens, dropped = promptfit.fit(self.model, req, layout,
                                            self._plan_for(id_slot, cache_reuse),
                                            self.prompt_rate, t_max_prompt_ms)
            # the whole prompt, for the idle fill after the request (_run)
            self._last_fit = (tokens, laid[0][0]) if dropped else None
        else:
            tokens, dropped = layout(req)[0], None
        return {"tokens": tokens, "grammar": self._constraint(schema, grammar),
                "dropped": dropped}

    def _plan_for(self, id_slot, cache_reuse):
        """plan_of(tokens): the cache plan of the session most likely to serve
        them: the one asked for, else the one sharing the longest prefix (the
        pool's choice among free sessions)."""
        sessions = self.loaded.sessions

        states = self.loaded.states

        def plan_of(tokens):
            if 0 <= id_slot < len(sessions):
                cached = list(sessions[id_slot].cached)
            else:
                cached = max((list(x.cached) for x in sessions),
                             key=lambda c: cachereuse.common_prefix(c, tokens))
            plan = cachereuse.plan(cached, tokens, cache_reuse)
            if states is not None:
                # a kept state the session would restore first (statecache.py)
                found, _ = states.best(tokens, cache_reuse, True, plan.reused,
                                       whole=self.model.memory.has_state,
                                       exact_tail=self.model.n_swa > 0
                                       and not self.model.memory.has_state)
                if found is not None:
                    plan = cachereuse.plan(found[1].tokens, tokens, cache_reuse)
            return plan
        return plan_of

    def _constraint(self, schema, grammar):
        """llama-server's ``json_schema`` or ``grammar``, as checked GBNF; where the
        request gives neither, the server's (--grammar, -j ...: Loaded.output_grammar)."""
        if schema is None and grammar is None:
            return self.loaded.output_grammar
        if schema is not None:
            grammar = schema_to_grammar(schema)
        if grammar is not None:
            check_grammar(self.model, grammar)
        return grammar

    def call_prepare_chat(self, messages, tools=(), tool_choice="auto", schema=None,
                          grammar=None, add_generation_prompt=True, enable_thinking=None,
                          kwargs=None, parallel_tool_calls=None, reasoning_format=None,
                          tokenize=True, continuation=None):
        if enable_thinking is None:
            enable_thinking = self.enable_thinking
        kwargs = dict(self.template_kwargs, **(kwargs or {}))
        if reasoning_format is None:
            reasoning_format = self.reasoning_format
        if schema is None and grammar is None and (not tools or tool_choice == "none"):
            # the server's output format, as llama-server keeps it unless the template's
            # tool grammar takes its place
            grammar = self.loaded.output_grammar
        plan = prepare_chat(self.model, template_for(self.loaded),
                            protocol.decode_messages(messages), protocol.decode_tools(tools),
                            tool_choice, schema, grammar, add_generation_prompt,
                            enable_thinking, kwargs, parallel_tool_calls, reasoning_format,
                            rescue=self.tool_call_rescue, check=tokenize,
                            continuation=continuation)
        out = {"text": plan.text}
        files = [f for m in messages for f in m.get("media") or ()]
        if tokenize:
            # the grammars were checked by prepare_chat (check=tokenize)
            out.update(
                tokens=self._media_tokens(plan.text, files, True) if files else
                self.model.tokenize(plan.text, add_special=True, parse_special=True),
                grammar=plan.grammar, grammar_triggers=list(plan.grammar_triggers),
                preserved_tokens=sorted(plan.preserved_tokens),
                chat={"fmt": dataclasses.asdict(plan.reply_format),
                      "id_length": plan.id_length, "rescue": plan.rescue})
        return out

    def _media_tokens(self, text, files, add_special):
        """Token ids of a prompt whose media markers stand for ``files`` (base64):
        each image or audio clip a run of its media id (engine/media.py)."""
        media = self.loaded.media
        if media is None:
            raise InvalidRequest("%s cannot take images or audio: it was not started with "
                                 "an mmproj (--mmproj)" % self.model.name)
        return media.tokenize(text, [base64.b64decode(f) for f in files], add_special)

    # -- generation -------------------------------------------------------------------
    def _generate(self, frame, cancel):
        rid = frame["id"]
        try:
            self.fill.wait()
            self._answer(rid, self._run, frame, cancel)
        finally:
            with self._lock:
                self._cancels.pop(rid, None)
                self._ended.notify_all()
            self.fill.done()

    def _join_group(self, key, cancel):
        """The choices of one prompt (GenerationParams.prompt_group): the first to
        come leads, and gets a function to call once its prompt's state is kept
        (or its evaluation failed); the others wait for that, then restore the
        state as any kept one (session.py _swap_state) instead of evaluating the
        prompt each, and get None.  llama-server's n_cmpl children copy the
        parent's cells alike.  Whoever comes after the lead is done finds the
        state kept already."""
        with self._lock:
            done = self._groups.get(key)
            if done is None:
                done = self._groups[key] = threading.Event()

                def release():
                    with self._lock:
                        if self._groups.get(key) is done:
                            del self._groups[key]
                    done.set()
                return release
        while not done.wait(0.05) and not cancel.cancelled:
            pass
        return None

    # the calls a generate frame may ask to make its prompt (protocol.py)
    _PREPARE = ("prepare_completion", "prepare_infill")

    def _prepared(self, prep, gen, session):
        """The prompt a generate frame's "prepare" makes; its grammar and dropped
        parts set on ``gen``, its size checked as the front checks given tokens."""
        if prep.get("method") not in self._PREPARE:
            raise OffgridError("no prepare method %r" % prep.get("method"))
        out = getattr(self, "call_" + prep["method"])(**prep.get("args", {}))
        gen.sampling.grammar = out["grammar"]
        if "dropped" in out:
            gen.prompt_dropped = out["dropped"]
        tokens = out["tokens"]
        if len(tokens) >= session.n_ctx:
            raise PromptTooLong(n_prompt_tokens=len(tokens), n_ctx=session.n_ctx)
        return tokens

    def think_spec(self, gen, fmt):
        """The reasoning budget of a chat generation (engine/thinkbudget.py) as token
        sequences of the reply format's markers, or None where it has none: llama-server's
        reasoning_budget_* fields, which it makes from the template's thinking tags."""
        budget = gen.reasoning_budget if gen.reasoning_budget is not None \
            else self.reasoning_budget
        if budget is None or budget < 0:
            # no bound, but its end may be asked for (reasoning_control), as
            # llama.cpp's sampler then counts from INT_MAX
            budget = NO_BOUND if gen.reasoning_control else -1
        if budget < 0 or not fmt.reasoning_markers:
            return None
        message = gen.reasoning_budget_message if gen.reasoning_budget_message is not None \
            else self.reasoning_budget_message

        def tokens(text):
            return self.model.tokenize(text, add_special=False, parse_special=True)
        pairs = fmt.reasoning_markers
        end = fmt.reasoning_end if fmt.starts_in_reasoning else pairs[0][1]
        return {"budget": budget, "starts": [tokens(s) for s, _ in pairs],
                "ends": [tokens(e) for e in dict.fromkeys([end] + [e for _, e in pairs])],
                "forced": (tokens(message) if message else []) + tokens(end),
                "counting": fmt.starts_in_reasoning}

    def _run(self, frame, cancel):
        rid = frame["id"]
        session = self.loaded.sessions[frame["session"]]
        if not session.memory.generates:
            # libllama would decode it and hand back logits it never computed
            raise EncoderOnly.of(self.model.meta.get("general.architecture", "?"))
        gen = protocol.decode_gen(frame["gen"])
        # its cache must be of the request's adapter set (engine/adapters.py)
        session.use_adapters(self.loaded.adapters.key(gen.lora))
        tokens = frame.get("tokens")
        if frame.get("prepare") is not None:
            tokens = self._prepared(frame["prepare"], gen, session)
        chat = frame.get("chat")
        stream = frame.get("stream", False)
        pacer = StreamPacer(self.send_many, self.stream_interval) if stream else None
        try:
            return self._paced_run(frame, cancel, rid, session, gen, tokens, chat, stream, pacer)
        finally:
            if pacer is not None:
                pacer.flush()       # held pieces go before the result (or the error)

    def _paced_run(self, frame, cancel, rid, session, gen, tokens, chat, stream, pacer):
        """_run's generation, its stream frames through ``pacer``."""
        on_piece = None
        rs = None
        held = []       # chat: token probabilities not yet sent with a delta
        if gen.speculate and tokens:
            gen.drafter = drafter_for(self.spec_type, chat is not None,
                                      gen.fim_suffix is not None,
                                      # (an image's media ids are no text)
                                      lambda: self.model.detokenize(
                                          [t for t in tokens if t >= 0], special=True))
        if chat is not None:
            rescue = chat.get("rescue")
            if rescue is not None:
                s = gen.sampling
                s.rescue_grammar, s.rescue_opener = rescue["grammar"], rescue["opener"]
                s.rescue_names = tuple(rescue["names"])
                s.rescue_watch_chars = rescue["watch_chars"]
            fmt = _reply_format(chat["fmt"])
            gen.think = self.think_spec(gen, fmt)
            rs = ReplyStream(fmt, chat["id_length"])
            if stream:
                def on_piece(text, probs=None):
                    if probs:
                        held.extend(probs)
                    deltas = rs.add(text)
                    for i, d in enumerate(deltas):
                        pacer.send(self._delta_frame(rid, d, held if i == len(deltas) - 1
                                                     else None, session, gen))
            else:
                def on_piece(text, probs=None):
                    rs.text += text
        elif stream:
            with_probs, with_tokens = gen.with_probs, gen.piece_tokens

            def on_piece(text, items=None):
                # items: the piece's TokenProbs (with_probs), else its token ids
                frame = {"op": "piece", "id": rid, "text": text}
                if items is not None:
                    if with_probs:
                        frame["probs"] = protocol.encode_probs(items)
                    if with_tokens:
                        frame["tokens"] = [p.id for p in items] if with_probs else items
                if gen.timings_per_token:
                    frame["usage"] = protocol.encode_live_usage(session.usage)
                pacer.send(frame)
        on_progress = None
        if stream and gen.return_progress:
            # a piece (or delta) of no text, carrying the prompt's progress
            op, key, empty = ("delta", "delta", {}) if chat is not None else ("piece", "text", "")

            def on_progress(p):
                pacer.send({"op": op, "id": rid, key: empty, "progress": p}, now=True)
        lead = on_evaluated = None
        if gen.prompt_group is not None and gen.cache_prompt and session.states is not None:
            lead = self._join_group(gen.prompt_group, cancel)
        if lead is not None:
            def on_evaluated():
                session.keep_prompt_state()
                lead()
        try:
            c = session.complete(tokens, gen, on_piece, cancel, on_progress,
                                 on_evaluated=on_evaluated)
        finally:
            if lead is not None:
                lead()
            cached = session.cached if not session.closed else []
        fit = self._last_fit
        if fit is not None and fit[0] == tokens and gen.cache_prompt:
            # the budget dropped parts of this prompt: they come back when idle
            self._last_fit = None
            self.fill.want(session, fit[1], gen.cache_reuse)
        self.prompt_rate.observe(c.usage)
        c.usage.dropped = gen.prompt_dropped
        if stream:
            c.probs = None      # they went out with the pieces: not again in the result
        out = {"completion": protocol.encode_completion(c), "n_cached": len(cached)}
        if frame.get("want_cached"):
            # what the front does not have already: the cache after the
            # prompt it sent (protocol.py)
            sent = frame.get("tokens")
            k = cachereuse.common_prefix(cached, sent) if sent else 0
            out["cached_prefix"], out["cached"] = k, cached[k:]
        if rs is not None:
            if stream:
                deltas, reply = rs.finish()
                if c.finish_reason.value != "cancelled":
                    if held and not deltas:
                        # tokens whose text made no delta (a marker, held text)
                        deltas = [ReplyDelta(content="")]
                    for i, d in enumerate(deltas):
                        pacer.send(self._delta_frame(rid, d, held if i == len(deltas) - 1
                                                     else None, session, gen))
            else:
                reply = parse_reply(rs.text, rs.fmt)
            for tc in reply.tool_calls:
                if not tc.id:
                    tc.id = new_tool_call_id(chat["id_length"])
            out["reply"] = {"content": reply.content,
                            "reasoning_content": reply.reasoning_content,
                            "tool_calls": [_call(tc) for tc in reply.tool_calls]}
        return out


    def _delta_frame(self, rid, d, held, session, gen):
        """A delta frame; ``held`` (token probabilities so far unsent) goes with it
        and is emptied, as llama-server puts a step's probabilities on its last delta;
        with timings_per_token, the request's counts and times so far."""
        frame = {"op": "delta", "id": rid, "delta": _delta(d)}
        if held:
            frame["probs"] = protocol.encode_probs(held)
            del held[:]
        if gen.timings_per_token:
            frame["usage"] = protocol.encode_live_usage(session.usage)
        return frame


class _EmbedWork:
    """The decodes an embed or rerank call made and their time: the front counts them
    as prompt work in /metrics, as llama-server counts an embedding task's batches."""

    def __init__(self, embedder):
        self.e = embedder
        self.n0, self.s0 = embedder.n_decodes, embedder.decode_seconds

    def done(self):
        return {"n_decode": self.e.n_decodes - self.n0,
                "decode_ms": (self.e.decode_seconds - self.s0) * 1000.0}


def _reply_format(d):
    d = dict(d)
    d["reasoning_markers"] = [tuple(p) for p in d["reasoning_markers"]]
    return ReplyFormat(**d)


def _call(tc):
    return {"id": tc.id, "name": tc.name, "arguments": tc.arguments}


def _delta(d):
    if d.reasoning_content is not None:
        return {"reasoning_content": d.reasoning_content}
    if d.content is not None:
        return {"content": d.content}
    index, tc = d.tool_call
    return {"tool_call": [index, _call(tc)]}


def main(argv=None):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    args = parse_args(argv)
    # the nice value first, so that the threads made from here on inherit it
    # (llama-server sets it from --prio alone, as here)
    generation = Placement.from_settings(args.cpu_placement)
    placement.set_process_priority(generation.prio)
    place_threads(placement.usable(generation, "--prio"),
                  placement.usable(Placement.from_settings(args.cpu_placement_batch),
                                   "--prio-batch"))
    if args.decode_lock:
        take_turns_with(FileTurns(args.decode_lock, on_handoff=pause_pools))
    inp = sys.stdin.buffer
    # Nothing else may write to the frame stream: frames go to a descriptor of
    # their own, and descriptor 1 becomes stderr, so that print() and whatever C
    # writes to stdout (ggml's abort runs gdb for a backtrace, which printed
    # "[New LWP ...]" into the frames) reach the terminal instead.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if args.verbose:
        # -v: the engine's own log lines (thread-count switches, ...) on stderr
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="offgrid worker %(process)d: %(message)s")
    shown = [-1]
    out_lock = threading.Lock()     # frames from the loader, the requests, and an abort

    def progress(fraction):
        # the front shows it in GET /models while the model loads: whole percents only
        pct = int(fraction * 100)
        if pct != shown[0]:
            shown[0] = pct
            with out_lock:
                out.write(protocol.encode({"op": "progress", "value": pct / 100.0}))
                out.flush()

    def stalled(err):
        # an rpc-server that never answers the handshake: ggml would wait for
        # good, so the load fails from here, and the process with it
        if out_lock.acquire(timeout=1.0):
            out.write(protocol.encode({"op": "failed", "error": protocol.encode_error(err)}))
            out.flush()
        os._exit(1)

    if args.rpc:
        endpoints = rpc.split_endpoints(args.rpc)

        def last_word(message):
            # ggml aborts (an rpc-server went away): tell the front which one,
            # so it answers 503 naming it rather than "SIGABRT"
            err = rpc.abort_error(message, endpoints)
            if err is not None and out_lock.acquire(timeout=1.0):
                out.write(protocol.encode({"op": "fatal", "error": protocol.encode_error(err)}))
                out.flush()
        try:
            libllama.on_ggml_abort(libllama.load(args.lib, verbose=args.verbose), last_word)
        except OffgridError:
            pass        # Loaded.load says what is wrong with the library
    def sized(kv_bytes):
        # what the KV caches will take, before they are made: the front's default
        # memory ceiling counts them (server/workers.py)
        with out_lock:
            # a draft model (-md) is a second model in this process: its file,
            # and a KV cache taken as large as the model's (its shape is not
            # read yet; a smaller draft's is less)
            draft = os.path.getsize(args.model_draft) if args.model_draft else 0
            out.write(protocol.encode({"op": "sizing", "kv_bytes": kv_bytes,
                                       "file_size": os.path.getsize(args.model),
                                       "draft_bytes": draft + kv_bytes if draft else 0}))
            out.flush()

    try:
        loaded = Loaded.load(args, progress, stalled, sized)
    except Exception as e:
        with out_lock:
            out.write(protocol.encode({"op": "failed", "error": protocol.encode_error(e)}))
            out.flush()
        return 1
    # The vocabulary scans grammar checks and ignore_eos need (about 2 s on
    # a 262k vocabulary) run now, as part of loading: off the first request's
    # path, and before anyone measures what a loaded worker holds.
    loaded.model.grammar_facts
    worker = Worker(loaded, out, args.reasoning, args.reasoning_format, out_lock,
                    args.spec_type, args.stream_interval_ms / 1000.0, args.spm_infill,
                    args.tool_call_rescue, args.template_kwargs, args.reasoning_budget,
                    args.reasoning_budget_message)
    worker.slot_save_path = args.slot_save_path
    worker.send({"op": "ready", "info": protocol.encode_info(loaded.info())})
    worker.serve(inp)
    # The front is gone.  Requests may still be running on other threads
    # inside libllama: end the process rather than free what they use.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
