"""The docs' commands work as written, and say what they do.

Every command of the ``sh`` blocks of README.md and docs/*.md (tests/doctext.py
reads them) has one entry in DOCS below, found by a pattern of its words, that
says how it is tested:

- ``Curl``: run with bash and curl against a real server: the README's
  ``make run`` for 127.0.0.1:8080 (the default model, Qwen2.5-Coder-0.5B),
  the shelf that docs/models.md starts for 127.0.0.1:8081, the HTTPS server of
  docs/cli.md for 127.0.0.1:8443 (with the certificate its openssl command
  makes in the scratch copy);
- ``Server``: a command that starts offgrid, started (on a free port, one
  thread) and probed for what its page says it does;
- ``Run``: run to its end, its output checked;
- ``NotRun``: a block marked ``<!-- docs-test: not run -->``: the test says
  why, and checks what it can without running it (the make target exists,
  the script parses the arguments);
- ``RunBy``: a block marked ``<!-- docs-test: run by tests/FILE -->``: that
  test runs the same command (its options and variables are in that file).

A command added to a page without an entry fails here, and so does an entry
whose command is gone.  The commands run as written but for the port and the
thread count (and ``--host 0.0.0.0``, which becomes 127.0.0.1: the suite
listens on loopback only), in a scratch copy of the checkout whose files are
links to this one, with HOME in it, so that a page's files (``models.ini``,
``~/.offgrid-keys``) land there.

Generation is short and greedy: the whole file takes a minute or two on 2
cores.  The servers decode on one thread: with two threads on two busy cores
ggml's spinning workers wait for each other and run several times slower.
"""

import base64
import json
import os
import re
import shlex
import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

try:
    from . import doctext, loras, mmproj
    from .serverproc import ROOT, ServerProcess, free_port, make_env, parse_sse
    from .test_bench_cli import _bench_module
    from .test_vision import chat_reference
    from .test_vision_engine import TOKENS
except ImportError:  # tests/ is on sys.path rather than a package
    import doctext
    import loras
    import mmproj
    from serverproc import ROOT, ServerProcess, free_port, make_env, parse_sse
    from test_bench_cli import _bench_module
    from test_vision import chat_reference
    from test_vision_engine import TOKENS

from offgrid import __version__

DEFAULT = "127.0.0.1:8080"      # make run's address in the examples
SHELF = "127.0.0.1:8081"        # the shelf of docs/models.md
ADAPTER = "127.0.0.1:8082"      # the README's server with a LoRA adapter
QWEN = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
GEMMA = "gemma-3-270m-q4_k_m.gguf"
SMOLLM = "smollm2-135m-instruct-q4_1.gguf"
KEY = "docs-test-key"           # what ~/.offgrid-keys holds for docs/security.md


# --------------------------------------------------------------------------
# The kinds of entry
# --------------------------------------------------------------------------

class Curl:
    """``server``: the fixture serving ``address`` (``make_run``); another's check also
    gets that server, to ask it for the answer it expects."""

    def __init__(self, check, address=DEFAULT, server="make_run"):
        self.check, self.address, self.server = check, address, server


class Server:
    def __init__(self, probe, before=None):
        self.probe, self.before = probe, before


class Run:
    def __init__(self, check):
        self.check = check


class NotRun:
    def __init__(self, reason, static):
        self.reason, self.static = reason, static


class RunBy:
    def __init__(self, test_file, why="a slow test: it builds the bundle"):
        self.test_file, self.why = test_file, why


# --------------------------------------------------------------------------
# Checks of the answers (a Curl's or Run's stdout)
# --------------------------------------------------------------------------

def _json(out):
    return json.loads(out)


def _greeting(text):
    return re.search(r"\b(hi|hello|hey)\b", text, re.I)


def health(out):
    assert _json(out)["status"] == "ok"


def https_health(out, server):
    """docs/cli.md's curl, to the HTTPS server (which curl reached verifying cert.pem)."""
    health(out)


def completion_paris(out):
    assert "Paris" in _json(out)["content"]


def completion_stream(out):
    events = parse_sse(out)
    assert events and all(isinstance(e, dict) for e in events), out
    assert events[-1]["stop"] is True
    text = "".join(e["content"] for e in events)
    assert "return" in text, text           # a function body, not chatter


def completion_json_schema(out):
    value = json.loads(_json(out)["content"])
    assert isinstance(value["name"], str) and 0 < len(value["name"]) <= 20, value


def infill_add(out):
    assert _json(out)["content"].strip() == "a + b"


def openai_completion(out):
    choice = _json(out)["choices"][0]
    assert "print(" in choice["text"], choice


