"""Record and replay: the front's responses, pinned before a refactor and checked after.

A few hundred requests across every route and dialect (llama.cpp's native
API, OpenAI's completions, chat, embeddings and Responses, Ollama's, and
Anthropic's Messages), streamed and not, errors included, go to real
servers on the three test models.  Each response is kept as its status, the
headers a client reads, and its body (JSON parsed), or for a stream each
event in order (SSE event name and data, or NDJSON line).  What may differ
from run to run is replaced by a placeholder of the same type: ids
(``chatcmpl-``, ``cmpl-``, ``msg_``, ``resp_``, tool-call ids), times
(``created``, ``created_at``, ``Process-Start-Time-Unix``), durations and
speeds (``*_ms``, ``*_per_second``, ``*_duration``), the build and version
and the checkout's paths.  A field that vanishes, appears or changes type
still differs.

    python3 tests/replay.py --record       record tests/golden/replay/*.json
                                           (twice, from fresh servers; see below)
    python3 tests/replay.py --check        replay against them and print the diffs
    python3 -m pytest tests/test_replay.py the same as a test, a case an item

Re-record only on purpose (a deliberate change of behaviour), from the code
whose responses are the reference, and read the diff of the golden files.

Determinism: every server decodes on one thread (``-t 1``), streams every
piece as its own event (``--stream-interval-ms 0``), and samples greedily
(temperature 0) or with a fixed seed; short generations.  The cases of a
group run in their order on one server started for them, so what the
sessions' caches hold (``tokens_cached``, ``cache_n``) is the same each time.
Most groups serve with one session (``-np 1``): the choices of ``n``/``n_cmpl``
then run one after another.  The group ``np2`` serves with two sessions, whose
choices decode together in one batch, where a near-tie of logits may go
either way: the recorder runs every group twice, and a case of ``np2`` whose
two recordings differ is kept as ``"unstable"`` (run, so the caches evolve
the same, but not compared); in any other group such a difference stops the
recording.
"""

import argparse
import base64
import hashlib
import http.client
import json
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

try:
    from .serverproc import ROOT, ServerProcess
except ImportError:     # run as a script, or tests/ on sys.path
    from serverproc import ROOT, ServerProcess

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from offgrid import __version__     # noqa: E402

GOLDEN = ROOT / "tests" / "golden" / "replay"
MODELS = ROOT / "models"
QWEN = MODELS / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
SMOLLM = MODELS / "smollm2-135m-instruct-q4_1.gguf"
GEMMA = MODELS / "gemma-3-270m-q4_k_m.gguf"
API_KEY = "replay-key"
ORIGIN = "http://editor.test"


# ==========================================================================
# The servers
# ==========================================================================

class Group:
    """A server and the cases that run on it, in order."""

    def __init__(self, name, args, ctx=2048):
        self.name, self.args, self.ctx = name, list(args), ctx
        self.cases = []


COMMON = ("-t", "1", "--stream-interval-ms", "0")

GROUPS = {g.name: g for g in (
    # the default model, one session: most cases, FIM included
    Group("qwen", ["-m", QWEN, "-np", "1", "--cors-origin", ORIGIN]),
    # a router over a folder of the three models (made at start): unknown
    # names are 404s, and smollm and gemma load on their first request
    Group("router", ["--models-dir", "{models_dir}", "-np", "1"]),
    # two sessions: n / n_cmpl and several prompts decode in one batch
    Group("np2", ["-m", QWEN, "-np", "2"]),
    # reranking, an API key, /slots and /metrics switched off
    Group("ranker", ["-m", SMOLLM, "--reranking", "--api-key", API_KEY, "--no-slots",
                     "--no-metrics"], ctx=512),
)}


class _Server(ServerProcess):
    """ServerProcess with the group's own command line (a router has no -m)."""

    def __init__(self, group, models_dir):
        super().__init__(QWEN, threads=1, ctx=group.ctx)
        args = [str(a).replace("{models_dir}", str(models_dir)) for a in group.args]
        self.args = args + ["--port", str(self.port), "-c", str(group.ctx)] + list(COMMON)


def models_folder():
    """A folder of links to the three models, for the router (its path is normalised)."""
    d = Path(tempfile.mkdtemp(prefix="offgrid-replay-"))
    for m in (QWEN, SMOLLM, GEMMA):
        (d / m.name).symlink_to(m.resolve())
    return d


# ==========================================================================
# The cases
# ==========================================================================

class Case:
    def __init__(self, group, name, method, path, body=None, raw=None, headers=None):
        self.group, self.name, self.method, self.path = group, name, method, path
        self.body, self.raw, self.headers = body, raw, dict(headers or {})

    @property
    def id(self):
        return "%s/%s" % (self.group, self.name)

    def request(self):
        """The request as the golden file keeps it (to see that a case changed)."""
        out = {"method": self.method, "path": self.path}
        if self.raw is not None:
            out["raw"] = self.raw.decode("latin-1")
        elif self.body is not None:
            out["body"] = self.body
        if self.headers:
            out["headers"] = self.headers
        return out


_group = None


def group(name):
    global _group
    _group = GROUPS[name]


def _add(name, method, path, body=None, raw=None, headers=None):
    assert all(c.name != name for c in _group.cases), "duplicate case %s" % name
    _group.cases.append(Case(_group.name, name, method, path, body, raw, headers))


def get(name, path, headers=None):
    _add(name, "GET", path, headers=headers)


def post(name, path, body, headers=None):
    _add(name, "POST", path, body, headers=headers)


def raw(name, method, path, data, headers=None):
    _add(name, method, path, raw=data, headers=headers)


# -- shared request pieces ------------------------------------------------------

G = {"temperature": 0}          # greedy
HI = [{"role": "user", "content": "Say hello."}]
CODE = "def fibonacci(n):\n"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string"}}}}}
NOW = {"type": "function", "function": {
    "name": "now", "description": "The time now",
    "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, NOW]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_TURN = ASK_WEATHER + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 21}"}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
# a literal grammar that makes a model write a reasoning block (its tokens its own)
THINK = 'root ::= "<think>" "Hm." "</think>" "Hi."'
LONG = "word " * 2500           # more tokens than a 2048 context holds
BAD_JSON = b'{"prompt": "x", '


def chat(**kw):
    return dict({"messages": HI, "max_tokens": 8}, **dict(G, **kw))


def cmpl(**kw):
    return dict({"prompt": CODE, "n_predict": 8}, **dict(G, **kw))


# -- qwen: the default model, one session --------------------------------------------

group("qwen")
get("health", "/health")
get("v1.health", "/v1/health")
_add("health.head", "HEAD", "/health")
get("root", "/")
get("props", "/props")
get("slots.fresh", "/slots")
get("models", "/models")
get("v1.models", "/v1/models")
_add("v1.models.head", "HEAD", "/v1/models")

# /tokenize, /detokenize
post("tokenize", "/tokenize", {"content": "Hello world"})
post("tokenize.pieces", "/tokenize", {"content": "Hello wörld <|im_end|>", "with_pieces": True})
post("tokenize.add_special", "/tokenize", {"content": "Hi", "add_special": True})
post("tokenize.no_parse_special", "/tokenize", {"content": "<|im_end|>", "parse_special": False})
post("tokenize.named_model", "/tokenize", {"content": "Hi", "model": "anything"})
post("tokenize.err.missing", "/tokenize", {})
post("tokenize.err.type", "/tokenize", {"content": 5})
post("tokenize.err.bool", "/tokenize", {"content": "x", "with_pieces": "yes"})
post("detokenize", "/detokenize", {"tokens": [9707, 1879]})
post("detokenize.empty", "/detokenize", {"tokens": []})
post("detokenize.err.type", "/detokenize", {"tokens": "9707"})
post("detokenize.err.range", "/detokenize", {"tokens": [99999999]})

# /apply-template
post("apply_template", "/apply-template", {"messages": HI})
post("apply_template.tools", "/apply-template", {"messages": TOOL_TURN, "tools": TOOLS})
post("apply_template.system", "/apply-template",
     {"messages": [{"role": "system", "content": "Be brief."}] + HI})
post("apply_template.prefill", "/apply-template",
     {"messages": HI + [{"role": "assistant", "content": "Hello"}]})
post("apply_template.err.missing", "/apply-template", {})
post("apply_template.err.role", "/apply-template", {"messages": [{"role": "robot",
                                                                    "content": "x"}]})

# /completion (and /completions)
post("completion", "/completion", cmpl())
post("completion.stream", "/completion", cmpl(stream=True))
post("completions.alias", "/completions", cmpl(n_predict=4))
post("completion.max_tokens", "/completion", {"prompt": CODE, "max_tokens": 3, **G})
post("completion.n_predict_over_max_tokens", "/completion",
     {"prompt": CODE, "n_predict": 2, "max_tokens": 6, **G})
post("completion.n_predict0", "/completion", cmpl(n_predict=0))
post("completion.stop", "/completion", cmpl(n_predict=12, stop=["\n"]))
post("completion.stop.stream", "/completion", cmpl(n_predict=12, stop=["(", "\n"], stream=True))
post("completion.stop.string", "/completion", cmpl(stop="fib"))
post("completion.tokens", "/completion", cmpl(prompt=[750, 75698, 1445, 982], n_predict=4))
post("completion.mixed", "/completion", cmpl(prompt=["def", 75698], n_predict=4))
post("completion.prompt_string", "/completion", cmpl(prompt={"prompt_string": CODE},
                                                       n_predict=4))
post("completion.nested", "/completion", cmpl(prompt=[[CODE]], n_predict=4))
post("completion.n_probs", "/completion", cmpl(n_predict=3, n_probs=2))
post("completion.n_probs.stream", "/completion", cmpl(n_predict=3, n_probs=2, stream=True))
post("completion.post_sampling", "/completion",
     cmpl(n_predict=3, n_probs=2, post_sampling_probs=True))
post("completion.logprobs_alias", "/completion", cmpl(n_predict=2, logprobs=1))
post("completion.return_tokens", "/completion", cmpl(n_predict=4, return_tokens=True))
post("completion.response_fields", "/completion",
     cmpl(n_predict=4, response_fields=["content", "generation_settings/n_predict", "nope"]))
post("completion.id_slot", "/completion", cmpl(n_predict=4, id_slot=0))
post("completion.seed", "/completion", cmpl(n_predict=6, temperature=0.9, seed=42))
post("completion.seed.again", "/completion", cmpl(n_predict=6, temperature=0.9, seed=42))
post("completion.logit_bias", "/completion", cmpl(n_predict=4, logit_bias=[[220, False]]))
post("completion.logit_bias.text", "/completion", cmpl(n_predict=4, logit_bias=[[" if", -100]]))
post("completion.grammar", "/completion", cmpl(n_predict=6, grammar='root ::= "yes" | "no"'))
post("completion.json_schema", "/completion", cmpl(prompt="JSON:", n_predict=8,
                                                     json_schema=SCHEMA))
post("completion.samplers", "/completion", cmpl(n_predict=4, samplers=["top_k", "temperature"]))
post("completion.samplers.letters", "/completion", cmpl(n_predict=4, samplers="kt"))
post("completion.ignore_eos", "/completion", cmpl(prompt="<|im_end|>", n_predict=3,
                                                    ignore_eos=True))
post("completion.no_cache", "/completion", cmpl(n_predict=3, cache_prompt=False))
post("completion.timings_per_token", "/completion",
     cmpl(n_predict=3, stream=True, timings_per_token=True))
post("completion.return_progress", "/completion",
     cmpl(prompt="import os\nimport sys\n", n_predict=2, stream=True, return_progress=True))
post("completion.n_indent", "/completion", cmpl(n_predict=8, n_indent=4))
post("completion.n_cmpl2", "/completion", cmpl(n_predict=3, n_cmpl=2))
post("completion.n2", "/completion", cmpl(n_predict=3, n=2))
post("completion.n_and_n_cmpl", "/completion", cmpl(n_predict=2, n=3, n_cmpl=2))
post("completion.prompts", "/completion", cmpl(prompt=["a = 1", "b = 2"], n_predict=3))
post("completion.prompts.stream", "/completion", cmpl(prompt=["a = 1", "b = 2"], n_predict=2,
                                                        stream=True))
post("completion.err.missing_prompt", "/completion", {"n_predict": 4})
post("completion.err.prompt_type", "/completion", cmpl(prompt=3.5))
post("completion.err.prompt_strings", "/completion", cmpl(prompt=[["a", "b"]]))
post("completion.err.temperature", "/completion", cmpl(temperature="hot"))
post("completion.err.n_predict", "/completion", cmpl(n_predict=-2))
post("completion.err.n_predict_float", "/completion", cmpl(n_predict=2.5))
post("completion.err.stop", "/completion", cmpl(stop=[1, 2]))
post("completion.err.top_p", "/completion", cmpl(top_p=2))
post("completion.err.seed_type", "/completion", cmpl(seed="x"))
post("completion.err.logit_bias", "/completion", cmpl(logit_bias=[[10 ** 7, 1]]))
post("completion.err.samplers", "/completion", cmpl(samplers=5))
post("completion.err.grammar_and_schema", "/completion", cmpl(grammar="root ::= \"a\"",
                                                               json_schema=SCHEMA))
post("completion.err.bad_grammar", "/completion", cmpl(grammar="root ::= ("))
post("completion.err.n_cmpl", "/completion", cmpl(n_cmpl=0))
post("completion.err.too_long", "/completion", cmpl(prompt=LONG))
post("completion.err.too_long.stream", "/completion", cmpl(prompt=LONG, stream=True))
post("completion.err.token_range", "/completion", cmpl(prompt=[5, 10 ** 8]))
post("completion.id_slot_beyond", "/completion", cmpl(id_slot=7))
post("completion.err.response_fields", "/completion", cmpl(response_fields="content"))
post("completion.err.body_array", "/completion", [CODE])
raw("completion.err.bad_json", "POST", "/completion", BAD_JSON,
    {"Content-Type": "application/json"})
raw("completion.err.empty_body", "POST", "/completion", b"",
    {"Content-Type": "application/json"})
get("completion.err.get", "/completion")

# /infill
INF = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n",
       "n_predict": 8, **G}
