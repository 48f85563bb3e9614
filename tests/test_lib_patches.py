"""The patches `make lib` applies to the pinned llama.cpp (scripts/patches).

Each patch must still apply to the pinned source, and what it changes must be
visible in the library lib/ holds (0005's KV cache streams of several
sequences are tests/test_kv_streams.py's).  The first patch aligns ggml-cpu's
work buffer (the scratch every kernel gets) to 64 bytes; unaligned, flash
attention's prompt kernel runs ~40% slower, and where glibc puts the buffer
differs from process to process.

The buffer is seen from outside, the way a developer would check it: gdb
stops at each ``ggml_graph_compute(cgraph, cplan)`` of a short completion and
reads ``cplan->work_size`` and ``cplan->work_data`` (the first two fields of
``struct ggml_cplan`` in ggml-cpu.h).  glibc's mmap threshold is set below the
buffer's size so that malloc always maps it, and a mapped block starts 16
bytes into its page: without the patch the pointer is then off by 16 every
time, not only in unlucky processes.
"""

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# and a GPU build's own (scripts/patches/vulkan/: applied to that build alone)
PATCHES = (sorted((ROOT / "scripts" / "patches").glob("*.patch"))
           + sorted((ROOT / "scripts" / "patches").glob("*/*.patch")))
GEMMA = ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"

# the second argument register, where gdb finds the cplan pointer at entry
_ARG2 = {"x86_64": "$rsi", "aarch64": "$x1"}.get(platform.machine())

_PROBE = r"""
import sys
sys.path.insert(0, sys.argv[1])
from offgrid.engine.model import Model
from offgrid.request import SamplingParams
from offgrid.engine.session import ChatSession, GenerationParams
model = Model.load(sys.argv[2], progress=False)
with ChatSession(model, n_ctx=512, n_batch=256, n_threads=2) as s:
    prompt = model.tokenize("The lighthouse keeper counted the ships. " * 12)
    s.complete(prompt, GenerationParams(n_predict=2, sampling=SamplingParams(temperature=0.0)))
model.close()
"""

_GDB = """set breakpoint pending on
set pagination off
set confirm off
break ggml_graph_compute
commands
silent
printf "cplan %%lu %%lu\\n", *(unsigned long *)%(arg)s, *(unsigned long *)(%(arg)s + 8)
continue
end
run
"""


def test_there_are_patches_and_each_says_why():
    assert PATCHES, "scripts/patches is empty: build_lib.sh would build llama.cpp as released"
    for p in PATCHES:
        text = p.read_text("utf-8")
        preamble = text.split("\n--- a/", 1)[0]
        assert len(preamble.split()) > 30, "%s: say what it fixes and why" % p.name
        assert "\n+++ b/" in text, "%s is not a unified diff" % p.name


@pytest.mark.parametrize("patch", PATCHES, ids=[p.parent.name + "/" + p.name
                                                  if p.parent.name != "patches" else p.name
                                                  for p in PATCHES])
def test_patch_applies_to_the_pinned_source(patch, llama_src):
    """A pin bump that breaks a patch fails here, not halfway through `make lib`."""
    out = subprocess.run(["patch", "--dry-run", "--forward", "-p1", "-d", str(llama_src),
                          "-i", str(patch)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow          # gemma under gdb: 20 s or more
@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
@pytest.mark.skipif(_ARG2 is None, reason="no register name for %s" % platform.machine())
def test_kernels_get_a_cache_line_aligned_work_buffer(lib, tmp_path):
    """The library this suite tests (lib/, or OFFGRID_LIB) carries the patch."""
    (tmp_path / "probe.py").write_text(_PROBE)
    (tmp_path / "cmds").write_text(_GDB % {"arg": _ARG2})
    env = dict(os.environ, OFFGRID_LIB=str(lib.path),
               GLIBC_TUNABLES="glibc.malloc.mmap_threshold=65536")
    out = subprocess.run(["gdb", "-q", "-batch", "-x", str(tmp_path / "cmds"), "--args",
                          os.path.realpath(sys.executable), str(tmp_path / "probe.py"),
                          str(ROOT), str(GEMMA)],
                         capture_output=True, text=True, env=env, timeout=120)
    plans = [tuple(int(v) for v in line.split()[1:3])
             for line in out.stdout.splitlines() if line.startswith("cplan ")]
    assert "exited normally" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    # the prompt's graph and the generated token's: both need scratch
    used = [(size, data) for size, data in plans if size > 0]
    assert len(used) >= 2, out.stdout[-2000:]
    assert all(size > 65536 for size, _ in used)        # so malloc mapped it
    assert [data % 64 for _, data in used] == [0] * len(used), used