def openai_chat(out):
    choice = _json(out)["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert _greeting(choice["message"]["content"]), choice


def openai_tool_call(out):
    choice = _json(out)["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def tokenize(out):
    tokens = _json(out)["tokens"]
    assert tokens and all(isinstance(t["id"], int) for t in tokens)
    assert "".join(t["piece"] for t in tokens) == "hello world"


def token_probabilities(out):
    body = _json(out)
    probs = body["completion_probabilities"]
    assert len(probs) == 2, body
    for p in probs:
        assert len(p["top_logprobs"]) == 2
        best = p["top_logprobs"][0]
        assert best["logprob"] >= p["top_logprobs"][1]["logprob"]
        assert (p["id"], p["logprob"]) == (best["id"], best["logprob"])   # greedy took it
    assert "".join(p["token"] for p in probs) == body["content"]


def apply_template(out):
    prompt = _json(out)["prompt"]
    # Qwen2.5's own template: its default system turn, then the message
    assert "<|im_start|>user\nSay hi<|im_end|>" in prompt, prompt
    assert prompt.endswith("<|im_start|>assistant\n") and "You are Qwen" in prompt, prompt


def ollama_fim(out):
    body = _json(out)
    assert body["response"] == "a + b", body
    assert body["done"] is True and body["done_reason"] == "stop" and body["eval_count"] <= 8


def ollama_chat(out):
    body = _json(out)
    assert body["message"]["role"] == "assistant" and _greeting(body["message"]["content"]), body
    assert body["done"] is True and body["done_reason"] == "stop"


def anthropic_chat(out):
    body = _json(out)
    assert body["type"] == "message" and body["stop_reason"] == "end_turn", body
    assert _greeting(body["content"][0]["text"]), body


def responses_chat(out):
    body = _json(out)
    assert body["status"] == "completed", body
    text = "".join(part["text"] for item in body["output"] if item["type"] == "message"
                   for part in item["content"])
    assert _greeting(text), body


def embeddings(out):
    body = _json(out)
    a, b = (d["embedding"] for d in body["data"])
    assert len(a) == len(b) == 896 and abs(sum(x * x for x in a) - 1) < 1e-4, body["usage"]
    assert sum(x * y for x, y in zip(a, b)) > 0.5       # two paraphrases


def image_chat(out, server):
    """docs/api.md's image: a picture of one red square, to the tests' own mmproj
    (tests/mmproj.py), where red is exactly one token's embedding: the answer is the
    greedy text of the same question with that token in the picture's place."""
    body = _json(out)
    image = "data:image/png;base64," + base64.b64encode(mmproj.png((255, 0, 0))).decode()
    expected = chat_reference(server, [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": image}}]}])
    assert body["choices"][0]["message"]["content"] == expected, body


def transcription(out, server):
    """docs/api.md's transcription: clip.wav (a tone) to the tests' own audio encoder
    (tests/mmproj.py); the transcript is the greedy text of the chat turn it stands for."""
    body = _json(out)
    status, _, prompt = server.post("/apply-template", {"messages": [
        {"role": "user", "content": "Transcribe audio to text<__media__>"}]})
    assert status == 200, prompt
    status, _, want = server.post("/completion", {
        "prompt": {"prompt_string": prompt["prompt"],
                   "multimodal_data": [base64.b64encode(mmproj.wav(1.0)).decode()]},
        "n_predict": 8, "temperature": 0})
    assert status == 200, want
    assert body["type"] == "transcript.text.done" and body["usage"]["output_tokens"] == 8, body
    assert body["text"] == want["content"], (body, want)


def version(out):
    assert out.strip() == "offgrid %s" % __version__


def bench_help(out):
    assert out.startswith("usage:") and "--only" in out and "--rounds" in out, out


def gpu_help(out):
    assert out.startswith("usage:") and "--kit" in out and "--budget" in out, out


def turns_help(out):
    assert out.startswith("usage:") and "--turns" in out and "--tokens" in out, out


def memory_help(out):
    assert out.startswith("usage:") and "--archs" in out and "--llama-server" in out, out


def wake_help(out):
    assert out.startswith("usage:") and "--sleep" in out and "--rounds" in out, out


def conformance_table(out):
    assert "| file | tests | pass llama-server | pass offgrid | gaps |" in out, out
    for core in ("basic", "tokenize", "infill", "completion", "tool_call"):
        assert "| test_%s.py" % core in out, core


# -- the shelf of docs/models.md, in the page's order --------------------------------

def shelf_load(out):
    assert _json(out) == {"success": True}


def shelf_list(out):
    by_id = {m["id"]: m for m in _json(out)["data"]}
    assert set(by_id) == {QWEN, GEMMA[:-5], SMOLLM[:-5]}, sorted(by_id)
    qwen, gemma, smollm = by_id[QWEN], by_id[GEMMA[:-5]], by_id[SMOLLM[:-5]]
    # models.ini: the completion model pinned with its own context, loaded at start
    assert qwen["pinned"] and qwen["settings"]["n_ctx"] == 8192 and \
        qwen["status"]["value"] == "loaded", qwen
    assert gemma["aliases"] == ["gemma", "small"] and gemma["settings"]["parallel"] == 2
    assert gemma["status"]["value"] in ("loading", "loaded"), gemma["status"]
    assert "notes" in smollm["aliases"] and smollm["settings"]["chat_template"] == "chatml"
    assert smollm["settings"]["ctx_size"] == 2048 and smollm["status"]["value"] == "unloaded"


def shelf_by_alias(out):
    body = _json(out)
    assert body["model"] == GEMMA[:-5], body         # "gemma" is an alias of the file
    assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["text"], body


def shelf_unload(out):
    assert _json(out) == {"success": True}


# --------------------------------------------------------------------------
# Probes of the servers a page starts (a DocServer)
# --------------------------------------------------------------------------

def _model_path(server):
    status, _, props = server.get("/props")
    assert status == 200, props
    return Path(props["model_path"]).name


def serves_the_default(server):
    status, _, body = server.get("/health")
    assert status == 200 and body["status"] == "ok"
    assert _model_path(server) == QWEN


def serves_gemma_without_fim(server):
    assert _model_path(server) == GEMMA
    status, _, body = server.post("/infill", {"input_prefix": "def f():", "input_suffix": "\n",
                                             "n_predict": 4})
    assert status == 501, body           # gemma-3-270m has no fill-in-the-middle tokens


def chats_with_one_and_completes_code_with_the_other(server):
    assert _model_path(server) == SMOLLM
    status, _, body = server.post("/infill", {"input_prefix": "def add(a, b):\n    return ",
                                             "input_suffix": "\n", "n_predict": 8,
                                             "temperature": 0, "stop": ["\n"]})
    assert status == 200 and body["content"].strip() == "a + b", body
    assert body["model"] == QWEN
    status, _, body = server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4})
    assert status == 200 and body["model"] == SMOLLM, body


def write_key_file(home):
    (home / ".offgrid-keys").write_text("# the docs test's key\n%s\n" % KEY)


def asks_for_the_key(server):
    status, _, _ = server.get("/health")
    assert status == 200                  # monitors need no key
    status, _, body = server.get("/v1/models")
    assert status == 401, body
    status, _, body = server.get("/v1/models", headers={"Authorization": "Bearer " + KEY})
    assert status == 200 and body["data"][0]["id"] == GEMMA, body
    status, _, _ = server.get("/v1/models", headers={"x-api-key": KEY})
    assert status == 200


def answers_yes_or_no_objects(server):
    """docs/cli.md's -j server: a chat reply is the schema's object, a request's own
    format wins, and /props shows the grammar."""
    status, _, out = server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Is the sky blue?"}], "max_tokens": 32})
    assert status == 200, out
    assert json.loads(out["choices"][0]["message"]["content"])["answer"] in ("yes", "no"), out
    status, _, out = server.post("/completion", {"prompt": "The sky is", "n_predict": 4,
                                                 "grammar": 'root ::= " blue"'})
    assert status == 200 and out["content"] == " blue", out
    status, _, props = server.get("/props")
    assert 'answer' in props["default_generation_settings"]["params"]["grammar"], props


def serves_https_under_the_prefix(server):
    """docs/cli.md's server: HTTPS with the page's certificate (server.tls trusts it and
    nothing else), every route under /llama and none outside it."""
    assert "listening on https://127.0.0.1:%d\n" % server.port in server.output
    status, _, body = server.get("/llama/health")
    assert status == 200 and body["status"] == "ok", body
    status, _, body = server.get("/llama/v1/models")
    assert status == 200 and body["data"][0]["id"] == QWEN, body
    status, _, body = server.get("/health")
    assert status == 404, body


def allows_one_origin(server):
    status, headers, _ = server.request("OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://localhost:5173", "Access-Control-Request-Method": "POST"})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://localhost:5173"
    status, _, body = server.get("/v1/models", headers={"Origin": "http://evil.example"})
    assert status == 403, body
    status, _, _ = server.get("/v1/models")                  # curl and editors send none
    assert status == 200


# --------------------------------------------------------------------------
# What a command not run here is checked for
# --------------------------------------------------------------------------

def scratch_env(scratch):
    """The environment the docs' commands get: this one, HOME in the scratch copy, and
    no make variables of an outer make (`make test` runs this file)."""
    env = make_env(HOME=str(scratch / "home"), PYTHONUNBUFFERED="1")
    env.setdefault("OFFGRID_CACHE", str(Path("~/.cache/offgrid").expanduser()))
    env.setdefault("PYENV_ROOT", str(Path("~/.pyenv").expanduser()))
    return env


def _sh(line, scratch, timeout=120):
    return subprocess.run(["bash", "-c", line], cwd=str(scratch), env=scratch_env(scratch),
                          capture_output=True, text=True, timeout=timeout)


def make_dry_run(script):
    """`make -n` of the command succeeds, and the recipe's line that runs `script` (with
    the command's *_ARGS) parses them: the line with --help after it exits 0."""
    def check(command, scratch):
        argv = shlex.split(command, comments=True)
        assert argv[0] == "make"
        r = _sh(shlex.join(["make", "-n"] + argv[1:]), scratch)
        assert r.returncode == 0, r.stdout + r.stderr
        lines = [line for line in r.stdout.splitlines()
                 if script in line and "--install" not in line]
        assert lines, "make -n runs no %s:\n%s" % (script, r.stdout)
        for value in (a.split("=", 1)[1] for a in argv[1:] if re.match(r"[A-Z_]+_ARGS=", a)):
            assert value in lines[-1], (value, lines[-1])
        r = _sh(lines[-1] + " --help", scratch)
        assert r.returncode == 0 and "usage:" in r.stdout, r.stdout + r.stderr
    return check


def make_runs_the_suite(command, scratch):
    r = _sh("make -n " + shlex.split(command)[1], scratch)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"-m pytest .* tests\b", r.stdout), r.stdout


