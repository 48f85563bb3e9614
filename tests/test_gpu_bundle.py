"""`make bundle GPU=vulkan`: the offline tarball with ggml's Vulkan backend, served on lavapipe.

The tarball is built once (a portable libllama with the Vulkan backend beside
the CPU variants: about 8 minutes on 2 quiet cores the first time, ggml-vulkan's
shaders; cached in ~/.cache/offgrid after), unpacked into an empty folder and
run as a machine with only python3 and its GPU driver runs it: ``env -i``,
the bundle's own lib/, with nothing from this checkout but the model file.
What it must not carry, the Vulkan loader and the driver (docs/gpu.md), the
machine has: here Debian's libvulkan1 and Mesa's lavapipe.  Its greedy text
with every layer on lavapipe is compared with the CPU build's as
tests/test_gpu.py compares lib/vulkan's; and with the loader hidden (a
machine without Vulkan) the bundle serves on the CPU and says why.  `make
test-gpu` runs it.
"""

import os
import re
import subprocess

import pytest

try:
    from .serverproc import ROOT, ServerProcess, make_env
    from .test_bundle import PYTHONS, BundledServer
    from .test_gpu import N_ALL, PROMPTS, SMOL, compare_prompts, lavapipe_env
except ImportError:  # tests/ is on sys.path rather than a package
    from serverproc import ROOT, ServerProcess, make_env
    from test_bundle import PYTHONS, BundledServer
    from test_gpu import N_ALL, PROMPTS, SMOL, compare_prompts, lavapipe_env

from offgrid import __version__

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def bundle_unpacked(tmp_path_factory, gpu, hours):
    """`make bundle GPU=gpu` into a folder of its own, its tarball checked by
    name and unpacked into another: the unpacked bundle's folder."""
    dist = tmp_path_factory.mktemp("dist")
    r = subprocess.run(["make", "--no-print-directory", "bundle", "GPU=" + gpu], cwd=str(ROOT),
                       env=make_env(DIST=str(dist)), capture_output=True, text=True,
                       timeout=hours * 3600)
    assert r.returncode == 0, "make bundle GPU=%s failed:\n%s%s" % (gpu, r.stdout, r.stderr)
    (tarball,) = dist.glob("offgrid-*.tar.gz")
    assert tarball.name == "offgrid-%s-linux-x86_64-%s.tar.gz" % (__version__, gpu)
    target = tmp_path_factory.mktemp("target")
    subprocess.run(["tar", "xf", str(tarball)], cwd=str(target), check=True)
    (folder,) = target.iterdir()
    return folder


@pytest.fixture(scope="module")
def unpacked(tmp_path_factory):
    return bundle_unpacked(tmp_path_factory, "vulkan", 3)


def bundle_env():
    """``VAR=value`` words for env -i: lavapipe named, as tests/test_gpu.py names it."""
    return ["%s=%s" % kv for kv in sorted(lavapipe_env().items())]


def test_the_bundle_carries_ggml_vulkan_and_not_the_loader_or_a_driver(unpacked):
    lib = unpacked / "lib"
    assert (lib / "libggml-vulkan.so").exists()
    assert len(list(lib.glob("libggml-cpu-*.so"))) >= 2, "the CPU variants beside it"
    assert not list(lib.glob("libvulkan.so*")) and not list(lib.glob("libvulkan_*"))
    # README.txt: the loader is the GPU's need alone; without it the bundle
    # serves on the CPU (ggml loads libggml-vulkan.so as a module)
    readme = (unpacked / "README.txt").read_text()
    needs = re.search(r"^libraries +(.*)$", readme, re.M).group(1).split()
    assert "libc.so.6" in needs and "libvulkan.so.1" not in needs, needs
    gpu = re.search(r"^GPU +for layers on the GPU .*\n +(\S+) and the GPU's driver", readme, re.M)
    assert gpu and gpu.group(1) == "libvulkan.so.1", readme


def test_list_devices_from_the_bundle_names_lavapipe(unpacked):
    python = PYTHONS[-1][1]
    out = subprocess.run(["env", "-i"] + bundle_env() + [python, "-I", str(unpacked),
                                                         "--list-devices"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "Available devices:" and lines[1].startswith("  Vulkan0: llvmpipe"), lines


def test_the_bundle_serves_every_layer_on_lavapipe_with_the_cpus_text(unpacked, tmp_path):
    # the oldest Python here (test_bundle.py serves on the newest too)
    gpu = BundledServer(bundle_env() + [PYTHONS[0][1], "-I", unpacked], tmp_path, SMOL)
    gpu.args += ["-ngl", "all"]
    gpu.startup_timeout = 600       # lavapipe compiles the shaders a cold cache lacks
    with ServerProcess(SMOL) as cpu, gpu:
        props = gpu.get("/props")[2]
        vulkan = [d for d in props["devices"] if d["name"] == "Vulkan0"]
        assert vulkan and vulkan[0]["layers"] == N_ALL, props["devices"]
        compare_prompts(cpu, gpu, PROMPTS, 12)


def without_the_loader(argv):
    """``argv`` in a mount namespace of its own where the Vulkan loader is an
    empty file (a user namespace: no privilege needed): a machine with no
    Vulkan installed, as far as the dynamic loader can tell."""
    loader = os.path.realpath("/usr/lib/x86_64-linux-gnu/libvulkan.so.1")
    assert os.path.isfile(loader), "no Vulkan loader (make lib GPU=vulkan installs libvulkan-dev)"
    return ["unshare", "-rm", "sh", "-c", 'mount --bind /dev/null "$0" && exec "$@"',
            loader] + [str(a) for a in argv]


class _NoLoaderServer(BundledServer):
    def launch(self):
        argv, cwd, env = super().launch()
        return without_the_loader(argv), cwd, env


def test_without_the_vulkan_loader_the_bundle_serves_on_the_cpu_and_says_why(unpacked, tmp_path):
    # README.txt's promise: the loader is for the GPU alone
    python = PYTHONS[0][1]
    out = subprocess.run(without_the_loader(["env", "-i"] + bundle_env()
                                            + [python, "-I", unpacked, "--list-devices"]),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["Available devices:", "  (none)"], out.stdout
    assert "has the Vulkan backend but it found no usable device" in out.stderr, out.stderr
    with _NoLoaderServer(bundle_env() + [python, "-I", unpacked], tmp_path, SMOL) as s:
        assert s.get("/props")[2]["devices"] == [{"name": "CPU", "layers": N_ALL}]
        status, _, body = s.post("/completion", {"prompt": "Hello", "n_predict": 4})
        assert status == 200 and body["tokens_predicted"] == 4, body
        assert any("serving on the CPU" in line for line in s.output), "".join(s.output)
