"""Ollama's /api/tags, /api/ps, /api/show, /api/version and /api/pull: what offgrid serves.

The models are those of the shelf (``shelf.py``: -m, --fim-model, the
--models-dir folders), loaded or not; their details come from the GGUF
metadata their workers reported at their last load (``entry.info.meta``,
``n_params``, ``caps``; empty for a model never loaded yet), and their digest
from reading the file once (``DIGESTS``).  /api/show loads the model it
describes.  /api/pull of a model offgrid serves succeeds at once (clients
such as Codex's ``--oss`` pull the model they are told to use); of any
other, it says that offgrid never downloads.  Shapes as Ollama's
docs/api.md; see ``ollama`` for the dialect as a whole.
"""

import hashlib
import math
import os
import threading
import time

from ... import __version__
from ...request import SamplingParams
from ..httpd.httperrors import NotFound
from .ollama import entry_named, model_name, rfc3339
from .fields import Fields
from .router_models import embeds_only

# The Ollama version whose endpoints offgrid serves (docs/api.md of that
# release; clients gate features on it): 0.13.4 is the first whose
# OpenAI-compatible /v1/responses Codex's --oss accepts (0.13.3 added it);
# /api/*, /v1/chat/completions, /v1/completions, /v1/embeddings and /v1/models
# are older.  Not 0.14: its image generation through /api/generate is not here.
OLLAMA_VERSION = "0.13.4"

# llama.h's llama_ftype (GGUF general.file_type) -> Ollama's quantization_level.
_FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
    29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4",
}


# -- the models ------------------------------------------------------------------------

class _Digests:
    """sha256 of each model file, read once on first use (a file of GBs takes seconds)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._done = {}         # (path, size, mtime) -> hex digest

    def of(self, path):
        st = os.stat(path)
        key = (path, st.st_size, st.st_mtime)
        with self._lock:        # one reader per file; others wait for its answer
            if key not in self._done:
                h = hashlib.sha256()
                with open(path, "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 20), b""):
                        h.update(block)
                self._done[key] = h.hexdigest()
            return self._done[key]


DIGESTS = _Digests()


def _meta_value(v):
    """A GGUF metadata value (the worker reports strings, libllama's gguf_kv_to_str) as the
    JSON number or boolean it is, as Ollama gives it, if it is one."""
    if v in ("true", "false"):
        return v == "true"
    for kind in (int, float):
        try:
            n = kind(v)
        except (TypeError, ValueError):
            continue
        return n if math.isfinite(n) else v     # JSON has no NaN or inf
    return v


def _parameter_size(n):
    """Ollama's parameter_size: "7.6B", "494.03M"."""
    for unit, scale, fmt in (("B", 1e9, "%.1f"), ("M", 1e6, "%.2f"), ("K", 1e3, "%.2f")):
        if n >= scale:
            return (fmt % (n / scale)) + unit
    return str(n)


def _details(entry):
    # a model never loaded yet has no metadata here: its worker reads it at load
    info = entry.info
    meta = info.meta if info is not None else {}
    family = meta.get("general.architecture", "")
    ftype = _meta_value(meta.get("general.file_type"))
    return {"parent_model": "", "format": "gguf", "family": family,
            "families": [family] if family else [],
            "parameter_size": _parameter_size(info.n_params) if info else "",
            "quantization_level": _FILE_TYPES.get(ftype, "unknown")}


def _model(entry):
    info = entry.info
    size = info.file_size if info else os.path.getsize(entry.path)
    return {"name": entry.id, "model": entry.id,
            "modified_at": rfc3339(os.path.getmtime(entry.path)),
            "size": size, "digest": DIGESTS.of(entry.path), "details": _details(entry)}


def _present(entries):
    """The entries whose file is there to describe (a shelf file may vanish any time)."""
    return [e for e in entries if os.path.isfile(e.path)]


def version(h, _body):
    h.send_json(200, {"version": OLLAMA_VERSION, "offgrid": __version__})


def pull(h, body):
    """POST /api/pull: Ollama's success, at once, for a model offgrid serves;
    for any other, an error saying models are never downloaded here.

    Streamed (the default) as Ollama streams it: a status line a step and
    "success" last, or an ``{"error": ...}`` line (Ollama's way: its clients
    read the error from the stream); not streamed, one object or a 404.
    """
    f = Fields(body)
    name = model_name(f)
    stream = f.bool("stream", True)
    svc = h.service
    svc.shelf.rescan()
    bare = name[:-len(":latest")] if name.endswith(":latest") else name
    served = any(e.answers_to(name) or e.answers_to(bare) for e in svc.entries
                 if e.status != "error")
    message = ("model %r is not served here, and offgrid never downloads models (it works "
               "offline by design): serve it with -m FILE or put its GGUF in a --models-dir "
               "folder" % name)
    if not stream:
        if not served:
            raise NotFound(message)
        h.send_json(200, {"status": "success"})
        return
    ns = h.ndjson_stream()
    if served:
        ns.send({"status": "pulling manifest"})
        ns.send({"status": "success"})
    else:
        ns.send({"error": message})
    ns.end()


def tags(h, _body):
    """GET /api/tags: every model on the shelf, loaded or not (the folders are read again)."""
    svc = h.service
    svc.shelf.rescan()
    h.send_json(200, {"models": [_model(e) for e in _present(svc.entries)
                                 if e.status != "error"]})


def ps(h, _body):
    """GET /api/ps: the models whose worker is serving now, and when each will be unloaded."""
    shelf = h.service.shelf
    out = []
    for e in _present(shelf.entries):
        if e.status != "loaded":
            continue
        m = _model(e)
        left, _ = shelf.expires_in(e)
        if left is None or e.active:
            expires = "2318-01-01T00:00:00Z"   # never (or not while in use): Ollama's "forever"
        else:
            expires = rfc3339(time.time() + max(0.0, left))
        m.update(size=m["size"] + e.info.kv_bytes, size_vram=0,
                 expires_at=expires, context_length=e.n_ctx)
        out.append(m)
    h.send_json(200, {"models": out})


def _template(entry):
    """The chat template in Ollama's Go-template terms, as far as clients read it.

    offgrid renders the model's own Jinja template (GET /props has it); this
    outline carries what clients test for: ``.Suffix`` exactly when the model
    does fill-in-the-middle (Continue), ``.Tools`` when its template takes
    tools (Ollama's own "tools" capability test).
    """
    caps = entry.info.caps or {}
    out = ["{{- /* offgrid renders this model's own chat template; an outline */ -}}\n"]
    if entry.has_fim:
        out.append("{{- if .Suffix }}<fim_prefix>{{ .Prompt }}<fim_suffix>{{ .Suffix }}"
                   "<fim_middle>\n{{- else if .Messages }}")
    else:
        out.append("{{- if .Messages }}")
    if caps.get("supports_tools"):
        out.append("{{- if .Tools }}{{ .System }}{{ range .Tools }}{{ . }}{{ end }}{{ end }}")
    out.append("{{- range .Messages }}{{ .Role }}: {{ .Content }}\n{{ end }}"
               "{{- else }}{{ if .System }}{{ .System }}\n{{ end }}{{ .Prompt }}{{ end }}"
               "{{ .Response }}")
    return "".join(out)


def _capabilities(entry):
    """Ollama's words for what the model does: an embedding model's is "embedding"
    alone, another's "completion" and what its template and files add."""
    if embeds_only(entry.info):
        return ["embedding"]
    caps = ["completion"]
    if (entry.info.caps or {}).get("supports_tools"):
        caps.append("tools")
    if entry.has_fim:
        caps.append("insert")
    if "vision" in (entry.info.modalities or ()):
        caps.append("vision")       # Ollama's word for a model that takes images
    return caps


# Ollama's names of the sampling settings a Modelfile may set
_OLLAMA_SAMPLING = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty",
                    "repeat_last_n", "presence_penalty", "frequency_penalty", "seed")


