"""-fa / --flash-attn: the sessions' contexts with flash attention on, off or
libllama's choice (auto), as llama-server's flag."""

import subprocess
import sys

import pytest

try:
    from .serverproc import ROOT, ServerProcess
except ImportError:
    from serverproc import ROOT, ServerProcess


@pytest.mark.parametrize("fa", ["off", "on"])
def test_a_server_generates_with_flash_attention_on_and_off(qwen_path, fa):
    with ServerProcess(qwen_path, "-fa", fa) as server:
        status, _, out = server.post("/completion", {"prompt": "def add(a, b):",
                                                     "n_predict": 8, "temperature": 0})
        assert status == 200, out
        assert out["tokens_predicted"] == 8 or out["stop_type"] == "eos"
        assert out["content"]


def test_an_unknown_flash_attention_mode_is_refused_at_the_command_line():
    r = subprocess.run([sys.executable, "-m", "offgrid", "-fa", "maybe", "-m", "x.gguf"],
                       cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--flash-attn" in r.stderr and "maybe" in r.stderr
