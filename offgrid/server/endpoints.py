"""One function per endpoint, and the table from path to function.

Each function gets the Handler and the parsed JSON body (None for GET),
turns the body into typed requests (``params``), runs them through the
Service and writes the response (``formats``).  Errors are raised, never
written here.
"""

import functools
from collections import namedtuple
from urllib.parse import unquote

from .. import __version__
from ..errors import OffgridError
from ..request import GenerationParams, InfillRequest, PromptProgress
from . import anthropic, chat, embeddings, formats, ollama, ollama_models, responses
from . import shelf_api
from .errors import BadRequest, HTTPError, NotFound, Unavailable
from .prompts import infill_prepare, infill_tokens
from .params import (Fields, completion_probs_from, include_usage_from, generation_from,
                     id_slot_from, infill_from, native_probs_from, output_schema_from,
                     prompt_from, prompts_from, response_fields_from, text_tokenizer,
                     MAX_N_CMPL)

# dialect: the shape of the route's error bodies (errors.error_body)
Route = namedtuple("Route", "handler methods auth needs_service dialect", defaults=("openai",))


# -- health, props, models, metrics -------------------------------------------------

def health(h, _body):
    svc = h.service
    if svc is None:
        h.send_json(503, {"status": "loading",
                          "error": {"code": 503, "message": "Loading model",
                                    "type": "unavailable_error"}})
    elif svc.state != "ready":
        h.send_json(503, {"status": "shutting down",
                          "error": {"code": 503, "message": "server is shutting down",
                                    "type": "unavailable_error"}})
    else:
        entries = svc.entries
        models = [{"id": e.id, "status": e.status} for e in entries]
        # a model can serve if it is loaded, or a request may load it; not while its
        # worker restarts after a death, nor when it cannot load at all
        servable = [e for e in entries if e.status in ("loaded", "unloaded", "sleeping")
                    or (e.status == "loading" and e.worker is None)]
        if entries and not servable:
            h.send_json(503, {"status": "loading", "models": models,
                              "error": {"code": 503, "message": "Loading model",
                                        "type": "unavailable_error"}})
        else:
            h.send_json(200, {"status": "ok", "models": models})


def _status(entry):
    """A model's state in llama-server's router words."""
    return entry.status


def _threads_of(entry):
    """The worker's thread counts now (engine/threads.py snapshot), or None
    while it is not there to ask."""
    return _ask(entry, "threads")


def _ask(entry, op):
    """A loaded model's worker's answer to ``op``, or None while it is not there to ask."""
    if entry.state != "ready":
        return None
    try:
        return entry.call(op, op)
    except (OffgridError, Unavailable):
        return None         # it died just now


def props(h, _body):
    svc = h.service
    e = svc.text
    info = e.info if e is not None else None
    if info is None:
        # a router: no default model (llama-server's router answers the same)
        shelf = svc.shelf
        h.send_json(200, {
            "role": "router", "max_instances": shelf.models_max,
            "models_autoload": shelf.autoload, "model_alias": "offgrid", "model_path": "none",
            "default_generation_settings": {"params": {}, "n_ctx": 0},
            "build_info": formats.FINGERPRINT, "is_sleeping": False,
            "infill": bool(svc.fim is not None and svc.fim.has_fim),
        })
        return
    defaults = GenerationParams(n_predict=svc.n_predict_default, sampling=svc.sampling_default)
    settings = formats.generation_settings(defaults, e.n_ctx, e.id)
    pool = e.pool
    h.send_json(200, {
        "default_generation_settings": {
            "id": 0, "id_task": -1, "n_ctx": e.n_ctx, "speculative": False,
            "is_processing": pool is not None and pool.n_busy > 0, "params": settings,
            "prompt": "",
            "next_token": {"has_next_token": True, "has_new_line": False, "n_remain": -1,
                           "n_decoded": 0, "stopping_word": ""},
        },
        "total_slots": info["n_sessions"],
        "model_alias": e.id,
        "model_path": e.path,
        "chat_template": info["chat_template"],
        "chat_template_caps": info["caps"],
        "modalities": {"vision": False, "audio": False},
        "build_info": formats.FINGERPRINT,
        # unloaded by --sleep-idle-seconds (or since): the next request wakes it
        "is_sleeping": e.worker is None,
        "infill": svc.fim.has_fim,
        "threads": _threads_of(e),
        # where the model's layers are: the CPU here, then each --rpc device
        "devices": info.get("devices") or [],
    })


