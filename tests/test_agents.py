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

What a 0.5B model does is partly chance (the clients send no seed), and
the tests assert what the server makes sure of -- the request is taken as
the client sends it, a reply that opens as a call to a given tool becomes
that client's tool call, its result goes back and is answered -- not how
often the model writes the call:

  * Codex's server decodes greedily (``--temp 0``) and each test works in a
    folder of its own fixed name (the working directory is part of the
    prompt): the same prompt gives the same reply, and to this prompt the
    greedy reply is the call (also with the prompt's date, which is part of
    it, moved over a year).  Sampling, the model writes it about a quarter
    of the time.
  * Claude Code's server samples, as its users' would: greedy decoding
    writes a markdown "memory" instead of the Read call whatever the date,
    and sampling writes the call about half the time.  So a run in which the
    model does not write it is run again, up to READ_TRIES times: that test's
    claim is the round trip of the call once the model writes it.

After a tool's result the model calls the tool again instead of answering
(the prompt is the one llama-server renders for the same messages; its
model does the same), so no test waits for an answer after the result.
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


def _server(*flags):
    assert QWEN.is_file(), "Qwen2.5-Coder is missing at %s (make model)" % QWEN
    return ServerProcess(QWEN, *flags, ctx=32768, startup_timeout=300)


@pytest.fixture(scope="module")
def claude_srv():
    """Claude Code's: sampling at the server's default temperature (see the docstring)."""
    with _server() as s:
        yield s


@pytest.fixture(scope="module")
def srv():
    """Codex's: greedy (see the module's docstring)."""
    with _server("--temp", "0") as s:
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


def watched(argv, env, cwd, stop=None):
    """Run a client that prints JSON events a line each: (exit code, or None if
    stopped, its events, its stderr).  ``stop(event)`` true ends the run there
    (SIGTERM)."""
    with tempfile.TemporaryFile("w+") as errf:
        p = subprocess.Popen(argv, env=env, cwd=str(cwd), stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=errf, text=True)
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
            rc = p.wait(60)
        finally:
            timer.cancel()
            if p.poll() is None:
                p.kill()
                p.wait()
            p.stdout.close()
        errf.seek(0)
        err = errf.read()
    return (None if stopped else rc), events, err


# -- Claude Code -------------------------------------------------------------------------

def claude(clients, srv, place, *args, stop=None):
    """Run ``claude --model qwen ARGS`` in place/work: (exit code, stdout, stderr),
    or with ``stop`` (and --output-format stream-json among ARGS) watched()'s answer."""
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
    argv = [str(clients / "claude"), "--model", "qwen"] + list(args)
    if stop is not None:
        return watched(argv, env, work, stop)
    return run(argv, env, work)


def test_claude_print_with_its_default_tools_answers(clients, claude_srv, place):
    rc, out, err = claude(clients, claude_srv, place, "-p", "Say hello.")
    assert rc == 0, err + out
    assert out.strip(), "claude -p printed no answer:\n" + err


READ_TRIES = 12    # runs: each ends where the model is seen not to write the Read call


def _opens_as_text(event, seen):
    """Whether this event is a reply's first text, before any tool_use block in the run."""
    if event.get("type") != "stream_event":
        return False
    e = event.get("event") or {}
    seen.add((e.get("content_block") or {}).get("type"))
    return e.get("type") == "content_block_delta" and \
        (e.get("delta") or {}).get("type") == "text_delta" and "tool_use" not in seen


def _reads_it_all(call, path):
    """Whether a Read call reads the whole of ``path`` (the model also writes
    calls to other paths, or from line 100)."""
    args = call["input"]
    return call["name"] == "Read" and args.get("file_path") == str(path) and \
        args.get("offset", 0) in (0, 1) and args.get("limit", 1) >= 1


