"""The front (offgrid.server and the command line) never loads libllama.

A crash inside libllama must cost one model's worker, never the server: so
no module of the front may import ctypes, offgrid.libllama, the engine that
drives it or the chat layer that runs beside it in the worker.  Checked in
a fresh interpreter, where nothing else has imported them first.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import importlib, pkgutil, sys
import offgrid.server as s
for m in pkgutil.walk_packages(s.__path__, "offgrid.server."):
    importlib.import_module(m.name)
import offgrid.__main__, offgrid.protocol, offgrid.request
print(" ".join(sorted(sys.modules)))
"""

# pure Python the front shares with the worker: the warm-cache measure
ALLOWED = {"offgrid.engine", "offgrid.engine.cachereuse"}


def loaded_modules():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=str(ROOT), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_importing_the_front_loads_neither_ctypes_nor_libllama():
    mods = loaded_modules()
    assert "ctypes" not in mods and "_ctypes" not in mods
    assert "offgrid.libllama" not in mods


def test_the_front_reaches_engine_and_chat_only_through_a_worker():
    mods = loaded_modules()
    below = {m for m in mods if m.startswith(("offgrid.engine", "offgrid.chat"))}
    assert below <= ALLOWED, sorted(below - ALLOWED)


def test_the_probe_would_see_a_front_module_that_loads_libllama():
    # the check itself can fail: the same probe, after importing the engine
    out = subprocess.run([sys.executable, "-c", "import offgrid.engine.session\n" + PROBE],
                         cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert "offgrid.libllama" in out.stdout.split() and "ctypes" in out.stdout.split()