def models(h, _body):
    """GET /models, /v1/models: the shelf, as OpenAI's list and llama-server's router's."""
    svc = h.service
    svc.shelf.rescan()
    created = int(svc.metrics.started)
    data = [shelf_api.model_object(svc.shelf, e, created) for e in svc.entries]
    h.send_json(200, {"object": "list", "data": data})


def model_retrieve(h, _body):
    """GET /v1/models/{id}: one model of /v1/models (OpenAI's retrieve), by id or alias."""
    svc = h.service
    name = unquote(h.path.split("?", 1)[0][len(_MODEL_PREFIX):])
    e = svc.shelf.lookup(name)
    if e is None:
        raise NotFound("The model '%s' does not exist" % name[:200], type="invalid_request_error")
    h.send_json(200, shelf_api.model_object(svc.shelf, e, int(svc.metrics.started)))


def _switched_off(svc, name):
    """llama-server's 501 for an endpoint the command line turned off."""
    if name in svc.endpoints_off:
        raise HTTPError("This server does not support %s endpoint. Start it with `--%s`"
                        % (name, name), status=501, type="not_supported_error")


def slots(h, _body):
    _switched_off(h.service, "slots")
    out = []
    for e in h.service.entries:
        if e.pool is None:
            continue        # not loaded: no sessions
        # live from the worker (a running request's cache grows); the front's
        # record from the last request while the worker is not there
        n_cached = [s.n_cached for s in e.pool.sessions]
        if e.state == "ready":
            try:
                n_cached = e.call("slots", "GET /slots")
            except (OffgridError, Unavailable):
                pass        # it died just now: the front's record will do
        threads = _threads_of(e) or {}
        for s, n in zip(e.pool.sessions, n_cached):
            out.append({"id": s.index, "model": e.id, "n_ctx": e.n_ctx, "state": _status(e),
                        "is_processing": e.pool.is_busy(s), "n_cached": n,
                        "n_threads": threads.get("generation"),
                        "n_threads_batch": threads.get("batch")})
    h.send_json(200, out)