def test_claude_reads_a_file_with_the_read_tool(clients, claude_srv, place):
    """A Read call the model writes round-trips: it reaches Claude Code as a
    tool_use, Claude Code reads the file, and the next request -- the file's
    text as the call's result -- is answered (by a second Read: see the
    module's docstring; --max-turns 2 ends the session there).

    Whether the 0.5B model writes that call is its own chance: sampling,
    about half its replies to this prompt open with a markdown "memory"
    instead, and some of its calls read another path or from line 100.  So a
    run that shows the model did not write it -- a reply opening as text (the
    run is stopped there), a call that does not read the whole file -- is run
    again, up to READ_TRIES times (all of them missing: well under one in a
    hundred).  What is asserted is what the server makes sure of.
    """
    secret = place / "work" / "secret.txt"
    secret.parent.mkdir(parents=True)
    secret.write_text("The secret word is PLUMTREE.\n")
    missed = []
    for _ in range(READ_TRIES):
        seen = set()
        rc, events, err = claude(
            clients, claude_srv, place, "-p",
            "Use the Read tool to read %s and tell me the secret word" % secret,
            "--tools", "Read", "--max-turns", "2", "--output-format", "stream-json",
            "--verbose", "--include-partial-messages",
            stop=lambda e: _opens_as_text(e, seen))
        turns = [e["message"] for e in events if e.get("type") == "assistant"]
        uses = [b for m in turns for b in m["content"] if b.get("type") == "tool_use"]
        log = "rc %s:\n%s\n%s" % (rc, json.dumps([e for e in events
                                                  if e.get("type") != "stream_event"])[-4000:],
                                   err[-2000:])
        # what is not the model's chance fails at once: the client's error, the server's
        assert rc in (None, 0, 1) and "API Error" not in json.dumps(turns), log
        if not uses or not _reads_it_all(uses[0], secret):
            text = "".join(e["event"]["delta"].get("text", "") for e in events
                           if e.get("type") == "stream_event"
                           and e["event"].get("type") == "content_block_delta")
            missed.append(json.dumps(uses[0]) if uses else "text: %r" % text[:100])
            print("run %d, not the call: %s (rc %s)" % (len(missed), missed[-1], rc))
            continue
        print("run %d: the Read call" % (len(missed) + 1))
        results = [b for e in events if e.get("type") == "user"
                   for b in e["message"]["content"]
                   if isinstance(b, dict) and b.get("type") == "tool_result"]
        final = [e for e in events if e.get("type") == "result"]
        assert results and results[0]["tool_use_id"] == uses[0]["id"], log
        assert "PLUMTREE" in json.dumps(results[0]["content"]), log
        # the request that carried the result was answered
        assert len(turns) >= 2, log
        assert final and final[-1].get("subtype") in ("success", "error_max_turns"), log
        return
    pytest.fail("in %d runs the model never wrote the Read call; it wrote:\n%s"
                % (READ_TRIES, "\n".join(missed)))


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
    return watched(argv, env, work, stop)


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
    """exec_command called, run by Codex, and its output sent back and answered
    (the run ends at the next thing Codex reports: an answer or another call).
    (Qwen 0.5B writes the command where the tool's name belongs: read by its
    arguments, see chat/rescue.py.)"""
    work = place / "work"
    work.mkdir()
    (work / "calc.py").write_text("def add(a, b):\n    return a + b  # CALC_MARKER\n")
    home = codex_home(place, provider=srv.base)
    ran = []

    def after_the_command(event):
        if ran:
            return event.get("type") in ("item.started", "item.completed", "turn.completed",
                                         "turn.failed", "error")
        if _ran_calc(event) is not None:
            ran.append(_ran_calc(event))
        return False

    rc, events, err = codex(clients, home, work,
                            ["--dangerously-bypass-approvals-and-sandbox",
                             "Run the shell command: cat calc.py"],
                            stop=after_the_command)
    log = "rc %s:\n%s\n%s" % (rc, json.dumps([e.get("item", e) for e in events])[-3000:],
                               err[-2000:])
    assert ran, "no exec_command with cat calc.py " + log
    assert "CALC_MARKER" in ran[0].get("aggregated_output", ""), ran[0]
    # the request that carried the output was answered, not refused
    after = events[events.index(next(e for e in events if _ran_calc(e))) + 1:]
    assert after and not [e for e in after if e.get("type") in ("turn.failed", "error")], log
