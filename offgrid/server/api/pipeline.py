"""The one generation pipeline: every dialect's generate request runs through ``run``.

A dialect parses its body into a ``Generation`` (the model, the typed
GenerationParams, the prompts, how many choices of each, whether to
stream) and hands it here with a ``Format``, its shapes: how a streamed
piece, a choice's end, the stream's end and a whole body look.  The
pipeline does the rest, once for every dialect (llama.cpp's
``handle_completions_impl(..., res_type)`` is the same idea):

    jobs      each prompt ``n`` times, numbered as llama-server numbers its
              child tasks: the prompts in order, each followed by its
              further choices; at most MAX_JOBS of them, and what a response
              that is not streamed would hold of token probabilities at most
              budget.MAX_PROB_ENTRIES
    seeds     choice k of a prompt samples with ``seed + k``
    cancel    one RequestCancel for the whole request: the client hanging up
              (the disconnect watcher), a newer request with the same
              ``id_slot`` (supersede) or the shutdown cancel every job of it,
              queued ones before they start
    counting  ``metrics.request`` once per request
    running   ``Service.run_choices``: at once on sessions of their own where
              the model has them (one batch per step), else in turn
    stream    SSE or NDJSON, by the format, opened at once: what would refuse
              the request before it runs is checked first (``Service.admit``:
              a real status, not an error event), then the headers and the
              dialect's opening event go out, and the dialect's keep-alive
              while the prompt is evaluated; an error after that becomes the
              stream's last event: the format's own (``Format.fail``), else
              the dialect's error event (``httpd``'s error exit)

Nothing here knows a dialect's field names or shapes.
"""

import contextlib
import functools
import itertools
from dataclasses import dataclass, field
from typing import List, Optional

from ...request import GenerationParams, PromptProgress
from ..httpd.httperrors import BadRequest
from . import budget, lora

# Jobs (prompts x choices) one request may create.  Each waits for a session
# of its own, so one request could otherwise fill a model's queue (64 prompts
# x 16 choices = 1024 jobs) ahead of every other client.
MAX_JOBS = 64


@dataclass
class Prompt:
    """One prompt of a request: its tokens, or the worker call that makes them."""
    tokens: Optional[List[int]]
    text: str = ""                  # what the native final object echoes as "prompt"
    prepare: Optional[tuple] = None     # (method, args): the worker makes the prompt
                                        # as the generation starts (tokens None)


@dataclass
class Generation:
    """A generate request in any dialect, parsed: what ``run`` needs."""
    entry: object                   # the ModelEntry, held for this request
    gen: GenerationParams
    prompts: List[Prompt]
    endpoint: str                   # its name in /metrics ("v1/chat/completions")
    what: str                       # in the log and in worker errors ("POST /v1/...")
    n: int = 1                      # choices of each prompt
    stream: bool = False
    id_slot: int = -1
    chat: Optional[dict] = None     # how the worker reads a chat reply (None: plain text)


@dataclass
class Job:
    """One generation of a request: which prompt, which choice of it, its place."""
    index: int                      # its place among the request's results
    prompt: Prompt
    k: int                          # the choice number within its prompt
    gen: GenerationParams = field(default=None, repr=False)


class Format:
    """A dialect's shapes.  The stream calls come from the request's job threads
    (several at once where choices run in one batch); ``out.send`` is safe to
    call from any of them."""

    # "sse" (text/event-stream) or "ndjson" (application/x-ndjson)
    stream_kind = "sse"
    # the completion's id, where its shapes carry one ("chatcmpl-..."): the running
    # request POST /v1/chat/completions/control names (None: none reaches it)
    cid = None
    # the message a quiet stream gets every few seconds (None: nothing); an SSE
    # comment, which every SSE reader skips
    keepalive = b": ping\n\n"

    def open(self, out):
        """The stream is open (headers sent): the dialect's opening events."""

    def progress(self, out, job, p):
        """Prompt progress (``return_progress``); False cancels."""
        return True

    def piece(self, out, job, payload, probs):
        """A piece of text (a chat delta dict with a chat plan); False cancels.

        A format whose Generation sets ``gen.piece_tokens`` or
        ``gen.timings_per_token`` also gets ``tokens=`` (the ids of the
        tokens the piece shows) and ``usage=`` (a Usage: the counts and times
        so far); the others are never called with them."""
        raise NotImplementedError

    def choice_end(self, out, job, c):
        """Job ``job`` finished with Completion ``c``: its last events."""

    def end(self, out, done):
        """Every job finished (``done``: their Completions in order): the stream's end."""

    def fail(self, out, exc):
        """The stream is open and ``exc`` ends the request: a dialect whose clients wait
        for a terminal event of its own (Responses' response.failed) writes it here
        and ends the stream; the default writes nothing, and httpd's error exit
        writes the dialect's error event (errormap)."""

    def body(self, jobs, done):
        """The whole response of a request that does not stream: a JSON object, or a
        str sent as text/plain."""
        raise NotImplementedError


