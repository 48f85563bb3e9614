"""The framed protocol between the front and a model's worker process.

A frame is a 4-byte big-endian length, then that many bytes of UTF-8 JSON:
one object.  Both ends are the same offgrid, started together; still,
nothing is unpickled on either side (JSON only, with Infinity for the -inf
of a banned token's logit bias).  The worker reads frames on its stdin and
writes them on its stdout; its stderr is the front's.

Front -> worker
    {"op": "call", "id": N, "method": NAME, "args": {...}}
        a short request, answered once (the methods: ``engine/worker.py``)
    {"op": "generate", "id": N, "session": I, "tokens": [...], "gen": {...},
     "stream": BOOL, "chat": {...} or null}
        run a prompt on session I; with "stream", pieces (or chat deltas)
        come back as they are final
    {"op": "generate", ..., "tokens": null, "prepare": {"method": NAME, "args": {...}}}
        the same, the prompt made first by the call NAME (prepare_completion,
        prepare_infill), whose grammar and dropped parts go into gen: one
        round trip where the front needs no tokens to pick the session
    A generate's result is {"completion": {...}, "n_cached": N, ...}: N tokens
    are in the session's cache now.  With "want_cached" in the frame (a model
    of several sessions: the front picks the warm one by them) it also has
    "cached_prefix": K and "cached": [...], the tokens after the first K of
    the frame's "tokens" (an editor's prompt of thousands of ids is not sent
    back each keystroke).
    {"op": "cancel", "id": N, "reason": TEXT}
        stop request N; a running decode stops within one graph node
    {"op": "ping", "seq": N}
        the heartbeat: answered at once by a pong, whatever runs
Worker -> front
    {"op": "ready", "info": {...}}      once, when the model and its sessions are loaded
                                        (a ModelInfo)
    {"op": "failed", "error": ERR}      instead of "ready": the model did not load
    {"op": "progress", "value": F}      while loading: the fraction libllama has read
    {"op": "sizing", "kv_bytes": N, "file_size": M}
                                        while loading, before the KV caches are made:
                                        what they will take (the default memory ceiling)
    {"op": "fatal", "error": ERR}       last words: ggml is aborting the process; the
                                        requests running get ERR (an RpcUnavailable)
    {"op": "piece", "id": N, "text": TEXT[, "probs": PROBS]}
    {"op": "delta", "id": N, "delta": {"content"|"reasoning_content"|"tool_call": ...}
                                     [, "probs": PROBS]}
    {"op": "pong", "seq": N, "steps": S, "running": R}
                                        S decode steps made so far, R generations running
    {"op": "result", "id": N, "value": VALUE}
    {"op": "error", "id": N, "error": ERR}
An embedding (the "embed" call) travels as encode_vector(): the base64 of
its float32 values, little-endian, which is also what OpenAI's
``encoding_format: "base64"`` sends, so that answer passes it on as it is.
A 896-float vector (Qwen2.5-0.5B's) is 4.8 KB so and takes 0.07 ms to
write and read back; as a JSON list of floats (Python's repr of each
float32, about 22 characters) it would be 19.9 KB and take 2.6 ms (measured
on this project's 2-core machine), per vector, on both sides of the pipe.
PROBS (only when the request asked for token probabilities) is
encode_probs() of the TokenProbs of the tokens whose text that frame
completes.
ERR is {"kind": NAME, "message": TEXT, "type": TEXT[, "fields": {...}]}:
NAME is a class of ``offgrid.errors``, so the front raises the same
exception the engine did and maps it to HTTP in its one place
(``server/errors.py``); "fields" are attributes it carries (PromptTooLong's
sizes).

Each request id belongs to the front; the worker forgets it with its
"result" or "error".
"""

import array
import base64
import dataclasses
import json
import struct
import sys
from typing import Optional

from . import errors
from .request import (Completion, FinishReason, GenerationParams, InfillRequest, Message,
                      SamplingParams, TokenProb, Tool, ToolCall, Usage)