def _sampling_parameters(s):
    """A model's own sampling defaults (its file's, its preset's, the flags':
    models/sampling.py) where they are not llama-server's, as Ollama lists the
    PARAMETERs of a Modelfile: "top_k 20"."""
    base = SamplingParams()
    return ["%s %s" % (name, "%g" % getattr(s, name))
            for name in _OLLAMA_SAMPLING
            if getattr(s, name) is not None and getattr(s, name) != getattr(base, name)]


def show(h, body):
    """POST /api/show: one model's template outline, capabilities, metadata and parameters."""
    f = Fields(body)
    name = model_name(f)
    # a shelf model described before (its worker's report is kept) is shown without
    # loading it again: clients call /api/show for every model they list
    entry = h.service.shelf.lookup(name)
    if entry is None or entry.info is None:
        entry = entry_named(h.service, name)
    info = entry.info
    # the template is /api/show's own field (as in Ollama), not repeated here
    model_info = {k: _meta_value(v) for k, v in sorted((info.meta or {}).items())
                  if k != "tokenizer.chat_template"}
    model_info.setdefault("general.parameter_count", info.n_params)
    # one "name value" a line: Continue reads num_ctx from here and fails on any other form
    parameters = ["num_ctx %d" % entry.n_ctx] + _sampling_parameters(entry.sampling)
    # a LoRA adapter (--lora) as Ollama's Modelfile names one: ADAPTER <file>
    adapters = "".join("ADAPTER %s\n" % p for p in entry.lora_paths)
    h.send_json(200, {
        "modelfile": "# Served by offgrid %s\nFROM %s\n%s%s"
                     % (__version__, entry.path, adapters,
                        "".join("PARAMETER %s\n" % p for p in parameters)),
        "parameters": "\n".join(parameters),
        "template": _template(entry),
        "details": _details(entry),
        "model_info": model_info,
        "capabilities": _capabilities(entry),
        "modified_at": rfc3339(os.path.getmtime(entry.path)),
    })
