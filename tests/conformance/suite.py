"""llama-server's own test suite, made runnable here: copied, patched, pointed at our models.

The pinned llama.cpp source (scripts/build_lib.sh unpacks it into the cache)
holds ``tools/server/tests``: black-box HTTP tests that start a server through
``utils.py``'s ``ServerProcess``.  Those tests download their models from
Hugging Face, which we cannot reach.  ``prepare()`` copies the suite into
``~/.cache/offgrid/conformance/`` (never touching the pinned source) and makes
four small, documented rewrites of the copy's ``utils.py`` (``REWRITES``):

1. ``ServerPreset.load_all`` downloads nothing: the models are local.
2. ``ServerProcess.start`` first calls ``local_models.use_local_model(self)``,
   which turns the preset's ``model_hf_repo``/``model_hf_file``/``model_url``
   into ``model_file`` = one of our registry models (``local_models.py``).
3. A request times out after 3 minutes, not 10.
4. ``download_file`` answers with a local model for the URLs we can map (the
   speculative draft) and fails saying so for the rest (LoRA adapters).

Each rewrite names the exact text it replaces; if the pinned source changes
so that one no longer matches, ``prepare()`` raises instead of running a
half-patched suite.  Which server runs is chosen by ``LLAMA_SERVER_BIN_PATH``
(utils.py reads it): our ``launcher.py``.
"""

import hashlib
import os
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

PKG = "llama-cpp-python-0.3.36-832db0699007"
PKG_DIR = "llama_cpp_python-0.3.36"


def cache_dir():
    return Path(os.environ.get("OFFGRID_CACHE") or "~/.cache/offgrid").expanduser()


def pinned_source():
    """The pinned llama.cpp tree, as scripts/build_lib.sh unpacks it."""
    return cache_dir() / PKG / "src" / PKG_DIR / "vendor" / "llama.cpp"


# (why, old text, new text): applied in order to the copy's utils.py.
REWRITES = [
    ("load_all downloads every preset's model from Hugging Face; ours are local files",
     '        """ Load all server presets to ensure model files are cached. """\n',
     '        """ Load all server presets to ensure model files are cached. """\n'
     '        return  # offgrid conformance: models are local (local_models.py)\n'),
    ("map the preset's Hugging Face model to a local file before the command line is built",
     "    def start(self, timeout_seconds: int = DEFAULT_HTTP_TIMEOUT) -> None:\n",
     "    def start(self, timeout_seconds: int = DEFAULT_HTTP_TIMEOUT) -> None:\n"
     "        import local_models; local_models.use_local_model(self)  # offgrid conformance\n"),
    ("a hung request fails its test in 3 minutes rather than 10, within the file's budget",
     "DEFAULT_REQUEST_TIMEOUT = 600\n",
     "DEFAULT_REQUEST_TIMEOUT = 180  # offgrid conformance: was 600\n"),
    ("downloads (draft models, LoRA adapters) come from the local map or fail by name",
     "    file_name = url.split('/').pop()\n",
     "    import local_models; return local_models.local_file(url)  # offgrid conformance\n"
     "    file_name = url.split('/').pop()\n"),
]


def patch_key():
    """Changes whenever the rewrites or the model map change, so a stale copy is redone."""
    h = hashlib.sha256()
    for _why, old, new in REWRITES:
        h.update(old.encode() + b"\0" + new.encode())
    h.update((HERE / "local_models.py").read_bytes())
    return h.hexdigest()[:10]


def prepare():
    """A patched copy of the suite; returns its ``tools/server/tests`` folder.

    The copy keeps the tree's shape (``models/templates`` three levels up)
    because tests name template files as ``../../../models/templates/X.jinja``.
    """
    src = pinned_source()
    tests = src / "tools" / "server" / "tests"
    if not (tests / "utils.py").is_file():
        raise SystemExit("the pinned llama.cpp source is missing at %s; run `make lib`" % src)
    top = cache_dir() / "conformance" / ("%s-%s" % (PKG, patch_key()))
    dest = top / "tools" / "server" / "tests"
    if (top / ".ready").is_file():
        return dest
    tmp = top.with_name(top.name + ".tmp%d" % os.getpid())
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(tests, tmp / "tools" / "server" / "tests",
                    ignore=shutil.ignore_patterns("__pycache__", "tmp"))
    shutil.copytree(src / "models" / "templates", tmp / "models" / "templates")
    utils = tmp / "tools" / "server" / "tests" / "utils.py"
    text = utils.read_text(encoding="utf-8")
    for why, old, new in REWRITES:
        if text.count(old) != 1:
            raise SystemExit("conformance patch no longer applies (%s): %r" % (why, old))
        text = text.replace(old, new)
    utils.write_text(text, encoding="utf-8")
    shutil.copy(HERE / "local_models.py", tmp / "tools" / "server" / "tests")
    (tmp / ".ready").write_text("patched by tests/conformance/suite.py\n")
    shutil.rmtree(top, ignore_errors=True)
    os.replace(tmp, top)
    return dest