# the requests' prompts of several choices, numbered (GenerationParams.prompt_group)
_PROMPT_GROUPS = itertools.count()


def jobs_of(g, choices_at_once=False):
    """The jobs of ``g``, numbered as llama-server numbers its child tasks;
    ``choices_at_once``: a prompt's choices run at once (Service.at_once)."""
    n_jobs = len(g.prompts) * g.n
    if n_jobs > MAX_JOBS:
        raise BadRequest("this request asks for %d generations (%d prompts x %d choices); "
                         "at most %d are allowed in one request"
                         % (n_jobs, len(g.prompts), g.n, MAX_JOBS))
    # what the response would hold of token probabilities, if it does not stream
    budget.check_probs(g.gen, n_jobs, g.entry.n_ctx, g.stream)
    jobs = [Job(i, p, k) for i, (p, k) in
            enumerate((p, k) for p in g.prompts for k in range(g.n))]
    base_seed = g.gen.sampling.seed
    # choices that take turns on one session find the prompt in its cache:
    # nothing to share
    group = next(_PROMPT_GROUPS) if choices_at_once else None
    for job in jobs:
        # its own copy: jobs may run at once; choice k its own seed (llama-server's)
        job.gen = g.gen if n_jobs == 1 else g.gen.copy()
        if base_seed is not None:
            job.gen.sampling.seed = base_seed + job.k
        if group is not None:
            # one evaluation of the prompt for all its choices (llama-server's
            # n_cmpl: the children copy the parent's cells)
            job.gen.prompt_group = "%d/%d" % (group, job.index // g.n)
    return jobs


def run(h, g, fmt):
    """Run Generation ``g`` for the request on handler ``h``, answering in ``fmt``'s shapes."""
    svc = h.service
    # the adapter scales it runs with: its own, else the global ones now (api/lora.py)
    g.gen.lora = lora.resolve(g.entry, g.gen.lora)
    jobs = jobs_of(g, svc.at_once(g.entry, g.n, g.id_slot))
    svc.metrics.request(g.endpoint)
    out = None
    if g.stream:
        svc.admit(g.entry, [p.tokens for p in g.prompts])
        if fmt.stream_kind == "sse":
            out = h.event_stream()
        else:
            out = h.ndjson_stream()
        out.open(fmt.keepalive)
        fmt.open(out)

    def one(job, cancel, look):
        def on_piece(payload, probs=None, **extra):
            if isinstance(payload, PromptProgress):
                return fmt.progress(out, job, payload)
            return fmt.piece(out, job, payload, probs, **extra)
        p = job.prompt
        c = svc.generate(g.entry, p.tokens, job.gen, g.id_slot,
                         on_piece if out is not None else None, cancel=cancel,
                         look=look, chat=g.chat, what=g.what, prepare=p.prepare)
        if out is not None:
            fmt.choice_end(out, job, c)
        return c

    try:
        with svc.one_request(g.entry, g.id_slot, h.connection,
                             warmup=g.gen.n_predict == 0) as (cancel, look), \
                svc.controlled(fmt.cid, cancel, g.gen.reasoning_control) if fmt.cid \
                else contextlib.nullcontext():
            done = svc.run_choices(g.entry, [functools.partial(one, job, cancel, look)
                                             for job in jobs], g.id_slot)
        if out is None:
            body = fmt.body(jobs[:len(done)], done)
            if isinstance(body, str):
                h.send_text(200, body, "text/plain; charset=utf-8")
            else:
                h.send_json(200, body)
            return
        fmt.end(out, done)
    except Exception as exc:
        if out is not None:
            fmt.fail(out, exc)
        raise       # httpd's error exit logs and counts it (and writes what is left)
    out.end()
