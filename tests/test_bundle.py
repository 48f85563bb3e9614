"""The air-gapped bundle: `make bundle`, unpacked where nothing else is, serves.

The tarball is built once per run with a tiny model put in by ``MODEL=``, then
unpacked with ``tar xf`` into an empty temporary folder and run the way a
machine with only python3 runs it: an empty environment (``env -i``), the
bundle's own portable lib/, nothing from this checkout, under the oldest and
the newest Python 3 found here (3.9 is the floor the code keeps to).

``python3 -I -m offgrid`` cannot work from any folder: -I takes the current
folder off sys.path.  Isolated mode runs the bundle folder itself instead,
``python3 -I <folder>``, through the ``__main__.py`` the bundle step writes.

The portable libllama is cached under ~/.cache/offgrid.  When it is not,
`make bundle` builds it first: about 8 minutes on 2 cores (7 CPU variants).
"""

import filecmp
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    from . import rawhttp
    from .serverproc import ROOT, ServerProcess, make_env
except ImportError:  # tests/ is on sys.path rather than a package
    import rawhttp
    from serverproc import ROOT, ServerProcess, make_env

from offgrid import __version__


def find_pythons():
    """[(version, executable)] for the oldest and the newest Python >= 3.9 here."""
    pyenv = Path(os.environ.get("PYENV_ROOT") or "~/.pyenv").expanduser()
    candidates = sorted(str(p) for p in pyenv.glob("versions/*/bin/python3"))
    candidates += [shutil.which("python3.%d" % minor) for minor in range(9, 20)]
    candidates.append(sys.executable)
    found = {}
    for exe in filter(None, candidates):
        try:
            out = subprocess.run([exe, "-c", "import sys; print(*sys.version_info[:2], "
                                  "sys.executable)"], capture_output=True, text=True,
                                 timeout=30).stdout.split()
        except (OSError, subprocess.SubprocessError):
            continue
        if len(out) == 3 and (int(out[0]), int(out[1])) >= (3, 9):
            found.setdefault((int(out[0]), int(out[1])), out[2])   # a real binary, not a shim
    ends = sorted(found)[:1] + sorted(found)[-1:]
    return [(v, found[v]) for v in sorted(set(ends))]


# minutes: a whole `make bundle`, and 8 more to build the portable libllama when
# it is not cached
pytestmark = pytest.mark.slow

PYTHONS = find_pythons()
PYTHON_IDS = ["python%d.%d" % v for v, _ in PYTHONS]


class BundledServer(ServerProcess):
    """``env -i COMMAND`` with ServerProcess's flags: no variable of ours reaches it."""

    def __init__(self, command, cwd, model):
        super().__init__(model)
        self.command = ["env", "-i"] + [str(c) for c in command]
        self.cwd = str(cwd)

    def launch(self):
        # ServerProcess runs this checkout's offgrid; this runs the bundle's,
        # with an empty environment (env -i)
        return self.command + self.args, self.cwd, None


def worker_of(server):
    """(executable, argv) of the server's one model worker."""
    for pid in rawhttp.children(server.proc.pid):
        try:
            return os.readlink("/proc/%d/exe" % pid), rawhttp.argv_of(pid)
        except OSError:
            continue
    raise AssertionError("the server has no worker process")


def assert_serves(server, package_root):
    """/health is ok, one completion generates, the model's worker runs on the server's
    own interpreter and its own offgrid package, the chat page's files are there, and
    SIGTERM ends it cleanly."""
    status, _, body = server.get("/health")
    assert status == 200 and body["status"] == "ok"
    status, headers, body = server.get("/", headers={"Accept": "text/html"})
    assert status == 200 and "Content-Security-Policy" in headers and 'src="app.js"' in body
    for name in ("index.html", "app.js", "app.css"):
        status, _, body = server.get("/" + name)
        assert status == 200 and body == (ROOT / "offgrid" / "webui" / name).read_text(), name
    status, _, body = server.post("/completion", {"prompt": "Hello", "n_predict": 8})
    assert status == 200, body
    assert body["tokens_predicted"] == 8
    assert isinstance(body["content"], str) and body["content"]
    exe, argv = worker_of(server)
    assert exe == os.readlink("/proc/%d/exe" % server.proc.pid)
    assert "sys.path.insert(0, %r)" % str(package_root) in " ".join(argv), argv
    assert server.stop() == 0, "".join(server.output)


# --------------------------------------------------------------------------
# Build once, unpack once
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tarball(tmp_path_factory, plain_model_path):
    dist = tmp_path_factory.mktemp("dist")
    r = subprocess.run(["make", "--no-print-directory", "bundle", "MODEL=%s" % plain_model_path],
                       cwd=str(ROOT), env=make_env(DIST=str(dist)), capture_output=True,
                       text=True, timeout=2 * 3600)
    assert r.returncode == 0, "make bundle failed:\n" + r.stdout + r.stderr
    (path,) = dist.glob("offgrid-*-linux-*.tar.gz")
    return path


@pytest.fixture(scope="module")
def unpacked(tarball, tmp_path_factory):
    """The one folder the tarball holds, unpacked into an empty folder."""
    target = tmp_path_factory.mktemp("target")
    subprocess.run(["tar", "xf", str(tarball)], cwd=str(target), check=True)
    (folder,) = target.iterdir()
    return folder


# --------------------------------------------------------------------------
# What the tarball holds
# --------------------------------------------------------------------------

def test_tarball_is_named_for_version_and_machine(tarball):
    assert tarball.name == "offgrid-%s-linux-%s.tar.gz" % (__version__, platform.machine())


