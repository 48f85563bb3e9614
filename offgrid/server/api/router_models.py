"""llama-server's router API over the shelf: the model objects of GET /models, POST
/models/load and /models/unload, and the per-model lines of /metrics.

Shapes as llama-server's ``server-models.cpp`` (``get_router_models``,
``post_router_models_load``/``unload``): each model object carries OpenAI's
fields (``id``, ``object``, ``created``, ``owned_by``), the router's
(``aliases``, ``tags``, ``status`` with its ``value``, ``source``), and,
once the model has been loaded, the ``meta`` llama-server's ``/v1/models``
gives.  Reading them never wakes a model (see ``shelf.py``).
"""

from ..httpd.httperrors import BadRequest
from ..models import presetkeys
from .fields import Fields


def _preset_ini(name, preset):
    """A model's preset settings in llama-server's INI words, as its /models shows them."""
    return "\n".join(["[%s]" % name] + [presetkeys.ini_line(key, preset[key])
                                       for key in presetkeys.SHOWN if key in preset]) + "\n"


def embeds_only(info):
    """An embedding (or rerank) model: its GGUF names a pooling type, or it is an
    encoder, which generates no text (the memory class "none": engine/memory.py)."""
    arch = info.meta.get("general.architecture", "")
    return info.meta.get("%s.pooling_type" % arch) is not None \
        or (info.memory or {}).get("class") == "none"


def capabilities(info):
    """What a model is for, from its worker's report: "chat", "infill", "embedding".

    A model whose GGUF names a pooling type is an embedding (or rerank) model;
    one with FIM tokens and no chat template is a code-completion model (chat
    would fall back to chatml, which it was never trained on).  The chat page
    offers chat with the others only.
    """
    dedicated = embeds_only(info)
    caps = []
    if not dedicated and (info.chat_template or not info.has_fim):
        caps.append("chat")
    if info.has_fim:
        caps.append("infill")
    if dedicated or info.pooling != "none":
        caps.append("embedding")
    return caps


def model_object(shelf, e, created):
    """One model of GET /models: what it is, its status, its settings."""
    status = {"value": e.status}
    if e.status == "loading" and e.progress is not None:
        status["progress"] = {"value": round(float(e.progress), 3)}
    if e.error and e.status in ("error", "unloaded"):
        # broken (error), or the last load could not make room (unloaded)
        status["failed"] = True
        status["error"] = e.error
    preset = e.preset or {}
    if preset:
        status["preset"] = _preset_ini(e.id, preset)
    settings = {k: v for k, v in preset.items()
                if k in presetkeys.SHOWN and k != "chat_template"}
    if e.settings.get("chat_template") or preset.get("chat_template"):
        settings["chat_template"] = e.settings.get("chat_template") or preset["chat_template"]
    info = e.info
    if info is not None:
        settings.update(n_ctx=info.n_ctx, parallel=info.n_sessions)
    left, then = shelf.expires_in(e)
    settings["pinned"] = e.pinned
    if e.worker is not None and left is not None:
        settings["unloads_in"] = max(0.0, round(left, 1)) if not e.active else None
        settings["unloads_to"] = then
    out = {
        "id": e.id, "object": "model", "created": created, "owned_by": "offgrid",
        "aliases": list(e.listed_aliases), "tags": list(e.tags), "path": e.path,
        "status": status,
        "source": e.source.replace(" ", "_"), "pinned": e.pinned, "settings": settings,
        "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
    }
    if info is not None:
        out["meta"] = {"n_vocab": info.n_vocab, "n_ctx_train": info.n_ctx_train,
                       "n_embd": info.n_embd, "n_params": info.n_params,
                       "size": info.size, "n_ctx": info.n_ctx, "fim": info.has_fim}
        out["capabilities"] = capabilities(info)     # offgrid's: known once it has loaded
        # --mmproj: images ("vision") and audio, as llama-server's router names them
        out["architecture"]["input_modalities"] = ["text"] + [
            {"vision": "image", "audio": "audio"}[m] for m in info.modalities]
    return out


def _named(svc, body):
    f = Fields(body)
    name = f.str("model")
    if not name:
        raise BadRequest("'model' is required: the name of a model on the shelf")
    e = svc.shelf.lookup(name)     # exact names only: never a path
    if e is None:
        raise svc.shelf.not_found(name)
    return e


def load(h, body):
    """POST /models/load {"model": NAME}: start loading it; poll GET /models for its status."""
    e = _named(h.service, body)
    if e.worker is not None or e.status == "loading":
        raise BadRequest("model %s is already running" % e.id)
    h.service.shelf.load(e, wait=False)
    h.send_json(200, {"success": True})


def unload(h, body):
    """POST /models/unload {"model": NAME}: end its worker now (its memory goes back)."""
    e = _named(h.service, body)
    if not h.service.shelf.unload(e, "POST /models/unload"):
        raise BadRequest("model %s is not running" % e.id)
    h.send_json(200, {"success": True})