post("infill", "/infill", INF)
post("infill.stream", "/infill", dict(INF, stream=True))
post("infill.extra", "/infill", dict(INF, input_extra=[{"filename": "util.py",
                                                         "text": "def sub(a, b):\n"
                                                                 "    return a - b\n"}]))
post("infill.prompt", "/infill", dict(INF, prompt="return"))
post("infill.n_probs", "/infill", dict(INF, n_predict=2, n_probs=2))
post("infill.empty", "/infill", {"n_predict": 3, **G})
post("infill.err.extra", "/infill", dict(INF, input_extra=[{"name": "x"}]))
post("infill.err.extra_type", "/infill", dict(INF, input_extra="x"))
post("infill.err.prefix_type", "/infill", dict(INF, input_prefix=5))

# /v1/completions
post("v1c", "/v1/completions", {"prompt": CODE, "max_tokens": 8, **G})
post("v1c.stream", "/v1/completions", {"prompt": CODE, "max_tokens": 4, "stream": True, **G})
post("v1c.stream.usage", "/v1/completions",
     {"prompt": CODE, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True},
      **G})
post("v1c.n_predict_alias", "/v1/completions", {"prompt": CODE, "n_predict": 3, **G})
post("v1c.max_tokens0", "/v1/completions", {"prompt": CODE, "max_tokens": 0, **G})
post("v1c.suffix", "/v1/completions",
     {"prompt": "def add(a, b):\n    ", "suffix": "\n\nprint(add(1, 2))\n", "max_tokens": 8, **G})
post("v1c.suffix.stream", "/v1/completions",
     {"prompt": "def add(a, b):\n    ", "suffix": "\n", "max_tokens": 4, "stream": True, **G})
post("v1c.suffix.empty_prefix", "/v1/completions",
     {"prompt": "", "suffix": "\nreturn x\n", "max_tokens": 4, **G})
post("v1c.logprobs", "/v1/completions", {"prompt": CODE, "max_tokens": 3, "logprobs": 2, **G})
post("v1c.logprobs.stream", "/v1/completions",
     {"prompt": CODE, "max_tokens": 3, "logprobs": 1, "stream": True, **G})
post("v1c.logprobs_false", "/v1/completions",
     {"prompt": CODE, "max_tokens": 2, "logprobs": False, **G})
post("v1c.n2", "/v1/completions", {"prompt": CODE, "max_tokens": 3, "n": 2, **G})
post("v1c.n2.logprobs", "/v1/completions", {"prompt": CODE, "max_tokens": 2, "n": 2,
                                            "logprobs": 1, **G})
post("v1c.prompts", "/v1/completions", {"prompt": ["x = 1", "y = 2"], "max_tokens": 3, **G})
post("v1c.prompts.stream", "/v1/completions",
     {"prompt": ["x = 1", "y = 2"], "max_tokens": 2, "stream": True,
      "stream_options": {"include_usage": True}, **G})
post("v1c.tokens", "/v1/completions", {"prompt": [750, 75698], "max_tokens": 3, **G})
post("v1c.stop", "/v1/completions", {"prompt": CODE, "max_tokens": 12, "stop": ["\n"], **G})
post("v1c.seed", "/v1/completions",
     {"prompt": CODE, "max_tokens": 5, "temperature": 1.0, "seed": 7})
post("v1c.best_of1", "/v1/completions", {"prompt": CODE, "max_tokens": 2, "best_of": 1, **G})
post("v1c.echo_false", "/v1/completions", {"prompt": CODE, "max_tokens": 2, "echo": False, **G})
post("v1c.json_schema", "/v1/completions",
     {"prompt": "JSON:", "max_tokens": 8, "response_format": {"type": "json_object"}, **G})
post("v1c.err.echo", "/v1/completions", {"prompt": CODE, "max_tokens": 2, "echo": True})
post("v1c.err.best_of", "/v1/completions", {"prompt": CODE, "max_tokens": 2, "best_of": 2})
post("v1c.err.missing_prompt", "/v1/completions", {"max_tokens": 2})
post("v1c.err.empty_prompt", "/v1/completions", {"prompt": "", "max_tokens": 2})
post("v1c.err.suffix_list", "/v1/completions", {"prompt": ["a", "b"], "suffix": "c"})
post("v1c.err.max_tokens", "/v1/completions", {"prompt": CODE, "max_tokens": -1})
post("v1c.err.n", "/v1/completions", {"prompt": CODE, "n": 17})
post("v1c.err.stream_options", "/v1/completions",
     {"prompt": CODE, "stream": True, "stream_options": True})
post("v1c.err.logprobs", "/v1/completions", {"prompt": CODE, "logprobs": "yes"})
post("v1c.err.too_long", "/v1/completions", {"prompt": LONG, "max_tokens": 2})
raw("v1c.err.bad_json", "POST", "/v1/completions", BAD_JSON,
    {"Content-Type": "application/json"})

# /v1/chat/completions
post("chat", "/v1/chat/completions", chat())
post("chat.stream", "/v1/chat/completions", chat(stream=True))
post("chat.stream.usage", "/v1/chat/completions",
     chat(stream=True, stream_options={"include_usage": True}))
post("chat.alias", "/chat/completions", chat(max_tokens=3))
post("chat.max_completion_tokens", "/v1/chat/completions",
     {"messages": HI, "max_completion_tokens": 3, "max_tokens": 9, **G})
post("chat.n_predict", "/v1/chat/completions", {"messages": HI, "n_predict": 2, **G})
post("chat.system", "/v1/chat/completions",
     chat(messages=[{"role": "system", "content": "Answer in French."}] + HI))
post("chat.developer", "/v1/chat/completions",
     chat(messages=[{"role": "developer", "content": "Be brief."}] + HI, max_tokens=4))
post("chat.parts", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": [{"type": "text", "text": "Say"},
                                                 {"type": "text", "text": "hello."}]}]))
