"""What `make lib` compiles for this machine (scripts/build_lib.sh).

A native build for an x86 CPU with AMX (Sapphire Rapids and later) leaves
ggml's AMX matrix path out: with it, every decode of a Q4_K model segfaulted
in ggml_backend_amx_mul_mat on a 2-core Xeon VM (libllama and llama-bench
alike; llama.cpp issue 20824), so the whole suite died on such a machine.
ggml says what its CPU backend was compiled with (ggml_cpu_has_amx_int8 is a
compile-time answer, whatever the CPU it runs on), so the test asks every
CPU backend lib/ holds: one in a native build, one per variant in a
portable one.
"""

import ctypes
import platform
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(platform.machine() != "x86_64", reason="AMX is an x86 extension")
def test_no_cpu_backend_in_lib_is_compiled_with_amx():
    backends = sorted(p for p in (ROOT / "lib").glob("libggml-cpu*.so*")
                      if not p.is_symlink())
    assert backends, "no ggml CPU backend in lib/: run `make lib`"
    for path in backends:
        cpu = ctypes.CDLL(str(path))
        cpu.ggml_cpu_has_amx_int8.restype = ctypes.c_int
        cpu.ggml_cpu_has_amx_int8.argtypes = []
        assert cpu.ggml_cpu_has_amx_int8() == 0, "%s has ggml's AMX path" % path.name
