"""-fa / --flash-attn: the sessions' contexts with flash attention on, off or
libllama's choice (auto), as llama-server's flag."""

import subprocess
import sys

import pytest

try:
    from .serverproc import ROOT, ServerProcess
except ImportError:
    from serverproc import ROOT, ServerProcess


@pytest.mark.parametrize("fa,given,said", [
    ("off", "disabled", "flash attention off (-fa off)"),
    ("on", "enabled", "flash attention on (-fa on)"),
    # on the CPU auto is on (measured as fast or faster: docs/performance.md)
    ("auto", "enabled", "flash attention on (-fa auto: every layer on the CPU")])
def test_a_server_generates_with_flash_attention_on_and_off(qwen_path, fa, given, said):
    with ServerProcess(qwen_path, "-fa", fa, "-v") as server:
        status, _, out = server.post("/completion", {"prompt": "def add(a, b):",
                                                     "n_predict": 8, "temperature": 0})
        assert status == 200, out
        assert out["tokens_predicted"] == 8 or out["stop_type"] == "eos"
        assert out["content"]
        log = "".join(server.output)
    # what libllama was given (its own log line, -v), and the load line's words
    assert "flash_attn            = %s" % given in log, log
    assert said in log, log


def test_an_unknown_flash_attention_mode_is_refused_at_the_command_line():
    r = subprocess.run([sys.executable, "-m", "offgrid", "-fa", "maybe", "-m", "x.gguf"],
                       cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--flash-attn" in r.stderr and "maybe" in r.stderr