_HEADER = struct.Struct(">I")
# A frame this large is a bug on the other side, not data: an 8 MiB request
# body tokenizes to frames of a few tens of MiB at most.
MAX_FRAME = 1 << 30


class ProtocolError(Exception):
    """The other side sent something that is not a frame (or closed mid-frame)."""


# -- frames ---------------------------------------------------------------------------

def encode(obj):
    """One frame's bytes."""
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8",
                                                                            "surrogatepass")
    return _HEADER.pack(len(data)) + data


def read_frame(f, sized=False):
    """The next object from the binary stream ``f``; None at a clean end of stream.
    ``sized``: (object, its frame's bytes), (None, 0) at the end."""
    head = f.read(_HEADER.size)
    if not head:
        return (None, 0) if sized else None
    if len(head) < _HEADER.size:
        raise ProtocolError("stream ended inside a frame header")
    (n,) = _HEADER.unpack(head)
    if n > MAX_FRAME:
        raise ProtocolError("frame of %d bytes" % n)
    data = f.read(n)
    if len(data) < n:
        raise ProtocolError("stream ended inside a frame")
    obj = json.loads(data.decode("utf-8", "surrogatepass"))
    return (obj, n) if sized else obj


# -- errors ---------------------------------------------------------------------------

def encode_error(exc):
    """ERR for an exception: its nearest class in offgrid.errors, its message."""
    kind = "OffgridError"
    for cls in type(exc).__mro__:
        if getattr(errors, cls.__name__, None) is cls:
            kind = cls.__name__
            break
    if not isinstance(exc, errors.OffgridError):
        # a bug in the worker: the front answers 500 with what it was
        kind, message = "OffgridError", "internal error: %s: %s" % (type(exc).__name__, exc)
    else:
        message = str(exc)
    err = {"kind": kind, "message": message, "type": getattr(exc, "http_type", None)}
    if hasattr(exc, "fields"):
        err["fields"] = exc.fields()        # e.g. PromptTooLong's two sizes
    return err


def decode_error(err):
    """The exception ERR stands for."""
    cls = getattr(errors, err.get("kind", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, errors.OffgridError)):
        cls = errors.OffgridError
    exc = cls(err.get("message", ""))
    if err.get("type"):
        exc.http_type = err["type"]
    for k, v in (err.get("fields") or {}).items():
        if hasattr(exc, k):
            setattr(exc, k, v)
    return exc


# -- typed requests and results -------------------------------------------------------

def encode_vector(le_bytes):
    """A vector's float32 bytes, little-endian, as the text a frame carries."""
    return base64.b64encode(le_bytes).decode("ascii")


def decode_vector(text):
    """array('f') of a vector encode_vector() wrote."""
    a = array.array("f")
    a.frombytes(base64.b64decode(text))
    if sys.byteorder != "little":
        a.byteswap()
    return a