def test_bundle_holds_package_portable_libraries_licenses_and_model(unpacked, plain_model_path):
    assert unpacked.name == "offgrid-%s-linux-%s" % (__version__, platform.machine())
    assert (unpacked / "offgrid" / "server" / "httpd" / "handler.py").is_file()
    assert (unpacked / "lib" / "libllama.so").exists()
    assert (unpacked / "lib" / "libmtmd.so").exists(), "no libmtmd for --mmproj"
    variants = sorted(p.name for p in (unpacked / "lib").glob("libggml-cpu-*.so"))
    assert len(variants) >= 2, variants
    assert not (unpacked / "lib" / "libggml-cpu.so").exists(), "a CPU backend fixed at build time"
    assert os.access(str(unpacked / "lib" / "ggml-rpc-server"), os.X_OK), "no rpc-server for --rpc"
    assert "MIT License" in (unpacked / "LICENSES" / "llama.cpp-LICENSE.txt").read_text()
    assert filecmp.cmp(str(unpacked / plain_model_path.name), str(plain_model_path), shallow=False)


def test_bundle_holds_the_cpu_variants_the_build_names(unpacked):
    # scripts/patches/0002: a portable build compiles CPU_VARIANTS, no more
    # (unless the environment asks for others)
    if "CPU_VARIANTS" in os.environ:
        named = os.environ["CPU_VARIANTS"].split()
    else:
        script = (ROOT / "scripts" / "build_lib.sh").read_text()
        named = re.search(r"^CPU_VARIANTS=\$\{CPU_VARIANTS:-([^}]*)\}", script, re.M).group(1).split()
    if named != ["all"]:
        built = sorted(p.name[len("libggml-cpu-"):-len(".so")]
                       for p in (unpacked / "lib").glob("libggml-cpu-*.so"))
        assert built == sorted(named)


def test_readme_states_a_glibc_floor_this_machine_meets(unpacked):
    readme = (unpacked / "README.txt").read_text()
    assert not re.search(r"^GPU ", readme, re.M), "a CPU bundle's README names a GPU"
    floor = re.search(r"^glibc +(\d+)\.(\d+) or newer", readme, re.M)
    assert floor, readme
    here = re.search(r"(\d+)\.(\d+)", os.confstr("CS_GNU_LIBC_VERSION"))
    assert (2, 17) <= tuple(map(int, floor.groups())) <= tuple(map(int, here.groups()))
    # and the glibc it was built with, this machine's, as ldd prints it
    built = re.search(r"built portable \(no -march=native\) with glibc (\S+)\n", readme)
    assert built and built.group(1) == "%s.%s," % here.groups(), readme


def test_checksums_list_every_file_and_match(unpacked):
    listed = {}
    for line in (unpacked / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ", 1)
        listed[name] = digest
    files = {str(p.relative_to(unpacked)) for p in unpacked.rglob("*")
             if p.is_file() and not p.is_symlink() and p.name != "SHA256SUMS"}
    assert set(listed) == files
    for name, digest in listed.items():
        assert hashlib.sha256((unpacked / name).read_bytes()).hexdigest() == digest, name


# --------------------------------------------------------------------------
# Serving with nothing but python3
# --------------------------------------------------------------------------

@pytest.mark.parametrize("python", [exe for _, exe in PYTHONS], ids=PYTHON_IDS)
def test_serves_from_inside_the_folder_with_an_empty_environment(unpacked, plain_model_path,
                                                                 python):
    # tar xf offgrid-*.tar.gz && cd offgrid-* && python3 -m offgrid -m model.gguf
    with BundledServer([python, "-m", "offgrid"], unpacked, plain_model_path.name) as server:
        assert_serves(server, unpacked)


@pytest.mark.parametrize("python", [exe for _, exe in PYTHONS], ids=PYTHON_IDS)
def test_serves_in_isolated_mode_from_another_folder(unpacked, plain_model_path, python,
                                                     tmp_path):
    model = unpacked / plain_model_path.name
    with BundledServer([python, "-I", unpacked], tmp_path, model) as server:
        assert_serves(server, unpacked)


def test_list_devices_runs_in_isolated_mode(unpacked, tmp_path):
    # --list-devices runs a process of its own (the front loads no libllama),
    # which must find the bundle's package as a worker does: -I puts no folder
    # of it on the child's path
    r = subprocess.run(["env", "-i", PYTHONS[0][1], "-I", str(unpacked), "--list-devices"],
                       cwd=str(tmp_path), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["Available devices:", "  (none)"], r.stdout + r.stderr


@pytest.mark.parametrize("python", [exe for _, exe in PYTHONS], ids=PYTHON_IDS)
def test_every_module_imports_with_an_empty_environment(unpacked, python):
    # Serving touches most modules, not all; an import runs every def and class line.
    code = ("import importlib, pkgutil, sys; sys.path.insert(0, sys.argv[1]); import offgrid\n"
            "for m in pkgutil.walk_packages(offgrid.__path__, 'offgrid.'):\n"
            "    importlib.import_module(m.name)")
    r = subprocess.run(["env", "-i", python, "-I", "-c", code, str(unpacked)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_wheel_installs_offline_and_finds_the_library_through_OFFGRID_LIB(unpacked,
                                                                          plain_model_path,
                                                                          tmp_path):
    python = PYTHONS[-1][1]
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    (wheel,) = unpacked.glob("offgrid-*-py3-none-any.whl")
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-index",
                    "--no-deps", str(wheel)], check=True)
    command = ["OFFGRID_LIB=%s" % (unpacked / "lib"), venv / "bin" / "offgrid"]
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import offgrid, os; print("
                           "os.path.dirname(os.path.dirname(os.path.abspath(offgrid.__file__))))"],
                          capture_output=True, text=True, check=True, cwd=str(tmp_path)).stdout
    with BundledServer(command, tmp_path, unpacked / plain_model_path.name) as server:
        assert_serves(server, site.strip())