def offgrid_parses(command, scratch):
    """offgrid's argument parser takes the command's flags (--help after them stops it)."""
    r = _sh(doctext.uncommented(command) + " --help", scratch)
    assert r.returncode == 0 and r.stdout.startswith("usage: offgrid"), r.stdout + r.stderr


def run_by(test_file):
    """The options and variables of the command are in test_file, as it runs them."""
    def check(command, scratch):
        source = (ROOT / test_file).read_text()
        for w in shlex.split(command, comments=True):
            if w.startswith("-") or re.match(r"[A-Z_]+=", w):
                wanted = '"%s' % (w.split("=", 1)[0] + "=" if "=" in w else w + '"')
                assert wanted in source, "%s runs no %s (of `%s`)" % (test_file, wanted, command)
    return check


# --------------------------------------------------------------------------
# Every command: a pattern of its words (doctext.bare) -> how it is tested
# --------------------------------------------------------------------------

BENCH = NotRun("make bench takes about 30 minutes and wants an idle machine "
               "(docs/performance.md); make -n and bench/run.py --help check the command",
               make_dry_run("bench/run.py"))
CONFORMANCE = NotRun("llama.cpp's server tests against two servers: about 20 minutes, and the "
                     "suite's own packages; tests/test_conformance_subset.py runs the passing "
                     "part; make -n and run.py --help check the command",
                     make_dry_run("tests/conformance/run.py"))