@dataclasses.dataclass
class WorkerSettings:
    """The engine's share of the command line, parsed once by the front (``__main__``,
    ``server/models/launch.py``) and handed to each worker as JSON on its command line:
    the worker has no defaults of its own to drift from the front's."""
    model: str                      # the GGUF file
    ctx_size: int
    batch_size: int
    ubatch_size: Optional[int]
    parallel: int
    threads: object                 # a count, or "auto"
    threads_batch: object
    spec_type: str                  # request.SPEC_TYPES
    spec_draft_n_max: Optional[int]  # None: each drafter's own (8 lookup, 63 copies)
    model_draft: Optional[str]      # -md: the draft model's file (spec_type draft-simple)
    spec_draft_n_min: int
    spec_draft_p_min: float
    stream_interval_ms: float
    chat_template: Optional[str]    # Jinja text, or a built-in name
    pooling: Optional[str]          # request.POOLINGS; None: the model's
    no_swa_full: bool
    no_repack: bool
    context_shift: bool
    spm_infill: bool                # FIM prompts suffix first (llama-server's --spm-infill)
    tool_call_rescue: bool          # chat/rescue.py: off with --no-tool-call-rescue
    reasoning: str                  # request.REASONING_MODES
    reasoning_format: str           # request.REASONING_FORMATS
    lib: Optional[str]
    decode_lock: Optional[str]      # the file every worker of one server flocks
    rpc: Optional[str]              # HOST:PORT[,...], checked by the front
    n_gpu_layers: Optional[int]     # -ngl: a count, -1 auto (None too), -2 all (engine/devices.py)
    tensor_split: Optional[list]
    verbose: bool
    flash_attn: str = "auto"        # -fa: on, off, auto (libllama's: on for the CPU)
    cache_ram: int = 0              # MiB of prompt states in memory (engine/statecache.py); -1: no bound
    cache_dir: Optional[str] = None     # where prompt states go when the worker ends; None: nowhere
    cache_disk_max: int = 4096      # MiB of them on disk, for this model
    slot_save_path: Optional[str] = None    # POST /slots/ID?action=save|restore's folder
    kv_unified: bool = True         # False: a KV cache stream per session (--no-kv-unified)
    mmproj: Optional[str] = None    # -mm: the model's image/audio projector (engine/media.py)
    mmproj_offload: bool = True     # False: --no-mmproj-offload (the encoder on the CPU)
    image_min_tokens: int = -1      # --image-min-tokens; -1: the mmproj's own
    image_max_tokens: int = -1      # --image-max-tokens; -1: the mmproj's own
    lora: Optional[list] = None     # -m's LoRA adapters: [path, start-up scale] (engine/adapters.py)
    # --control-vector(-scaled): [path, scale] each, summed (engine/controlvector.py), and
    # --control-vector-layer-range's [START, END] (None: every layer)
    control_vectors: list = dataclasses.field(default_factory=list)
    control_vector_layers: Optional[list] = None
    stream_pace: float = 12.0       # tok/s a stream keeps beside a prompt (engine/batch.py)
    device: Optional[list] = None   # -dev: device names, ["none"]; None: every GPU (engine/devices.py)
    split_mode: Optional[str] = None    # -sm: none, layer, row; None: layer
    main_gpu: int = 0               # -mg: the device of -sm none
    kv_offload: bool = True         # False: --no-kv-offload
    # --chat-template-kwargs (and --reasoning-effort): what every chat request's
    # chat_template_kwargs are laid over
    template_kwargs: dict = dataclasses.field(default_factory=dict)
    reasoning_budget: int = -1      # --reasoning-budget (engine/thinkbudget.py); -1: no bound
    reasoning_budget_message: str = ""
    # --override-kv: [key, "int"|"float"|"bool"|"str", value] in place of the file's
    override_kv: list = dataclasses.field(default_factory=list)
    # -ot, --cpu-moe, --n-cpu-moe: [regex, buffer type name] (engine/model.py)
    override_tensor: list = dataclasses.field(default_factory=list)
    load_mode: str = "auto"         # -lm: how libllama reads the file (libllama.LOAD_MODES)
    lazy_mode: str = "auto"         # -lzm: per-layer embeddings read on demand (LAZY_MODES)
    check_tensors: bool = False     # --check-tensors: a tensor of NaN or inf fails the load
    # --rope-scaling, --rope-scale, --rope-freq-*, --yarn-*: {llama_context_params field:
    # value} of those given (libllama.ROPE_PARAMS)
    rope: dict = dataclasses.field(default_factory=dict)
    cache_type_k: str = "f16"       # -ctk, -ctv: the KV cache's types (request.KV_CACHE_TYPES)
    cache_type_v: str = "f16"
    cache_type_k_draft: str = "f16"     # -ctkd, -ctvd: the draft model's (-md)
    cache_type_v_draft: str = "f16"
    # --grammar(-file), -j/-jf: ["grammar", GBNF] or ["schema", a JSON schema], what a
    # request that sets no output format of its own is held to (engine/loaded.py)
    output_default: Optional[list] = None
    ctx_checkpoints: int = 8        # -ctxcp: a recurrent state's checkpoints per session
    checkpoint_min_step: int = 256  # -cms: tokens between them in a long prompt (0: a batch)
    # -C/-Cr, --cpu-strict, --prio, --poll and their -batch twins, the twins already
    # defaulted: {"cpus": [...], "strict", "prio", "poll"} (engine/placement.py)
    cpu_placement: dict = dataclasses.field(default_factory=dict)
    cpu_placement_batch: dict = dataclasses.field(default_factory=dict)
    numa: Optional[str] = None      # --numa: distribute, isolate, numactl; None: off


