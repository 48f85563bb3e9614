"""Coding agents out of the box: Claude Code and Codex, the real clients, on the default model.

Each test runs the client's own binary (npm packages, installed into the cache
by scripts/agent_clients.sh, `make agent-clients`) against a real offgrid on
Qwen2.5-Coder-0.5B with a 32k context, as its docs point it at a local server:
Claude Code through ANTHROPIC_BASE_URL (/v1/messages), Codex through a
model provider in its config.toml (/v1/responses) and through its Ollama
mode (``--oss --local-provider ollama``: /api/version, /api/tags, /api/pull,
then /v1/responses).  Every client runs with HOME in a temporary folder,
pointed at loopback only, its telemetry, update checks and other traffic
off.

Their prompts are long (Claude Code's ~11k tokens with its default tools,
Codex's ~8.5k): evaluating one takes 30 s to 10 minutes on the 2-core test
machine depending on its load, hence ``slow`` and few tests.  One server
serves them all, so what the prompts share stays in its cache.

What a 0.5B model does is partly chance: the clients send no seed and
sample at the server's default temperature, and the model gets a call right
in some samples and not in others (Codex's exec_command: about half).  So
the server here decodes greedily (``--temp 0``) and each test works in a
folder of its own fixed name (the working directory is part of the prompt):
the same prompt gives the same reply.  The tests assert what the server
makes sure of -- the request is taken as the client sends it, a reply that
opens as a call to a given tool becomes that client's tool call, the result
goes back -- on what the model does with that prompt.
"""

import json
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import pytest

try:
    from .serverproc import ROOT, ServerProcess
except ImportError:
    from serverproc import ROOT, ServerProcess

QWEN = ROOT / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
ALIAS = QWEN.stem                   # the name Ollama-minded clients use (no .gguf)
RUN_TIMEOUT = 1800                  # seconds one client run may take on a loaded machine

pytestmark = [pytest.mark.slow, pytest.mark.agents]


