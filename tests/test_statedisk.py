"""Prompt states on disk (engine/statedisk.py, --cache-dir): sleep, unload and restart.

A state written by one worker comes back in the next worker of the same
model file, libllama build and settings, with the same greedy text as a
prompt evaluated from nothing.  Anything else (corrupted or truncated bytes,
another model, a file claiming another build, a folder that cannot be
written, a full disk) is a miss with one log line, never a wrong answer.
"""

import logging
import os
import resource
import signal
import time

import pytest

from offgrid.engine import statedisk
from offgrid.engine.session import ChatSession, GenerationParams
from offgrid.engine.statecache import StateCache
from offgrid.request import SamplingParams

try:
    from .serverproc import ServerProcess, TEST_THREADS
except ImportError:
    from serverproc import ServerProcess, TEST_THREADS

GREEDY = GenerationParams(n_predict=8, sampling=SamplingParams(temperature=0))
CONTEXT = {"n_ctx": 1024}


def prompt_of(model):
    return model.tokenize("def double(x):\n    return x * 2\n" * 30, add_special=False)


def session_of(model):
    return ChatSession(model, n_ctx=1024, n_batch=256, n_threads=TEST_THREADS)


def disk_of(model, root, context=CONTEXT):
    ident = statedisk.identity(model.path, model.lib.path, context)
    return statedisk.StateDisk(str(root), ident, 64 << 20)


@pytest.fixture(scope="module")
def evaluated(qwen):
    """The tokens and state of prompt_of(qwen) + its greedy reply, a prompt that
    goes on from them, and that prompt's reply evaluated from nothing (once: each
    test writes the state into a folder of its own)."""
    prompt = prompt_of(qwen)
    with session_of(qwen) as s:
        first = s.complete(prompt, GREEDY)
        cached, state = list(s.cached), s.copy_state()
    follow = prompt + first.tokens + qwen.tokenize("\ndef triple(x):", add_special=False)
    with session_of(qwen) as ref:
        want = ref.complete(follow, GREEDY).text
    return cached, state, follow, want


@pytest.fixture
def written(qwen, tmp_path, evaluated):
    """A folder holding that state as a worker leaves it when it goes."""
    cached, state, follow, want = evaluated
    disk = disk_of(qwen, tmp_path)
    assert disk.write_all([(cached, state, None)]) == 1
    return tmp_path, disk.dir, follow, want


def restore_from(qwen, root, follow, context=CONTEXT):
    """A fresh worker's view: its StateCache lists the folder; a session serves ``follow``."""
    states = StateCache(64 << 20, disk_of(qwen, root, context))
    states.adopt_disk()
    with session_of(qwen) as s:
        s.use_states(states)
        return s.complete(follow, GREEDY), states


def state_file(folder):
    (name,) = [n for n in os.listdir(folder) if n.endswith(".state")]
    return os.path.join(folder, name)


def another_build(data):
    """A state file's bytes, its header claiming another libllama build."""
    at = data.index(b'"head_sha256": "', data.index(b'"build"')) + len(b'"head_sha256": "')
    return data[:at] + (b"0" if data[at:at + 1] != b"0" else b"1") + data[at + 1:]