def metrics(h, _body):
    svc = h.service
    _switched_off(svc, "metrics")
    m = svc.metrics.snapshot(reset_rates=True)  # its own copy: other threads count on
    pools = [e.pool for e in svc.entries if e.pool is not None]     # loaded models only
    busy = sum(p.n_busy for p in pools)
    idle = sum(p.n_idle for p in pools)
    waiting = sum(p.n_waiting for p in pools)
    # llama-server's names and meanings first (its own descriptions), then offgrid's
    lines = [
        ("counter", "llamacpp:prompt_tokens_total", "Number of prompt tokens processed, "
         "excluding cached tokens", m.prompt_tokens),
        ("counter", "llamacpp:prompt_tokens_cached_total", "Number of prompt tokens reused "
         "from the cache", m.cached_tokens),
        ("counter", "llamacpp:prompt_seconds_total", "Total time spent processing prompts",
         m.prompt_seconds),
        ("counter", "llamacpp:tokens_predicted_total", "Number of generation tokens processed",
         m.predicted_tokens),
        ("counter", "llamacpp:tokens_predicted_seconds_total", "Total time spent generating "
         "tokens", m.predicted_seconds),
        ("counter", "llamacpp:n_decode_total", "Total number of llama_decode() calls",
         m.n_decode),
        ("counter", "llamacpp:n_tokens_max", "Largest observed sequence length (prompt + "
         "generation)", m.n_tokens_max),
        # speculation from the request's text (--spec-type ngram-simple); offgrid
        # counts drafted tokens, not verification steps: that one stays 0
        ("counter", "llamacpp:spec_decode_num_draft_tokens_total", "Speculative: Total draft "
         "tokens generated", m.draft_tokens),
        ("counter", "llamacpp:spec_decode_num_accepted_tokens_total", "Speculative: Total "
         "draft tokens accepted by the target model", m.draft_accepted),
        ("counter", "llamacpp:spec_decode_num_drafts_total", "Speculative: Total speculative "
         "decoding verification steps", 0),
        ("gauge", "llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s "
         "since the previous scrape", m.prompt_rate),
        ("gauge", "llamacpp:predicted_tokens_seconds", "Average generation throughput in "
         "tokens/s since the previous scrape", m.predicted_rate),
        ("gauge", "llamacpp:requests_processing", "Number of requests processing", busy),
        ("gauge", "llamacpp:requests_deferred", "Number of requests deferred", waiting),
        # each llama_decode() here serves one session (decodes take turns, no batching)
        ("gauge", "llamacpp:n_busy_slots_per_decode", "Average number of busy slots per "
         "llama_decode() call", 1 if m.n_decode else 0),
        ("counter", "offgrid_prompt_tokens_cached_total", "Prompt tokens reused from the cache.",
         m.cached_tokens),
        ("counter", "offgrid_requests_cancelled_total", "Requests cancelled (superseded, "
         "disconnected or shut down).", m.cancelled),
        ("counter", "offgrid_requests_superseded_total", "Requests cancelled by a newer one "
         "with the same id_slot.", svc.supersede.superseded),
        ("counter", "offgrid_errors_total", "Requests answered with a 5xx error.", m.errors),
        ("gauge", "offgrid_sessions_busy", "Sessions running a request.", busy),
        ("gauge", "offgrid_sessions_idle", "Sessions free.", idle),
        ("gauge", "offgrid_queue_length", "Requests waiting for a session.", waiting),
    ]
    out = []
    for kind, name, help_text, value in lines:
        out += ["# HELP %s %s" % (name, help_text), "# TYPE %s %s" % (name, kind),
                "%s %s" % (name, value)]
    out += ["# HELP offgrid_requests_total Requests by endpoint.",
            "# TYPE offgrid_requests_total counter"]
    for endpoint, n in sorted(m.requests.items()):
        out.append('offgrid_requests_total{endpoint="%s"} %d' % (endpoint, n))
    out += shelf_api.metric_lines(svc.shelf, _label)
    threads = [(e, _threads_of(e)) for e in svc.entries]
    threads = [(e, t) for e, t in threads if t is not None]
    out += ["# HELP offgrid_threads Threads a model's decodes use now (-t auto adapts them).",
            "# TYPE offgrid_threads gauge"]
    for e, t in threads:
        for kind in ("generation", "batch"):
            out.append('offgrid_threads{model="%s",kind="%s"} %d' % (_label(e.id), kind, t[kind]))
    out += ["# HELP offgrid_thread_switches_total Times -t auto changed a thread count.",
            "# TYPE offgrid_thread_switches_total counter"]
    for e, t in threads:
        out.append('offgrid_thread_switches_total{model="%s"} %d' % (_label(e.id), t["switches"]))
    batching = [(e, _ask(e, "batching")) for e, _ in threads]
    for name, key, help_text in (
            ("offgrid_decode_steps_total", "steps", "Decode steps of a model's sessions."),
            ("offgrid_batched_steps_total", "shared_steps",
             "Decode steps that carried several sessions' tokens in one batch.")):
        out += ["# HELP %s %s" % (name, help_text), "# TYPE %s counter" % name]
        for e, b in batching:
            if b is not None:
                out.append('%s{model="%s"} %d' % (name, _label(e.id), b[key]))
    # llama-server's header: when the counters started, for rates across restarts
    h.send_text(200, "\n".join(out) + "\n",
                headers={"Process-Start-Time-Unix": str(int(m.started))})