@dataclasses.dataclass
class SlotAction:
    """POST /slots/ID?action=...: what the front asks of the session it holds for it
    (llama-server's slot save, restore and erase; engine/slotfile.py)."""
    action: str                     # "save", "restore" or "erase"
    id_slot: int                    # the session
    filename: str = ""              # a plain file name in --slot-save-path (save, restore)


def valid_filename(name):
    """llama.cpp's fs_validate_filename (no subfolders): a plain file name, no path
    separator, no "..", no control or reserved characters, not ending in a space or
    a dot."""
    if not isinstance(name, str) or not name or len(name.encode("utf-8", "surrogatepass")) > 255:
        return False
    for ch in name:
        c = ord(ch)
        if c <= 0x1F or c == 0x7F or 0x80 <= c <= 0x9F or c in (0xFF0E, 0x2215, 0x2216) \
                or 0xD800 <= c <= 0xDFFF or c in (0xFFFD, 0xFEFF) or ch in ':*?"<>|/\\':
            return False
    if name[0] == " " or name[-1] in " .":
        return False
    return ".." not in name and name != "."


def encode_slot_action(a):
    return _fields_of(a)


def decode_slot_action(d):
    return SlotAction(**{f.name: d[f.name] for f in dataclasses.fields(SlotAction) if f.name in d})


def encode_settings(settings):
    return _fields_of(settings)


def decode_settings(d):
    return WorkerSettings(**{f.name: d[f.name] for f in dataclasses.fields(WorkerSettings)
                             if f.name in d})


@dataclasses.dataclass
class ModelInfo:
    """What a worker reports of its model once it is loaded (the "ready" frame): the
    front's one description of a model, kept while it is unloaded."""
    path: str                       # the GGUF file, absolute
    name: str                       # general.name, else the file's stem
    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_params: int
    size: int                       # bytes of its tensors
    file_size: int                  # bytes of its file
    n_ctx: int                      # each session's context (-c)
    n_sessions: int                 # -np
    has_fim: bool                   # fill-in-the-middle tokens
    chat_template: str              # the template in use ("" where the model has none)
    caps: dict                      # what the template can do (chat/caps.py's Caps)
    meta: dict                      # the GGUF's metadata, as strings
    kv_bytes: int                   # the sessions' KV caches together
    n_embd_out: int                 # the length of an embedding
    pooling: str                    # how embeddings pool (engine/embed.py)
    rank_head: bool                 # a reranker's classification head (pooling_type rank)
    # where its layers are: the CPU, then each device ("name", "layers", "type",
    # "backend", "free", "total", "held" bytes, "endpoint" of an --rpc one; engine/devices.py)
    devices: list
    speculative: bool               # its requests may draft (--spec-type other than none)
    draft: str                      # the draft model's file name (-md), "" without one
    draft_bytes: int                # its file and KV cache, held beside the model's
    flash_attn: str                 # -fa as it was resolved, in words for the load line
    memory: dict                    # its memory class and what it enables (engine/memory.py)
    modalities: list = dataclasses.field(default_factory=list)  # "vision", "audio" (--mmproj)
    # its LoRA adapters (--lora): id, path, scale, task_name, prompt_prefix each
    lora: list = dataclasses.field(default_factory=list)
    placement: str = ""             # the load line's words for devices, "" on the CPU alone
    # the load line's words for its control vector (engine/controlvector.py), "" without one
    control_vector: str = ""
    # what the model holds in a GPU's own memory (not the host's: an integrated GPU's
    # or lavapipe's count as the host's), which the host memory accounting leaves out
    device_bytes: int = 0
    grammar: str = ""               # --grammar(-file), -j/-jf as GBNF ("": none)
    # a transcription's chat turn for its template: [system, user] (chat/adjust.asr_prompt)
    asr_prompt: list = dataclasses.field(default_factory=lambda: ["", "Transcribe audio to text"])


