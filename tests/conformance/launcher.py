#!/usr/bin/env python3
"""A stand-in for the ``llama-server`` binary that llama-server's test suite starts.

utils.py runs ``$LLAMA_SERVER_BIN_PATH ARGS...``; the runner points it here.
With ``$CONFORMANCE_TARGET=llama-server`` this execs the real binary
(``$CONFORMANCE_LLAMA_SERVER``); with ``offgrid`` it maps llama-server's
command line to ``python -m offgrid``'s and execs that, so the suite's
SIGTERM reaches the server itself.  Both get ``--threads 1`` unless the test
sets threads: the machine is shared, and the two servers should compete on
equal terms.  The suite's router preset (no model: llama-server lists what
the suite downloaded into its Hugging Face cache) gets, on both, a
``--models-preset`` of our stand-ins under the suite's model names.

Nothing is dropped silently.  Each start appends one JSON line to
``$CONFORMANCE_LOG_FILE`` (the runner's, per test file): the test that started it
(pytest's ``$PYTEST_CURRENT_TEST``), the command line, and for offgrid the
flags it dropped.  The runner counts them into the table.
"""

import json
import re
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent

# llama-server flags that take a value (the ones utils.py passes, and their short forms)
VALUE_FLAGS = {
    "--port", "--temp", "--seed", "--host", "-m", "--model", "--model-url", "-md",
    "--model-draft", "-hf", "--hf-repo", "-hff", "--hf-file", "--models-dir", "--models-max",
    "--models-preset", "--cors-origins", "-b", "--batch-size", "-ub", "--ubatch-size", "-t",
    "--threads", "-tb", "--threads-batch", "-ngl", "--n-gpu-layers", "--pooling", "-a",
    "--alias", "--tags", "-c", "--ctx-size", "-np", "--parallel", "-ctk", "--cache-type-k",
    "-ctv", "--cache-type-v", "-fa", "--flash-attn", "-n", "--n-predict", "--slot-save-path",
    "--grp-attn-n", "--grp-attn-w", "--lora", "--spec-type", "--api-key", "--spec-draft-n-max",
    "--spec-draft-n-min", "--spec-synth-len", "--spec-synth-rates", "--reasoning-format",
    "--reasoning", "--chat-template", "--chat-template-file", "--mmproj-url", "--media-path",
    "--sleep-idle-seconds", "--cache-ram", "--tools", "--tools-runtime",
    "--mcp-servers-config", "--mcp-servers-json", "--api-key-file",
}

# llama-server flag -> offgrid flag, value passed as it is
SAME_VALUE = {
    "--port": "--port", "--host": "--host", "-m": "-m", "--model": "-m",
    "-c": "-c", "--ctx-size": "-c", "-b": "-b", "--batch-size": "-b",
    "-ub": "-ub", "--ubatch-size": "-ub", "-t": "-t", "--threads": "-t", "-tb": "-tb",
    "--threads-batch": "-tb", "-np": "--parallel", "--parallel": "--parallel",
    "-n": "-n", "--n-predict": "-n", "--api-key": "--api-key",
    "--api-key-file": "--api-key-file", "--chat-template": "--chat-template",
    "--chat-template-file": "--chat-template", "--seed": "--seed", "--temp": "--temp",
    "--pooling": "--pooling",
    "--models-dir": "--models-dir", "--models-max": "--models-max",
    "--models-preset": "--models-preset", "--sleep-idle-seconds": "--sleep-idle-seconds",
    "--reasoning": "--reasoning", "-rea": "--reasoning",
    "--reasoning-format": "--reasoning-format", "--tags": "--tags",
    "-md": "-md", "--model-draft": "-md", "--spec-draft-n-max": "--spec-draft-n-max",
    "--spec-draft-n-min": "--spec-draft-n-min",
    "-ctk": "-ctk", "--cache-type-k": "-ctk", "-ctv": "-ctv", "--cache-type-v": "-ctv",
    "--slot-save-path": "--slot-save-path", "--cache-ram": "--cache-ram", "-cram": "--cache-ram",
}
# --spec-type values offgrid has (request.SPEC_TYPES); any other is dropped
SPEC_TYPES = {"none", "ngram-simple", "draft-simple"}
SAME_SWITCH = {"--verbose": "-v", "-v": "-v", "--metrics": "--metrics",
               "--no-slots": "--no-slots", "--slots": "--slots",
               "--no-models-autoload": "--no-models-autoload",
               "--models-autoload": "--models-autoload",
               "--embedding": "--embeddings", "--embeddings": "--embeddings",
               "--reranking": "--reranking", "--rerank": "--reranking",
               "--context-shift": "--context-shift", "--no-context-shift": "--no-context-shift",
               "--no-ui": "--no-webui", "--no-webui": "--no-webui", "--ui": "--webui",
               "--webui": "--webui"}

