"""``python -m offgrid`` / ``offgrid``: load the models and serve them over HTTP.

The flags are named like llama-server's, so habits carry over.  The HTTP
socket opens first, so ``/health`` answers 503 "loading" while the models
load; then one line ``listening on http://HOST:PORT`` says it is ready.
SIGINT/SIGTERM stop it: new requests get 503, running ones get a grace
period, the process exits 0.
"""

import argparse
import ipaddress
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

from . import __version__
from .errors import OffgridError
from .protocol import WorkerSettings
from .request import (KV_CACHE_TYPES, LOAD_MODES, POOLINGS, REASONING_FORMATS,
                      REASONING_MODES, SPEC_TYPES)


def thread_count(value):
    """-t / -tb: "auto", or a count (0 and below mean auto, as llama-server's -1)."""
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError("a number of threads or auto, not %r" % value)
    return n if n > 0 else "auto"


# llama.cpp's LLM_FFN_EXPS_REGEX (common.h): a Mixture of Experts layer's expert weights
FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


def tensor_overrides(args):
    """-ot's REGEX=BUFT items, then --cpu-moe's and --n-cpu-moe's, as [regex, buffer type
    name] (llama-server's order); ValueError for one that does not read."""
    out = []
    for value in args.override_tensor:
        for item in value.split(","):
            pattern, sep, buft = item.rpartition("=")
            if not sep or not pattern or not buft:
                raise ValueError("-ot %s: give REGEX=BUFFER_TYPE, e.g. "
                                 "'\\.ffn_.*_exps\\.=CPU'" % item)
            try:
                re.compile(pattern)
            except re.error as e:
                raise ValueError("-ot %s: not a regular expression (%s)" % (item, e))
            out.append([pattern, buft])
    if args.n_cpu_moe < 0:
        raise ValueError("--n-cpu-moe must be 0 or more")
    if args.cpu_moe:
        out.append([FFN_EXPS_REGEX, "CPU"])
    out += [[r"blk\.%d%s" % (i, FFN_EXPS_REGEX), "CPU"] for i in range(args.n_cpu_moe)]
    return out


def kv_override(item):
    """One --override-kv item, KEY=TYPE:VALUE, as [key, type, value] (as llama.cpp's
    string_parse_kv_override reads it); ValueError where it is not one."""
    key, sep, rest = item.partition("=")
    kind, colon, text = rest.partition(":")
    if not sep or not key or len(key.encode()) >= 128 or not colon:
        raise ValueError("--override-kv %s: give KEY=TYPE:VALUE (TYPE int, float, bool or "
                         "str)" % item)
    try:
        value = {"int": int, "float": float, "str": str,
                 "bool": {"true": True, "false": False}.__getitem__}[kind](text)
    except (KeyError, ValueError):
        raise ValueError("--override-kv %s: not a value of type int, float, bool (true or "
                         "false) or str" % item)
    if kind == "int" and not -2 ** 63 <= value < 2 ** 63:
        raise ValueError("--override-kv %s: an int is 64 bits" % item)
    if kind == "str" and len(text.encode()) > 127:
        raise ValueError("--override-kv %s: a str value may be at most 127 bytes" % key)
    return [key, kind, value]


def template_kwargs(args):
    """--chat-template-kwargs and --reasoning-effort as one dict (llama-server's flags);
    ValueError for a value they, or --reasoning-budget, do not take."""
    kwargs = {}
    if args.chat_template_kwargs is not None:
        try:
            kwargs = json.loads(args.chat_template_kwargs)
        except ValueError as e:
            raise ValueError("--chat-template-kwargs: not JSON (%s)" % e)
        if not isinstance(kwargs, dict):
            raise ValueError("--chat-template-kwargs must be a JSON object")
        if not isinstance(kwargs.get("enable_thinking", False), bool):
            raise ValueError("--chat-template-kwargs: enable_thinking must be true or false")
    if args.reasoning_effort not in (None, "default"):
        kwargs["reasoning_effort"] = args.reasoning_effort
    if args.reasoning_budget < -1:
        raise ValueError("--reasoning-budget %d: give -1 (no bound), 0 or more"
                         % args.reasoning_budget)
    return kwargs


def gpu_layers(value):
    """-ngl: a count of layers, or auto (-1: as many as the devices' memory holds) or
    all (-2), as llama-server's common/arg.cpp keeps them (engine/devices.py)."""
    if value == "auto":
        return -1
    if value == "all":
        return -2
    try:
        n = int(value)
    except ValueError:
        n = None
    if n is None or n < -2:
        raise argparse.ArgumentTypeError("a number of layers, auto or all, not %r" % value)
    return n


def device_list(value):
    """-dev: "Vulkan0,Vulkan1" as a list; "none": the CPU alone."""
    names = [x.strip() for x in value.split(",") if x.strip()]
    if not names or ("none" in names and len(names) > 1):
        raise argparse.ArgumentTypeError("device names such as Vulkan0,Vulkan1 (or none), "
                                         "not %r" % value)
    return names