SUITE = NotRun("the suite itself: run from inside it, it would run this test again; "
               "make -n checks the target", make_runs_the_suite)
BUNDLE = RunBy("tests/test_bundle.py")
FLEET = RunBy("tests/test_fleet.py", "`make fleet`: Debian's haproxy and nginx in front of "
              "three replicas, about two minutes")


def make_n_runs(needle):
    """`make -n` of the command succeeds and its recipe has ``needle`` (a GPU build, its
    tests: too long to run here)."""
    def check(command, scratch):
        argv = shlex.split(command, comments=True)
        assert argv[0] == "make"
        r = _sh(shlex.join(["make", "-n"] + argv[1:]), scratch)
        assert r.returncode == 0 and needle in r.stdout, r.stdout + r.stderr
    return check


GPU_BUILD = NotRun("a GPU build takes about 8 minutes on 2 quiet cores (Vulkan's shaders) or "
                   "hours (CUDA's kernels); `make test-gpu` builds lib/vulkan and "
                   "tests/test_gpu.py serves on it; make -n checks the command",
                   make_n_runs("scripts/build_lib.sh lib/"))
GPU_SERVE = NotRun("needs lib/vulkan (`make lib GPU=vulkan`); tests/test_gpu.py runs "
                   "--list-devices and servers on it; offgrid's parser checks the flags",
                   offgrid_parses)


def gpu_bench_parses(command, scratch):
    """bench/gpu.py's parser takes the command; the tarball is the one its kit writes."""
    gpu = _bench_module("bench_gpu_docs", "gpu.py")
    argv = shlex.split(command, comments=True)
    if argv[0] == "tar":
        tarball = gpu.KIT.with_suffix(".tar.xz").relative_to(ROOT)
        assert argv[2] == str(tarball), (argv, tarball)
        return
    args = gpu.parse_args(argv[2:])
    assert args.cmd in ("kit", "run"), args


GPU_BENCH = NotRun("bench/gpu.py's kit builds CUDA (20 minutes on 2 cores) and its run needs "
                   "an NVIDIA GPU; tests/test_bench_gpu.py checks its models, the lavapipe run "
                   "in docs/gpu.md the rest; its parser checks the command", gpu_bench_parses)


def agents_run_this_way(command, scratch):
    """tests/test_agents.py sets each variable and passes each flag of the command."""
    source = (ROOT / "tests" / "test_agents.py").read_text()
    if command.startswith("python3 -m offgrid"):
        # its server: the default model with the context the page asks for
        assert re.search(r"ServerProcess\(QWEN\b[^)]*\bctx=32768", source), \
            "tests/test_agents.py starts no server on the default model with -c 32768"
        return
    for w in shlex.split(command, comments=True):
        if w.startswith("-") or re.match(r"[A-Z_]+=", w):
            wanted = w.split("=", 1)[0] if "=" in w else '"%s"' % w
            assert wanted in source, "tests/test_agents.py uses no %s (of `%s`)" % (
                wanted, command)


