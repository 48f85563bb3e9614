"""Fixtures shared by the whole suite: libllama, the models, their paths.

Nothing here skips.  `make test` builds libllama and fetches the default model
before it runs pytest, so a missing library or model means the build is broken,
and a test that quietly skipped would hide exactly that.  Fixtures fail instead,
saying what is missing and which make target provides it.

Models are loaded once per test session and closed at its end; tests that make
ChatSessions from them must close those first (a ``with`` block or a
module-scoped fixture does).  The tiny random models are built into a cache
folder that outlives the run ($OFFGRID_CACHE or ~/.cache/offgrid, under
``tiny-models``), keyed by their recipe, so they are built once per machine.
"""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# `pytest` run from anywhere still tests this checkout's offgrid
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from offgrid import libllama        # noqa: E402
from offgrid.engine.model import Model     # noqa: E402

try:
    from . import tinymodels
except ImportError:  # tests/ is on sys.path rather than a package
    import tinymodels

# What `make model` fetches (scripts/fetch_model.py).  Qwen2.5-Coder is the
# default `make run` serves: tests of what a user sees use it; gemma and the
# tiny models serve tests that need speed rather than sense.
GEMMA = ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"
QWEN = ROOT / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
SMOLLM = ROOT / "models" / "smollm2-135m-instruct-q4_1.gguf"


def cache_dir():
    """offgrid's download and build cache: $OFFGRID_CACHE or ~/.cache/offgrid."""
    return Path(os.environ.get("OFFGRID_CACHE") or "~/.cache/offgrid").expanduser()


# --------------------------------------------------------------------------
# The library and the pinned llama.cpp source
# --------------------------------------------------------------------------

@pytest.fixture(scope="session")
def lib():
    """The loaded libllama (LibraryError, not a skip, when it is missing)."""
    return libllama.load()


@pytest.fixture(scope="session")
def llama_src():
    """The pinned llama.cpp source tree that `make lib` unpacks."""
    src = tinymodels.llama_cpp_source()
    assert (src / "include" / "llama.h").is_file(), \
        "the pinned llama.cpp source is missing at %s; run `make lib`" % src
    return src


# --------------------------------------------------------------------------
# Model files
# --------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_dir(llama_src):
    """Where the tiny models are built, once per machine."""
    path = cache_dir() / "tiny-models"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def fim_model_path(tiny_dir):
    return tinymodels.fim_model(tiny_dir)


@pytest.fixture(scope="session")
def fim_norepo_model_path(tiny_dir):
    return tinymodels.fim_model(tiny_dir, repo_tokens=False)


@pytest.fixture(scope="session")
def plain_model_path(tiny_dir):
    return tinymodels.plain_model(tiny_dir)


def _fetched(path):
    assert path.is_file(), "the model is missing at %s; run `make model`" % path
    return path


@pytest.fixture(scope="session")
def gemma_path():
    return _fetched(GEMMA)


@pytest.fixture(scope="session")
def qwen_path():
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M: the default model (chat, tools, FIM)."""
    return _fetched(QWEN)


@pytest.fixture(scope="session")
def smollm_path():
    """SmolLM2-135M-Instruct Q4_1: a small ChatML model."""
    return _fetched(SMOLLM)


# --------------------------------------------------------------------------
# Loaded models, one of each per session
# --------------------------------------------------------------------------

def _loaded(path):
    model = Model.load(str(path), progress=False)
    try:
        yield model
    finally:
        model.close()


@pytest.fixture(scope="session")
def gemma(lib, gemma_path):
    yield from _loaded(gemma_path)


@pytest.fixture(scope="session")
def qwen(lib, qwen_path):
    yield from _loaded(qwen_path)


@pytest.fixture(scope="session")
def smollm(lib, smollm_path):
    yield from _loaded(smollm_path)


@pytest.fixture(scope="session")
def fim_model(lib, fim_model_path):
    yield from _loaded(fim_model_path)


@pytest.fixture(scope="session")
def fim_norepo_model(lib, fim_norepo_model_path):
    yield from _loaded(fim_norepo_model_path)


@pytest.fixture(scope="session")
def plain_model(lib, plain_model_path):
    yield from _loaded(plain_model_path)


def pytest_terminal_summary(terminalreporter):
    """Print the "figures:" lines tests wrote to stdout (fault and load figures) after the run."""
    lines = [line for report in terminalreporter.stats.get("passed", [])
             for name, text in report.sections if "stdout" in name
             for line in text.splitlines() if line.startswith("figures:")]
    if lines:
        terminalreporter.section("figures")
        for line in lines:
            terminalreporter.write_line(line)


# The files that take longest, longest first: every file over ~25 s in a run
# of each file alone at -n 1 on the shared machine (load 5-8, 2026-12-06; about
# 2.5x a quiet run's times; test_replay.py's from its own timing).  The
# bundle's first, since on a machine without its cached portable libllama it
# builds one for about 8 minutes while the other worker runs the rest.  Under
# `make test`'s pytest workers a file runs whole on one worker, in collection
# order: started last, a long file runs alone while the other worker sits idle
# (test_webui.py, alphabetically last and 236 s there, would).  Only the order
# of files changes; no test depends on it.
LONGEST_FILES = [
    "test_bundle.py", "test_webui.py", "test_speculation.py", "test_replay.py",
    "test_draftmodel.py", "test_memory_classes.py", "test_workers.py", "test_hostile.py",
    "test_kv_streams.py", "test_server_openai.py", "test_embeddings.py", "test_docs.py",
    "test_ollama.py", "test_conformance_subset.py", "test_statecache.py", "test_rpc.py",
    "test_engine.py", "test_responses.py", "test_chat_shapes.py", "test_statedisk.py",
    "test_tool_rescue.py", "test_memory_states.py", "test_conformance_gaps.py", "test_lora.py",
    "test_shelf.py", "test_batching.py", "test_edit_paths.py", "test_faults.py",
    "test_anthropic.py", "test_security.py", "test_chat_forced.py", "test_jinja_budget.py",
    "test_idle_fill.py", "test_chunk_reuse.py", "test_threadpool.py", "test_hostile_values.py",
    "test_hostile_loading.py", "test_chat_tools.py", "test_json_output.py",
    "test_slot_actions.py", "test_agent_followups.py", "test_vision.py",
    "test_server_concurrency.py", "test_infill_budget.py", "test_fanout_cancel.py"]


def pytest_configure(config):
    # pytest-xdist 3.6 and later hand out the files of --dist loadfile by their
    # number of tests, most first (--loadscope-reorder, on by default), which
    # undid the order above: test_conformance_subset.py (3 tests, over a minute)
    # went 86th of 94 files, test_speculation.py 40th.  Keep collection order.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))