post("chat.stop", "/v1/chat/completions", chat(max_tokens=12, stop=["!"]))
post("chat.stop.stream", "/v1/chat/completions", chat(max_tokens=12, stop="!", stream=True))
post("chat.seed", "/v1/chat/completions", chat(temperature=1.0, seed=11, max_tokens=6))
post("chat.n2", "/v1/chat/completions", chat(n=2, max_tokens=3))
post("chat.n2.stream", "/v1/chat/completions", chat(n=2, max_tokens=2, stream=True,
                                                    stream_options={"include_usage": True}))
post("chat.n_cmpl", "/v1/chat/completions", chat(n_cmpl=2, max_tokens=2))
post("chat.n2.logprobs", "/v1/chat/completions", chat(n=2, max_tokens=2, logprobs=True,
                                                      top_logprobs=1))
post("chat.n_and_n_cmpl", "/v1/chat/completions", chat(n=1, n_cmpl=2, max_tokens=2))
post("chat.logprobs", "/v1/chat/completions", chat(logprobs=True, max_tokens=3))
post("chat.top_logprobs", "/v1/chat/completions", chat(logprobs=True, top_logprobs=2,
                                                       max_tokens=3))
post("chat.top_logprobs.stream", "/v1/chat/completions",
     chat(logprobs=True, top_logprobs=1, max_tokens=2, stream=True))
post("chat.top_logprobs.post", "/v1/chat/completions",
     chat(logprobs=True, top_logprobs=2, max_tokens=2, post_sampling_probs=True))
post("chat.tools.auto", "/v1/chat/completions",
     chat(messages=ASK_WEATHER, tools=TOOLS, max_tokens=24))