AGENTS = NotRun("needs Claude Code and Codex, which tests/test_agents.py installs and runs "
                "against a real server this way (a slow test: their prompts are 8-11k "
                "tokens)", agents_run_this_way)

DOCS = {
    # README.md
    r"^make run$": "make_run",          # the server of every 127.0.0.1:8080 example
    r"^make test$": SUITE,
    r"8080/health$": Curl(health),
    r"8080/completion .*The capital of France is": Curl(completion_paris),
    r'8080/completion .*"stream": true': Curl(completion_stream),
    r'8080/completion .*"json_schema"': Curl(completion_json_schema),
    r"8080/infill ": Curl(infill_add),
    r"8080/v1/completions ": Curl(openai_completion),
    r'8080/v1/chat/completions .*"Say hi"': Curl(openai_chat),
    r'8080/v1/chat/completions .*"tools"': Curl(openai_tool_call),
    r"8080/tokenize ": Curl(tokenize),
    r"--lora-scaled my-adapter\.gguf:0\.5 ": "adapter",     # the server of the 8082 example
    r"8082/completion ": "adapter_base_text",
    # docs/api.md
    r'8080/completion .*"n_probs"': Curl(token_probabilities),
    r"8080/apply-template ": Curl(apply_template),
    r"^python3 -m offgrid -m gemma-3-4b-it\S* --mmproj ": NotRun(
        "no vision model or mmproj can be had offline; tests/test_vision.py serves --mmproj "
        "with a projector the tests write (tests/mmproj.py); offgrid's parser checks the flags",
        offgrid_parses),
    r'8080/v1/chat/completions .*"image_url"': Curl(image_chat, server="vision"),
    r"8080/v1/audio/transcriptions ": Curl(transcription, server="audio"),
    # docs/dialects.md
    r"8080/api/generate ": Curl(ollama_fim),
    r"8080/api/chat ": Curl(ollama_chat),
    r"8080/v1/messages ": Curl(anthropic_chat),
    r"8080/v1/responses ": Curl(responses_chat),
    r"8080/v1/embeddings ": Curl(embeddings),
    # docs/cli.md
    r"^python3 -m offgrid --version$": Run(version),
    r"^python3 -m offgrid -m models/gemma\S* -j ": Server(answers_yes_or_no_objects),
    r"^openssl req -x509 ": "tls_cert",        # the certificate of the 8443 example
    r"--ssl-key-file key\.pem ": "tls",        # the server of the 8443 example
    r"8443/llama/health$": Curl(https_health, "127.0.0.1:8443", server="tls"),
    # docs/models.md
    r"^make run MODEL=models/gemma": Server(serves_gemma_without_fim),
    r"^python3 -m offgrid -m models/smollm.* --fim-model models/qwen":
        Server(chats_with_one_and_completes_code_with_the_other),
    r"--models-dir models ": "shelf",   # the server of every 127.0.0.1:8081 example
    r"8081/models/load ": Curl(shelf_load, SHELF),
    r"8081/v1/models$": Curl(shelf_list, SHELF),
    r'8081/v1/completions .*"gemma"': Curl(shelf_by_alias, SHELF),
    r"8081/models/unload ": Curl(shelf_unload, SHELF),
    # docs/security.md
    r"--host 0\.0\.0\.0 --api-key-file ~/\.offgrid-keys$": Server(asks_for_the_key,
                                                                 before=write_key_file),
    r"--cors-origin http://localhost:5173$": Server(allows_one_origin),
    # docs/install.md: tests/test_bundle.py builds the bundle and runs these
    r"^make bundle$": BUNDLE,
    r"^MODEL=models/gemma-3-270m-q4_k_m\.gguf make bundle$": BUNDLE,
    r"^tar xf offgrid-\*\.tar\.gz && cd offgrid-\*/$": BUNDLE,
    r"^python3 -m offgrid -m gemma-3-270m-q4_k_m\.gguf$": BUNDLE,
    r"^python3 -I \. -m gemma": BUNDLE,
    r"^python3 -m pip install --no-index offgrid-\*\.whl$": BUNDLE,
    r"^OFFGRID_LIB=\$PWD/lib offgrid -m": BUNDLE,
    # docs/agents.md
    r"^python3 -m offgrid -m models/qwen.* -c 32768$": AGENTS,
    r"ANTHROPIC_BASE_URL=http://127\.0\.0\.1:8080 ": AGENTS,
    r"^CODEX_OSS_BASE_URL=": AGENTS,
    # docs/rpc.md
    r"^lib/ggml-rpc-server -H 10\.0\.0\.2": NotRun(
        "needs another machine on a private network; tests/test_rpc.py runs ggml-rpc-server "
        "with these flags on loopback", run_by("tests/test_rpc.py")),
    r"^python3 -m offgrid -m big-model\.gguf --rpc 10\.": NotRun(
        "needs two other machines on a private network (and a model too big for one); "
        "tests/test_rpc.py runs --rpc on loopback; offgrid's parser checks the flags",
        offgrid_parses),
    # docs/gpu.md
    r"^make lib GPU=": GPU_BUILD,
    r"^python3 -m offgrid --lib lib/vulkan --list-devices$": GPU_SERVE,
    r"^python3 -m offgrid -m models/qwen\S* --lib lib/vulkan$": GPU_SERVE,
    r"^make test-cuda-bundle CUDA_ARCHS=": NotRun(
        "builds a portable CUDA libllama (20 minutes for one architecture on 2 cores, "
        "hours for the default five); make -n checks the target",
        make_n_runs("tests/test_cuda_bundle.py")),
    r"^make test-gpu$": NotRun("the GPU suite (tests/test_gpu.py): it builds lib/vulkan "
                               "first; make -n checks the target",
                               make_n_runs("tests/test_gpu.py")),
    # docs/fleet.md: tests/test_fleet.py starts the replicas and both balancers so
    r"^python3 -m offgrid .*--instance-name ": FLEET,
    r"^haproxy -f ": FLEET,
    r"^nginx -c ": FLEET,
    # docs/compatibility.md
    r"^make conformance": CONFORMANCE,
    r"^python3 tests/conformance/run\.py --table$": Run(conformance_table),
    # docs/performance.md
    r"^make bench": BENCH,
    r"^python3 bench/run\.py --help$": Run(bench_help),
    r"^python3 bench/turns\.py --help$": Run(turns_help),
    r"^python3 bench/gpu\.py run --help$": Run(gpu_help),
    r"^python3 bench/gpu\.py (kit|run --kit)": GPU_BENCH,
    r"^tar xJf build/gpukit": GPU_BENCH,
    r"^python3 bench/wake\.py --help$": Run(wake_help),
    r"^python3 bench/memory\.py --help$": Run(memory_help),
    # docs/testing.md
    r"^make test-fast$": SUITE,
}