@pytest.fixture(scope="module")
def clients():
    """The folder of the claude and codex executables (installed once, cached)."""
    out = subprocess.run(["bash", str(ROOT / "scripts" / "agent_clients.sh")],
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, "scripts/agent_clients.sh failed:\n" + out.stderr
    return Path(out.stdout.strip()) / "bin"


@pytest.fixture(scope="module")
def srv():
    assert QWEN.is_file(), "Qwen2.5-Coder is missing at %s (make model)" % QWEN
    with ServerProcess(QWEN, "--temp", "0", ctx=32768, startup_timeout=300) as s:
        yield s


@pytest.fixture
def place(request):
    """A folder of the test's own fixed name, emptied: the clients put their
    working directory in the prompt, and greedy decoding gives the same reply
    to the same prompt."""
    path = Path(tempfile.gettempdir()) / "offgrid-agent-tests" / request.node.name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _base_env(home):
    """A clean environment: none of the user's keys, proxies or settings."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
            "LANG": "C.UTF-8", "NO_PROXY": "127.0.0.1,localhost", "TERM": "dumb"}


def run(argv, env, cwd, timeout=RUN_TIMEOUT):
    p = subprocess.run(argv, env=env, cwd=str(cwd), capture_output=True, text=True,
                       timeout=timeout, stdin=subprocess.DEVNULL)
    return p.returncode, p.stdout, p.stderr


# -- Claude Code -------------------------------------------------------------------------

def claude(clients, srv, place, *args):
    env = dict(_base_env(place / "home"),
               ANTHROPIC_BASE_URL=srv.base, ANTHROPIC_API_KEY="offgrid-test",
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1",
               DISABLE_TELEMETRY="1", DISABLE_ERROR_REPORTING="1", DISABLE_BUG_COMMAND="1",
               # the client's own request timeout (10 minutes) is less than a long
               # prompt takes on a loaded 2-core machine
               API_TIMEOUT_MS=str(RUN_TIMEOUT * 1000))
    (place / "home").mkdir(exist_ok=True)
    work = place / "work"
    work.mkdir(exist_ok=True)
    return run([str(clients / "claude"), "--model", "qwen"] + list(args), env, work)


def test_claude_print_with_its_default_tools_answers(clients, srv, place):
    rc, out, err = claude(clients, srv, place, "-p", "Say hello.")
    assert rc == 0, err + out
    assert out.strip(), "claude -p printed no answer:\n" + err


def test_claude_reads_a_file_with_the_read_tool(clients, srv, place):
    """The Read call, the file's text going back to the model as its result."""
    secret = place / "work" / "secret.txt"
    secret.parent.mkdir(parents=True)
    secret.write_text("The secret word is PLUMTREE.\n")
    rc, out, err = claude(clients, srv, place, "-p",
                          "Use the Read tool to read %s and tell me the secret word" % secret,
                          "--tools", "Read", "--max-turns", "2", "--output-format",
                          "stream-json", "--verbose")
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    uses = [b for e in events if e.get("type") == "assistant"
            for b in e["message"]["content"] if b.get("type") == "tool_use"]
    results = [b for e in events if e.get("type") == "user"
               for b in e["message"]["content"]
               if isinstance(b, dict) and b.get("type") == "tool_result"]
    assert uses, "no tool_use in the session (rc %d):\n%s\n%s" % (rc, out[-3000:], err[-2000:])
    assert uses[0]["name"] == "Read" and uses[0]["input"]["file_path"] == str(secret)
    assert results and "PLUMTREE" in json.dumps(results[0]["content"])


# -- Codex -------------------------------------------------------------------------------

def codex_home(place, provider=None):
    """HOME and CODEX_HOME in place, with offgrid as the model provider (or none:
    --oss picks the built-in Ollama one)."""
    home = place / "home"
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    lines = ["check_for_update_on_startup = false", "model_context_window = 32768", ""]
    if provider:
        lines = ['model = "qwen"', 'model_provider = "offgrid"'] + lines + [
            "[model_providers.offgrid]", 'name = "offgrid"', 'base_url = "%s/v1"' % provider,
            'wire_api = "responses"', ""]
    lines += ["[analytics]", "enabled = false", ""]
    (home / ".codex" / "config.toml").write_text("\n".join(lines))
    return home


def codex(clients, home, work, args, extra_env=None, stop=None):
    """Run ``codex exec --json``: (exit code or None if stopped, events, stderr).

    ``stop(event)`` true ends the run there (SIGTERM): a small model may go on
    calling tools after the one a test is about, and codex exec has no turn limit.
    """
    env = dict(_base_env(home), CODEX_HOME=str(home / ".codex"), **(extra_env or {}))
    argv = [str(clients / "codex"), "exec", "--skip-git-repo-check", "--json"] + list(args)
    p = subprocess.Popen(argv, env=env, cwd=str(work), stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    timer = threading.Timer(RUN_TIMEOUT, p.kill)
    timer.start()
    events, stopped = [], False
    try:
        for line in p.stdout:
            if line.startswith("{"):
                events.append(json.loads(line))
                if stop is not None and stop(events[-1]):
                    stopped = True
                    p.terminate()
                    break
        err = p.stderr.read() if not stopped else ""
        rc = p.wait(60)
    finally:
        timer.cancel()
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
        p.stderr.close()
    assert stopped or len(events) == 0 or rc is not None
    return (None if stopped else rc), events, err


def _items(events, kind):
    return [e["item"] for e in events
            if e.get("type") == "item.completed" and e["item"].get("type") == kind]


def _ran_calc(event):
    """The command_execution item of ``cat calc.py``, if this event completes one."""
    item = event.get("item") or {}
    if event.get("type") == "item.completed" and item.get("type") == "command_execution" \
            and "calc.py" in str(item.get("command", "")):
        return item
    return None


def test_codex_exec_with_its_default_tools_answers(clients, srv, place):
    home = codex_home(place, provider=srv.base)
    rc, events, err = codex(clients, home, place, ["Say hello."],
                            stop=lambda e: _items([e], "agent_message"))
    assert _items(events, "agent_message"), "no answer (rc %s):\n%s\n%s" % (
        rc, json.dumps(events)[:3000], err[-3000:])
    assert not [e for e in events if e.get("type") in ("turn.failed", "error")], events


def test_codex_oss_ollama_mode_pulls_and_answers_with_offgrids_model_name(clients, srv,
                                                                          place):
    """--oss --local-provider ollama: version check (0.13.4 or newer), the model list,
    a pull of the model (offgrid serves it: success at once), then /v1/responses."""
    home = codex_home(place)
    rc, events, err = codex(clients, home, place,
                            ["--oss", "--local-provider", "ollama", "-m", ALIAS, "Say hello."],
                            {"CODEX_OSS_BASE_URL": srv.base + "/v1"},
                            stop=lambda e: _items([e], "agent_message"))
    assert _items(events, "agent_message"), "no answer (rc %s):\n%s\n%s" % (
        rc, json.dumps(events)[:3000], err[-3000:])
    assert not [e for e in events if e.get("type") in ("turn.failed", "error")], events


def test_codex_runs_a_shell_command_through_a_tool_call(clients, srv, place):
    """exec_command called, and run by Codex.  (Qwen 0.5B writes the command
    where the tool's name belongs: read by its arguments, see chat/rescue.py.)"""
    work = place / "work"
    work.mkdir()
    (work / "calc.py").write_text("def add(a, b):\n    return a + b  # CALC_MARKER\n")
    home = codex_home(place, provider=srv.base)
    rc, events, err = codex(clients, home, work,
                            ["--dangerously-bypass-approvals-and-sandbox",
                             "Run the shell command: cat calc.py"],
                            stop=lambda e: _ran_calc(e) is not None)
    ran = [i for i in (_ran_calc(e) for e in events) if i is not None]
    assert ran, "no exec_command with cat calc.py (rc %s):\n%s\n%s" % (
        rc, json.dumps([e.get("item", e) for e in events])[:3000], err[-2000:])
    assert "CALC_MARKER" in ran[0].get("aggregated_output", ""), ran[0]
