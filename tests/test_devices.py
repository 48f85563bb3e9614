"""The device flags on the CPU build (lib/): llama-server's parsing, --list-devices,
-ngl auto's arithmetic.  The device path itself runs in tests/test_gpu.py (`make
test-gpu`, a Vulkan build on lavapipe); these take a second or two."""

import argparse
import subprocess
import sys

import pytest

try:
    from .serverproc import ROOT
except ImportError:  # tests/ is on sys.path rather than a package
    from serverproc import ROOT

from offgrid.flags import parse_args
from offgrid.flagvalues import device_list, gpu_layers
from offgrid.engine import devices


def test_ngl_takes_a_count_auto_and_all_as_llama_server_keeps_them():
    assert gpu_layers("auto") == devices.NGL_AUTO == -1
    assert gpu_layers("all") == devices.NGL_ALL == -2
    assert gpu_layers("0") == 0 and gpu_layers("12") == 12
    for bad in ("-3", "many", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            gpu_layers(bad)


def test_device_names_and_none():
    assert device_list("Vulkan0,Vulkan1") == ["Vulkan0", "Vulkan1"]
    assert device_list("none") == ["none"]
    for bad in ("", ",", "none,Vulkan0"):
        with pytest.raises(argparse.ArgumentTypeError):
            device_list(bad)


def test_the_device_flags_parse_and_reach_the_worker():
    from offgrid.server.models.launch import worker_settings
    args = parse_args(["-m", "x.gguf", "-ngl", "all", "-dev", "Vulkan1", "-sm", "none",
                       "-mg", "1", "-nkvo", "-ts", "3,1"])
    s = worker_settings("x.gguf", args)
    assert (s.n_gpu_layers, s.device, s.split_mode, s.main_gpu, s.kv_offload,
            s.tensor_split) == (-2, ["Vulkan1"], "none", 1, False, [3.0, 1.0])
    s = worker_settings("x.gguf", parse_args(["-m", "x.gguf"]))
    assert (s.n_gpu_layers, s.device, s.split_mode, s.kv_offload) == (None, None, None, True)


def test_list_devices_of_the_cpu_build_is_none_without_a_warning():
    out = subprocess.run([sys.executable, "-m", "offgrid", "--list-devices"], cwd=str(ROOT),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["Available devices:", "  (none)"]
    # a build without a GPU backend has nothing to explain
    assert "no usable device" not in out.stderr


def test_a_gpu_build_without_its_driver_library_serves_on_the_cpu_build_beside(tmp_path):
    # lib/cuda as `make lib GPU=cuda` installs it, on a machine without the
    # NVIDIA driver: its libraries need libcuda.so.1, which dlopen cannot find.
    # Made here (a CUDA build takes hours): a library that needs libcuda.so.1
    # (linked against a stub of that name kept out of every search path) as
    # the folder's libllama.so, the real CPU build one folder up
    lib = tmp_path / "lib"
    (lib / "cuda").mkdir(parents=True)
    for f in (ROOT / "lib").glob("lib*.so*"):
        (lib / f.name).symlink_to(f)
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "s.c").write_text("void cuInit(void) {}\n")
    (stub / "l.c").write_text("void cuInit(void); void offgrid_gpu(void) { cuInit(); }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o",
                    str(stub / "libcuda.so.1"), str(stub / "s.c")], check=True)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib / "cuda" / "libllama.so"),
                    str(stub / "l.c"), str(stub / "libcuda.so.1")], check=True)
    (stub / "libcuda.so.1").unlink()
    out = subprocess.run([sys.executable, "-m", "offgrid", "--lib", str(lib / "cuda"),
                          "--list-devices"], cwd=str(ROOT), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["Available devices:", "  (none)"]
    assert ("this libllama (%s) needs libcuda.so.1, the driver's, which this machine lacks; "
            "serving on the CPU with %s" % (lib / "cuda", lib / "libllama.so")) in out.stderr
    # without a CPU build beside it, the failure says what is missing
    for f in lib.glob("lib*.so*"):
        f.unlink()
    out = subprocess.run([sys.executable, "-m", "offgrid", "--lib", str(lib / "cuda"),
                          "--list-devices"], cwd=str(ROOT), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "libcuda.so.1" in out.stderr


class Free:
    """A device's free memory, as layer_count reads it (Device.memory())."""

    def __init__(self, free):
        self.free = free

    def memory(self):
        return self.free, self.free


def test_ngl_auto_offloads_what_the_free_memory_holds_less_the_margin():
    mib = 1 << 20
    gib = 1 << 30
    # 24 layers and the output: 25 of 100 MiB each (80 weights, 20 KV)
    assert devices.layer_count(None, 24, [Free(gib + 2500 * mib)], 80 * mib, 20 * mib) == -1
    assert devices.layer_count(-1, 24, [Free(gib + 1000 * mib)], 80 * mib, 20 * mib) == 10
    # two devices' free memory adds up
    assert devices.layer_count(-1, 24, [Free(gib + 500 * mib)] * 2, 80 * mib, 20 * mib) == 10
    assert devices.layer_count(-1, 24, [Free(gib // 2)], 80 * mib, 20 * mib) == 0
    # all and a count are as given; no device: nothing to put there
    assert devices.layer_count(-2, 24, [Free(0)], 80 * mib, 0) == -1
    assert devices.layer_count(7, 24, [Free(0)], 80 * mib, 0) == 7
    assert devices.layer_count(-2, 24, [], 80 * mib, 0) == 0