# Switches that ask for what offgrid always does; accepted, and logged as such.
#   --offline        offgrid never downloads anything
#   --jinja          offgrid always renders the model's Jinja template
#   --swa-full       offgrid keeps a full-size KV cache for SWA models unless --no-swa-full
#   --cont-batching  -np sessions run requests at once (in turns per decode, not one batch)
#   --slots          /slots is always served
AS_DEFAULT = {"--offline", "--jinja", "--swa-full", "--cont-batching", "-cb"}
# Flags offgrid leaves aside on purpose (docs/compatibility.md, "Differences from llama-server");
# accepted, and logged apart from the dropped ones.
#   --no-jinja         chat templates are always the model's Jinja template
#   -fa/--flash-attn   libllama picks flash attention itself (its "auto")
ON_PURPOSE = {"--no-jinja", "-fa", "--flash-attn"}


def offgrid_flags(argv):
    """(offgrid's argv, the llama-server flags dropped, the ones offgrid does anyway,
    the ones it leaves aside on purpose)."""
    out, dropped, as_default, on_purpose = [], [], [], []
    i = 0
    while i < len(argv):
        flag = argv[i]
        value = None
        if "=" in flag and flag.startswith("--"):
            flag, value = flag.split("=", 1)
        elif flag in VALUE_FLAGS and i + 1 < len(argv):
            value = argv[i + 1]
            i += 1
        i += 1
        if flag in SAME_VALUE and value is not None:
            out += [SAME_VALUE[flag], value]
        elif flag in ("--cors-origins", "-a", "--alias") and value is not None:
            # comma lists in llama-server, a repeated flag in offgrid
            to = "--cors-origin" if flag == "--cors-origins" else "-a"
            for item in value.split(","):
                if item.strip():
                    out += [to, item.strip()]
        elif flag == "--spec-type" and value in SPEC_TYPES:
            out += [flag, value]
        elif flag in SAME_SWITCH:
            out.append(SAME_SWITCH[flag])
        elif flag in AS_DEFAULT:
            as_default.append(flag)
        elif flag in ON_PURPOSE:
            on_purpose.append(flag)
        elif flag in KV_UNIFIED:
            pass                        # kv_unified() below
        else:
            dropped.append(flag)
    unified = kv_unified(argv)
    if not unified:
        out.append("--no-kv-unified")
    per_session_ctx(out, kv_unified=unified)
    if "--metrics" not in argv:
        out.append("--no-metrics")      # llama-server's /metrics is off unless asked for
    # llama-server keeps prompt states in memory only: none on disk, where one test's
    # server would find another's after a restart
    out.append("--no-cache-disk")
    return out, dropped, as_default, on_purpose


KV_UNIFIED = {"-kvu": True, "--kv-unified": True, "-no-kvu": False, "--no-kv-unified": False}


def kv_unified(argv):
    """Whether llama-server runs this command line with one KV cache for all its
    slots (server.cpp): with -np auto (absent or negative) always, 4 slots in it;
    with an explicit -np only with -kvu, else a stream of cells per slot, which
    offgrid's --no-kv-unified gives its sessions too."""
    n_par = -1
    for i, a in enumerate(argv):
        flag, _, value = a.partition("=")
        if flag in ("-np", "--parallel"):
            value = value if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "-1")
            try:
                n_par = int(value)
            except ValueError:
                pass
    if n_par < 0:
        return True
    said = [KV_UNIFIED[a] for a in argv if a in KV_UNIFIED]
    return said[-1] if said else False