def tensor_split(value):
    """-ts: proportions, "3,1" (llama-server also takes "3/1")."""
    try:
        parts = [float(x) for x in value.replace("/", ",").split(",") if x.strip()]
    except ValueError:
        parts = []
    if not parts or any(not (x >= 0) or x == float("inf") for x in parts) or not any(parts):
        raise argparse.ArgumentTypeError("proportions such as 3,1, not %r" % value)
    return parts


def rpc_endpoints(value, allow_remote):
    """--rpc's "HOST:PORT[,HOST:PORT...]" as a list; raises ValueError for a malformed one,
    and for a host that is not this machine's unless ``allow_remote``: rpc-server has no
    authentication, so nobody should point a model at one on a network by accident."""
    out = []
    for endpoint in (e.strip() for e in value.split(",")):
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("--rpc %s: give HOST:PORT, e.g. 127.0.0.1:50052" % endpoint)
        if not allow_remote and not is_loopback(host):
            raise ValueError("--rpc %s is not on this machine; rpc-server has no "
                             "authentication, so offgrid only reaches one elsewhere with "
                             "--rpc-allow-remote, over a private network or a tunnel "
                             "(docs/rpc.md)" % endpoint)
        out.append(endpoint)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="offgrid", description="A local LLM server over libllama.")
    p.add_argument("-m", "--model", help="GGUF model for text and chat requests, loaded at "
                   "start (optional with --models-dir or --models-preset)")
    p.add_argument("--fim-model", help="GGUF code model for /infill and suffix requests "
                   "(default: --model); loaded at start and never evicted")
    # the shelf (server/shelf.py): models loaded on demand, by name
    p.add_argument("--models-dir", action="append", default=[], metavar="DIR",
                   help="a folder of GGUF files (and one level of subfolders) served by name, "
                   "loaded when a request names one (repeatable)")
    p.add_argument("--models-preset", metavar="FILE",
                   help="per-model settings in llama-server's preset INI format "
                   "([name] and [*] sections)")
    p.add_argument("--models-max", type=int, default=0, metavar="N",
                   help="most models loaded at once; past it the least recently used idle "
                   "one is unloaded (default 0: as many as --models-memory holds)")
    p.add_argument("--models-memory", metavar="SIZE", default=None,
                   help="memory the loaded models may hold, e.g. 12G (default: 3/4 of "
                   "physical RAM; 0: no budget)")
    p.add_argument("--models-autoload", action=argparse.BooleanOptionalAction, default=True,
                   help="load a model when a request names it (default on; off: requests "
                   "for a model not loaded get 400 until POST /models/load)")
    p.add_argument("--pin", action="append", default=[], metavar="NAME",
                   help="a shelf model that is never evicted nor put to sleep (repeatable; "
                   "--fim-model is pinned anyway)")
    p.add_argument("--sleep-idle-seconds", type=float, default=None, metavar="S",
                   help="unload a model idle for S seconds (status sleeping); the next "
                   "request loads it again (default: never)")
    p.add_argument("-a", "--alias", action="append", default=[],
                   help="names the --model answers to, a comma list (repeatable; the first "
                   "is its id; /models lists them all)")
    p.add_argument("--tags", action="append", default=[], metavar="TAGS",
                   help="informational tags of the --model for /models, a comma list "
                   "(repeatable; not used to route requests)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind, or a comma list of them (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks one)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096,
                   help="context size of each session, in tokens (default 4096; "
                   "0: the model's training context)")
    p.add_argument("-b", "--batch-size", type=int, default=512,
                   help="prompt tokens decoded per step (default 512)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=None,
                   help="physical batch size (default: --batch-size)")
    p.add_argument("-t", "--threads", type=thread_count, default="auto",
                   help="threads for generation: a number pins it; auto (the default) "
                        "starts at every core and uses fewer while other programs hold "
                        "some (docs/cli.md, \"Threads\")")
    p.add_argument("-tb", "--threads-batch", type=thread_count, default=None,
                   help="threads for prompt evaluation, likewise (default: as --threads)")
    p.add_argument("--spec-type", choices=SPEC_TYPES, default=None,
                   help="speculative decoding: drafts tokens from the request's own text "
                        "and checks them in one decode; the output is the same; a request "
                        "stops drafting where it does not pay.  edits (the default): "
                        "requests whose prompt carries the answer (next-edit windows, code "
                        "quoted to be rewritten) draft long copies of it; auto: those, and "
                        "prompt lookup (ngram-simple) for /completion and fill-in-the-middle; "
                        "ngram-simple: those, and prompt lookup for every other request; "
                        "ngram-mod: every request drafts as a copy; draft-simple: a draft "
                        "model's tokens (-md; the default with -md); none: no drafts")
    p.add_argument("--spec-draft-n-max", type=int, default=None, metavar="N",
                   help="most tokens drafted at once (default 8 for prompt lookup, 63 for "
                        "copies; at most 64)")
    p.add_argument("-md", "--model-draft", "--spec-draft-model", dest="model_draft",
                   metavar="FILE",
                   help="a smaller model of the same vocabulary drafts tokens for -m's, "
                        "which checks them in one decode; the output is the same "
                        "(docs/cli.md, \"Speculation\")")
    p.add_argument("--spec-draft-n-min", type=int, default=0, metavar="N",
                   help="a draft model's draft of fewer tokens is not checked (default 0)")
    p.add_argument("--spec-draft-p-min", "--draft-p-min", type=float, default=0.0,
                   metavar="P", help="a draft model's draft stops at a token it gives a "
                   "probability under P, among its top 10 (default 0)")
    p.add_argument("--stream-interval-ms", type=float, default=25.0, metavar="MS",
                   help="a streamed reply's pieces that come faster than this go out "
                        "together, one write every MS at most (default 25; the first "
                        "goes at once; 0: each as it comes, as llama-server)")
    p.add_argument("-np", "--parallel", type=int, default=1,
                   help="sessions per model, i.e. requests run at once (default 1)")
    p.add_argument("--stream-pace", type=float, default=WorkerSettings.stream_pace,
                   metavar="TOK_S",
                   help="while one session's prompt is evaluated beside others' streams, "
                   "the streams go on at TOK_S tokens a second on average, and the "
                   "prompt takes the rest of the time in steps of its own of about two "
                   "periods (default %(default)g; 0: the prompt goes in whole batches and "
                   "the streams wait, as llama-server)")
    p.add_argument("-n", "--n-predict", type=int, default=-1,
                   help="default tokens to generate when a request sets none (-1: no limit)")
    from .server.models import sampling
    sampling.add_flags(p)
    p.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="serve /metrics (default on; llama-server's default is off)")
    p.add_argument("--slots", action=argparse.BooleanOptionalAction, default=True,
                   help="serve /slots (default on, as llama-server's)")
    p.add_argument("--embeddings", "--embedding", action=argparse.BooleanOptionalAction,
                   default=True, help="serve /v1/embeddings, /embedding(s), /api/embed(dings) "
                   "and /rerank (default on; the embedding context is made on first use)")
    p.add_argument("--pooling", choices=POOLINGS,
                   help="how embeddings pool the tokens' states (default: the model's GGUF "
                   "pooling_type, else mean)")
    p.add_argument("--reranking", "--rerank", action="store_true",
                   help="pool for /rerank (--pooling rank), for a reranker model")
    p.add_argument("--webui", "--ui", action=argparse.BooleanOptionalAction, default=True,
                   help="the chat page at / for browsers (--no-webui: / answers text only)")
    p.add_argument("--api-key", action="append", default=[],
                   help="API key (repeatable; also $OFFGRID_API_KEY)")
    p.add_argument("--api-key-file", help="file with one API key per line")
    p.add_argument("--cors-origin", action="append", default=[],
                   help="origin allowed to call the API from a browser (repeatable)")
    p.add_argument("--cors-origins", action="append", default=[], metavar="A,B,...",
                   help="origins allowed, a comma list (llama-server's form of --cors-origin)")
    p.add_argument("--max-body", type=int, default=8 * 1024 * 1024,
                   help="largest request body in bytes (default 8 MiB)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds an idle connection is kept, and a client that stops "
                   "reading a response is waited for (default 30)")
    p.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a client may take to send a whole request (default 30)")
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds running requests get to finish on shutdown (default 10)")
    p.add_argument("--max-queue", type=int, default=None, metavar="N",
                   help="requests that may wait for a model's sessions, per model; one more "
                   "gets 503 with Retry-After at once, which a load balancer takes to another "
                   "replica (default: no bound)")
    p.add_argument("--instance-name", metavar="NAME", default=None,
                   help="send X-Offgrid-Instance: NAME on every response, so which replica "
                   "behind a load balancer answered shows (default: none)")
    p.add_argument("--cache-reuse", type=int, default=64,
                   help="FIM requests move cached runs of at least N tokens to where the new "
                   "prompt needs them instead of recomputing them (default 64; 0: off)")
    p.add_argument("-cram", "--cache-ram", type=int, default=None, metavar="MIB",
                   help="prompt states kept in memory per model, restored into any session "
                   "when a prompt comes back (two clients taking turns on -np 1), in MiB "
                   "(default: a quarter of the memory free when the model loads, at most "
                   "8192; -1: no limit; 0: off)")
    p.add_argument("--cache-dir", metavar="DIR", default=None,
                   help="where prompt states go when a model sleeps, is unloaded or the "
                   "server stops, read back when a request would use them (default: "
                   "offgrid/states under $XDG_CACHE_HOME or ~/.cache)")
    p.add_argument("--no-cache-disk", action="store_true",
                   help="keep prompt states in memory only, never on disk")
    p.add_argument("--cache-disk-max", type=int, default=4096, metavar="MIB",
                   help="most MiB of prompt states written to disk per model (default 4096)")
    p.add_argument("--slot-save-path", metavar="DIR", default=None,
                   help="folder for POST /slots/ID?action=save|restore files (llama-server's "
                   "flag; without it the slot actions are refused)")
    p.add_argument("--spm-infill", action="store_true",
                   help="lay fill-in-the-middle prompts out suffix first (suffix/prefix/middle), "
                   "as some code models were trained; llama-server's flag (default: prefix first)")
    p.add_argument("--context-shift", action=argparse.BooleanOptionalAction, default=False,
                   help="when a session's context fills up while generating, drop the older "
                   "half of it after the request's n_keep tokens and go on (default off: the "
                   "reply ends, truncated)")
    p.add_argument("-fa", "--flash-attn", choices=("on", "off", "auto"), default="auto",
                   help="flash attention in the sessions' contexts, as llama-server's -fa "
                   "(default auto: on where every layer is on the CPU, measured as fast or faster "
                   "there; libllama's choice with --rpc devices; the load line says which)")
    p.add_argument("-kvu", "--kv-unified", dest="kv_unified", action="store_true",
                   default=True,
                   help="the -np sessions' KV cells in one cache they share (default; "
                   "llama-server's -kvu)")
    p.add_argument("-no-kvu", "--no-kv-unified", dest="kv_unified", action="store_false",
                   help="a cache stream of -c cells for each -np session (llama-server's "
                   "default with an explicit -np): a prompt's text does not depend on "
                   "where the other sessions' cells lie, and sessions decoding at once "
                   "take one step per run of consecutive sessions")
    p.add_argument("-ctk", "--cache-type-k", choices=KV_CACHE_TYPES, default="f16",
                   help="the KV cache's key type (default f16): q8_0 halves the keys' memory")
    p.add_argument("-ctv", "--cache-type-v", choices=KV_CACHE_TYPES, default="f16",
                   help="the KV cache's value type (default f16); a quantized one needs flash "
                   "attention (-fa on or auto)")
    p.add_argument("--no-swa-full", action="store_true",
                   help="windowed KV cache for sliding-window models: less memory, "
                   "but no prompt-cache reuse")
    p.add_argument("--swa-full", dest="no_swa_full", action="store_false",
                   help="the whole window's KV cache for sliding-window models (the default)")
    p.add_argument("--chat-template", metavar="NAME|FILE|TEXT",
                   help="chat template for --model instead of its own: a Jinja file, "
                   "\"chatml\", the name of a libllama built-in template, or the "
                   "template's Jinja text itself")
    p.add_argument("--chat-template-file", metavar="FILE", default=None,
                   help="chat template for --model instead of its own: a Jinja file")
    p.add_argument("--chat-template-kwargs", metavar="JSON", default=None,
                   help="variables for the chat template, a JSON object (as llama-server's: "
                   "'{\"enable_thinking\": false}'); a request's chat_template_kwargs are "
                   "laid over them")
    p.add_argument("--reasoning-effort", metavar="LEVEL", default=None,
                   help="the template's reasoning_effort where a request does not say "
                   "(\"low\", \"high\", ...; default: the template's own)")
    p.add_argument("--reasoning-budget", type=int, default=-1, metavar="N",
                   help="tokens of thinking a chat reply may take before its end is forced "
                   "(-1: no bound, the default; 0: it ends at once), where a request does "
                   "not say (reasoning_budget_tokens)")
    p.add_argument("--reasoning-budget-message", metavar="TEXT", default="",
                   help="words forced before the end of thinking when the budget is spent")
    p.add_argument("-rea", "--reasoning", choices=REASONING_MODES, default="auto",
                   help="thinking in chat replies, where a request does not say: on, off, or "
                   "auto (the template's own default)")
    p.add_argument("--reasoning-format", choices=REASONING_FORMATS,
                   default="auto", help="where a chat reply's thinking goes, where a request "
                   "does not say: reasoning_content (auto, deepseek), content too "
                   "(deepseek-legacy), or left in content (none)")
    # llama-server's switches for what offgrid always does, so its command lines run
    for flags, what in ((("--jinja",), "render chat with the model's Jinja template"),
                        (("-cb", "--cont-batching"), "batch the -np sessions' decodes"),
                        (("--offline",), "never download anything"),
                        (("--no-warmup", "--warmup"), "no warm-up run: a model's first "
                         "request reads its weights"),
                        (("--repack",), "repack the CPU's weights unless -nr"),
                        (("--mmproj-offload",), "the projector on a GPU where there is one, "
                         "unless --no-mmproj-offload")):
        p.add_argument(*flags, action="store_true", dest="as_default",
                       help="taken: offgrid always does (%s)" % what)
    p.add_argument("--no-jinja", action="store_true",
                   help="taken, with a line: offgrid renders every template as Jinja")
    p.add_argument("--no-tool-call-rescue", action="store_true",
                   help="with tools and tool_choice auto, leave a reply that opens as a bare "
                   "JSON call ({\"name\": <a tool>, \"arguments\": ...}, maybe in a ```json "
                   "fence) to the model: by default it is held to that tool's call grammar "
                   "and becomes a tool call, as small models need")
    # several machines (engine/rpc.py): llama.cpp's RPC backend, as llama-server's flags
    p.add_argument("--rpc", metavar="HOST:PORT[,...]",
                   help="put the model's layers on llama.cpp's rpc-servers (ggml-rpc-server, "
                   "`make rpc-server`) at these endpoints (docs/rpc.md)")
    p.add_argument("--rpc-allow-remote", action="store_true",
                   help="let --rpc reach hosts other than this one (rpc-server has no "
                   "authentication: a private network or a tunnel only)")
    # devices (engine/devices.py, docs/gpu.md): a GPU build's (make lib GPU=vulkan|cuda)
    # and --rpc's, with llama-server's flags
    p.add_argument("-ngl", "--gpu-layers", "--n-gpu-layers", dest="n_gpu_layers",
                   type=gpu_layers, default=None, metavar="N",
                   help="how many layers go to the devices (a GPU build's, --rpc's), the "
                   "last ones; the others stay on the CPU: a number, all, or auto (the "
                   "default: all that the devices' free memory holds)")
    p.add_argument("-dev", "--device", type=device_list, default=None, metavar="DEV1,DEV2,...",
                   help="the devices that hold layers, by name (as listed by the flag below); "
                   "none: the CPU alone (default: every GPU, and --rpc's)")
    p.add_argument("--list-devices", action="store_true",
                   help="print the devices of the library (--lib) and exit")
    p.add_argument("-sm", "--split-mode", choices=("none", "layer", "row"), default=None,
                   help="layers across several devices: layer (the default), row (CUDA "
                   "splits each weight's rows; others as layer), or none: -mg's device alone")
    p.add_argument("-mg", "--main-gpu", type=int, default=0, metavar="INDEX",
                   help="with -sm none, the device (an index into the device list) that "
                   "holds the layers (default 0)")
    p.add_argument("-ts", "--tensor-split", type=tensor_split, default=None, metavar="N0,N1,...",
                   help="each device's proportion of those layers, in device order (default: "
                   "by the memory each has free)")
    p.add_argument("-nkvo", "--no-kv-offload", action="store_true",
                   help="keep the KV caches in host memory, not with their layers on a device")
    p.add_argument("-kvo", "--kv-offload", dest="no_kv_offload", action="store_false",
                   help="the KV caches with their layers (the default)")
    p.add_argument("-nr", "--no-repack", action="store_true",
                   help="keep the CPU's weights as the file has them, not repacked for "
                   "faster kernels (which sum in another order than an rpc-server's)")
    # images and audio (engine/media.py, server/api/media.py): llama-server's flags
    p.add_argument("-mm", "--mmproj", metavar="FILE",
                   help="the -m model's multimodal projector (an mmproj GGUF): images (and "
                   "audio, where it has an audio encoder) in every dialect (docs/api.md)")
    p.add_argument("--no-mmproj-offload", action="store_true",
                   help="run the projector's encoder on the CPU even where a GPU is there")
    p.add_argument("--image-min-tokens", type=int, default=None, metavar="N",
                   help="fewest tokens an image becomes, for projectors of dynamic size "
                   "(default: the mmproj's)")
    p.add_argument("--image-max-tokens", type=int, default=None, metavar="N",
                   help="most tokens an image becomes, for projectors of dynamic size "
                   "(default: the mmproj's)")
    p.add_argument("--media-path", metavar="DIR",
                   help="let requests name images by file:// URLs under this folder "
                   "(refused otherwise; http(s) URLs always are: offgrid fetches nothing)")
    p.add_argument("-ot", "--override-tensor", action="append", default=[],
                   metavar="REGEX=BUFT,...", help="tensors whose names match REGEX go to "
                   "that buffer type (CPU, Vulkan0, CUDA0, ...), as llama-server's")
    p.add_argument("-cmoe", "--cpu-moe", action="store_true",
                   help="every layer's Mixture of Experts weights on the CPU")
    p.add_argument("-ncmoe", "--n-cpu-moe", type=int, default=0, metavar="N",
                   help="the first N layers' Mixture of Experts weights on the CPU")
    p.add_argument("-lm", "--load-mode", default="auto", choices=LOAD_MODES,
                   help="how libllama reads the model file, as llama-server's: mmap (auto), "
                   "none (read into memory), mlock or mmap+mlock (kept in RAM), dio (direct "
                   "I/O)")
    p.add_argument("--mlock", dest="load_mode", action="store_const", const="mmap+mlock",
                   help="older llama-server's form of -lm mmap+mlock")
    p.add_argument("--no-mmap", dest="load_mode", action="store_const", const="none",
                   help="older llama-server's form of -lm none")
    p.add_argument("--override-kv", action="append", default=[], metavar="KEY=TYPE:VALUE,...",
                   help="the model's metadata values in place of its file's (TYPE int, float, "
                   "bool or str), as llama-server's: tokenizer.ggml.add_bos_token=bool:false")
    p.add_argument("--lib", help="path to libllama.so or its folder (default: $OFFGRID_LIB, "
                   "then lib/, then the system's)")
    p.add_argument("--worker-max-rss", type=float, default=None, metavar="MIB",
                   help="memory ceiling of each model's worker process in MiB; past it the "
                   "worker is killed and restarted (default: model file + KV cache + "
                   "a margin; 0: none)")
    p.add_argument("--front-max-rss", type=float, default=None, metavar="MIB",
                   help="memory ceiling of the front process (HTTP, queues, responses) in "
                   "MiB: past three quarters of it new work gets 503 until running requests "
                   "finish (default: 4096, or half the RAM if less; 0: none)")
    p.add_argument("--worker-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a loaded model's worker that does not answer its heartbeat for this "
                   "long (or makes no decode step for 4 times this with generations running, "
                   "or leaves a call unanswered for 10 times this) is stuck: it is killed and "
                   "restarted, and its requests get a 500 naming the model (default: 30)")
    p.add_argument("-v", "--verbose", "--log-verbose", action="store_true",
                   help="log requests and libllama")
    # llama-server's logging and HTTP-thread flags, taken so its command lines run:
    # offgrid's log is a few plain lines on stderr, and each connection has a thread
    p.add_argument("--log-disable", "--log-timestamps", "--no-log-timestamps", "--log-prefix",
                   "--no-log-prefix", action="store_true", dest="log_as_default",
                   help="taken and unused: offgrid's log is a few plain lines on stderr "
                   "(-v: more)")
    p.add_argument("--log-colors", nargs="?", const="auto", choices=("on", "off", "auto"),
                   default=None, help="taken and unused: offgrid logs no colours")
    p.add_argument("-lv", "--verbosity", "--log-verbosity", type=int, default=None,
                   metavar="N", help="llama-server's log threshold: 4 or more is -v")
    p.add_argument("--threads-http", type=int, default=None, metavar="N",
                   help="taken and unused: each connection has a thread of its own")
    p.add_argument("--version", action="version", version="offgrid " + __version__)
    from .server.api import lora
    lora.add_flags(p)
    args = p.parse_args(argv)
    try:
        args.lora_specs = lora.specs_from(args)
        args.sampling = sampling.from_args(args)
        args.template_kwargs = template_kwargs(args)
        args.override_kv = [kv_override(item) for value in args.override_kv
                            for item in value.split(",") if item]
        args.override_tensor = tensor_overrides(args)
    except ValueError as e:
        p.error(str(e))
    if args.verbosity is not None and args.verbosity >= 4:
        args.verbose = True             # llama-server's debug level
    args.cors_origin += [o.strip() for value in args.cors_origins for o in value.split(",")
                         if o.strip()]
    if args.chat_template_file is not None:
        if not os.path.isfile(args.chat_template_file):
            p.error("--chat-template-file %s: no such file" % args.chat_template_file)
        args.chat_template = args.chat_template or args.chat_template_file
    if args.cache_type_v not in ("f32", "f16", "bf16") and args.flash_attn == "off":
        p.error("-ctv %s (a quantized value cache) needs flash attention: -fa on or auto, "
                "not off" % args.cache_type_v)
    if args.no_jinja:
        print("offgrid: --no-jinja: offgrid renders every chat template as Jinja, the "
              "model's own unless --chat-template names another", file=sys.stderr)
    if args.lora_specs and not args.model:
        p.error("--lora adapters are for -m's model: give one")
    if args.list_devices:
        return args
    if not (args.model or args.models_dir or args.models_preset):
        p.error("give a model (-m FILE) or a shelf of them (--models-dir DIR, "
                "--models-preset FILE)")
    if args.mmproj and not os.path.isfile(args.mmproj):
        p.error("--mmproj %s: no such file" % args.mmproj)
    if args.mmproj and not args.model:
        p.error("--mmproj is the projector of -m's model: give -m too")
    if args.media_path and not os.path.isdir(args.media_path):
        p.error("--media-path %s: no such folder" % args.media_path)
    for flag in ("image_min_tokens", "image_max_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error("--%s must be 1 or more" % flag.replace("_", "-"))
    if args.max_queue is not None and args.max_queue < 0:
        p.error("--max-queue must be 0 or more")
    if args.instance_name is not None and not re.fullmatch(r"[\x21-\x7e]{1,64}",
                                                           args.instance_name):
        # it goes into a header line as it is
        p.error("--instance-name must be 1 to 64 printable ASCII characters without spaces")
    if not 0 <= args.stream_pace <= 1000:
        p.error("--stream-pace must be between 0 and 1000")
    if not 0 <= args.stream_interval_ms <= 1000:
        p.error("--stream-interval-ms must be between 0 and 1000")
    if args.spec_draft_n_max is not None and not 1 <= args.spec_draft_n_max <= 64:
        p.error("--spec-draft-n-max must be between 1 and 64")
    if not 0 <= args.spec_draft_n_min <= 64:
        p.error("--spec-draft-n-min must be between 0 and 64")
    if not 0.0 <= args.spec_draft_p_min <= 1.0:
        p.error("--spec-draft-p-min must be between 0 and 1")
    if args.spec_type is None:
        args.spec_type = "draft-simple" if args.model_draft else "edits"
    if args.model_draft and args.spec_type != "draft-simple":
        p.error("-md drafts with a model: --spec-type draft-simple, or leave --spec-type out")
    if args.spec_type == "draft-simple":
        if not args.model_draft:
            p.error("--spec-type draft-simple needs a draft model (-md FILE)")
        if not args.model:
            p.error("-md drafts for -m's model: give one")
        if not os.path.isfile(args.model_draft):
            p.error("draft model file not found: %s" % args.model_draft)
    if args.rpc is not None:
        try:
            args.rpc = ",".join(rpc_endpoints(args.rpc, args.rpc_allow_remote))
        except ValueError as e:
            p.error(str(e))
    if args.main_gpu < 0:
        p.error("-mg %d: give a device's index, 0 or more" % args.main_gpu)
    # the flags given on the command line win over a preset's (llama-server's rule)
    for action in p._actions:
        action.default = argparse.SUPPRESS
    args.explicit = set(vars(p.parse_args(argv)))
    return args


def read_api_keys(args):
    """The keys from --api-key, $OFFGRID_API_KEY and --api-key-file.

    Raises ValueError where a key was asked for but none came of it (an
    empty --api-key, an empty file): a server meant to be locked must not
    start open.
    """
    keys = list(args.api_key)
    env = os.environ.get("OFFGRID_API_KEY")
    if env is not None:
        keys.append(env)
    if any(not k.strip() for k in keys):
        raise ValueError("an empty API key was given (--api-key or $OFFGRID_API_KEY)")
    keys = [k.strip() for k in keys]
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as fh:
            found = [k for k in (line.strip() for line in fh) if k and not k.startswith("#")]
        if not found:
            raise ValueError("--api-key-file %s holds no key" % args.api_key_file)
        keys += found
    return keys


def is_loopback(host):
    """Whether ``host`` (one address, or a comma list) only accepts connections from this
    machine."""
    if "," in host:
        return all(is_loopback(h.strip()) for h in host.split(",") if h.strip())
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def main(argv=None):
    args = parse_args(argv)
    if args.list_devices:
        # libllama is the workers' alone: a process of its own lists them
        from .server.models.worker_process import offgrid_command
        return subprocess.call(offgrid_command(
            "from offgrid.engine.devices import main; sys.exit(main())",
            ["--lib", args.lib] if args.lib else []))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from .server.api.routes import APP
    from .server.httpd.httperrors import HTTPError
    from .server.httpd.frontmem import ceiling_from_flag
    from .server.httpd.server import make_server
    from .server.models.launch import build_shelf
    from .server.serving.service import Service

    try:
        api_keys = read_api_keys(args)
    except OSError as e:
        print("offgrid: cannot read --api-key-file: %s" % e, file=sys.stderr)
        return 2
    except ValueError as e:
        print("offgrid: %s" % e, file=sys.stderr)
        return 2
    if args.slot_save_path:
        # llama-server makes the folder too; the workers write into it
        args.slot_save_path = os.path.abspath(os.path.expanduser(args.slot_save_path))
        try:
            os.makedirs(args.slot_save_path, exist_ok=True)
        except OSError as e:
            print("offgrid: cannot make --slot-save-path %s: %s" % (args.slot_save_path,
                                                                     e.strerror),
                  file=sys.stderr)
            return 2
    if not is_loopback(args.host) and not api_keys:
        print("offgrid: warning: listening on %s without an API key; anyone who can reach "
              "this address can use the server (set --api-key)" % args.host, file=sys.stderr)
    try:
        httpd = make_server(args.host, args.port, APP, None, api_keys, args.cors_origin,
                            args.max_body, args.verbose, args.timeout, args.read_timeout,
                            ceiling_from_flag(args.front_max_rss), args.instance_name)
    except OSError as e:
        print("offgrid: cannot listen on %s:%d: %s" % (args.host, args.port, e), file=sys.stderr)
        return 1
    httpd.RequestHandlerClass.webui = args.webui
    serving = threading.Thread(target=httpd.serve_forever, name="http", daemon=True)
    serving.start()   # /health says "loading" meanwhile

    # Decodes take turns across the models' workers as they do across the
    # sessions of one (see engine/session.py): the workers flock this file.
    lock_fd, decode_lock = tempfile.mkstemp(prefix="offgrid-decode-", suffix=".lock")
    os.close(lock_fd)

    def fail(message, code=1):
        print("offgrid: %s" % message, file=sys.stderr)
        if shelf is not None:
            shelf.close()
        os.unlink(decode_lock)
        httpd.shutdown()
        httpd.server_close()
        return code

    shelf = None
    try:
        shelf, text, fim = build_shelf(args, decode_lock)
    except ValueError as e:
        return fail(e, 2)
    # the command line's models are loaded before "listening on"; a failure ends the server
    for entry in (text, fim):
        if entry is not None:
            try:
                shelf.load(entry)
            except (OffgridError, HTTPError) as e:
                return fail(getattr(e, "message", e))
    for entry in (text, fim):
        info = entry.info if entry is not None else None
        if info and info.pooling == "rank" and not info.rank_head:
            # llama-server goes ahead too; the scores then come from no trained head
            print("offgrid: warning: %s has no rank head (its GGUF pooling_type is not rank): "
                  "/rerank scores are the first component of its hidden state, not relevance"
                  % entry.id, file=sys.stderr)
    service = Service(text, fim, n_predict_default=args.n_predict,
                      shutdown_grace=args.shutdown_grace, cache_reuse=max(0, args.cache_reuse),
                      endpoints_off=[
                          name for name, on in (("metrics", args.metrics),
                                                ("slots", args.slots),
                                                ("embeddings", args.embeddings)) if not on],
                      shelf=shelf, fim_given=fim is not None)
    service.slot_save_path = args.slot_save_path
    from .server.api import media
    media.allow_files_under(args.media_path)    # file:// images (refused without it)
    httpd.RequestHandlerClass.service = service
    shelf.start_reaper()
    # preset models marked load-on-startup, and --pin ones, load meanwhile
    for entry in shelf.entries:
        if entry.worker is None and entry.status == "unloaded" and (
                entry.pinned or (entry.preset or {}).get("load_on_startup")):
            shelf.load(entry, wait=False)

    stop = StopSignals()
    stop.install()
    host, port = httpd.server_address[:2]
    address = "http://%s:%d" % (host if ":" not in host else "[%s]" % host, port)
    print("listening on " + address, flush=True)
    if args.webui:
        print("offgrid: chat page at %s/" % address, file=sys.stderr, flush=True)

    stop.wait()
    print("offgrid: shutting down", file=sys.stderr, flush=True)
    # New requests get 503 from now on, those on kept-alive connections too
    # (a balancer retries them elsewhere); then stop accepting, and close the
    # listening socket, so a new connection is refused at once (server.py:
    # stop_accepting) rather than left in the kernel's queue, while the
    # running requests finish.
    service.stop_taking()
    httpd.shutdown()
    httpd.stop_accepting()
    service.shutdown()
    # Let the handlers write their last bytes (a client that stopped reading
    # gets 5 seconds), then end the workers.
    httpd.drain(5.0)
    httpd.server_close()
    # A worker is a process: ending it frees everything it held, whether or
    # not a handler still waits on it (that one gets "worker died").
    service.close()
    os.unlink(decode_lock)
    return 0


class StopSignals:
    """SIGINT and SIGTERM as a flag the main thread polls.

    The handler takes no lock.  Python runs it in the main thread between two
    bytecodes, which may be inside ``Event.wait`` with the event's own lock
    held: an ``Event.set()`` here then waits for that lock forever.  That is
    how a server once never noticed its SIGTERM (the test that stopped it
    waited 60 s, then killed it).
    """

    def __init__(self):
        self.received = []
        self._wake = None

    def install(self):
        # the C handler writes a byte here, so wait() wakes at once, not at its
        # next look: during that look a balancer would still send new work here
        self._wake, w = os.pipe()
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w)
        signal.signal(signal.SIGINT, self.handler)
        signal.signal(signal.SIGTERM, self.handler)

    def handler(self, signum, _frame):
        self.received.append(signum)
        # a second Ctrl-C (or SIGTERM) ends the process at once, grace or not
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def wait(self, poll=0.5):
        """Return once a signal came: at once through the wakeup pipe, else at the
        next look (sleep is what a signal interrupts)."""
        while not self.received:
            if self._wake is None:
                time.sleep(poll)
            elif select.select([self._wake], [], [], poll)[0]:
                os.read(self._wake, 512)


if __name__ == "__main__":
    sys.exit(main())
