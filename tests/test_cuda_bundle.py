"""`make bundle GPU=cuda` on a machine without the NVIDIA driver.

The tarball is built once (a portable libllama with ggml's CUDA backend beside
the CPU variants, with the CUDA 13 toolchain from NVIDIA's PyPI wheels: hours
on 2 cores the first time for the default CUDA_ARCHS, a fraction of that for
one card's, e.g. CUDA_ARCHS=90-real; cached in ~/.cache/offgrid after),
unpacked into an empty folder and run as a machine with only python3 runs it:
``env -i``, the bundle's own lib/.  This machine has no NVIDIA GPU and no
driver, so what is checked is what a bundle must be without them: what it
carries (ggml-cuda, the CUDA runtime and cuBLAS that NVIDIA's licence lets an
application carry, and that licence) and what it leaves to the machine (the
driver's libcuda.so.1), that its README names that library and the
architectures it was built for, and that without the driver it serves on
the CPU and says why.  Layers on a real card need a machine with one; none
has run here yet (docs/gpu.md).  `make test-cuda-bundle` runs it.
"""

import os
import re
import subprocess

import pytest

try:
    from .serverproc import ROOT, make_env
    from .test_bundle import PYTHONS, BundledServer
    from .test_gpu import N_ALL, SMOL
    from .test_gpu_bundle import bundle_unpacked
except ImportError:  # tests/ is on sys.path rather than a package
    from serverproc import ROOT, make_env
    from test_bundle import PYTHONS, BundledServer
    from test_gpu import N_ALL, SMOL
    from test_gpu_bundle import bundle_unpacked

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

# what bundle.sh copies from the toolchain's wheels beside libggml-cuda.so
CARRIED = ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13")
DRIVER = "libcuda.so.1"


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory):
    assert not os.path.exists("/proc/driver/nvidia"), \
        "this file checks a machine without the NVIDIA driver"
    return bundle_unpacked(tmp_path_factory, "cuda", 12)


def needed(path):
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True,
                         check=True).stdout
    return re.findall(r"\(NEEDED\).*\[(.*)\]", out)


def test_the_bundle_carries_ggml_cuda_its_runtime_and_licence_and_not_the_driver(unpacked):
    lib = unpacked / "lib"
    assert (lib / "libggml-cuda.so").exists()
    assert len(list(lib.glob("libggml-cpu-*.so"))) >= 2, "the CPU variants beside it"
    for name in CARRIED:
        assert (lib / name).is_file(), name
    assert not list(lib.glob("libcuda.so*")), "the driver's library is the machine's own"
    # everything ggml-cuda needs is in lib/ or the system's, but the driver's
    missing = [so for so in needed(lib / "libggml-cuda.so") if not (lib / so).exists()]
    assert DRIVER in missing, missing
    assert not [so for so in missing if so.startswith("libcu") and so != DRIVER], missing
    licence = (unpacked / "LICENSES" / "NVIDIA-CUDA-LICENSE.txt").read_text()
    assert "NVIDIA" in licence and "distribut" in licence.lower()


def test_the_readme_names_the_driver_and_the_architectures_built(unpacked):
    readme = (unpacked / "README.txt").read_text()
    needs = re.search(r"^libraries +(.*)$", readme, re.M).group(1).split()
    assert "libc.so.6" in needs and not [so for so in needs if so.startswith("libcu")], needs
    gpu = re.search(r"^GPU +for layers on the GPU .*\n +(\S+) and the GPU's driver", readme, re.M)
    assert gpu and gpu.group(1) == DRIVER, readme
    archs = subprocess.run(["bash", "scripts/build_lib.sh", "--cuda-archs"], cwd=str(ROOT),
                           env=make_env(), capture_output=True, text=True,
                           check=True).stdout.strip()
    line = re.search(r"^CUDA archs +(\S+)$", readme, re.M)
    assert line and line.group(1) == archs, readme


def test_without_the_driver_the_bundle_serves_on_the_cpu_and_says_why(unpacked, tmp_path):
    python = PYTHONS[0][1]
    out = subprocess.run(["env", "-i", python, "-I", str(unpacked), "--list-devices"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["Available devices:", "  (none)"], out.stdout
    assert "has the CUDA backend but it found no usable device" in out.stderr, out.stderr
    server = BundledServer([python, "-I", unpacked], tmp_path, SMOL)
    server.args += ["-ngl", "all"]      # asked for, and no device to give them to
    with server as s:
        assert s.get("/props")[2]["devices"] == [{"name": "CPU", "layers": N_ALL}]
        status, _, body = s.post("/completion", {"prompt": "Hello", "n_predict": 4})
        assert status == 200 and body["tokens_predicted"] == 4, body
        assert any("serving on the CPU" in line for line in s.output), "".join(s.output)