def test_a_state_on_disk_serves_the_next_worker_with_the_same_text(qwen, written):
    root, _, follow, want = written
    c, states = restore_from(qwen, root, follow)
    assert c.usage.cached_tokens > 0.9 * len(follow)
    assert c.text == want
    assert states.stats()["disk"]["reads"] == 1


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "empty", "tokens"])
def test_a_damaged_file_is_a_miss_with_one_log_line(qwen, written, caplog, damage):
    root, folder, follow, want = written
    path = state_file(folder)
    data = bytearray(open(path, "rb").read())
    if damage == "flipped byte":
        data[len(data) // 2] ^= 0x40
    elif damage == "truncated":
        data = data[:len(data) - 1000]
    elif damage == "empty":
        data = b""
    else:
        # a token of the prompt changed: the state no longer holds those tokens
        at = data.index(b'"sha256"')
        head_end = data.index(b"}", at) + 1
        data[head_end + 8] ^= 0x01
    open(path, "wb").write(bytes(data))
    with caplog.at_level(logging.WARNING, logger="offgrid.statedisk"):
        c, _ = restore_from(qwen, root, follow)
    assert c.usage.cached_tokens == 0
    assert c.text == want
    lines = [r for r in caplog.records if r.name == "offgrid.statedisk"]
    assert len(lines) == 1 and path in lines[0].getMessage()


def test_a_file_of_another_model_is_not_used(qwen, smollm, written, caplog):
    root, folder, _, _ = written
    # the file moved into the folder of another model
    other = disk_of(smollm, root)
    os.makedirs(other.dir)
    os.rename(state_file(folder), os.path.join(other.dir, "0.state"))
    with caplog.at_level(logging.WARNING, logger="offgrid.statedisk"):
        assert other.index() == []
    assert "another model file" in caplog.text


def test_a_file_claiming_another_build_or_settings_is_not_used(qwen, written, caplog):
    root, folder, follow, want = written
    path = state_file(folder)
    data = open(path, "rb").read()
    open(path, "wb").write(another_build(data))
    with caplog.at_level(logging.WARNING, logger="offgrid.statedisk"):
        c, _ = restore_from(qwen, root, follow)
    assert "another libllama build" in caplog.text
    assert c.usage.cached_tokens == 0 and c.text == want
    caplog.clear()
    open(path, "wb").write(data)
    with caplog.at_level(logging.WARNING, logger="offgrid.statedisk"):
        c, _ = restore_from(qwen, root, follow, context={"n_ctx": 2048})
    assert "another context" in caplog.text and c.usage.cached_tokens == 0


def test_a_folder_of_another_builds_files_is_one_log_line(qwen, written, caplog):
    """After an upgrade of libllama every file is another build's: a line, not a line each."""
    root, folder, _, _ = written
    forged = another_build(open(state_file(folder), "rb").read())
    for i in range(5):
        open(os.path.join(folder, "%d.state" % (i + 1)), "wb").write(forged)
    with caplog.at_level(logging.WARNING, logger="offgrid.statedisk"):
        assert [name for name, _, _ in disk_of(qwen, root).index()] == ["0.state"]
    (line,) = [r.getMessage() for r in caplog.records if r.name == "offgrid.statedisk"]
    assert "1.state, 2.state, 3.state, ... (5 files)" in line, line
    assert "another libllama build" in line


def test_a_folder_that_cannot_be_written_logs_once_and_writes_nothing(qwen, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    disk = disk_of(qwen, blocker / "states")
    with session_of(qwen) as s, caplog.at_level(logging.WARNING, logger="offgrid.statedisk"):
        s.evaluate(prompt_of(qwen))
        for _ in range(2):
            assert disk.write_all([(list(s.cached), s.copy_state(), None)]) == 0
    assert len([r for r in caplog.records if r.name == "offgrid.statedisk"]) == 1


def test_a_full_disk_leaves_no_half_file(qwen, tmp_path, caplog):
    """RLIMIT_FSIZE makes a write fail part way as a full disk does (EFBIG, not ENOSPC)."""
    disk = disk_of(qwen, tmp_path)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    with session_of(qwen) as s, caplog.at_level(logging.WARNING, logger="offgrid.statedisk"):
        s.evaluate(prompt_of(qwen))
        data = s.copy_state()
        resource.setrlimit(resource.RLIMIT_FSIZE, (len(data) // 2, hard))
        try:
            assert disk.write_all([(list(s.cached), data, None)]) == 0
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, old_handler)
    assert os.listdir(disk.dir) == []
    assert "not saved" in caplog.text


def test_two_workers_sharing_a_folder_keep_each_others_states(qwen, tmp_path):
    """Two servers given one --cache-dir (or two workers of one model): a writer
    prunes only what it listed, so the other's newer file stays while the bound
    has room, and goes first when it has not."""
    with session_of(qwen) as s:
        s.evaluate(prompt_of(qwen))
        mine = (list(s.cached), s.copy_state(), None)
        s.evaluate(qwen.tokenize("class Other:\n    pass\n" * 25, add_special=False))
        theirs = (list(s.cached), s.copy_state(), None)
    a, b = disk_of(qwen, tmp_path), disk_of(qwen, tmp_path)
    a.index()
    b.index()
    assert b.write_all([theirs]) == 1
    assert a.write_all([mine]) == 1     # a never listed b's file
    names = sorted(n for n in os.listdir(a.dir) if n.endswith(".state"))
    assert len(names) == 2, names
    both = {tuple(t) for _, t, _ in disk_of(qwen, tmp_path).index()}
    assert both == {tuple(mine[0]), tuple(theirs[0])}
    # no room for both: the writer's own state wins, the other's goes
    small = statedisk.StateDisk(str(tmp_path), a.ident, len(mine[1]) + 1024)
    assert small.write_all([mine]) == 1     # it listed nothing: both files are others'
    left = [t for _, t, _ in disk_of(qwen, tmp_path).index()]
    assert left == [mine[0]]


# -- through the server ---------------------------------------------------------------

QWEN = "models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
LONG = "def double(x):\n    return x * 2\n" * 40


def ask(server):
    status, _, body = server.post("/completion", {"prompt": LONG, "n_predict": 6,
                                                  "temperature": 0})
    assert status == 200, body
    return body


def test_after_a_restart_a_long_prompt_comes_from_disk(tmp_path):
    flags = ("--cache-dir", str(tmp_path), "-np", "1")
    with ServerProcess(QWEN, *flags) as s:
        first = ask(s)
        assert first["timings"]["cache_n"] == 0
    assert any(f.endswith(".state") for _, _, fs in os.walk(tmp_path) for f in fs)
    with ServerProcess(QWEN, *flags) as s:
        again = ask(s)
    assert again["timings"]["cache_n"] >= first["timings"]["prompt_n"] - 1
    assert again["timings"]["prompt_n"] <= 1
    assert again["content"] == first["content"]


def test_a_model_that_sleeps_wakes_with_its_prompt(tmp_path):
    with ServerProcess(QWEN, "--cache-dir", str(tmp_path), "--sleep-idle-seconds", "1") as s:
        first = ask(s)
        deadline = time.monotonic() + 30
        while s.get("/props")[2].get("is_sleeping") is not True:
            assert time.monotonic() < deadline, "the model never went to sleep"
            time.sleep(0.2)
        again = ask(s)
    assert again["timings"]["prompt_n"] <= 1 and again["content"] == first["content"]


def test_no_cache_disk_writes_nothing(tmp_path):
    with ServerProcess(QWEN, "--cache-dir", str(tmp_path), "--no-cache-disk") as s:
        ask(s)
    assert list(tmp_path.iterdir()) == []