post("chat.tools.required", "/v1/chat/completions",
     chat(messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", max_tokens=24))
post("chat.tools.required.stream", "/v1/chat/completions",
     chat(messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", max_tokens=24, stream=True))
post("chat.tools.named", "/v1/chat/completions",
     chat(messages=ASK_WEATHER, tools=TOOLS, max_tokens=24,
          tool_choice={"type": "function", "function": {"name": "now"}}))
post("chat.tools.none", "/v1/chat/completions",
     chat(messages=ASK_WEATHER, tools=TOOLS, tool_choice="none", max_tokens=6))
post("chat.tools.result", "/v1/chat/completions", chat(messages=TOOL_TURN, tools=TOOLS))
post("chat.tools.result.stream", "/v1/chat/completions",
     chat(messages=TOOL_TURN, tools=TOOLS, stream=True, max_tokens=4))
post("chat.tools.parallel_false", "/v1/chat/completions",
     chat(messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
          parallel_tool_calls=False, max_tokens=24))
post("chat.tools.cut", "/v1/chat/completions",
     chat(messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", max_tokens=5))
post("chat.json_object", "/v1/chat/completions",
     chat(response_format={"type": "json_object"}, max_tokens=10))
post("chat.json_schema", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
          max_tokens=10))
post("chat.json_schema.stream", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}},
          max_tokens=10, stream=True))
post("chat.response_format_text", "/v1/chat/completions",
     chat(response_format={"type": "text"}, max_tokens=3))
post("chat.grammar", "/v1/chat/completions", chat(grammar='root ::= "ok"', max_tokens=4))
post("chat.reasoning_format_none", "/v1/chat/completions",
     chat(reasoning_format="none", max_tokens=3))
post("chat.reasoning_effort_none", "/v1/chat/completions",
     chat(reasoning_effort="none", max_tokens=3))
post("chat.enable_thinking", "/v1/chat/completions",
     chat(chat_template_kwargs={"enable_thinking": False}, max_tokens=3))
post("chat.prefill", "/v1/chat/completions",
     chat(messages=HI + [{"role": "assistant", "content": "Hello"}], max_tokens=4))
post("chat.continue_final", "/v1/chat/completions",
     chat(messages=HI + [{"role": "assistant", "content": "Hel"}], continue_final_message=True,
          add_generation_prompt=False, max_tokens=4))
post("chat.return_progress", "/v1/chat/completions",
     chat(stream=True, return_progress=True, timings_per_token=True, max_tokens=2))
post("chat.verbose", "/v1/chat/completions", chat(verbose=True, max_tokens=2))
post("chat.logit_bias", "/v1/chat/completions", chat(logit_bias={"9707": -100}, max_tokens=3))
post("chat.id_slot", "/v1/chat/completions", chat(id_slot=0, max_tokens=2))
post("chat.model_named", "/v1/chat/completions", chat(model="gpt-4o", max_tokens=2))
post("chat.err.messages_missing", "/v1/chat/completions", {"max_tokens": 2})
post("chat.err.messages_empty", "/v1/chat/completions", chat(messages=[]))
post("chat.err.messages_type", "/v1/chat/completions", chat(messages="hi"))
post("chat.err.role", "/v1/chat/completions", chat(messages=[{"role": "wizard",
                                                              "content": "x"}]))
post("chat.err.no_content", "/v1/chat/completions", chat(messages=[{"role": "user"}]))
post("chat.err.content_type", "/v1/chat/completions", chat(messages=[{"role": "user",
                                                                      "content": 5}]))
post("chat.err.image", "/v1/chat/completions", chat(messages=[{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]))
post("chat.err.two_assistants", "/v1/chat/completions",
     chat(messages=HI + [{"role": "assistant", "content": "a"},
                         {"role": "assistant", "content": "b"}]))
post("chat.err.continue_and_prompt", "/v1/chat/completions",
     chat(messages=HI + [{"role": "assistant", "content": "a"}], continue_final_message=True))
post("chat.err.top_logprobs_alone", "/v1/chat/completions", chat(top_logprobs=2))
post("chat.err.top_logprobs_range", "/v1/chat/completions", chat(logprobs=True,
                                                                 top_logprobs=21))
post("chat.err.logprobs_type", "/v1/chat/completions", chat(logprobs=2))
post("chat.err.tools", "/v1/chat/completions", chat(tools=[{"x": 1}]))
post("chat.err.tools_type", "/v1/chat/completions", chat(tools={"type": "function"}))
post("chat.err.tool_choice", "/v1/chat/completions", chat(tools=TOOLS, tool_choice="always"))
post("chat.err.tool_choice_unknown", "/v1/chat/completions",
     chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}))
post("chat.err.tools_and_grammar", "/v1/chat/completions",
     chat(tools=TOOLS, grammar='root ::= "a"'))
post("chat.err.tool_calls_shape", "/v1/chat/completions",
     chat(messages=[{"role": "assistant", "tool_calls": [{"function": "x"}]}]))
post("chat.err.response_format", "/v1/chat/completions",
     chat(response_format={"type": "xml"}))
post("chat.err.response_format_type", "/v1/chat/completions", chat(response_format="json"))
post("chat.err.json_schema_wrapper", "/v1/chat/completions",
     chat(response_format={"type": "json_schema", "json_schema": "x"}))
post("chat.err.reasoning_format", "/v1/chat/completions", chat(reasoning_format="loud"))
post("chat.err.enable_thinking", "/v1/chat/completions",
     chat(chat_template_kwargs={"enable_thinking": "yes"}))
post("chat.err.template_kwargs", "/v1/chat/completions", chat(chat_template_kwargs=[1]))
post("chat.err.n", "/v1/chat/completions", chat(n=0))
post("chat.err.best_of", "/v1/chat/completions", chat(best_of=3))
post("chat.err.max_tokens", "/v1/chat/completions", chat(max_tokens="8"))
post("chat.err.max_completion_tokens", "/v1/chat/completions", chat(max_completion_tokens=-5))
post("chat.err.stream_type", "/v1/chat/completions", chat(stream="yes"))
post("chat.err.too_long", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": LONG}]))
post("chat.err.too_long.stream", "/v1/chat/completions",
     chat(messages=[{"role": "user", "content": LONG}], stream=True))
post("chat.err.body_array", "/v1/chat/completions", [chat()])
raw("chat.err.bad_json", "POST", "/v1/chat/completions", BAD_JSON,
    {"Content-Type": "application/json"})
raw("chat.err.not_utf8", "POST", "/v1/chat/completions", b'{"messages": "\xff"}',
    {"Content-Type": "application/json"})
get("chat.err.get", "/v1/chat/completions")

# /chat/completions/input_tokens
post("input_tokens", "/v1/chat/completions/input_tokens", {"messages": HI})
post("input_tokens.tools", "/v1/chat/completions/input_tokens",
     {"messages": ASK_WEATHER, "tools": TOOLS})
post("input_tokens.alias", "/chat/completions/input_tokens", {"messages": HI})
post("input_tokens.err", "/v1/chat/completions/input_tokens", {"messages": []})

# /v1/embeddings, /embedding(s), rerank refused
post("v1.embeddings", "/v1/embeddings", {"input": "hello"})
post("v1.embeddings.list", "/v1/embeddings", {"input": ["hello", "world"], "model": "x"})
post("v1.embeddings.tokens", "/v1/embeddings", {"input": [9707, 1879]})
post("v1.embeddings.base64", "/v1/embeddings", {"input": "hello", "encoding_format": "base64"})
post("v1.embeddings.dimensions", "/v1/embeddings", {"input": "hello", "dimensions": 896})
post("v1.embeddings.err.dimensions", "/v1/embeddings", {"input": "hello", "dimensions": 8})
post("v1.embeddings.err.missing", "/v1/embeddings", {})
post("v1.embeddings.err.empty", "/v1/embeddings", {"input": ""})
post("v1.embeddings.err.type", "/v1/embeddings", {"input": {"a": 1}})
post("v1.embeddings.err.format", "/v1/embeddings", {"input": "x", "encoding_format": "hex"})
post("embedding", "/embedding", {"content": "hello"})
post("embeddings.native", "/embeddings", {"content": ["a", "b"]})
post("embedding.err.missing", "/embedding", {})
post("rerank.refused", "/rerank", {"query": "q", "documents": ["a", "b"]})
post("v1.rerank.refused", "/v1/rerank", {"query": "q", "documents": ["a"]})

# /v1/responses
RESP = {"input": "Say hello.", "max_output_tokens": 8, **G}
post("responses", "/v1/responses", RESP)
post("responses.stream", "/v1/responses", dict(RESP, stream=True))
post("responses.instructions", "/v1/responses", dict(RESP, instructions="Answer in French."))
post("responses.items", "/v1/responses", dict(RESP, input=[
    {"role": "user", "content": [{"type": "input_text", "text": "Say hello."}]},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Again."}]))
post("responses.tools.required", "/v1/responses", dict(
    RESP, input="What is the weather in Paris?", max_output_tokens=24, tool_choice="required",
    tools=[dict(WEATHER["function"], type="function"), dict(NOW["function"], type="function")]))
post("responses.tools.required.stream", "/v1/responses", dict(
    RESP, input="What is the weather in Paris?", max_output_tokens=24, tool_choice="required",
    stream=True, tools=[dict(WEATHER["function"], type="function")]))
post("responses.tools.named", "/v1/responses", dict(
    RESP, input="Time?", max_output_tokens=24, tool_choice={"type": "function", "name": "now"},
    tools=[dict(NOW["function"], type="function")]))
post("responses.tool_output", "/v1/responses", dict(RESP, input=[
    {"role": "user", "content": "What is the weather in Paris?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather",
     "arguments": "{\"city\": \"Paris\"}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "{\"temp_c\": 21}"}],
    tools=[dict(WEATHER["function"], type="function")], max_output_tokens=6))
post("responses.json_schema", "/v1/responses", dict(
    RESP, max_output_tokens=10, text={"format": {"type": "json_schema", "name": "n",
                                                  "schema": SCHEMA}}))
post("responses.reasoning", "/v1/responses", dict(RESP, reasoning={"effort": "none"},
                                                  max_output_tokens=3))
post("responses.cut", "/v1/responses", dict(RESP, max_output_tokens=2, stream=True))
post("responses.err.background", "/v1/responses", dict(RESP, background=True))
post("responses.err.previous", "/v1/responses", dict(RESP, previous_response_id="resp_1"))
post("responses.err.missing_input", "/v1/responses", {"max_output_tokens": 4})
post("responses.err.input_type", "/v1/responses", dict(RESP, input=5))
post("responses.err.max_output_tokens", "/v1/responses", dict(RESP, max_output_tokens=0))
post("responses.err.tools", "/v1/responses", dict(RESP, tools=[{"type": "web_search"}]))
post("responses.err.item", "/v1/responses", dict(RESP, input=[{"type": "image"}]))
post("responses.err.format", "/v1/responses", dict(RESP, text={"format": {"type": "yaml"}}))
post("responses.err.reasoning", "/v1/responses", dict(RESP, reasoning="high"))
raw("responses.err.bad_json", "POST", "/v1/responses", BAD_JSON,
    {"Content-Type": "application/json"})

# Ollama
get("api.version", "/api/version")
get("api.tags", "/api/tags")
get("api.ps", "/api/ps")
post("api.show", "/api/show", {"model": "qwen2.5-coder"})
post("api.show.name", "/api/show", {"name": "anything:latest"})
post("api.show.err.missing", "/api/show", {})
OGEN = {"model": "qwen2.5-coder:0.5b", "prompt": "Say hello.",
        "options": {"num_predict": 6, "temperature": 0}}
post("api.generate", "/api/generate", OGEN)
post("api.generate.nostream", "/api/generate", dict(OGEN, stream=False))
post("api.generate.system", "/api/generate", dict(OGEN, stream=False, system="Answer in French."))
post("api.generate.raw", "/api/generate", dict(OGEN, prompt=CODE, raw=True))
post("api.generate.raw.nostream", "/api/generate", dict(OGEN, prompt=CODE, raw=True,
                                                        stream=False))
post("api.generate.suffix", "/api/generate",
     dict(OGEN, prompt="def add(a, b):\n    ", suffix="\n\nprint(add(1, 2))\n"))
post("api.generate.suffix.nostream", "/api/generate",
     dict(OGEN, prompt="def add(a, b):\n    ", suffix="\n", stream=False))
post("api.generate.suffix.raw", "/api/generate",
     dict(OGEN, prompt="def add(a, b):\n    ", suffix="\n", raw=True, stream=False))
post("api.generate.format_json", "/api/generate",
     dict(OGEN, format="json", stream=False, options={"num_predict": 8, "temperature": 0}))
post("api.generate.format_schema", "/api/generate",
     dict(OGEN, format=SCHEMA, stream=False, options={"num_predict": 8, "temperature": 0}))
post("api.generate.think", "/api/generate", dict(OGEN, think=False, stream=False))
post("api.generate.think_level", "/api/generate", dict(OGEN, think="high", stream=False))
post("api.generate.stop", "/api/generate",
     dict(OGEN, stream=False, options={"num_predict": 12, "temperature": 0, "stop": ["!"]}))
post("api.generate.seed", "/api/generate",
     dict(OGEN, stream=False, options={"num_predict": 6, "temperature": 1.0, "seed": 3}))
post("api.generate.num_predict_neg2", "/api/generate",
     dict(OGEN, prompt="Say hi", stream=False,
          options={"num_predict": -2, "temperature": 0, "stop": ["!", "."]}))
post("api.generate.num_ctx", "/api/generate",
     dict(OGEN, stream=False, options={"num_predict": 2, "temperature": 0, "num_ctx": 8192}))
post("api.generate.keep_alive", "/api/generate", dict(OGEN, stream=False, keep_alive="5m"))
post("api.generate.id_slot", "/api/generate", dict(OGEN, stream=False, id_slot=0))
post("api.generate.load", "/api/generate", {"model": "qwen2.5-coder"})
post("api.generate.latest", "/api/generate", dict(OGEN, model="qwen2.5-coder:latest",
                                                  stream=False))
post("api.generate.err.missing_model", "/api/generate", {"prompt": "hi"})
post("api.generate.err.raw_system", "/api/generate", dict(OGEN, raw=True, system="x"))
post("api.generate.err.template", "/api/generate", dict(OGEN, template="{{ .Prompt }}"))
post("api.generate.err.context", "/api/generate", dict(OGEN, context=[1, 2]))
post("api.generate.err.images", "/api/generate", dict(OGEN, images=["AAAA"]))
post("api.generate.err.format", "/api/generate", dict(OGEN, format="xml"))
post("api.generate.err.think", "/api/generate", dict(OGEN, think="very"))
post("api.generate.err.keep_alive", "/api/generate", dict(OGEN, keep_alive=[1]))
post("api.generate.err.options", "/api/generate", dict(OGEN, options={"temperature": "x"}))
post("api.generate.err.options_type", "/api/generate", dict(OGEN, options=[1]))
post("api.generate.err.prompt_type", "/api/generate", dict(OGEN, prompt=5))
post("api.generate.err.too_long", "/api/generate", dict(OGEN, prompt=LONG))
post("api.generate.err.too_long.raw", "/api/generate", dict(OGEN, prompt=LONG, raw=True,
                                                            stream=False))
raw("api.generate.err.bad_json", "POST", "/api/generate", BAD_JSON,
    {"Content-Type": "application/json"})
post("api.generate.err.body_array", "/api/generate", [OGEN])
OCHAT = {"model": "qwen2.5-coder", "messages": HI, "options": {"num_predict": 6,
                                                                "temperature": 0}}
post("api.chat", "/api/chat", OCHAT)
post("api.chat.nostream", "/api/chat", dict(OCHAT, stream=False))
post("api.chat.tools", "/api/chat",
     dict(OCHAT, messages=ASK_WEATHER, tools=[{"function": WEATHER["function"]}],
          tool_choice="required", options={"num_predict": 24, "temperature": 0}))
post("api.chat.tools.nostream", "/api/chat",
     dict(OCHAT, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", stream=False,
          options={"num_predict": 24, "temperature": 0}))
post("api.chat.tool_result", "/api/chat", dict(OCHAT, stream=False, tools=TOOLS, messages=[
    ASK_WEATHER[0],
    {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_name": "get_weather", "content": "{\"temp_c\": 21}"}]))
post("api.chat.format", "/api/chat", dict(OCHAT, format=SCHEMA, stream=False,
                                          options={"num_predict": 8, "temperature": 0}))
post("api.chat.think", "/api/chat", dict(OCHAT, think=True, stream=False))
post("api.chat.prefill", "/api/chat", dict(OCHAT, stream=False, messages=HI + [
    {"role": "assistant", "content": "Hello"}]))
post("api.chat.load", "/api/chat", {"model": "qwen2.5-coder"})
post("api.chat.load_empty", "/api/chat", {"model": "qwen2.5-coder", "messages": []})
post("api.chat.err.messages_type", "/api/chat", {"model": "m", "messages": "hi"})
post("api.chat.err.images", "/api/chat", dict(OCHAT, messages=[
    {"role": "user", "content": "x", "images": ["AAAA"]}]))
post("api.chat.err.content", "/api/chat", dict(OCHAT, messages=[{"role": "user",
                                                                 "content": ["x"]}]))
post("api.chat.err.tool_calls", "/api/chat", dict(OCHAT, messages=[
    {"role": "assistant", "content": "", "tool_calls": {"x": 1}}]))
post("api.chat.err.role", "/api/chat", dict(OCHAT, messages=[{"role": "boss", "content": "x"}]))
post("api.chat.err.missing_model", "/api/chat", {"messages": HI})
post("api.chat.err.tools", "/api/chat", dict(OCHAT, tools=[{"function": {"name": ""}}]))
post("api.chat.err.too_long", "/api/chat", dict(OCHAT, messages=[{"role": "user",
                                                                  "content": LONG}]))
raw("api.chat.err.bad_json", "POST", "/api/chat", BAD_JSON, {"Content-Type": "application/json"})
get("api.chat.err.get", "/api/chat")
post("api.embed", "/api/embed", {"model": "m", "input": "hello"})
post("api.embed.list", "/api/embed", {"model": "m", "input": ["hello", "world"]})
post("api.embed.dimensions", "/api/embed", {"model": "m", "input": "hello", "dimensions": 8})
post("api.embed.empty", "/api/embed", {"model": "m", "input": []})
post("api.embed.truncate_false", "/api/embed", {"model": "m", "input": "hi", "truncate": False})
post("api.embed.err.input", "/api/embed", {"model": "m", "input": [1, 2]})
post("api.embed.err.too_long", "/api/embed", {"model": "m", "input": LONG, "truncate": False})
post("api.embed.err.model", "/api/embed", {"input": "x"})
post("api.embeddings", "/api/embeddings", {"model": "m", "prompt": "hello"})
post("api.embeddings.empty", "/api/embeddings", {"model": "m", "prompt": ""})
post("api.pull", "/api/pull", {"model": "llama3"})
post("api.push", "/api/push", {"model": "llama3"})
post("api.create", "/api/create", {"model": "x"})
post("api.copy", "/api/copy", {"source": "a", "destination": "b"})
_add("api.delete", "DELETE", "/api/delete", {"model": "x"})
post("api.delete.post", "/api/delete", {"model": "x"})
get("api.unknown", "/api/nope")
post("api.tags.post", "/api/tags", {})

# Anthropic
AMSG = {"model": "claude-3-5-haiku", "max_tokens": 8, "messages": HI, **G}
post("messages", "/v1/messages", AMSG)
post("messages.stream", "/v1/messages", dict(AMSG, stream=True))
post("messages.system", "/v1/messages", dict(AMSG, system="Answer in French."))
post("messages.system_blocks", "/v1/messages",
     dict(AMSG, system=[{"type": "text", "text": "Be brief."}], max_tokens=4))
post("messages.blocks", "/v1/messages", dict(AMSG, messages=[
    {"role": "user", "content": [{"type": "text", "text": "Say"},
                                 {"type": "text", "text": "hello."}]}]))
post("messages.stop_sequences", "/v1/messages", dict(AMSG, stop_sequences=["!"], max_tokens=12))
post("messages.stop_sequences.stream", "/v1/messages",
     dict(AMSG, stop_sequences=["!"], max_tokens=12, stream=True))
post("messages.top_k", "/v1/messages", dict(AMSG, top_k=1, top_p=0.5, temperature=0.7,
                                            max_tokens=4))
post("messages.tools", "/v1/messages", dict(AMSG, messages=ASK_WEATHER, max_tokens=24, tools=[
    {"name": "get_weather", "description": "The weather in a city",
     "input_schema": WEATHER["function"]["parameters"]}]))
post("messages.tools.any", "/v1/messages", dict(AMSG, messages=ASK_WEATHER, max_tokens=24,
                                                tool_choice={"type": "any"}, tools=[
    {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]))
post("messages.tools.any.stream", "/v1/messages", dict(
    AMSG, messages=ASK_WEATHER, max_tokens=24, stream=True, tool_choice={"type": "any"},
    tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]))
post("messages.tools.tool", "/v1/messages", dict(
    AMSG, messages=ASK_WEATHER, max_tokens=24, tool_choice={"type": "tool", "name": "now"},
    tools=[{"name": "now", "input_schema": {"type": "object", "properties": {}}}]))
post("messages.tools.none", "/v1/messages", dict(
    AMSG, messages=ASK_WEATHER, max_tokens=4, tool_choice={"type": "none"},
    tools=[{"name": "now", "input_schema": {"type": "object"}}]))
post("messages.tool_result", "/v1/messages", dict(AMSG, max_tokens=6, messages=[
    ASK_WEATHER[0],
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                       "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                  "content": "{\"temp_c\": 21}"}]}],
    tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]))
post("messages.thinking", "/v1/messages", dict(AMSG, thinking={"type": "disabled"},
                                               max_tokens=3))
post("messages.thinking_blocks", "/v1/messages", dict(AMSG, max_tokens=3, messages=HI + [
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "Greet."},
                                      {"type": "text", "text": "Hello"}]}]))
post("messages.output_format", "/v1/messages", dict(
    AMSG, max_tokens=10, output_config={"format": {"type": "json_schema", "schema": SCHEMA}}))
post("messages.prefill", "/v1/messages", dict(AMSG, max_tokens=4, messages=HI + [
    {"role": "assistant", "content": "Hello"}]))
post("messages.err.max_tokens_missing", "/v1/messages", {"messages": HI})
post("messages.err.max_tokens", "/v1/messages", dict(AMSG, max_tokens=0))
post("messages.err.messages_empty", "/v1/messages", dict(AMSG, messages=[]))
post("messages.err.role", "/v1/messages", dict(AMSG, messages=[{"role": "system",
                                                                "content": "x"}]))
post("messages.err.content_missing", "/v1/messages", dict(AMSG, messages=[{"role": "user"}]))
post("messages.err.image", "/v1/messages", dict(AMSG, messages=[{"role": "user", "content": [
    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}]}]))