def entry_for(command):
    """(pattern, entry) of the one DOCS entry whose pattern the command's words match."""
    words = doctext.bare(command.text)
    found = [(p, e) for p, e in DOCS.items() if re.search(p, words, re.S)]
    assert len(found) == 1, "%s:%d: a docs command needs exactly one entry in DOCS, has %d:\n%s" \
        % (command.page, command.line, len(found), command.text)
    return found[0]


COMMANDS = doctext.all_commands()
SHELF_COMMANDS = [c for c in COMMANDS if SHELF in c.text or "--models-dir models " in c.text]
ADAPTER_COMMANDS = [c for c in COMMANDS if ADAPTER in c.text or "my-adapter.gguf" in c.text]
OTHERS = [c for c in COMMANDS if c not in SHELF_COMMANDS and c not in ADAPTER_COMMANDS]


def command_id(command):
    try:
        pattern, entry = entry_for(command)
    except AssertionError:
        return "%s:%d-unmatched" % (command.page.name, command.line)
    name = getattr(entry, "check", None) or getattr(entry, "probe", None)
    label = (name.__name__ if name else entry if isinstance(entry, str) else
             "not_run" if isinstance(entry, NotRun) else "run_by_" + Path(entry.test_file).stem)
    return "%s:%d-%s" % (command.page.name, command.line, label)


# --------------------------------------------------------------------------
# The scratch copy, and the servers
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A copy of the checkout made of links to it, with a HOME and models.ini of its own."""
    folder = tmp_path_factory.mktemp("checkout")
    for entry in ROOT.iterdir():
        if entry.name != ".git":
            (folder / entry.name).symlink_to(entry)
    (folder / "home").mkdir()
    (ini,) = [b.text for b in doctext.blocks(Path("docs/models.md")) if b.lang == "ini"]
    (folder / "models.ini").write_text(ini)
    return folder


class DocServer(ServerProcess):
    """A server a page's command starts, on a free port and one thread, in the scratch copy."""

    own_group = True        # make and bash stand between this process and the server

    def __init__(self, command, scratch):
        super().__init__(None, startup_timeout=300)
        self.scratch = scratch
        self.command = self.rewrite(command)

    def rewrite(self, command):
        command = doctext.uncommented(command)
        if command.startswith("make run"):
            return command + ' PORT=%d ARGS="-t 1"' % self.port
        assert command.startswith("python3 -m offgrid "), command
        command = command.replace("--host 0.0.0.0", "--host 127.0.0.1")
        if re.search(r"--port \d+", command):
            command = re.sub(r"--port \d+", "--port %d" % self.port, command)
        else:
            command += " --port %d" % self.port
        return command + " -t 1"

    def launch(self):
        return ["bash", "-c", "exec " + self.command], str(self.scratch), scratch_env(self.scratch)


def run_curl(command, servers, scratch):
    command = doctext.uncommented(command)
    for address, server in servers.items():
        command = command.replace(address, "127.0.0.1:%d" % server.port)
    # --fail-with-body: an HTTP error status is curl's exit 22, with the error body kept for
    # the message (the examples are single curl commands, so it goes last)
    run = _sh(command + " --fail-with-body", scratch)
    assert run.returncode == 0, "%s\nexit %d: %s%s" % (command, run.returncode, run.stdout,
                                                      run.stderr)
    return run.stdout