def per_session_ctx(flags, kv_unified):
    """llama-server's --ctx-size is the whole KV cache, split among --parallel slots
    (unless --kv-unified); offgrid's -c is each session's.  Rewrite -c in place."""
    if "-c" not in flags or "--parallel" not in flags or kv_unified:
        return
    at, n_par = flags.index("-c") + 1, int(flags[flags.index("--parallel") + 1])
    if n_par > 1 and int(flags[at]) > 0:
        flags[at] = str(int(flags[at]) // n_par)


# The Hugging Face names the suite's router tests ask for, and our stand-ins
# (local_models.py's choice: tinygemma3 -> gemma, stories260K -> SmolLM2, its
# infill copy -> Qwen2.5-Coder).
ROUTER_MODELS = [
    ("ggml-org/tinygemma3-GGUF:Q8_0", "gemma-3-270m-q4_k_m.gguf"),
    ("ggml-org/test-model-stories260K:F32", "smollm2-135m-instruct-q4_1.gguf"),
    ("ggml-org/test-model-stories260K-infill:F32", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
]


# a command line with none of these is the suite's router preset (no model)
MODEL_FLAGS = {"-m", "--model", "--models-dir", "--models-preset", "-hf", "--hf-repo",
               "-mu", "--model-url"}


def router_preset():
    """A --models-preset file naming ROUTER_MODELS (written once, in the temp folder)."""
    import tempfile
    import zlib
    models = os.environ.get("OFFGRID_CONFORMANCE_MODELS") or str(ROOT / "models")
    text = "".join("[%s]\nmodel = %s\n\n" % (name, os.path.join(models, f))
                   for name, f in ROUTER_MODELS)
    path = os.path.join(tempfile.gettempdir(), "offgrid-conformance-router-%d.ini"
                        % zlib.crc32(text.encode()))
    if not os.path.exists(path):
        with open(path + ".tmp", "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(path + ".tmp", path)
    return path


def offgrid_help():
    """offgrid's --help, to keep only the flags this checkout has."""
    import subprocess
    try:
        return subprocess.run([sys.executable, "-m", "offgrid", "--help"], cwd=str(ROOT),
                              capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def offgrid_flag_names():
    """The long flags offgrid's --help lists."""
    return re.findall(r"--[a-z][a-z-]*", offgrid_help())


def has_threads(argv):
    return any(a in ("-t", "--threads") or a.startswith("--threads=") for a in argv)


def log(target, record):
    path = os.environ.get("CONFORMANCE_LOG_FILE")
    if not path:
        return
    record = dict(record, target=target,
                  test=os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0])
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")


def main(argv):
    target = os.environ.get("CONFORMANCE_TARGET", "offgrid")
    if not has_threads(argv):
        argv = argv + ["--threads", "1"]
    if target == "llama-server":
        binary = os.environ["CONFORMANCE_LLAMA_SERVER"]
        if not MODEL_FLAGS.intersection(a.split("=", 1)[0] for a in argv):
            # the router preset: llama-server would list the suite's models from the
            # Hugging Face cache that load_all() filled; offline, both servers get
            # the same preset of our stand-ins
            argv = argv + ["--models-preset", router_preset()]
        log(target, {"argv": argv})
        os.execv(binary, [binary] + argv)
    flags, dropped, as_default, on_purpose = offgrid_flags(argv)
    # flags offgrid may not have yet: kept only where this checkout has them
    known = os.environ.get("OFFGRID_CONFORMANCE_FLAGS", "").split() or offgrid_flag_names()
    for flag in ("--seed", "--temp", "--metrics", "--no-metrics", "--slots", "--no-slots",
                 "--embeddings", "--pooling", "--reranking",
                 "--reasoning", "--reasoning-format", "--context-shift"):
        if flag in flags and flag not in known:
            at = flags.index(flag)
            del flags[at:at + (2 if flag in ("--seed", "--temp", "--pooling", "--reasoning",
                                             "--reasoning-format") else 1)]
            if flag != "--no-metrics":
                dropped.append(flag)
    if not MODEL_FLAGS.intersection(flags):
        # llama-server's router preset: no model, models picked per request from its
        # Hugging Face cache.  offgrid's router takes a preset: the suite's names
        # mapped to our files, as local_models.py maps them for the other presets.
        flags += ["--models-preset", router_preset()]
    cmd = [sys.executable, "-m", "offgrid", "--lib", str(ROOT / "lib")] + flags
    log(target, {"argv": argv, "offgrid": cmd[2:], "dropped": dropped, "as_default": as_default,
                 "on_purpose": on_purpose})
    if dropped:
        print("launcher: dropped llama-server flags offgrid lacks: %s" % " ".join(dropped),
              file=sys.stderr, flush=True)
    # the test's working folder stays: template and slot paths are relative to it
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    os.execve(sys.executable, cmd, env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
