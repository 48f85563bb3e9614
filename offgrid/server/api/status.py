"""What the server says about itself: /health, /props, /models, /slots, /metrics, and /.

None of these loads a model: they read the shelf as it is.
"""

import dataclasses
from urllib.parse import unquote

from ..httpd.httperrors import HTTPError, NotFound, Unavailable
from . import formats, router_models
from .errormap import error_body


# -- health, props, models, metrics -------------------------------------------------

def _unhealthy(status, message, **fields):
    """/health's 503: llama-server's error body (the one mapping's), with the status."""
    return dict({"status": status}, **fields, **error_body(Unavailable(message)))


def health(h, _body):
    """200 only when a request for the default model can be served now: what a load
    balancer's health check asks (docs/fleet.md).  Cheap: it reads the shelf, never
    a worker."""
    svc = h.service
    if svc is None:
        h.send_json(503, _unhealthy("loading", "Loading model"))
    elif svc.state != "ready":
        h.send_json(503, _unhealthy("shutting down", "server is shutting down"))
    else:
        entries = svc.entries
        models = [{"id": e.id, "status": _health_status(e)} for e in entries]
        if svc.text is not None:
            # a server with a default model is judged by it alone: not while it
            # loads (at start, a restart after its worker died, a wake), nor when it
            # cannot load, nor while its worker misses its heartbeat.  Unloaded or
            # sleeping is ok: a request loads it, and a balancer that saw 503 here
            # would never send the request that wakes it.
            servable = [svc.text] if _health_status(svc.text) in (
                "loaded", "unloaded", "sleeping") else []
        else:
            # a router: some model can serve, or a request may load one; a load in
            # progress on demand is no outage of the others
            servable = [e for e in entries if _health_status(e) in ("loaded", "unloaded",
                                                                      "sleeping")
                        or (e.status == "loading" and e.worker is None)]
        if entries and not servable:
            h.send_json(503, _unhealthy("loading", "Loading model", models=models))
        else:
            h.send_json(200, {"status": "ok", "models": models})


def _threads_of(entry):
    """The worker's thread counts now (engine/threads.py snapshot), or None
    while it is not there to ask."""
    return _ask(entry, "threads")


def _ask(entry, op):
    """A loaded model's worker's answer to ``op``, or None while it is not there to ask:
    within a second, else its last answer (reading the shelf never waits on a worker)."""
    return entry.peek(op)


def _health_status(entry):
    """A model's status for /health and /slots: "unresponsive" while its worker misses
    heartbeats (models/worker_client.py kills and restarts it soon after)."""
    w = entry.worker
    if w is not None and w.unresponsive:
        return "unresponsive"
    return entry.status


def props(h, _body):
    svc = h.service
    if h.command == "POST":
        # llama-server's POST /props: with --props it answers success and changes
        # nothing (its "update any props here" is empty), without it a 501
        if "props" in svc.endpoints_off:
            raise HTTPError("This server does not support changing global properties. "
                            "Start it with `--props`", status=501, type="not_supported_error")
        h.send_json(200, {"success": True})
        return
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
    defaults = dataclasses.replace(svc.generation_default, sampling=e.sampling)
    settings = formats.generation_settings(defaults, e.n_ctx, e.id)
    settings["grammar"] = info.grammar      # --grammar(-file), -j/-jf's, as GBNF
    pool = e.pool
    h.send_json(200, {
        "default_generation_settings": {
            "id": 0, "id_task": -1, "n_ctx": e.n_ctx, "speculative": info.speculative,
            "is_processing": pool is not None and pool.n_busy > 0, "params": settings,
            "prompt": "",
            "next_token": {"has_next_token": True, "has_new_line": False, "n_remain": -1,
                           "n_decoded": 0, "stopping_word": ""},
        },
        "total_slots": info.n_sessions,
        "model_alias": e.id,
        "model_path": e.path,
        "chat_template": info.chat_template,
        "chat_template_caps": info.caps,
        # --mmproj's encoders (engine/media.py)
        "modalities": {"vision": "vision" in info.modalities, "audio": "audio" in info.modalities},
        "build_info": formats.FINGERPRINT,
        # unloaded by --sleep-idle-seconds (or since): the next request wakes it
        "is_sleeping": e.worker is None,
        "infill": svc.fim.has_fim,
        "threads": _threads_of(e),
        # where the model's layers are: the CPU here, then each --rpc device
        "devices": info.devices or [],
        # dense, swa, hybrid or recurrent, and what its cache may do
        "memory": info.memory,
    })


def models(h, _body):
    """GET /models, /v1/models: the shelf, as OpenAI's list and llama-server's router's."""
    svc = h.service
    svc.shelf.rescan()
    created = int(svc.metrics.started)
    data = [router_models.model_object(svc.shelf, e, created) for e in svc.entries]
    h.send_json(200, {"object": "list", "data": data})


def model_retrieve(h, _body):
    """GET /v1/models/{id}: one model of /v1/models (OpenAI's retrieve), by id or alias."""
    svc = h.service
    name = unquote(h.path.split("?", 1)[0][len(MODEL_PREFIX):])
    e = svc.shelf.lookup(name)
    if e is None:
        raise NotFound("The model '%s' does not exist" % name[:200], type="invalid_request_error")
    h.send_json(200, router_models.model_object(svc.shelf, e, int(svc.metrics.started)))