def _label(value):
    """A Prometheus label value: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def root(h, _body):
    """GET /: a liveness answer (Ollama's clients ping it before anything else)."""
    h.send_text(200, "offgrid is running\n", "text/plain; charset=utf-8")


# -- tokens -------------------------------------------------------------------------

def tokenize(h, body):
    f = Fields(body)
    entry = h.service.entry_for(f.raw("model"))
    content = f.str("content")
    if content is None:
        raise BadRequest("'content' is required")
    out = entry.call("tokenize", "POST /tokenize", text=content,
                     add_special=f.bool("add_special", False),
                     parse_special=f.bool("parse_special", True),
                     with_pieces=f.bool("with_pieces", False))
    if "body" in out:
        # with pieces, the worker writes the body itself (one fragment per distinct token)
        h.send_raw_json(200, out["body"].encode("utf-8", "replace"))
    else:
        h.send_json(200, {"tokens": out["tokens"]})


def detokenize(h, body):
    f = Fields(body)
    entry = h.service.entry_for(f.raw("model"))
    tokens = f.raw("tokens", [])
    if not isinstance(tokens, list):
        raise BadRequest("'tokens' must be a list of token ids")
    h.send_json(200, entry.call("detokenize", "POST /detokenize", tokens=tokens))


# -- llama-server's native completions ---------------------------------------------

def completion(h, body):
    f = Fields(body)
    svc = h.service
    entry = svc.entry_for(f.raw("model"))
    if not f.has("prompt"):
        raise BadRequest('"prompt" must be provided')
    prompts = prompts_from(f.raw("prompt"))
    gen = generation_from(f, entry.n_vocab, svc.n_predict_default,
                          sampling_default=svc.sampling_default, tokenize=text_tokenizer(entry))
    native_probs_from(f, gen, entry.n_vocab)
    schema, grammar = output_schema_from(f)
    jobs = []
    # the worker makes a lone prompt as it starts: one round trip, not two
    deferred = svc.deferred_prepare(entry, len(prompts) * _n_cmpl(f), f.bool("stream", False))
    for prompt in prompts:
        args = dict(parts=prompt.parts, add_special=True, schema=schema, grammar=grammar)
        text = prompt.parts[0] if prompt.is_text else ""
        if deferred:
            jobs.append((None, text, ("prepare_completion", args)))
            continue
        out = entry.call("prepare_completion", "POST /completion", **args)
        gen.sampling.grammar = out["grammar"]
        jobs.append((out["tokens"], text, None))
    _run_native(h, f, entry, jobs, gen, "completion")


def infill(h, body):
    f = Fields(body)
    svc = h.service
    entry = svc.entry_for(f.raw("model"), fim=True)
    req = infill_from(f)
    gen = generation_from(f, entry.n_vocab, svc.n_predict_default,
                          sampling_default=svc.sampling_default, tokenize=text_tokenizer(entry))
    native_probs_from(f, gen, entry.n_vocab)
    gen.cache_reuse = _cache_reuse(f, svc)
    if svc.deferred_prepare(entry, _n_cmpl(f), f.bool("stream", False)):
        # the worker lays out the prompt as it starts: one round trip, not two
        job = (None, "", ("prepare_infill", infill_prepare(f, req, gen)))
    else:
        job = (infill_tokens(f, entry, req, gen, "POST /infill"), "", None)
    _run_native(h, f, entry, [job], gen, "infill")


def _n_cmpl(f):
    return f.int("n_cmpl" if f.has("n_cmpl") else "n", 1, lo=1, hi=MAX_N_CMPL)


def _cache_reuse(f, svc):
    """Chunk reuse for a FIM request: llama-server's n_cache_reuse, else the server's."""
    return f.int("n_cache_reuse", svc.cache_reuse, lo=0, hi=1 << 20)


def _run_native(h, f, entry, jobs, gen, endpoint):
    """Run /completion or /infill: one result, or an array for several prompts or n_cmpl > 1.

    ``jobs``: (prompt tokens, prompt text, prepare) per prompt; ``prepare``
    (then tokens is None) is the (method, args) call with which the worker
    makes the prompt itself (Service.deferred_prepare).  Each prompt runs
    ``n_cmpl`` times, all of them at once where the model has the sessions
    (Service.run_choices: decoded in one batch); results are numbered as
    llama-server's: the prompts in order, each followed by its further
    completions.
    """
    svc = h.service
    svc.metrics.request(endpoint)
    stream = f.bool("stream", False)
    id_slot = id_slot_from(f)
    fields = response_fields_from(f)
    return_tokens = f.bool("return_tokens", False)
    n_cmpl = _n_cmpl(f)
    gen.return_progress = stream and f.bool("return_progress", False)
    timings_per_token = f.bool("timings_per_token", False)
    es = h.event_stream() if stream else None
    base_seed = gen.sampling.seed
    finals = {}     # index -> the final object of that result

    alone = len(jobs) * n_cmpl == 1

    def job(index, tokens, prompt_text, prepare, k):
        g = gen if alone else gen.copy()    # its own seed: jobs may run at once
        if base_seed is not None:
            g.sampling.seed = base_seed + k
        counter = {"n": 0}

        def on_piece(text, probs=None):
            if isinstance(text, PromptProgress):    # return_progress
                return es.send(formats.native_progress(text, index, id_slot, len(tokens),
                                                       timings_per_token))
            counter["n"] += len(probs) if probs else 1
            return es.send(formats.native_partial(text, index, id_slot, counter["n"],
                                                  len(tokens), probs, g.post_sampling_probs))

        c = svc.generate(entry, tokens, g, id_slot, on_piece if stream else None,
                         sock=h.connection, what="POST /" + endpoint, prepare=prepare)
        obj = formats.native_final(c, entry.id, g, entry.n_ctx, id_slot, prompt_text,
                                   index=index, stream=stream, return_tokens=return_tokens)
        if stream:
            obj["content"] = ""     # the pieces already carried it, as in llama-server
        if fields:
            obj = formats.select_fields(obj, fields)
        if stream:
            es.send(obj)
        finals[index] = obj
        return c

    jobs = [functools.partial(job, index, tokens, prompt_text, prepare, k)
            for index, (tokens, prompt_text, prepare, k)
            in enumerate((t, p, q, k) for t, p, q in jobs for k in range(n_cmpl))]
    results = [finals[i] for i in range(len(svc.run_choices(entry, jobs, id_slot)))]
    if stream:
        es.end()
    else:
        h.send_json(200, results[0] if len(results) == 1 else results)


# -- OpenAI -------------------------------------------------------------------------

def _openai_checks(f):
    """``n`` choices of each prompt (llama-server's n_cmpl), checked; best_of and echo refused."""
    if f.int("best_of", 1) != 1:
        raise BadRequest("'best_of' must be 1: offgrid does not rank several completions")
    if f.bool("echo", False):
        raise BadRequest("'echo' is not supported: the response never repeats the prompt")
    return f.int("n", 1, lo=1, hi=MAX_N_CMPL)


def v1_completions(h, body):
    f = Fields(body)
    svc = h.service
    n = _openai_checks(f)
    suffix = f.str("suffix")
    if not f.has("prompt"):
        raise BadRequest("'prompt' is required")
    if suffix is not None:
        prompt = prompt_from(f.raw("prompt"))
        if not prompt.is_text:
            raise BadRequest("with 'suffix', 'prompt' must be a string")
        entry = svc.entry_for(f.raw("model"), fim=True)
        gen = generation_from(f, entry.n_vocab, svc.n_predict_default,
                              ("max_tokens", "n_predict"), svc.sampling_default,
                              tokenize=text_tokenizer(entry))
        completion_probs_from(f, gen, entry.n_vocab)
        gen.cache_reuse = _cache_reuse(f, svc)
        req = InfillRequest(input_prefix=prompt.parts[0], input_suffix=suffix)
        prompts = [infill_tokens(f, entry, req, gen, "POST /v1/completions")]
    else:
        entry = svc.entry_for(f.raw("model"))
        gen = generation_from(f, entry.n_vocab, svc.n_predict_default,
                              ("max_tokens", "n_predict"), svc.sampling_default,
                              tokenize=text_tokenizer(entry))
        completion_probs_from(f, gen, entry.n_vocab)
        schema, grammar = output_schema_from(f)
        prompts = []
        for prompt in prompts_from(f.raw("prompt")):
            if prompt.is_text and not prompt.parts[0]:
                # nothing to continue (with a suffix, an empty prefix is a fine FIM request)
                raise BadRequest("'prompt' must not be empty")
            out = entry.call("prepare_completion", "POST /v1/completions", parts=prompt.parts,
                             add_special=True, schema=schema, grammar=grammar)
            gen.sampling.grammar = out["grammar"]
            prompts.append(out["tokens"])
    svc.metrics.request("v1/completions")
    stream = f.bool("stream", False)
    include_usage = include_usage_from(f)
    id_slot = id_slot_from(f)
    cid, created = formats.new_id("cmpl"), formats.now()
    es = h.event_stream() if stream else None
    base_seed = gen.sampling.seed

    def choice(index, tokens, k):
        g = gen.copy()      # its own seed: choices may run at once
        if base_seed is not None:
            g.sampling.seed = base_seed + k
        offset = [0]        # where the next token starts in the completion's text

        def on_piece(text, probs=None):
            lp = None
            if probs is not None:
                lp, offset[0] = formats.oai_completion_logprobs(probs, offset[0])
            return es.send(formats.oai_completion_chunk(text, entry.id, cid, created,
                                                        logprobs=lp, index=index))

        c = svc.generate(entry, tokens, g, id_slot, on_piece if stream else None,
                         sock=h.connection, what="POST /v1/completions")
        if stream:
            es.send(formats.oai_completion_chunk("", entry.id, cid, created,
                                                 formats.finish_reason(c), index=index))
        return c

    # each prompt n times, numbered in that order (llama-server's child tasks)
    done = svc.run_choices(entry, [
        functools.partial(choice, index, tokens, k) for index, (tokens, k)
        in enumerate((t, k) for t in prompts for k in range(n))], id_slot)
    prompt_tokens = sum(len(t) for t in prompts)
    if not stream:
        h.send_json(200, formats.oai_completion(done, entry.id, cid, created, prompt_tokens))
        return
    if include_usage:
        chunk = formats.oai_usage_chunk(done[0], "text_completion", entry.id, cid, created)
        chunk["usage"] = formats.usage_of_choices(done, prompt_tokens)
        es.send(chunk)
    es.send(b"[DONE]")
    es.end()


# -- the table ------------------------------------------------------------------------

_GET, _POST = ("GET",), ("POST",)

ROUTES = {
    "/health": Route(health, _GET, False, False),
    "/v1/health": Route(health, _GET, False, False),
    "/props": Route(props, _GET, True, True),
    "/models": Route(models, _GET, True, True),
    "/v1/models": Route(models, _GET, True, True),
    "/models/load": Route(shelf_api.load, _POST, True, True),
    "/models/unload": Route(shelf_api.unload, _POST, True, True),
    "/slots": Route(slots, _GET, True, True),
    "/metrics": Route(metrics, _GET, True, True),
    "/tokenize": Route(tokenize, _POST, True, True),
    "/detokenize": Route(detokenize, _POST, True, True),
    "/apply-template": Route(chat.apply_template, _POST, True, True),
    "/completion": Route(completion, _POST, True, True),
    "/completions": Route(completion, _POST, True, True),
    "/infill": Route(infill, _POST, True, True),
    "/v1/completions": Route(v1_completions, _POST, True, True),
    "/v1/chat/completions": Route(chat.chat_completions, _POST, True, True),
    "/chat/completions": Route(chat.chat_completions, _POST, True, True),
    # embeddings and rerank (server/embeddings.py)
    "/v1/embeddings": Route(embeddings.v1_embeddings, _POST, True, True),
    "/embedding": Route(embeddings.embedding, _POST, True, True),
    "/embeddings": Route(embeddings.embedding, _POST, True, True),
    "/rerank": Route(embeddings.rerank, _POST, True, True),
    "/reranking": Route(embeddings.rerank, _POST, True, True),
    "/v1/rerank": Route(embeddings.rerank, _POST, True, True),
    "/v1/reranking": Route(embeddings.rerank, _POST, True, True),
    "/v1/chat/completions/input_tokens": Route(chat.input_tokens, _POST, True, True),
    "/chat/completions/input_tokens": Route(chat.input_tokens, _POST, True, True),
    # Ollama's API (server/ollama.py); "/" answers its clients' heartbeat
    "/": Route(root, _GET, False, False),
    "/api/version": Route(ollama_models.version, _GET, False, False, "ollama"),
    "/api/tags": Route(ollama_models.tags, _GET, True, True, "ollama"),
    "/api/ps": Route(ollama_models.ps, _GET, True, True, "ollama"),
    "/api/show": Route(ollama_models.show, _POST, True, True, "ollama"),
    "/api/generate": Route(ollama.generate, _POST, True, True, "ollama"),
    "/api/chat": Route(ollama.chat_, _POST, True, True, "ollama"),
    "/api/embed": Route(ollama.embed, _POST, True, True, "ollama"),
    "/api/embeddings": Route(ollama.embeddings_, _POST, True, True, "ollama"),
    "/api/pull": Route(ollama_models.pull, _POST, True, True, "ollama"),
    "/api/push": Route(ollama.manage, _POST, True, False, "ollama"),
    "/api/create": Route(ollama.manage, _POST, True, False, "ollama"),
    "/api/copy": Route(ollama.manage, _POST, True, False, "ollama"),
    "/api/delete": Route(ollama.manage, ("DELETE",), True, False, "ollama"),
    "/v1/messages": Route(anthropic.messages, _POST, True, True, "anthropic"),
    "/v1/messages/count_tokens": Route(anthropic.count_tokens, _POST, True, True, "anthropic"),
    "/v1/responses": Route(responses.responses, _POST, True, True),
}


# Routes whose path ends in a value (the handler reads it from h.path), tried
# after ROUTES' exact paths: (prefix, route).
_MODEL_PREFIX = "/v1/models/"
PREFIX_ROUTES = ((_MODEL_PREFIX, Route(model_retrieve, _GET, True, True)),)


def route_of(path):
    """The route of a path (no query string): an exact one, else a prefix's, else None."""
    route = ROUTES.get(path)
    if route is None:
        for prefix, r in PREFIX_ROUTES:
            if path.startswith(prefix) and len(path) > len(prefix):
                return r
    return route


def dialect_of(path):
    """The error shape for a path: its route's dialect; Ollama's for any other /api/ path."""
    route = route_of(path)
    if route is not None:
        return route.dialect
    return "ollama" if path.startswith("/api/") else "openai"


__all__ = ["ROUTES", "PREFIX_ROUTES", "Unavailable", "dialect_of", "route_of"]
