"""bench/ is not run by `make test` (it needs an idle machine), so this checks
that its modules still import and its command line parses: a broken merge
once left `make bench` failing at import for a whole session."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_help_runs():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--rounds" in out.stdout and "--only" in out.stdout


def test_rpc_bench_help_runs():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "rpc.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--servers" in out.stdout and "--rounds" in out.stdout