post("messages.err.system", "/v1/messages", dict(AMSG, system=5))
post("messages.err.tools", "/v1/messages", dict(AMSG, tools=[{"type": "web_search_20250305",
                                                              "name": "web_search"}]))
post("messages.err.tool_choice", "/v1/messages", dict(AMSG, tool_choice={"type": "always"}))
post("messages.err.tool_choice_name", "/v1/messages", dict(
    AMSG, tool_choice={"type": "tool", "name": "nope"},
    tools=[{"name": "now", "input_schema": {"type": "object"}}]))
post("messages.err.thinking", "/v1/messages", dict(AMSG, thinking={"type": "maybe"}))
post("messages.err.output_config", "/v1/messages", dict(AMSG, output_config={"format": "json"}))
post("messages.err.temperature", "/v1/messages", dict(AMSG, temperature="0"))
post("messages.err.stop_sequences", "/v1/messages", dict(AMSG, stop_sequences=5))
post("messages.err.too_long", "/v1/messages", dict(AMSG, messages=[{"role": "user",
                                                                    "content": LONG}]))
post("messages.err.too_long.stream", "/v1/messages", dict(
    AMSG, stream=True, messages=[{"role": "user", "content": LONG}]))
post("messages.err.body_array", "/v1/messages", [AMSG])
raw("messages.err.bad_json", "POST", "/v1/messages", BAD_JSON,
    {"Content-Type": "application/json"})
get("messages.err.get", "/v1/messages")
post("count_tokens", "/v1/messages/count_tokens", {"model": "m", "messages": HI})
post("count_tokens.system_tools", "/v1/messages/count_tokens", {
    "model": "m", "messages": ASK_WEATHER, "system": "Be brief.",
    "tools": [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]})
post("count_tokens.err", "/v1/messages/count_tokens", {"model": "m", "messages": []})

# HTTP: paths, methods, origins
get("err.404", "/nope")
get("err.404.v1", "/v1/nope")
post("err.404.post", "/v1/messages/nope", {})
_add("err.405.put", "PUT", "/v1/models")
post("err.405.post_health", "/health", {})
_add("err.405.delete", "DELETE", "/v1/chat/completions")
get("err.query_string", "/health?verbose=1")
_add("cors.preflight", "OPTIONS", "/v1/chat/completions",
     headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
              "Access-Control-Request-Headers": "content-type, authorization"})
_add("cors.preflight.refused", "OPTIONS", "/v1/chat/completions",
     headers={"Origin": "http://evil.test", "Access-Control-Request-Method": "POST"})
_add("cors.preflight.404", "OPTIONS", "/nope", headers={"Origin": ORIGIN})
get("cors.allowed", "/v1/models", headers={"Origin": ORIGIN})
post("cors.allowed.stream", "/completion", cmpl(n_predict=2, stream=True),
     headers={"Origin": ORIGIN})
post("cors.refused", "/completion", cmpl(n_predict=2), headers={"Origin": "http://evil.test"})
post("cors.refused.ollama", "/api/chat", OCHAT, headers={"Origin": "http://evil.test"})
post("cors.refused.anthropic", "/v1/messages", AMSG, headers={"Origin": "http://evil.test"})
raw("err.content_length", "POST", "/completion", b'{"prompt": "x"}',
    {"Content-Type": "application/json", "Content-Length": "3"})
raw("err.form_body", "POST", "/v1/chat/completions", b"a=1&b=2",
    {"Content-Type": "application/x-www-form-urlencoded"})
get("slots.after", "/slots")
get("metrics", "/metrics")

# more of the above, streamed (after the rest, so the cases before replay as recorded)
post("completion.grammar.stream", "/completion", cmpl(n_predict=6, grammar='root ::= "yes" | "no"',
                                                       stream=True))
post("completion.json_schema.stream", "/completion",
     cmpl(prompt="JSON:", n_predict=8, json_schema=SCHEMA, stream=True))
post("completion.post_sampling.stream", "/completion",
     cmpl(n_predict=3, n_probs=2, post_sampling_probs=True, stream=True))
post("completion.return_tokens.stream", "/completion",
     cmpl(n_predict=3, return_tokens=True, stream=True, response_fields=["content", "tokens"]))
