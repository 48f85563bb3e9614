"""The command line: llama-server's flags, named as it names them so habits carry
over, and offgrid's own; parse_args reads them into one namespace that
__main__ and server/models/launch.py read."""

import argparse
import os
import re
import sys

from . import __version__
from .flagenv import env_argv
from .flagvalues import (api_prefix, cpu_mask, cpu_placements, cpu_range, cpu_strict,
                         device_list, gpu_layers, grammar_file, grammar_text,
                         json_schema_file, json_schema_text, logit_bias, numa_strategy,
                         poll_level, priority, rpc_endpoints, template_kwargs,
                         tensor_overrides, tensor_split, thread_count, tls_context)
from .protocol import WorkerSettings
from .server.models import overrides
from .request import (KV_CACHE_TYPES, LAZY_MODES, LOAD_MODES, POOLINGS, REASONING_FORMATS,
                      REASONING_MODES, SPEC_TYPES)


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
    p.add_argument("--ssl-key-file", metavar="FNAME", default=None,
                   help="PEM private key: with --ssl-cert-file the server speaks HTTPS only")
    p.add_argument("--ssl-cert-file", metavar="FNAME", default=None,
                   help="PEM certificate (chain) of --ssl-key-file's key")
    p.add_argument("--api-prefix", type=api_prefix, default=None, metavar="PREFIX",
                   help="path the server serves every route under, without the trailing "
                   "slash: /llama serves /llama/v1/chat/completions, /llama/health and the "
                   "chat page at /llama/ (default: none)")
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
    # where those threads run (engine/placement.py); each -batch one defaults to its twin's
    for batch in ("", "-batch"):
        short = "b" if batch else ""
        what = "prompt batches' threads" if batch else "generation's threads"
        p.add_argument("-C" + short, "--cpu-mask" + batch, type=cpu_mask, default=None,
                       metavar="M", help="CPUs the %s may run on, as a hex mask "
                       "(0x6: CPUs 1 and 2); adds to --cpu-range%s (default: %s)"
                       % (what, batch, "--cpu-mask's" if batch else "any"))
        p.add_argument("-Cr" + short, "--cpu-range" + batch, type=cpu_range, default=None,
                       metavar="LO-HI", help="CPUs the %s may run on, as a range; adds to "
                       "--cpu-mask%s" % (what, batch))
        p.add_argument("--cpu-strict" + batch, type=cpu_strict, default=None if batch else 0,
                       metavar="<0|1>", help="1: each of the %s on a CPU of its own, in "
                       "turn (default: %s)" % (what, "--cpu-strict's" if batch else "0"))
        p.add_argument("--prio" + batch, type=priority, default=None if batch else 0,
                       metavar="N", help="scheduling of the %s: -1 low, 0 normal, 1 medium, "
                       "2 high, 3 realtime (1 to 3 need root or CAP_SYS_NICE; default: %s)"
                       % (what, "--prio's" if batch else "0"))
        p.add_argument("--poll" + batch, type=poll_level, default=None, metavar="<0...100>",
                       help="how long the %s poll for work before they sleep (default: %s)"
                       % (what, "--poll's" if batch else "1, about 4 ms; llama-server's 50 "
                          "is about 200 ms of a core after each decode"))
    p.add_argument("--numa", type=numa_strategy, default=None, metavar="TYPE",
                   help="ggml's NUMA placement: distribute (spread threads over every node), "
                   "isolate (the node the worker started on), numactl (numactl's CPU map) "
                   "(default: off)")
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
    p.add_argument("-n", "--n-predict", "--predict", type=int, default=-1,
                   help="default tokens to generate when a request sets none (-1: no limit)")
    # what a request that does not say gets (llama-server's params_base); the sampling
    # ones are models/sampling.py's, and -l's ids are checked against each model's vocabulary
    p.add_argument("-r", "--reverse-prompt", action="append", default=[], metavar="TEXT",
                   help="a stop string for requests that give none of their own "
                   "(repeatable; llama-server's flag)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="requests go on past the end-of-generation tokens unless they set "
                   "ignore_eos false (llama-server's flag)")
    p.add_argument("-sp", "--special", action="store_true",
                   help="replies show the text of the control tokens they generate "
                   "(<|im_start|>, <think>, ...), which otherwise render as nothing "
                   "(llama-server's flag)")
    p.add_argument("--keep", type=int, default=0, metavar="N",
                   help="tokens of the prompt a context shift keeps (-1: all) for requests "
                   "that set no n_keep (default 0)")
    p.add_argument("--cache-prompt", action=argparse.BooleanOptionalAction, default=True,
                   help="requests reuse what their session's cache holds of their prompt "
                   "unless they set cache_prompt false (default on)")
    for flags, read, what in ((("--grammar",), grammar_text, "GBNF"),
                              (("--grammar-file",), grammar_file, "a file of GBNF"),
                              (("-j", "--json-schema"), json_schema_text, "a JSON schema"),
                              (("-jf", "--json-schema-file"), json_schema_file,
                               "a file of a JSON schema")):
        p.add_argument(*flags, dest="output_default", type=read, default=None,
                       metavar="FILE" if "file" in flags[-1] else "TEXT",
                       help="%s every request that sets no grammar, schema or "
                       "response_format (and a chat without tools) is held to; the last of "
                       "the four grammar and schema flags given wins" % what)
    p.add_argument("-l", "--logit-bias", action="append", default=None, type=logit_bias,
                   metavar="TOKEN_ID(+/-)BIAS",
                   help="a bias on a token's logit for requests that set no logit_bias, "
                   "e.g. 15043+1, or 15043-inf to ban it (repeatable)")
    from .server.models import sampling
    sampling.add_flags(p)
    p.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="serve /metrics (default on; llama-server's default is off)")
    p.add_argument("--props", action="store_true",
                   help="POST /props answers {\"success\": true} (llama-server's: it changes "
                   "no property yet); without it, a 501")
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
    p.add_argument("-to", "--timeout", type=float, default=30.0,
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
    p.add_argument("--reuse-port", action="store_true",
                   help="let other processes listen on the same port (SO_REUSEPORT: the "
                   "kernel spreads new connections over them), as llama-server's flag")
    p.add_argument("--sse-ping-interval", type=float, default=10.0, metavar="S",
                   help="seconds a stream may stay quiet (its prompt evaluated, its request "
                   "queued) before a keep-alive comment or ping event (default 10; 0 or "
                   "less: none)")
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
    p.add_argument("-ctxcp", "--ctx-checkpoints", "--swa-checkpoints", type=int, default=8,
                   metavar="N", dest="ctx_checkpoints",
                   help="checkpoints of a hybrid or recurrent model's state kept per session, "
                   "where a later prompt that parts from the cache restarts (default 8; 0: "
                   "none, such a prompt is evaluated whole)")
    p.add_argument("-cms", "--checkpoint-min-step", type=int, default=256, metavar="N",
                   help="tokens between those checkpoints inside a long prompt (default 256; "
                   "0: one a batch)")
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
    p.add_argument("-ctkd", "--cache-type-k-draft", "--spec-draft-type-k",
                   choices=KV_CACHE_TYPES, default="f16", dest="cache_type_k_draft",
                   help="the draft model's (-md) key cache type (default f16)")
    p.add_argument("-ctvd", "--cache-type-v-draft", "--spec-draft-type-v",
                   choices=KV_CACHE_TYPES, default="f16", dest="cache_type_v_draft",
                   help="the draft model's (-md) value cache type (default f16)")
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
    for flags, kind, what in ((("--perf", "--no-perf"), None, "libllama's timings"),
                              (("-dt", "--defrag-thold"), "N", "deprecated in llama-server too"),
                              (("-sps", "--slot-prompt-similarity"), "X", "a request goes to "
                               "the session whose cache serves it best"),
                              (("--cache-idle-slots", "--no-cache-idle-slots"), None,
                               "offgrid's kept prompt states do it")):
        p.add_argument(*flags, dest="as_default", default=None,
                       **({"action": "store_true"} if kind is None else {"metavar": kind}),
                       help="taken and unused (%s)" % what)
    p.add_argument("-nocb", "--no-cont-batching", action="store_true",
                   help="taken, with a line: offgrid always batches the sessions' decodes")
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
    # RoPE and YaRN (llama-server's flags): positions stretched for a context longer than
    # the trained one, e.g. --rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 32768
    p.add_argument("--rope-scaling", choices=("none", "linear", "yarn"), default=None,
                   help="how positions are stretched past the trained context (default: "
                   "the model file's)")
    p.add_argument("--rope-scale", type=float, default=None, metavar="N",
                   help="stretch the context N times (a RoPE frequency scale of 1/N)")
    for flag, what in (("--rope-freq-base", "RoPE base frequency"),
                       ("--rope-freq-scale", "RoPE frequency scale (1/N stretches N times)"),
                       ("--yarn-ext-factor", "YaRN extrapolation mix factor"),
                       ("--yarn-attn-factor", "YaRN attention magnitude scale"),
                       ("--yarn-beta-slow", "YaRN high correction dimension"),
                       ("--yarn-beta-fast", "YaRN low correction dimension")):
        p.add_argument(flag, type=float, default=None, metavar="N",
                       help="%s (default: the model file's)" % what)
    p.add_argument("--yarn-orig-ctx", type=int, default=None, metavar="N",
                   help="YaRN: the context the model was trained on (default: the file's)")
    # llama-server's control vectors, for -m's model (engine/controlvector.py); both
    # file flags append to one list, in the order given, as llama-server sums them
    p.add_argument("--control-vector", action="append", dest="control_vector_items",
                   type=lambda v: ("--control-vector", v), default=[], metavar="FNAME",
                   help="add a control vector to -m's model at scale 1 (a comma list, or "
                   "the flag again, for several; they are summed)")
    p.add_argument("--control-vector-scaled", action="append", dest="control_vector_items",
                   type=lambda v: ("--control-vector-scaled", v), default=[],
                   metavar="FNAME:SCALE,...",
                   help="add a control vector at scale SCALE (a comma list for several)")
    p.add_argument("--control-vector-layer-range", nargs=2, default=None,
                   metavar=("START", "END"),
                   help="the layers the control vectors are added to, both inclusive "
                   "(default: from 1 to the last)")
    p.add_argument("--check-tensors", action="store_true",
                   help="check every tensor's data for NaN and infinity as the model loads "
                   "(a load that finds one fails), as llama-server's flag")
    p.add_argument("-lzm", "--lazy-mode", default="auto", choices=LAZY_MODES,
                   help="tensors the architecture marks (per-layer embeddings) read from the "
                   "file as needed instead of held in memory, as llama-server's: on, auto "
                   "(those over 4 GiB; the default) or off")
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
    p.add_argument("--log-file", metavar="FNAME", default=None,
                   help="what the server and its workers write to stdout and stderr goes to "
                   "FNAME as well (made anew at each start)")
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
    # llama-server's LLAMA_ARG_* variables, under the command line (flagenv.py)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = env_argv(p, argv, os.environ) + argv
    except ValueError as e:
        p.error(str(e))
    args = p.parse_args(argv)
    try:
        args.lora_specs = lora.specs_from(args)
        args.sampling = sampling.from_args(args)
        args.template_kwargs = template_kwargs(args)
        args.override_kv = [o for value in args.override_kv
                            for o in overrides.kv_overrides(value)]
        args.override_tensor = tensor_overrides(args)
        args.tls = tls_context(args.ssl_key_file, args.ssl_cert_file)
        args.cpu_placement, args.cpu_placement_batch = cpu_placements(args)
        args.rope = overrides.rope_settings(args)
        args.control_vectors = [pair for flag, value in args.control_vector_items
                                for pair in overrides.control_vectors(value, flag)]
        args.control_vector_layers = (overrides.control_vector_layers(
            *args.control_vector_layer_range) if args.control_vector_layer_range else None)
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
    for threads, placement, flag in ((args.threads, args.cpu_placement, "-t"),
                                     (args.threads_batch, args.cpu_placement_batch, "-tb")):
        cpus = placement["cpus"]
        if isinstance(threads, int) and cpus and len(cpus) < threads:
            # llama-server's warning (postprocess_cpu_params); -t auto stays within them
            print("offgrid: %s %d: more threads than the %d CPUs their mask names; they "
                  "will wait for each other" % (flag, threads, len(cpus)), file=sys.stderr)
    if args.no_cont_batching:
        print("offgrid: --no-cont-batching: offgrid always batches the -np sessions' decodes",
              file=sys.stderr)
    if args.no_jinja:
        print("offgrid: --no-jinja: offgrid renders every chat template as Jinja, the "
              "model's own unless --chat-template names another", file=sys.stderr)
    if args.lora_specs and not args.model:
        p.error("--lora adapters are for -m's model: give one")
    if args.control_vectors and not args.model:
        p.error("--control-vector is for -m's model: give one (a preset's control-vector "
                "key gives one to its model)")
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
    if args.ctx_checkpoints < 0 or args.checkpoint_min_step < 0:
        p.error("-ctxcp and -cms must be 0 or more")
    if args.keep < -1:
        p.error("--keep %d: give -1 (the whole prompt), 0 or more" % args.keep)
    if args.main_gpu < 0:
        p.error("-mg %d: give a device's index, 0 or more" % args.main_gpu)
    # the flags given on the command line win over a preset's (llama-server's rule)
    for action in p._actions:
        action.default = argparse.SUPPRESS
    args.explicit = set(vars(p.parse_args(argv)))
    return args