@pytest.fixture(scope="module")
def vision(lib, scratch, plain_model_path, tiny_dir):
    """docs/api.md's server with an mmproj: the tiny model with the tests' own projector
    (no vision model can be had offline), and the page's picture.png: one red square."""
    (scratch / "picture.png").write_bytes(mmproj.png((255, 0, 0)))
    path = mmproj.write(tiny_dir, plain_model_path, TOKENS)
    with ServerProcess(plain_model_path, "--mmproj", path, ctx=512, threads=1) as server:
        yield server


@pytest.fixture(scope="module")
def tls(lib, scratch):
    """docs/cli.md's HTTPS server: its certificate made by the page's openssl command in
    the scratch copy, then the page's server, whose client helpers trust that certificate."""
    (make_cert,) = [c for c in OTHERS if entry_for(c)[1] == "tls_cert"]
    run = _sh(doctext.uncommented(make_cert.text), scratch)
    assert run.returncode == 0, run.stdout + run.stderr
    (command,) = [c for c in OTHERS if entry_for(c)[1] == "tls"]
    with DocServer(command.text, scratch) as server:
        server.tls = ssl.create_default_context(cafile=str(scratch / "cert.pem"))
        yield server


@pytest.fixture(scope="module")
def audio(lib, scratch, plain_model_path, tiny_dir):
    """docs/api.md's server with an audio encoder: the tiny model with the tests' own
    (tests/mmproj.py), greedy; and the page's clip.wav, a second of a tone."""
    (scratch / "clip.wav").write_bytes(mmproj.wav(1.0))
    path = mmproj.write_audio(tiny_dir, plain_model_path)
    with ServerProcess(plain_model_path, "--mmproj", path, "--temp", "0", ctx=1024,
                       threads=1) as server:
        yield server


@pytest.fixture(scope="module")
def make_run(lib, scratch):
    """The README's `make run`, on a free port: the server of the 127.0.0.1:8080 examples."""
    assert shutil.which("curl"), "the docs' examples use curl; install it"
    (command,) = [c for c in OTHERS if entry_for(c)[1] == "make_run"]
    with DocServer(command.text, scratch) as server:
        yield server


# --------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------

def test_every_command_has_one_entry_and_every_entry_a_command():
    matched = [entry_for(c)[0] for c in COMMANDS]
    assert set(matched) == set(DOCS), "entries with no command in the docs: %s" \
        % sorted(set(DOCS) - set(matched))


def test_the_marks_on_the_pages_are_the_entries():
    for command in COMMANDS:
        _, entry = entry_for(command)
        wanted = ("not run" if isinstance(entry, NotRun) else
                  "run by " + entry.test_file if isinstance(entry, RunBy) else None)
        assert command.mark == wanted, "%s:%d is marked %r but its entry is %r:\n%s" % (
            command.page, command.line, command.mark, wanted, command.text)


def test_every_code_block_names_its_language():
    for page in doctext.pages():
        for block in doctext.blocks(page):
            assert block.lang in doctext.LANGUAGES, "%s:%d: a ``` block of %r" % (
                page, block.line, block.lang)


@pytest.mark.parametrize("command", OTHERS, ids=command_id)
def test_docs_command(command, scratch, request):
    _, entry = entry_for(command)
    if entry == "make_run":
        serves_the_default(request.getfixturevalue("make_run"))
    elif entry in ("tls_cert", "tls"):
        serves_https_under_the_prefix(request.getfixturevalue("tls"))
    elif isinstance(entry, Curl) and entry.server != "make_run":
        server = request.getfixturevalue(entry.server)
        entry.check(run_curl(command.text, {entry.address: server}, scratch), server)
    elif isinstance(entry, Curl):
        entry.check(run_curl(command.text, {DEFAULT: request.getfixturevalue("make_run")},
                             scratch))
    elif isinstance(entry, Run):
        run = _sh(command.text, scratch)
        assert run.returncode == 0, run.stdout + run.stderr
        entry.check(run.stdout)
    elif isinstance(entry, Server):
        request.getfixturevalue("lib")
        if entry.before:
            entry.before(scratch / "home")
        with DocServer(command.text, scratch) as server:
            entry.probe(server)
    elif isinstance(entry, NotRun):
        entry.static(command.text, scratch)
        pytest.skip("not run by design: " + entry.reason)
    else:
        run_by(entry.test_file)(command.text, scratch)
        pytest.skip("run by %s (%s)" % (entry.test_file, entry.why))


def test_the_shelf_example_in_its_order(lib, scratch):
    """docs/models.md's shelf: started as the page says, then its curls in the page's order
    (each depends on the one before: a load, the listing, a request by alias, an unload)."""
    assert shutil.which("curl"), "the docs' examples use curl; install it"
    (start,) = [c for c in SHELF_COMMANDS if entry_for(c)[1] == "shelf"]
    steps = [c for c in SHELF_COMMANDS if c is not start]
    assert len(steps) == 4, steps
    with DocServer(start.text, scratch) as server:
        for step in steps:
            entry_for(step)[1].check(run_curl(step.text, {SHELF: server}, scratch))