post("infill.extra.stream", "/infill", dict(INF, stream=True, n_predict=4, input_extra=[
    {"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]))
post("v1c.stop.stream", "/v1/completions",
     {"prompt": CODE, "max_tokens": 12, "stop": ["\n"], "stream": True, **G})
post("v1c.json_schema.stream", "/v1/completions",
     {"prompt": "JSON:", "max_tokens": 8, "response_format": {"type": "json_object"},
      "stream": True, **G})
post("chat.system.stream", "/v1/chat/completions",
     chat(messages=[{"role": "system", "content": "Answer in French."}] + HI, stream=True))
post("chat.tools.auto.stream", "/v1/chat/completions",
     chat(messages=ASK_WEATHER, tools=TOOLS, max_tokens=24, stream=True))
post("chat.tools.named.stream", "/v1/chat/completions",
     chat(messages=ASK_WEATHER, tools=TOOLS, max_tokens=24, stream=True,
          tool_choice={"type": "function", "function": {"name": "get_weather"}}))
post("chat.json_object.stream", "/v1/chat/completions",
     chat(response_format={"type": "json_object"}, max_tokens=10, stream=True))
post("chat.logprobs.stream.usage", "/v1/chat/completions",
     chat(logprobs=True, max_tokens=3, stream=True, stream_options={"include_usage": True}))
post("chat.prefill.stream", "/v1/chat/completions",
     chat(messages=HI + [{"role": "assistant", "content": "Hello"}], max_tokens=4, stream=True))
post("responses.instructions.stream", "/v1/responses",
     dict(RESP, instructions="Answer in French.", stream=True))
post("responses.json_schema.stream", "/v1/responses", dict(
    RESP, max_output_tokens=10, stream=True,
    text={"format": {"type": "json_schema", "name": "n", "schema": SCHEMA}}))
post("responses.tool_output.stream", "/v1/responses", dict(RESP, stream=True, input=[
    {"role": "user", "content": "What is the weather in Paris?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather",
     "arguments": "{\"city\": \"Paris\"}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "{\"temp_c\": 21}"}],
    tools=[dict(WEATHER["function"], type="function")], max_output_tokens=6))
post("api.generate.format_json.stream", "/api/generate",
     dict(OGEN, format="json", options={"num_predict": 8, "temperature": 0}))
post("api.generate.stop.stream", "/api/generate",
     dict(OGEN, options={"num_predict": 12, "temperature": 0, "stop": ["!"]}))
post("api.generate.system.stream", "/api/generate", dict(OGEN, system="Answer in French."))
post("api.chat.format.stream", "/api/chat", dict(OCHAT, format=SCHEMA,
                                                 options={"num_predict": 8, "temperature": 0}))
post("api.chat.tool_result.stream", "/api/chat", dict(OCHAT, tools=TOOLS, messages=[
    ASK_WEATHER[0],
    {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_name": "get_weather", "content": "{\"temp_c\": 21}"}]))
post("api.chat.think.stream", "/api/chat", dict(OCHAT, think=True))
post("messages.system.stream", "/v1/messages", dict(AMSG, system="Answer in French.",
                                                    stream=True))
post("messages.tools.stream", "/v1/messages", dict(
    AMSG, messages=ASK_WEATHER, max_tokens=24, stream=True, tools=[
        {"name": "get_weather", "description": "The weather in a city",
         "input_schema": WEATHER["function"]["parameters"]}]))
post("messages.tools.tool.stream", "/v1/messages", dict(
    AMSG, messages=ASK_WEATHER, max_tokens=24, stream=True,
    tool_choice={"type": "tool", "name": "get_weather"},
    tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]))
post("messages.tool_result.stream", "/v1/messages", dict(AMSG, max_tokens=6, stream=True, messages=[
    ASK_WEATHER[0],
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                       "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                  "content": "{\"temp_c\": 21}"}]}],
    tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]))
post("messages.output_format.stream", "/v1/messages", dict(
    AMSG, max_tokens=10, stream=True,
    output_config={"format": {"type": "json_schema", "schema": SCHEMA}}))
post("messages.prefill.stream", "/v1/messages", dict(
    AMSG, max_tokens=4, stream=True, messages=HI + [{"role": "assistant", "content": "Hello"}]))
get("metrics.end", "/metrics")


# -- router: three models in a folder, loaded on demand --------------------------------

group("router")
SMOL, GEM = SMOLLM.name[:-len(".gguf")], GEMMA.name[:-len(".gguf")]
get("health", "/health")
get("props", "/props")
get("models", "/models")
get("v1.models", "/v1/models")
get("api.tags", "/api/tags")
get("api.ps.none", "/api/ps")
post("err.no_model.completion", "/completion", cmpl())
post("err.no_model.chat", "/v1/chat/completions", chat())
post("err.unknown.completion", "/completion", cmpl(model="llama-9000"))
post("err.unknown.infill", "/infill", dict(INF, model="llama-9000"))
post("err.unknown.tokenize", "/tokenize", {"content": "x", "model": "llama-9000"})
post("err.unknown.v1c", "/v1/completions", {"prompt": "x", "model": "llama-9000"})
post("err.unknown.chat", "/v1/chat/completions", chat(model="llama-9000"))
post("err.unknown.chat.stream", "/v1/chat/completions", chat(model="llama-9000", stream=True))
post("err.unknown.embeddings", "/v1/embeddings", {"input": "x", "model": "llama-9000"})
post("err.unknown.responses", "/v1/responses", dict(RESP, model="llama-9000"))
post("err.unknown.api.generate", "/api/generate", dict(OGEN, model="llama-9000"))
post("err.unknown.api.chat", "/api/chat", dict(OCHAT, model="llama-9000"))
post("err.unknown.api.embed", "/api/embed", {"model": "llama-9000", "input": "x"})
post("err.unknown.api.show", "/api/show", {"model": "llama-9000"})
post("err.unknown.messages", "/v1/messages", dict(AMSG, model="llama-9000"))
post("err.unknown.count_tokens", "/v1/messages/count_tokens", {"model": "llama-9000",
                                                                "messages": HI})
post("err.path_name", "/v1/chat/completions", chat(model="../etc/passwd"))
for model, tag in ((SMOL, "smollm"), (GEM, "gemma")):
    post(tag + ".completion", "/completion", cmpl(model=model))
    post(tag + ".completion.stream", "/completion", cmpl(model=model, n_predict=4, stream=True))
    post(tag + ".completion.probs", "/completion", cmpl(model=model, n_predict=2, n_probs=2))
    post(tag + ".tokenize", "/tokenize", {"content": "Hello world", "model": model,
                                          "with_pieces": True})
    post(tag + ".apply_template", "/apply-template", {"messages": TOOL_TURN, "model": model})
    post(tag + ".infill", "/infill", dict(INF, model=model))
    post(tag + ".v1c", "/v1/completions", {"prompt": CODE, "max_tokens": 6, "model": model, **G})
    post(tag + ".v1c.suffix", "/v1/completions", {"prompt": "a", "suffix": "b", "model": model})
    post(tag + ".chat", "/v1/chat/completions", chat(model=model))
    post(tag + ".chat.stream", "/v1/chat/completions", chat(model=model, stream=True,
                                                          stream_options={"include_usage": True}))
    post(tag + ".chat.logprobs", "/v1/chat/completions",
         chat(model=model, logprobs=True, top_logprobs=2, max_tokens=2))
    post(tag + ".chat.tools", "/v1/chat/completions",
         chat(model=model, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
              max_tokens=24))
    post(tag + ".chat.think", "/v1/chat/completions", chat(model=model, grammar=THINK,
                                                          max_tokens=12))
    post(tag + ".chat.think.stream", "/v1/chat/completions",
         chat(model=model, grammar=THINK, max_tokens=12, stream=True))
    post(tag + ".chat.think.none", "/v1/chat/completions",
         chat(model=model, grammar=THINK, max_tokens=12, reasoning_format="none"))
    post(tag + ".chat.think.legacy", "/v1/chat/completions",
         chat(model=model, grammar=THINK, max_tokens=12, reasoning_format="deepseek-legacy"))
    post(tag + ".chat.think.cut", "/v1/chat/completions",
         chat(model=model, grammar=THINK, max_tokens=3, stream=True))
    post(tag + ".chat.json", "/v1/chat/completions",
         chat(model=model, response_format={"type": "json_object"}, max_tokens=8))
    post(tag + ".embeddings", "/v1/embeddings", {"input": "hello", "model": model})
    post(tag + ".responses", "/v1/responses", dict(RESP, model=model))
    post(tag + ".responses.stream", "/v1/responses", dict(RESP, model=model, stream=True,
                                                         max_output_tokens=4))
    post(tag + ".api.generate", "/api/generate", dict(OGEN, model=model))
    post(tag + ".api.generate.raw", "/api/generate", dict(OGEN, model=model, raw=True,
                                                         prompt=CODE, stream=False))
    post(tag + ".api.generate.suffix", "/api/generate", dict(OGEN, model=model, suffix="x"))
    post(tag + ".api.chat", "/api/chat", dict(OCHAT, model=model))
    post(tag + ".api.chat.nostream", "/api/chat", dict(OCHAT, model=model, stream=False))
    post(tag + ".api.show", "/api/show", {"model": model})
    post(tag + ".api.embed", "/api/embed", {"model": model, "input": ["a", "b"]})
    post(tag + ".messages", "/v1/messages", dict(AMSG, model=model))
    post(tag + ".messages.stream", "/v1/messages", dict(AMSG, model=model, stream=True,
                                                       max_tokens=4))
    post(tag + ".count_tokens", "/v1/messages/count_tokens", {"model": model, "messages": HI})
    post(tag + ".input_tokens", "/v1/chat/completions/input_tokens",
         {"model": model, "messages": HI})
    get(tag + ".props", "/props?model=" + model)
get("api.ps.loaded", "/api/ps")
get("models.loaded", "/models")
get("health.loaded", "/health")
get("slots", "/slots")
post("models.unload", "/models/unload", {"model": GEM})
post("models.unload.err", "/models/unload", {"model": "llama-9000"})
post("models.unload.err.missing", "/models/unload", {})
get("models.unloaded", "/v1/models")
post("models.load", "/models/load", {"model": GEM})
post("models.load.err", "/models/load", {"model": "llama-9000"})
get("api.ps.end", "/api/ps")
get("metrics", "/metrics")


# -- np2: two sessions; choices and prompts decode together ------------------------------
# No token probabilities and no /slots here: which sessions share a decode step
# is a matter of timing, and it moves logprobs in their last digits and which
# session holds what; the same requests on one session are in "qwen".

group("np2")
post("completion.n_cmpl2", "/completion", cmpl(n_predict=4, n_cmpl=2))
post("completion.n_cmpl3.stream", "/completion", cmpl(n_predict=3, n_cmpl=3, stream=True))
post("completion.n2", "/completion", cmpl(n_predict=3, n=2))
post("completion.n_and_n_cmpl", "/completion", cmpl(n_predict=3, n=3, n_cmpl=2))
post("completion.prompts", "/completion", cmpl(prompt=["a = 1", "b = 2", "c = 3"], n_predict=3))
post("completion.prompts.stream", "/completion", cmpl(prompt=["a = 1", "b = 2"], n_predict=3,
                                                        stream=True))
post("completion.prompts.n_cmpl", "/completion", cmpl(prompt=["a = 1", "b = 2"], n_predict=2,
                                                        n_cmpl=2))
post("completion.seed.n_cmpl", "/completion", cmpl(n_predict=4, n_cmpl=2, temperature=1.0,
                                                     seed=5))
post("completion.id_slot1", "/completion", cmpl(n_predict=3, id_slot=1))
post("completion.id_slot.n_cmpl", "/completion", cmpl(n_predict=2, id_slot=0, n_cmpl=2))
post("infill.n_cmpl", "/infill", dict(INF, n_predict=3, n_cmpl=2))
post("v1c.n2", "/v1/completions", {"prompt": CODE, "max_tokens": 4, "n": 2, **G})
post("v1c.n2.stream", "/v1/completions", {"prompt": CODE, "max_tokens": 3, "n": 2, "stream": True,
                                          "stream_options": {"include_usage": True}, **G})
post("v1c.prompts.n2", "/v1/completions", {"prompt": ["x = 1", "y = 2"], "max_tokens": 2,
                                           "n": 2, **G})
post("v1c.n2.seed", "/v1/completions", {"prompt": CODE, "max_tokens": 4, "n": 2,
                                        "temperature": 1.0, "seed": 9})
post("chat.n2", "/v1/chat/completions", chat(n=2, max_tokens=4))
post("chat.n3.stream", "/v1/chat/completions", chat(n=3, max_tokens=3, stream=True,
                                                    stream_options={"include_usage": True}))
post("chat.n_cmpl2", "/v1/chat/completions", chat(n_cmpl=2, max_tokens=3))
post("chat.n_and_n_cmpl", "/v1/chat/completions", chat(n=2, n_cmpl=3, max_tokens=2))
post("chat.n2.seed", "/v1/chat/completions", chat(n=2, max_tokens=4, temperature=1.0, seed=13))
post("chat.n2.tools", "/v1/chat/completions", chat(n=2, messages=ASK_WEATHER, tools=TOOLS,
                                                   tool_choice="required", max_tokens=24))
post("chat.n2.id_slot", "/v1/chat/completions", chat(n=2, max_tokens=2, id_slot=1))
post("chat.id_slot1", "/v1/chat/completions", chat(max_tokens=2, id_slot=1))
post("chat.id_slot_beyond", "/v1/chat/completions", chat(max_tokens=2, id_slot=2))
post("chat.err.n", "/v1/chat/completions", chat(n=17))
get("props", "/props")
# Each evaluates its whole prompt: which session takes which choice is a matter
# of timing, and with the sessions' caches kept, so would be what each reuses.
for _c in _group.cases:
    if _c.method == "POST" and isinstance(_c.body, dict):
        _c.body = dict(_c.body, cache_prompt=False)


# -- ranker: reranking, an API key, /slots and /metrics off ---------------------------

group("ranker")
KEY = {"Authorization": "Bearer " + API_KEY}
DOCS = ["A machine is a physical system.", "Learning is acquiring knowledge.",
        "Machine learning studies algorithms that learn from data.", "Paris est une ville."]
get("health", "/health")
get("props.no_key", "/props")
get("props", "/props", headers=KEY)
post("rerank", "/rerank", {"query": "Machine learning is", "documents": DOCS}, headers=KEY)
post("rerank.top_n", "/rerank", {"query": "Machine learning is", "documents": DOCS, "top_n": 2,
                                 "return_text": True}, headers=KEY)
post("rerank.tei", "/rerank", {"query": "q", "texts": DOCS[:2]}, headers=KEY)
post("rerank.v1", "/v1/rerank", {"query": "q", "documents": DOCS[2:3]}, headers=KEY)
post("reranking", "/reranking", {"query": "q", "documents": DOCS[:1]}, headers=KEY)
post("v1.reranking.x_api_key", "/v1/reranking", {"query": "q", "documents": DOCS[:1]},
     headers={"x-api-key": API_KEY})
post("rerank.err.documents", "/rerank", {"query": "q", "documents": "a"}, headers=KEY)
post("rerank.err.documents_items", "/rerank", {"query": "q", "documents": [1, 2]}, headers=KEY)
post("rerank.err.query", "/rerank", {"documents": DOCS}, headers=KEY)
post("rerank.err.query_type", "/rerank", {"query": 5, "documents": DOCS}, headers=KEY)
post("embeddings.refused", "/v1/embeddings", {"input": "x"}, headers=KEY)
post("api.embed.refused", "/api/embed", {"model": "m", "input": "x"}, headers=KEY)
get("slots.off", "/slots", headers=KEY)
get("metrics.off", "/metrics", headers=KEY)
post("auth.missing", "/rerank", {"query": "q", "documents": DOCS}, headers={})
post("auth.wrong", "/rerank", {"query": "q", "documents": DOCS},
     headers={"Authorization": "Bearer nope"})
post("auth.missing.chat", "/v1/chat/completions", chat())
get("auth.missing.api.tags", "/api/tags")
post("auth.missing.api.chat", "/api/chat", OCHAT)
post("auth.missing.messages", "/v1/messages", AMSG)
post("auth.missing.messages.x_api_key_wrong", "/v1/messages", AMSG,
     headers={"x-api-key": "nope"})
get("auth.version_open", "/api/version")
get("auth.root_open", "/")
post("chat.with_key", "/v1/chat/completions", chat(max_tokens=3), headers=KEY)
post("messages.with_key", "/v1/messages", dict(AMSG, max_tokens=3),
     headers={"x-api-key": API_KEY})


CASES = [c for g in GROUPS.values() for c in g.cases]


# ==========================================================================
# Running a case
# ==========================================================================

# Headers that say nothing about behaviour: when, and which build.
SKIP_HEADERS = {"date", "server"}


def exchange(server, case, timeout=120):
    """Send one case on a new connection; the response as recorded (not normalised)."""
    c = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    try:
        headers = dict(case.headers)
        data = case.raw
        if data is None and case.body is not None:
            data = json.dumps(case.body).encode()
            headers.setdefault("Content-Type", "application/json")
        if "Content-Length" in headers:
            # a lying length: http.client would send its own as well
            c.putrequest(case.method, case.path, skip_accept_encoding=True)
            for k, v in headers.items():
                c.putheader(k, v)
            c.endheaders(data)
        else:
            c.request(case.method, case.path, body=data, headers=headers)
        r = c.getresponse()
        payload = r.read()
    finally:
        c.close()
    out = {"status": r.status,
           "headers": {k.lower(): v for k, v in r.getheaders()
                       if k.lower() not in SKIP_HEADERS}}
    ctype = r.getheader("Content-Type", "")
    text = payload.decode("utf-8", "replace")
    if ctype.startswith("text/event-stream"):
        out["events"] = parse_sse(text)
    elif ctype.startswith("application/x-ndjson"):
        out["lines"] = [_json_or_text(line) for line in text.split("\n") if line]
        if text and not text.endswith("\n"):
            out["unterminated"] = True
    elif "json" in ctype:
        out["body"] = _json_or_text(text)
    elif case.path.split("?")[0] == "/metrics" and r.status == 200:
        out["metrics"] = metrics_shape(text)
    else:
        out["text"] = text
    return out


def _json_or_text(s):
    try:
        return {"json": json.loads(s)}
    except ValueError:
        return {"text": s}


def parse_sse(text):
    """Each message of an event stream: its event name (if any) and its data, in order."""
    events = []
    if text and not text.endswith("\n\n"):
        events.append({"unterminated": True})
    for block in text.split("\n\n"):
        if not block:
            continue
        ev = {}
        for line in block.split("\n"):
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "data":
                ev["data"] = _json_or_text(value) if "data" not in ev else {"text": "?"}
            elif field == "event":
                ev["event"] = value
            else:
                ev.setdefault("other", []).append(line)
        events.append(ev)
    return events


def metrics_shape(text):
    """/metrics without its values: each line, a sample's value as its kind."""
    out = []
    for line in text.splitlines():
        if line.startswith("#") or not line:
            out.append(line)
            continue
        name, _, value = line.rpartition(" ")
        kind = "int" if re.fullmatch(r"-?\d+", value) else "float"
        out.append("%s <%s>" % (name, kind))
    return out


# ==========================================================================
# Normalising
# ==========================================================================

# Keys whose value is a moment: kept as its type.
TIME_KEYS = {"created", "created_at", "modified_at", "expires_at", "completed_at"}
# Keys whose value is a duration or a speed (offgrid's, llama-server's, Ollama's).
_DURATION = re.compile(r"(_ms|_per_second|duration|_seconds)$")
# Keys whose value is an id a server makes up.
ID_KEYS = {"id", "call_id", "tool_call_id", "tool_use_id", "item_id", "response_id"}
# The 24 hex digits of formats.new_id (chatcmpl-, cmpl-, msg_, resp_, rs_/msg_/fc_ items).
_HEX24 = re.compile(r"(?<![0-9a-f])[0-9a-f]{24}(?![0-9a-f])")
# A tool call's random id (chat/template.new_tool_call_id: 32, or 9 for Mistral).
_RANDOM_ID = re.compile(r"[A-Za-z0-9]{9}|[A-Za-z0-9]{32}")
_VERSION = re.compile(r"(offgrid[ /-])" + re.escape(__version__))
_RFC3339 = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)")


def type_mark(v):
    """A placeholder that keeps a value's JSON type."""
    if v is None:
        return None
    if isinstance(v, bool):
        return "<bool>"
    if isinstance(v, int):
        return "<int>"
    if isinstance(v, float):
        return "<float>"
    if isinstance(v, str):
        return "<str>"
    return "<%s>" % type(v).__name__


class Normaliser:
    """One response's normalisation: a made-up id gets the same placeholder each
    time it appears in that response (a stream's chunks share theirs)."""

    def __init__(self, paths):
        self.paths = paths      # [(prefix, placeholder)], longest first
        self.ids = {}

    def _id(self, s):
        return self.ids.setdefault(s, "<id%d>" % (len(self.ids) + 1))

    def text(self, s):
        for prefix, mark in self.paths:
            s = s.replace(prefix, mark)
        s = _HEX24.sub(lambda m: self._id(m.group(0)), s)
        return _VERSION.sub(r"\1<version>", s)

    def value(self, v, key=None):
        if isinstance(v, dict):
            return {k: self.value(x, k) for k, x in v.items()}
        if isinstance(v, list):
            if len(v) > 16 and all(isinstance(x, float) for x in v):
                return _floats(v)
            return [self.value(x, key) for x in v]
        if key in TIME_KEYS or (key and _DURATION.search(key)):
            return type_mark(v)
        if key in ("system_fingerprint", "build_info") and isinstance(v, str):
            return "<build>"
        if key == "offgrid" and isinstance(v, str):
            return "<version>"
        if isinstance(v, str):
            if key in ID_KEYS and _RANDOM_ID.fullmatch(v) and not v.isdigit():
                return self._id(v)
            if key == "embedding" and len(v) > 64:       # base64 floats
                return _base64_floats(v)
            if _RFC3339.fullmatch(v):
                return "<time>"
            return self.text(v)
        return v

    def response(self, r):
        out = {"status": r["status"], "headers": self.headers(r["headers"])}
        for k in ("body", "events", "lines", "metrics", "text", "unterminated"):
            if k in r:
                out[k] = self.value(r[k]) if k != "text" else self.text(r[k])
        if "events" in out:
            out["events"] = by_choice(out["events"])
        return out

    def headers(self, h):
        out = {}
        for k, v in sorted(h.items()):
            if k == "content-length" and v != "0":
                v = "<length>"      # bodies with times and durations vary in length
            elif k == "process-start-time-unix":
                v = "<int>" if v.isdigit() else v
            out[k] = self.text(v)
        return out


def by_choice(events):
    """A stream's events, those of each choice together in choice order.

    The choices of one request (``n``, ``n_cmpl``, several prompts) stream
    at once, and how their events interleave is a matter of timing; the
    order of each choice's own events is not.  Events of no choice (a usage
    chunk, ``[DONE]``) keep their place after them.
    """
    def index(ev):
        obj = (ev.get("data") or {}).get("json")
        if not isinstance(obj, dict):
            return None
        if isinstance(obj.get("index"), int):
            return obj["index"]                 # llama.cpp's native stream
        choices = obj.get("choices")
        if isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict):
            return choices[0].get("index")      # OpenAI's chunks
        return None
    indexes = [index(ev) for ev in events]
    if len(set(i for i in indexes if i is not None)) < 2:
        return events
    order = sorted(range(len(events)),
                   key=lambda k: (indexes[k] is None, indexes[k] or 0, k))
    return [events[k] for k in order]