# where /v1/models/{id} begins (routes.PREFIX_ROUTES)
MODEL_PREFIX = "/v1/models/"


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
        n_cached = e.peek("slots") or [s.n_cached for s in e.pool.sessions]
        threads = _threads_of(e) or {}
        # the model's kept prompt states (engine/statecache.py), which any of its
        # sessions may restore: the same on each of its slots
        states = e.peek("states")
        for s, n in zip(e.pool.sessions, n_cached):
            slot = {"id": s.index, "model": e.id, "n_ctx": e.n_ctx,
                    "state": _health_status(e),
                    "is_processing": e.pool.is_busy(s), "n_cached": n,
                    "n_threads": threads.get("generation"),
                    "n_threads_batch": threads.get("batch")}
            if states is not None:
                slot["prompt_cache"] = states
            out.append(slot)
    h.send_json(200, out)


def metrics(h, _body):
    svc = h.service
    _switched_off(svc, "metrics")
    m = svc.metrics.snapshot(reset_rates=True)  # its own copy: other threads count on
    pools = [e.pool for e in svc.entries if e.pool is not None]     # loaded models only
    busy = sum(p.n_busy for p in pools)
    idle = sum(p.n_idle for p in pools)
    waiting = sum(p.n_waiting for p in pools)
    # the models' decode steps (engine/batch.py): sessions batched into one step
    threads = [(e, _threads_of(e)) for e in svc.entries]
    threads = [(e, t) for e, t in threads if t is not None]
    batching = [(e, _ask(e, "batching")) for e, _ in threads]
    steps = sum(b["steps"] for _, b in batching if b is not None)
    members = sum(b["members"] for _, b in batching if b is not None)
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
        # speculation from the request's text (--spec-type)
        ("counter", "llamacpp:spec_decode_num_draft_tokens_total", "Speculative: Total draft "
         "tokens generated", m.draft_tokens),
        ("counter", "llamacpp:spec_decode_num_accepted_tokens_total", "Speculative: Total "
         "draft tokens accepted by the target model", m.draft_accepted),
        ("counter", "llamacpp:spec_decode_num_drafts_total", "Speculative: Total speculative "
         "decoding verification steps", m.draft_steps),
        ("gauge", "llamacpp:prompt_tokens_seconds", "Average prompt throughput in tokens/s "
         "since the previous scrape", m.prompt_rate),
        ("gauge", "llamacpp:predicted_tokens_seconds", "Average generation throughput in "
         "tokens/s since the previous scrape", m.predicted_rate),
        ("gauge", "llamacpp:requests_processing", "Number of requests processing", busy),
        ("gauge", "llamacpp:requests_deferred", "Number of requests deferred", waiting),
        # the loaded models' sessions per decode step since they loaded
        ("gauge", "llamacpp:n_busy_slots_per_decode", "Average number of busy slots per "
         "llama_decode() call", members / steps if steps else 0),
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
    out += router_models.metric_lines(svc.shelf, _label)
    out += ["# HELP offgrid_threads Threads a model's decodes use now (-t auto adapts them).",
            "# TYPE offgrid_threads gauge"]
    for e, t in threads:
        for kind in ("generation", "batch"):
            out.append('offgrid_threads{model="%s",kind="%s"} %d' % (_label(e.id), kind, t[kind]))
    out += ["# HELP offgrid_thread_switches_total Times -t auto changed a thread count.",
            "# TYPE offgrid_thread_switches_total counter"]
    for e, t in threads:
        out.append('offgrid_thread_switches_total{model="%s"} %d' % (_label(e.id), t["switches"]))
    for name, key, help_text in (
            ("offgrid_decode_steps_total", "steps", "Decode steps of a model's sessions."),
            ("offgrid_batched_steps_total", "shared_steps",
             "Decode steps that carried several sessions' tokens in one batch.")):
        out += ["# HELP %s %s" % (name, help_text), "# TYPE %s counter" % name]
        for e, b in batching:
            if b is not None:
                out.append('%s{model="%s"} %d' % (name, _label(e.id), b[key]))
    out += _state_lines([(e, _ask(e, "states")) for e, _ in threads])
    # llama-server's header: when the counters started, for rates across restarts
    h.send_text(200, "\n".join(out) + "\n",
                headers={"Process-Start-Time-Unix": str(int(m.started))})


# The kept prompt states of each model (engine/statecache.py, --cache-ram, --cache-dir)
_STATE_GAUGES = (
    ("offgrid_state_cache_states", "states",
     "Prompt states kept to be restored into a session, by where they are."),
    ("offgrid_state_cache_bytes", "bytes", "Bytes of the prompt states kept, by where they are."),
)
_STATE_COUNTERS = (
    ("offgrid_state_cache_hits_total", "hits",
     "Requests whose prompt came from a kept state restored into their session."),
    ("offgrid_state_cache_misses_total", "misses",
     "Requests that looked for a kept state beyond their session's cache and found none."),
    ("offgrid_state_cache_saves_total", "saves", "Prompt states kept in memory."),
    ("offgrid_state_cache_evictions_total", "evictions",
     "Prompt states let go to stay within --cache-ram."),
)


def _state_lines(states):
    states = [(e, st) for e, st in states if st is not None]
    out = []
    for name, key, help_text in _STATE_GAUGES:
        out += ["# HELP %s %s" % (name, help_text), "# TYPE %s gauge" % name]
        for e, st in states:
            out.append('%s{model="%s",where="memory"} %d' % (name, _label(e.id), st[key]))
            if "disk" in st:
                out.append('%s{model="%s",where="disk"} %d' % (name, _label(e.id),
                                                              st["disk"][key]))
    for name, key, help_text in _STATE_COUNTERS:
        out += ["# HELP %s %s" % (name, help_text), "# TYPE %s counter" % name]
        for e, st in states:
            out.append('%s{model="%s"} %d' % (name, _label(e.id), st[key]))
    return out


def _label(value):
    """A Prometheus label value: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