def test_the_adapter_example(lib, scratch, make_run):
    """The README's LoRA example: the server with an adapter (one the test writes for
    Qwen2.5-Coder: tests/loras.py), then its curl, whose request at scale 0 must
    get the text the default server (no adapter) gives the same request."""
    assert shutil.which("curl"), "the docs' examples use curl; install it"
    (start,) = [c for c in ADAPTER_COMMANDS if entry_for(c)[1] == "adapter"]
    (step,) = [c for c in ADAPTER_COMMANDS if c is not start]
    loras.for_model(ROOT / "models" / QWEN, scratch / "my-adapter.gguf")
    with DocServer(start.text, scratch) as server:
        status, _, listed = server.get("/lora-adapters")
        assert status == 200 and [(a["id"], a["path"], a["scale"]) for a in listed] == \
            [(0, "my-adapter.gguf", 0.5)], listed
        out = _json(run_curl(step.text, {ADAPTER: server}, scratch))
    body = json.loads(re.search(r"-d '(.*)'", step.text).group(1))
    body.pop("lora")
    status, _, base = make_run.post("/completion", body)
    assert status == 200 and out["content"] == base["content"], (out, base)


# -- what the pages say about the code ------------------------------------------------

def test_the_readme_is_a_newcomers_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 12 * 1024, "README.md is %d bytes" % len(text.encode())
    first_screen = "\n".join(text.splitlines()[:25])
    assert "](ARCHITECTURE.md)" in first_screen and "](docs/)" in first_screen
    first = doctext.blocks(Path("README.md"))[0]
    assert [doctext.bare(c.text) for c in doctext.commands(first)] == ["make run", "make test"]
    for page in doctext.pages()[1:]:
        assert "](%s)" % page in text, "the README does not link %s" % page


def test_every_link_and_anchor_resolves():
    for page in doctext.pages():
        for target, anchor in doctext.links(page):
            path = Path(os.path.normpath((ROOT / page).parent / target)) if target \
                else ROOT / page
            assert path.exists(), "%s links to %s, which is not there" % (page, target)
            if anchor:
                assert anchor in doctext.anchors(path.relative_to(ROOT)), \
                    "%s links to %s#%s: no such heading" % (page, target, anchor)


def test_every_flag_of_the_command_line_is_in_cli_md():
    out = subprocess.run([sys.executable, "-m", "offgrid", "--help"], cwd=str(ROOT),
                         capture_output=True, text=True, check=True).stdout
    flags = set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", out.split("options:", 1)[1]))
    table = (ROOT / "docs" / "cli.md").read_text().split("## Flags", 1)[1].split("\n## ", 1)[0]
    listed = set()
    for row in table.splitlines()[2:]:            # the first column of each row
        listed |= set(re.findall(r"(?<![\w-])(--?[a-z][a-z-]*)", row.split(" | ")[0]))
    assert not sorted(flags - listed), \
        "flags --help lists that docs/cli.md does not: %s" % sorted(flags - listed)
    assert not sorted(listed - flags), \
        "flags docs/cli.md lists that offgrid does not take: %s" % sorted(listed - flags)


def test_every_route_is_in_api_md_or_dialects_md():
    source = "\n".join(p.read_text() for p in (ROOT / "offgrid").rglob("*.py"))
    routes = set(re.findall(r'^\s*"(/[^"]*)": Route\(', source, re.M))
    assert len(routes) > 30, "the route table is no longer written as '\"/path\": Route(...)'"
    documented = "\n".join((ROOT / "docs" / name).read_text() for name in ("api.md",
                                                                          "dialects.md"))
    missing = sorted(r for r in routes if not re.search(r"[` ]%s[`,) ]" % re.escape(r),
                                                        documented))
    assert not missing, "routes no page documents: %s" % missing


def _bench_markdown():
    return _bench_module("bench_run", "run.py").markdown


def test_each_measured_run_says_where_what_when_and_beside_what():
    text = (ROOT / "docs" / "performance.md").read_text()
    runs = text.split("\n## The runs\n", 1)[1].split("\n## ", 1)[0].split("\n### ")[1:]
    assert len(runs) >= 5
    markdown = _bench_markdown()
    for run in runs:
        title = run.splitlines()[0]
        for field in ("host", "commit", "date", "load", "results"):
            assert re.search(r"^- \*\*%s\*\*: \S" % field, run, re.M), (title, field)
        header = re.search(r"^- \*\*results\*\*:(.*?)(?=^\S|\n\n)", run, re.M | re.S).group(1)
        for name in re.findall(r"`(bench/results/[^`]+\.json)`", header):
            result = json.loads((ROOT / name).read_text())
            if "scenarios" in result:         # make bench's files: the table is theirs
                assert markdown(result) in run, "%s: the table is not %s's" % (title, name)