def _floats(v):
    """A long float vector (an embedding): its length, head and digest."""
    digest = hashlib.sha256(json.dumps(v).encode()).hexdigest()[:16]
    return {"<floats>": len(v), "head": v[:4], "sha256": digest}


def _base64_floats(s):
    try:
        n = len(base64.b64decode(s)) // 4
    except ValueError:
        return s
    return {"<base64 floats>": n, "sha256": hashlib.sha256(s.encode()).hexdigest()[:16]}


def path_marks(models_dir=None):
    """The checkout's and this machine's paths, longest first, with their placeholders."""
    marks = [(str(ROOT), "<ROOT>"), (str(Path.home()), "<HOME>")]
    for m in (QWEN, SMOLLM, GEMMA):
        marks.append((str(m.resolve().parent), "<MODEL_CACHE>"))
    if models_dir is not None:
        marks.append((str(models_dir), "<MODELS_DIR>"))
        marks.append((str(Path(models_dir).resolve()), "<MODELS_DIR>"))
    return sorted(set(marks), key=lambda m: -len(m[0]))


# ==========================================================================
# Comparing
# ==========================================================================

def diff(want, got, path="", out=None, limit=20):
    """Where two normalised responses differ: ["path: want != got", ...]."""
    out = [] if out is None else out
    if len(out) >= limit:
        return out
    if type(want) is not type(got):
        out.append("%s: %s != %s (type %s != %s)" % (path or "<root>", _short(want), _short(got),
                                                     type(want).__name__, type(got).__name__))
    elif isinstance(want, dict):
        for k in want:
            if k not in got:
                out.append("%s.%s: missing (was %s)" % (path, k, _short(want[k])))
            else:
                diff(want[k], got[k], "%s.%s" % (path, k), out, limit)
        for k in got:
            if k not in want:
                out.append("%s.%s: new field %s" % (path, k, _short(got[k])))
    elif isinstance(want, list):
        for i, (a, b) in enumerate(zip(want, got)):
            diff(a, b, "%s[%d]" % (path, i), out, limit)
        if len(want) != len(got):
            extra = want[len(got):] if len(want) > len(got) else got[len(want):]
            out.append("%s: length %d != %d (%s: %s)" % (
                path or "<root>", len(want), len(got),
                "missing" if len(want) > len(got) else "extra", _short(extra)))
    elif want != got:
        out.append("%s: %s != %s" % (path or "<root>", _short(want), _short(got)))
    return out[:limit]


