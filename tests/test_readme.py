"""The README's examples work as written against `make run`.

Every curl command in the README's ``sh`` blocks that talks to
127.0.0.1:8080 is run, as written but for the port, with bash and curl
against a real server on the default model (Qwen2.5-Coder-0.5B-Instruct, one
``-m`` and no ``--fim-model``, as `make run` starts it).  Each command has a
check below, keyed by a fragment of its text, that its answer is the one the
README promises: an example added to the README without a check fails here,
and so does a check whose example is gone.

The examples keep their generation short and greedy (temperature 0): this
model runs at about 50 tokens/s on 2 cores, so the whole file takes seconds
on an idle machine.  The server gets one thread: with two threads on two busy
cores ggml's spinning workers wait for each other and run several times slower.
"""

import json
import re
import shlex
import shutil
import subprocess

import pytest

try:
    from .serverproc import ROOT, ServerProcess, parse_sse
except ImportError:  # tests/ is on sys.path rather than a package
    from serverproc import ROOT, ServerProcess, parse_sse

README = ROOT / "README.md"
ADDRESS = "127.0.0.1:8080"


def shell_commands(text):
    """The commands of the ``sh`` blocks in text, continuation lines joined.

    A command goes on while its line ends in a backslash or a quote is still
    open (the JSON bodies span lines inside single quotes); comment lines
    between commands are dropped.
    """
    commands = []
    for block in re.findall(r"^```sh\n(.*?)^```", text, re.M | re.S):
        pending = ""
        for line in block.splitlines():
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            pending += line + "\n"
            if line.endswith("\\"):
                continue
            try:
                shlex.split(pending)
            except ValueError:   # an open quote: the command goes on
                continue
            commands.append(pending.strip())
            pending = ""
        assert not pending, "unterminated command in a README sh block:\n" + pending
    return commands


COMMANDS = [c for c in shell_commands(README.read_text()) if c.startswith("curl") and ADDRESS in c]


# --------------------------------------------------------------------------
# What each example answers.  A check takes curl's stdout.
# --------------------------------------------------------------------------

def _json(out):
    return json.loads(out)


def health(out):
    assert _json(out)["status"] == "ok"


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
    assert re.search(r"\b(hi|hello|hey)\b", choice["message"]["content"], re.I), choice


def openai_tool_call(out):
    choice = _json(out)["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def anthropic_chat(out):
    body = _json(out)
    assert body["type"] == "message" and body["stop_reason"] == "end_turn", body
    assert re.search(r"\b(hi|hello|hey)\b", body["content"][0]["text"], re.I), body


def responses_chat(out):
    body = _json(out)
    assert body["status"] == "completed", body
    text = "".join(part["text"] for item in body["output"] if item["type"] == "message"
                   for part in item["content"])
    assert re.search(r"\b(hi|hello|hey)\b", text, re.I), body


def embeddings(out):
    body = _json(out)
    a, b = (d["embedding"] for d in body["data"])
    assert len(a) == len(b) == 896 and abs(sum(x * x for x in a) - 1) < 1e-4, body["usage"]
    assert sum(x * y for x, y in zip(a, b)) > 0.5       # two paraphrases


def tokenize(out):
    tokens = _json(out)["tokens"]
    assert tokens and all(isinstance(t["id"], int) for t in tokens)
    assert "".join(t["piece"] for t in tokens) == "hello world"


# fragments of the command (all of a tuple's) -> check; each command matches exactly one
CHECKS = {
    "/health": health,
    "The capital of France is": completion_paris,
    '"stream": true': completion_stream,
    '"json_schema"': completion_json_schema,
    "/infill": infill_add,
    "/v1/completions": openai_completion,
    ("/v1/chat/completions", '"Say hi"'): openai_chat,
    "/v1/messages": anthropic_chat,
    "/v1/responses": responses_chat,
    '"tools"': openai_tool_call,
    "/tokenize": tokenize,
    "/v1/embeddings": embeddings,
}


def check_for(command):
    found = [check for fragments, check in CHECKS.items()
             if all(f in command for f in ((fragments,) if isinstance(fragments, str)
                                           else fragments))]
    assert len(found) == 1, "README example needs exactly one check in CHECKS, has %d:\n%s" \
        % (len(found), command)
    return found[0]


def example_id(command):
    path = re.search(re.escape(ADDRESS) + r"(/\S*)", command).group(1)
    return "%s-%s" % (path, check_for(command).__name__)


# --------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------

def test_every_check_has_its_example():
    used = {check_for(command) for command in COMMANDS}
    assert used == set(CHECKS.values()), \
        "checks with no README example: %s" % sorted(c.__name__ for c in set(CHECKS.values()) - used)


@pytest.fixture(scope="module")
def server(lib, qwen_path):
    assert shutil.which("curl"), "the README's examples use curl; install it"
    with ServerProcess(qwen_path, threads=1) as srv:
        yield srv


@pytest.mark.parametrize("command", COMMANDS, ids=example_id)
def test_readme_example_answers_as_promised(server, command):
    check = check_for(command)
    command = command.replace(ADDRESS, "127.0.0.1:%d" % server.port)
    # --fail-with-body: an HTTP error status is curl's exit 22, with the error body
    # kept for the message (the examples are single curl commands, so it goes last)
    run = subprocess.run(["bash", "-c", command + " --fail-with-body"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, "%s\nexit %d: %s%s" % (command, run.returncode, run.stdout,
                                                      run.stderr)
    check(run.stdout)