def encode_info(info):
    return _fields_of(info)


def decode_info(d):
    return ModelInfo(**{f.name: d[f.name] for f in dataclasses.fields(ModelInfo)})


def encode_gen(gen):
    # field by field: dataclasses.asdict deep-copies every list on the way,
    # a tenth of a millisecond of every request's front for nothing
    d = _fields_of(gen)
    d["sampling"] = _fields_of(gen.sampling)
    d["preserved_tokens"] = sorted(gen.preserved_tokens)
    return d


def _fields_of(obj):
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def decode_gen(d):
    d = dict(d)
    s = dict(d.pop("sampling"))
    s["samplers"] = tuple(s["samplers"])
    s["logit_bias"] = [(int(t), float(b)) for t, b in s["logit_bias"]]
    s["grammar_triggers"] = tuple(s["grammar_triggers"])
    s["rescue_names"] = tuple(s.get("rescue_names", ()))
    d["preserved_tokens"] = frozenset(d["preserved_tokens"])
    return GenerationParams(sampling=SamplingParams(**s), **d)


def encode_completion(c):
    d = {"text": c.text, "tokens": c.tokens, "finish_reason": c.finish_reason.value,
         "stop_type": c.stop_type, "stopping_word": c.stopping_word,
         "usage": _fields_of(c.usage), "truncated": c.truncated}
    if c.probs is not None:
        d["probs"] = encode_probs(c.probs)
    return d


def decode_completion(d):
    c = Completion(d["text"], d["tokens"], FinishReason(d["finish_reason"]), d["stop_type"],
                   d["stopping_word"], Usage(**d["usage"]), d["truncated"])
    if d.get("probs") is not None:
        c.probs = decode_probs(d["probs"])
    return c


# the fields of a Usage a streamed piece carries (timings_per_token)
_LIVE_USAGE = ("prompt_tokens", "cached_tokens", "evaluated", "prompt_ms",
               "completion_tokens", "generation_ms")


def encode_live_usage(u):
    """A request's Usage so far, on a piece or delta frame (timings_per_token)."""
    return {k: getattr(u, k) for k in _LIVE_USAGE}


def decode_live_usage(d):
    return Usage(**{k: d[k] for k in _LIVE_USAGE if k in d})


def encode_probs(probs):
    """TokenProbs as [id, bytes, prob, [[id, bytes, prob], ...]]; bytes as a
    latin-1 string (one character per byte: compact, exact)."""
    return [[p.id, p.bytes.decode("latin-1"), p.prob,
             [[t.id, t.bytes.decode("latin-1"), t.prob] for t in p.top]] for p in probs]


def decode_probs(items):
    return [TokenProb(i, b.encode("latin-1"), p,
                      [TokenProb(ti, tb.encode("latin-1"), tp) for ti, tb, tp in top])
            for i, b, p, top in items]


def encode_infill(req):
    return dataclasses.asdict(req)


def decode_infill(d):
    d = dict(d)
    d["input_extra"] = [(str(a), str(b)) for a, b in d["input_extra"]]
    return InfillRequest(**d)


def encode_messages(messages):
    return [dataclasses.asdict(m) for m in messages]


def decode_messages(items):
    out = []
    for d in items:
        d = dict(d)
        d["tool_calls"] = [ToolCall(**tc) for tc in d["tool_calls"]]
        out.append(Message(**d))
    return out


def encode_tools(tools):
    return [dataclasses.asdict(t) for t in tools]


def decode_tools(items):
    return [Tool(**d) for d in items]