# -- /metrics ------------------------------------------------------------------------------

def _pool(e, counter):
    pool = e.pool
    return getattr(pool, counter) if pool is not None else 0


def _sessions_used(e):
    pool = e.pool
    return round(pool.n_busy / len(pool.sessions), 4) if pool is not None and pool.sessions \
        else 0.0


def _kv_used(e):
    """The tokens the sessions' caches hold now, over their cells (-c each): the
    worker's live count (a running request's cache grows), else the front's record."""
    pool = e.pool
    if pool is None or not pool.sessions or e.info is None or not e.n_ctx:
        return 0.0
    cached = e.peek("slots") or [s.n_cached for s in pool.sessions]
    return round(min(1.0, sum(cached) / float(e.n_ctx * len(pool.sessions))), 4)


def metric_lines(shelf, label):
    """Prometheus lines, one per model for each of these; ``label`` escapes a value."""
    per_model = [
        ("counter", "offgrid_worker_starts_total", "Worker processes started, per model.",
         lambda e: e.worker_starts),
        ("counter", "offgrid_worker_deaths_total", "Worker processes that died, per model.",
         lambda e: e.worker_deaths),
        ("gauge", "offgrid_worker_ready", "Whether the model's worker is serving (1) or "
         "not (0: loading, unloaded, sleeping).", lambda e: int(e.status == "loaded")),
        ("counter", "offgrid_model_loads_total", "Loads of the model (at start, on demand, "
         "POST /models/load).", lambda e: e.loads),
        ("counter", "offgrid_model_unloads_total", "Unloads of the model (idle, keep_alive, "
         "evicted, POST /models/unload).", lambda e: e.unloads),
        ("counter", "offgrid_model_evictions_total", "Unloads to make room for another model.",
         lambda e: e.evictions),
        ("counter", "offgrid_model_load_seconds_total", "Seconds spent loading the model.",
         lambda e: round(e.load_seconds, 3)),
        ("gauge", "offgrid_model_resident_bytes", "Memory its worker process holds (RSS).",
         shelf.resident),
        # what a router in front of several replicas weighs (docs/fleet.md)
        ("gauge", "offgrid_model_requests_queued", "Requests waiting for one of the model's "
         "sessions (--max-queue bounds them).", lambda e: _pool(e, "n_waiting")),
        ("gauge", "offgrid_model_requests_running", "Requests running on the model's sessions.",
         lambda e: _pool(e, "n_busy")),
        ("gauge", "offgrid_model_sessions_used_ratio", "Fraction of the model's sessions "
         "running a request (0-1).", _sessions_used),
        ("gauge", "offgrid_model_kv_used_ratio", "Fraction of the model's KV cache cells "
         "holding its sessions' tokens (0-1).", _kv_used),
    ]
    entries = shelf.entries
    out = []
    for kind, name, help_text, value in per_model:
        out += ["# HELP %s %s" % (name, help_text), "# TYPE %s %s" % (name, kind)]
        for e in entries:
            out.append('%s{model="%s"} %s' % (name, label(e.id), value(e)))
    # where each loaded model's layers are (engine/rpc.py): the CPU, the --rpc devices
    out += ["# HELP offgrid_model_device_layers Layers of the model on each device (CPU: "
            "this machine; RPCn: an rpc-server at endpoint).",
            "# TYPE offgrid_model_device_layers gauge"]
    for e in entries:
        for d in e.info.devices if e.status == "loaded" and e.info is not None else []:
            out.append('offgrid_model_device_layers{model="%s",device="%s",endpoint="%s"} %d'
                       % (label(e.id), label(d["name"]), label(d.get("endpoint") or ""),
                          d["layers"]))
    # each device's memory, apart from the host's (engine/devices.py): what the model
    # holds there (the drop in its free memory across the load) and what is free
    for name, key, help_text in (
            ("offgrid_model_device_held_bytes", "held", "Bytes of device memory the "
             "model's load took (weights, KV caches, buffers), per device."),
            ("offgrid_model_device_free_bytes", "free", "Free bytes of each device the "
             "model uses, when its worker last reported."),
            ("offgrid_model_device_total_bytes", "total", "Total bytes of each device "
             "the model uses.")):
        out += ["# HELP %s %s" % (name, help_text), "# TYPE %s gauge" % name]
        for e in entries:
            for d in e.info.devices if e.status == "loaded" and e.info is not None else []:
                if d["name"] != "CPU" and d.get(key) is not None:
                    out.append('%s{model="%s",device="%s",endpoint="%s"} %d'
                               % (name, label(e.id), label(d["name"]),
                                  label(d.get("endpoint") or ""), d[key]))
    return out


__all__ = ["capabilities", "embeds_only", "load", "metric_lines", "model_object", "unload"]