def _short(v, n=160):
    s = json.dumps(v, ensure_ascii=False)
    return s if len(s) <= n else s[:n] + "..."


# ==========================================================================
# Running groups
# ==========================================================================

def run_groups(names=None, log=None):
    """Start the groups' servers, run their cases in order; {case id: normalised response}.

    The servers start at once (loading is most of their start); the groups
    then run one after another, so no two decode at the same time.
    """
    groups = [GROUPS[n] for n in (names or GROUPS)]
    models_dir = models_folder()
    marks = path_marks(models_dir)
    servers = {g.name: _Server(g, models_dir) for g in groups}
    errors = []

    def start(s):
        try:
            s.start()
        except Exception as exc:       # reported below, with the server's output
            errors.append(exc)
    threads = [threading.Thread(target=start, args=(s,)) for s in servers.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results = {}
    try:
        if errors:
            raise errors[0]
        for g in groups:
            t0 = time.monotonic()
            for case in g.cases:
                r = exchange(servers[g.name], case)
                results[case.id] = Normaliser(marks).response(r)
            if log:
                log("%s: %d cases in %.1f s" % (g.name, len(g.cases), time.monotonic() - t0))
    finally:
        for s in servers.values():
            if s.proc is not None and s.proc.poll() is None:
                s.stop()
        for m in models_dir.iterdir():
            m.unlink()
        models_dir.rmdir()
    return results


def golden_path(group_name):
    return GOLDEN / ("%s.json" % group_name)


def load_golden(group_name):
    with open(golden_path(group_name), encoding="utf-8") as f:
        return json.load(f)


def write_golden(group, first, second):
    """The group's golden file from two recordings; a case whose two differ is
    "unstable" in np2 and an error anywhere else."""
    cases, unstable, errors = [], [], []
    for case in group.cases:
        a, b = first[case.id], second[case.id]
        entry = {"name": case.name, "request": case.request()}
        if a != b:
            if group.name != "np2":
                errors.append("%s:\n  %s" % (case.id, "\n  ".join(diff(a, b))))
                continue
            entry["unstable"] = True
            unstable.append("%s (%s)" % (case.id, "; ".join(diff(a, b, limit=2))))
        else:
            entry["response"] = a
        cases.append(entry)
    if errors:
        raise SystemExit("two recordings differ (not written):\n" + "\n".join(errors))
    GOLDEN.mkdir(parents=True, exist_ok=True)
    doc = {"about": "tests/replay.py's recorded responses; re-record with "
                    "`python3 tests/replay.py --record`",
           "server": [str(a).replace(str(ROOT) + "/", "") for a in group.args]
                     + ["-c", str(group.ctx)] + list(COMMON),
           "cases": cases}
    with open(golden_path(group.name), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1, ensure_ascii=False, sort_keys=False)
        f.write("\n")
    return unstable


def check_against_golden(results, names=None):
    """{case id: [diff lines]} for every case whose response is not the recorded one."""
    failures = {}
    for name in names or GROUPS:
        golden = {c["name"]: c for c in load_golden(name)["cases"]}
        for case in GROUPS[name].cases:
            problem = compare_case(case, golden.get(case.name), results.get(case.id))
            if problem:
                failures[case.id] = problem
    return failures


def compare_case(case, recorded, got):
    """Diff lines for one case ([] when it replays identically)."""
    if recorded is None:
        return ["not recorded: re-record (python3 tests/replay.py --record)"]
    if recorded["request"] != json.loads(json.dumps(case.request())):
        return ["the case's request changed since it was recorded: re-record"]
    if recorded.get("unstable"):
        return []
    return diff(recorded["response"], got)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--record", action="store_true", help="record the golden files (twice)")
    p.add_argument("--check", action="store_true", help="replay and print the differences")
    p.add_argument("--only", action="append", help="a group (repeatable)")
    args = p.parse_args(argv)
    names = args.only or list(GROUPS)

    def log(msg):
        print(msg, flush=True)
    if args.record:
        t0 = time.monotonic()
        first = run_groups(names, log)
        second = run_groups(names, log)
        for name in names:
            unstable = write_golden(GROUPS[name], first, second)
            log("%s: %d cases written to %s%s" % (
                name, len(GROUPS[name].cases), golden_path(name).relative_to(ROOT),
                "; unstable:\n  %s" % "\n  ".join(unstable) if unstable else ""))
        log("recorded in %.0f s" % (time.monotonic() - t0))
    elif args.check:
        t0 = time.monotonic()
        failures = check_against_golden(run_groups(names, log), names)
        for cid, lines in failures.items():
            print("%s:\n  %s" % (cid, "\n  ".join(lines)))
        log("%d of %d cases differ (%.0f s)" % (len(failures),
                                                sum(len(GROUPS[n].cases) for n in names),
                                                time.monotonic() - t0))
        return 1 if failures else 0
    else:
        p.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
