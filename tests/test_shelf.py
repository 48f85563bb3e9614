"""A shelf of models: a folder of GGUFs served by name, loaded on demand, unloaded when idle.

The shelf is a tmp folder of symlinks to the real model files (SmolLM2-135M,
gemma-3-270m, Qwen2.5-Coder-0.5B), a truncated GGUF and a text file named
``x.gguf``.  Four servers, one thread each, small contexts:

* ``srv``: ``--models-dir`` with Qwen as the pinned ``--fim-model`` and
  ``--models-max 2``, so every other load has to evict: on-demand loads in
  each dialect, 404s, eviction, keep_alive, the router API, broken files;
* ``budget``: ``--models-memory 450M``, which two models do not fit in;
* ``sleepy``: ``-m`` SmolLM2 with ``--sleep-idle-seconds 3``;
* ``preset``: a ``--models-preset`` file, ``--no-models-autoload``, ``--pin``.

The tests of ``srv`` run in file order and each says what it expects loaded.
"""

import json
import os
import threading
import time
from pathlib import Path

import anthropic
import ollama
import openai
import pytest

try:
    from .rawhttp import argv_of, children, tree_rss
    from .serverproc import ServerProcess
except ImportError:
    from rawhttp import argv_of, children, tree_rss
    from serverproc import ServerProcess

MODELS = Path(__file__).resolve().parent.parent / "models"
SMOL = MODELS / "smollm2-135m-instruct-q4_1.gguf"
GEMMA = MODELS / "gemma-3-270m-q4_k_m.gguf"
QWEN = MODELS / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
HELLO = [{"role": "user", "content": "Say hello."}]


class ShelfServer(ServerProcess):
    """A ServerProcess whose flags are all its own (no -m: a router over a folder)."""

    def __init__(self, *args, startup_timeout=180):
        super().__init__(SMOL, startup_timeout=startup_timeout)
        self.args = ["--port", str(self.port), "-t", "1"] + [str(a) for a in args]

    # -- what the tests read -------------------------------------------------------------
    def models(self):
        status, _, body = self.get("/v1/models")
        assert status == 200, body
        return {m["id"]: m for m in body["data"]}

    def status_of(self, name):
        return self.models()[name]["status"]["value"]

    def wait_status(self, name, wanted, timeout=60):
        deadline = time.monotonic() + timeout
        while True:
            got = self.status_of(name)
            if got in wanted:
                return got
            assert time.monotonic() < deadline, "%s stayed %s, not %s" % (name, got, wanted)
            time.sleep(0.1)

    def model_metric(self, metric, name):
        return self.metrics().get('%s{model="%s"}' % (metric, name), 0.0)

    def chat(self, model, n=4, **extra):
        body = {"model": model, "messages": HELLO, "max_tokens": n, "temperature": 0}
        body.update(extra)
        return self.post("/v1/chat/completions", body)


def make_shelf(folder):
    folder.mkdir()
    for src in (SMOL, GEMMA, QWEN):
        assert src.is_file(), "missing model %s" % src
        (folder / src.name).symlink_to(src)
    # a GGUF cut short: its header reads, its tensors are not there
    with open(SMOL, "rb") as fh:
        (folder / "truncated.gguf").write_bytes(fh.read(1 << 20))
    (folder / "x.gguf").write_text("this is not a model\n")
    return folder


def worker_of(srv, path):
    """The pid of the worker serving the model file ``path``, or None."""
    for pid in children(srv.proc.pid):
        if any(str(path) in arg for arg in argv_of(pid)):
            return pid
    return None


# -- the shelf server -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_shelf(tmp_path_factory.mktemp("shelf") / "models")


@pytest.fixture(scope="module")
def srv(folder):
    with ShelfServer("--models-dir", folder, "--fim-model", folder / QWEN.name,
                     "--models-max", 2, "-c", 2048) as s:
        yield s


def test_every_file_is_listed_by_name_and_only_the_fim_model_is_loaded(srv):
    m = srv.models()
    assert {"smollm2-135m-instruct-q4_1", "gemma-3-270m-q4_k_m", "truncated", "x"} <= set(m)
    qwen = next(v for v in m.values() if v["path"].endswith(QWEN.name))
    assert qwen["status"]["value"] == "loaded" and qwen["pinned"] is True
    assert m["gemma-3-270m-q4_k_m"]["status"]["value"] in ("unloaded", "loaded")
    assert m["x"]["status"]["value"] == "error"
    assert "not a GGUF" in m["x"]["status"]["error"]


def test_a_request_loads_its_model_by_name_in_the_openai_dialect(srv):
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none")
    r = client.chat.completions.create(model="smollm2-135m-instruct-q4_1", messages=HELLO,
                                       max_tokens=4, temperature=0)
    assert r.model == "smollm2-135m-instruct-q4_1" and r.choices[0].message.content
    assert srv.status_of("smollm2-135m-instruct-q4_1") == "loaded"


def test_a_request_loads_its_model_in_the_llama_cpp_dialect(srv):
    status, _, body = srv.post("/completion", {"model": "gemma-3-270m-q4_k_m",
                                               "prompt": "Once upon", "n_predict": 4})
    assert status == 200, body
    assert body["model"] == "gemma-3-270m-q4_k_m" and body["tokens_predicted"] > 0


def test_a_request_loads_its_model_in_the_ollama_dialect(srv):
    client = ollama.Client(host=srv.base)
    r = client.chat(model="smollm2-135m-instruct-q4_1:latest", messages=HELLO,
                    options={"num_predict": 4, "temperature": 0})
    assert r.message.content
    names = [m.model for m in client.ps().models]
    assert "smollm2-135m-instruct-q4_1" in names
    listed = [m.model for m in client.list().models]
    assert "gemma-3-270m-q4_k_m" in listed and "x" not in listed


def test_a_request_loads_its_model_in_the_anthropic_dialect(srv):
    client = anthropic.Anthropic(base_url=srv.base, api_key="none")
    r = client.messages.create(model="gemma-3-270m-q4_k_m", max_tokens=4, messages=HELLO)
    assert r.content[0].text is not None and r.usage.output_tokens > 0


def test_a_request_loads_its_model_in_the_responses_dialect(srv):
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none")
    r = client.responses.create(model="smollm2-135m-instruct-q4_1", input="Say hello.",
                                max_output_tokens=4)
    assert r.output_text is not None and r.usage.output_tokens > 0


def test_fim_goes_to_the_pinned_fim_model(srv):
    status, _, body = srv.post("/infill", {"input_prefix": "def add(a, b):\n    return ",
                                           "input_suffix": "\n", "n_predict": 4})
    assert status == 200, body
    assert body["model"].startswith("qwen2.5-coder")


@pytest.mark.parametrize("name", ["no-such-model", "../models/" + SMOL.name,
                                  str(SMOL), "models/" + SMOL.stem, "..", "x/../gemma"])
def test_an_unknown_name_or_a_path_is_a_404_listing_known_names(srv, name):
    status, _, body = srv.chat(name)
    assert status == 404, body
    assert body["error"]["type"] == "not_found_error"
    assert "gemma-3-270m-q4_k_m" in body["error"]["message"]


def test_an_unknown_name_is_a_404_in_each_dialect(srv):
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=srv.base + "/v1", api_key="none").chat.completions.create(
            model="nope", messages=HELLO, max_tokens=2)
    with pytest.raises(anthropic.NotFoundError):
        anthropic.Anthropic(base_url=srv.base, api_key="none").messages.create(
            model="nope", max_tokens=2, messages=HELLO)
    with pytest.raises(ollama.ResponseError) as e:
        ollama.Client(host=srv.base).chat(model="nope", messages=HELLO)
    assert e.value.status_code == 404 and "not found" in e.value.error
    status, _, body = srv.post("/api/generate", {"model": "nope", "prompt": "hi"})
    assert status == 404 and isinstance(body["error"], str)


def test_a_request_without_a_model_is_a_400_on_a_router(srv):
    status, _, body = srv.post("/v1/chat/completions", {"messages": HELLO, "max_tokens": 2})
    assert status == 400 and "model" in body["error"]["message"]
    status, _, props = srv.get("/props")
    assert status == 200 and props["role"] == "router" and props["max_instances"] == 2


def test_a_broken_file_is_an_error_and_the_rest_keep_serving(srv):
    status, _, body = srv.chat("truncated")
    assert status == 500, body
    assert "truncated" in body["error"]["message"] and "cannot be loaded" in body["error"]["message"]
    m = srv.models()["truncated"]
    assert m["status"]["value"] == "error" and m["status"]["failed"] is True
    assert m["status"]["error"]
    status, _, body = srv.chat("x")
    assert status == 500 and "not a GGUF" in body["error"]["message"]
    status, _, body = srv.chat("smollm2-135m-instruct-q4_1")
    assert status == 200, body
    status, _, health = srv.get("/health")
    assert status == 200 and health["status"] == "ok"


def test_a_file_added_while_running_appears_and_serves(srv, folder):
    link = folder / "late-arrival.gguf"
    link.symlink_to(SMOL)
    try:
        assert "late-arrival" in srv.models()
        status, _, body = srv.chat("late-arrival")
        assert status == 200, body
    finally:
        srv.post("/models/unload", {"model": "late-arrival"})
        link.unlink()
    assert "late-arrival" not in srv.models()


def test_models_max_evicts_the_least_recently_used_idle_model_never_the_pinned_one(srv):
    qwen = next(k for k, v in srv.models().items() if v["pinned"])
    assert srv.chat("smollm2-135m-instruct-q4_1")[0] == 200
    evictions = srv.model_metric("offgrid_model_evictions_total", "smollm2-135m-instruct-q4_1")
    assert srv.chat("gemma-3-270m-q4_k_m")[0] == 200
    assert srv.status_of("smollm2-135m-instruct-q4_1") == "unloaded"
    assert srv.status_of(qwen) == "loaded"
    assert srv.model_metric("offgrid_model_evictions_total",
                            "smollm2-135m-instruct-q4_1") == evictions + 1
    loaded = [k for k, v in srv.models().items() if v["status"]["value"] == "loaded"]
    assert sorted(loaded) == sorted([qwen, "gemma-3-270m-q4_k_m"])


@pytest.mark.slow
def test_a_model_with_a_running_stream_is_never_evicted(srv):
    qwen = next(k for k, v in srv.models().items() if v["pinned"])
    c = srv.conn()
    c.request("POST", "/v1/chat/completions", body=json.dumps({
        "model": "smollm2-135m-instruct-q4_1", "messages": HELLO, "max_tokens": 1800,
        "stream": True, "ignore_eos": True}).encode(),
        headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    first = r.readline()
    assert first.startswith(b"data: ")
    try:
        # qwen is pinned and smollm2 streams: gemma has no room, and says why
        status, _, body = srv.chat("gemma-3-270m-q4_k_m")
        assert status == 503, body
        msg = body["error"]["message"]
        assert "pinned" in msg and "running" in msg and "--models-max 2" in msg
        assert srv.status_of("smollm2-135m-instruct-q4_1") == "loaded"
        assert srv.status_of(qwen) == "loaded"
        line = r.readline()
        while line == b"\n":
            line = r.readline()
        assert line.startswith(b"data: ")       # still streaming all along
    finally:
        c.close()       # hanging up ends the stream
    # once the stream has ended, smollm2 is idle and makes room
    assert srv.chat("gemma-3-270m-q4_k_m")[0] == 200
    assert srv.status_of("smollm2-135m-instruct-q4_1") == "unloaded"


def test_concurrent_first_requests_for_one_model_share_one_load(srv):
    name = "smollm2-135m-instruct-q4_1"
    srv.post("/models/unload", {"model": name})
    srv.wait_status(name, ("unloaded",))
    loads = srv.model_metric("offgrid_model_loads_total", name)
    results = []

    def one():
        results.append(srv.chat(name, n=2)[0])
    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    seen = set()
    while any(t.is_alive() for t in threads):
        status, _, health = srv.get("/health")     # a load in progress is no outage
        assert status == 200 and health["status"] == "ok", health
        seen.add(srv.status_of(name))
        time.sleep(0.05)
    for t in threads:
        t.join(120)
    assert results == [200, 200, 200]
    assert "loading" in seen or "loaded" in seen
    assert srv.model_metric("offgrid_model_loads_total", name) == loads + 1
    print("figures: 3 concurrent first requests, 1 load of SmolLM2; load seconds so far %.2f"
          " over %d loads" % (srv.model_metric("offgrid_model_load_seconds_total", name),
                              srv.model_metric("offgrid_model_loads_total", name)))


def test_keep_alive_0_ends_the_worker_and_gives_its_memory_back(srv):
    name = "smollm2-135m-instruct-q4_1"
    assert srv.chat(name)[0] == 200
    assert worker_of(srv, SMOL.name) is not None
    before = tree_rss(srv.proc.pid)
    status, _, body = srv.post("/api/generate", {"model": name, "prompt": "Hi",
                                                 "keep_alive": 0, "stream": False,
                                                 "options": {"num_predict": 2}})
    assert status == 200, body
    deadline = time.monotonic() + 10
    while worker_of(srv, SMOL.name) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker_of(srv, SMOL.name) is None
    after = tree_rss(srv.proc.pid)
    print("figures: keep_alive 0 on SmolLM2 (%d MiB file): process tree RSS %d -> %d MiB"
          % (SMOL.stat().st_size >> 20, before >> 20, after >> 20))
    assert before - after >= SMOL.stat().st_size, (before, after)
    assert srv.status_of(name) == "unloaded"
    assert srv.model_metric("offgrid_model_resident_bytes", name) == 0


def test_api_show_of_a_model_loaded_before_does_not_load_it_again(srv):
    name = "smollm2-135m-instruct-q4_1"
    srv.post("/models/unload", {"model": name})
    status, _, body = srv.post("/api/show", {"model": name})
    assert status == 200 and "completion" in body["capabilities"]
    assert body["model_info"]["general.architecture"] == "llama"
    assert srv.status_of(name) == "unloaded"


def test_a_bad_keep_alive_is_a_400(srv):
    status, _, body = srv.post("/api/generate", {"model": "gemma-3-270m-q4_k_m",
                                                 "prompt": "Hi", "keep_alive": "soon"})
    assert status == 400 and "keep_alive" in body["error"]


def test_the_router_api_loads_and_unloads_by_name(srv):
    name = "smollm2-135m-instruct-q4_1"
    srv.post("/models/unload", {"model": name})
    status, _, body = srv.post("/models/load", {"model": name})
    assert status == 200 and body == {"success": True}
    srv.wait_status(name, ("loaded",))
    status, _, body = srv.post("/models/load", {"model": name})
    assert status == 400 and "already" in body["error"]["message"]
    status, _, body = srv.post("/models/unload", {"model": name})
    assert status == 200 and body == {"success": True}
    assert srv.status_of(name) == "unloaded"
    assert worker_of(srv, SMOL.name) is None
    status, _, body = srv.post("/models/unload", {"model": name})
    assert status == 400 and "not running" in body["error"]["message"]
    status, _, body = srv.post("/models/load", {"model": "../etc/passwd"})
    assert status == 404


def test_metrics_count_loads_unloads_evictions_and_resident_bytes_per_model(srv):
    m = srv.metrics()
    for metric in ("offgrid_model_loads_total", "offgrid_model_unloads_total",
                   "offgrid_model_evictions_total", "offgrid_model_load_seconds_total",
                   "offgrid_model_resident_bytes"):
        assert any(k.startswith(metric + '{model="') for k in m), metric
    qwen = next(k for k, v in srv.models().items() if v["pinned"])
    assert srv.model_metric("offgrid_model_resident_bytes", qwen) > 100 << 20
    assert srv.model_metric("offgrid_model_load_seconds_total", qwen) > 0


# -- -m beside a folder -------------------------------------------------------------------

def test_the_model_of_m_is_the_default_and_one_model_with_its_file_in_the_folder(folder):
    with ServerProcess(SMOL, "--models-dir", folder, threads=1, ctx=512) as s:
        status, _, body = s.get("/v1/models")
        smol = [m for m in body["data"] if m["path"].endswith(SMOL.name)
                or SMOL.stem in m["aliases"]]
        assert [m["id"] for m in smol] == [SMOL.name]          # -m's id, as before
        assert smol[0]["status"]["value"] == "loaded"
        # no model named: the default; a model named: that one; unknown: 404 (a folder)
        status, _, body = s.post("/completion", {"prompt": "Hi", "n_predict": 2})
        assert status == 200 and body["model"] == SMOL.name
        status, _, body = s.post("/completion", {"model": SMOL.stem, "prompt": "Hi",
                                                 "n_predict": 2})
        assert status == 200 and body["model"] == SMOL.name
        assert s.post("/completion", {"model": "nope", "prompt": "Hi"})[0] == 404


# -- a memory budget ------------------------------------------------------------------------

def test_aliases_and_tags_of_m_are_listed_as_llama_servers(tmp_path):
    # llama-server's -a and --tags take comma lists; /models lists both as sets
    # (sorted), the aliases with the one that names the model, not the file's name
    with ServerProcess(SMOL, "-a", "tinyllama-2,fim", "-a", "code", "--tags", "chat,fim,small",
                       threads=1, ctx=512) as s:
        (m,) = s.get("/models")[2]["data"]
        assert m["id"] == "tinyllama-2"                 # offgrid: the first given
        assert m["aliases"] == ["code", "fim", "tinyllama-2"]
        assert m["tags"] == ["chat", "fim", "small"]
        for name in ("code", "fim", SMOL.stem):         # every name still answers
            status, _, body = s.post("/completion", {"model": name, "prompt": "Hi",
                                                     "n_predict": 1})
            assert status == 200 and body["model"] == "tinyllama-2", (name, body)
    with ServerProcess(SMOL, threads=1, ctx=512) as s:
        (m,) = s.get("/v1/models")[2]["data"]
        assert m["id"] == SMOL.name and m["aliases"] == [] and m["tags"] == []


@pytest.fixture(scope="module")
def budget(folder):
    with ShelfServer("--models-dir", folder, "--models-memory", "450M", "-c", 512) as s:
        yield s


def test_a_memory_budget_evicts_the_least_recently_used_model(budget):
    smol, gemma = "smollm2-135m-instruct-q4_1", "gemma-3-270m-q4_k_m"
    assert budget.chat(smol)[0] == 200
    assert budget.model_metric("offgrid_model_resident_bytes", smol) > SMOL.stat().st_size
    # SmolLM2's worker and gemma's file and caches do not fit in 450 MiB together
    assert budget.chat(gemma)[0] == 200
    assert budget.status_of(smol) == "unloaded"
    assert budget.model_metric("offgrid_model_evictions_total", smol) == 1
    assert budget.status_of(gemma) == "loaded"


# -- idle unload ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sleepy():
    with ServerProcess(SMOL, "--sleep-idle-seconds", 3, threads=1, ctx=512) as s:
        yield s


def test_an_idle_model_sleeps_and_health_polling_does_not_keep_it_awake(sleepy):
    assert sleepy.post("/completion", {"prompt": "Hi", "n_predict": 2})[0] == 200
    assert sleepy.get("/props")[2]["is_sleeping"] is False
    deadline = time.monotonic() + 12
    while True:
        # what a monitor polls must not count as use
        assert sleepy.get("/health")[0] == 200
        assert sleepy.get("/props")[0] == 200
        assert sleepy.get("/metrics")[0] == 200
        assert sleepy.get("/v1/models")[0] == 200
        if sleepy.get("/props")[2]["is_sleeping"]:
            break
        assert time.monotonic() < deadline, "the model never went to sleep"
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while worker_of(sleepy, SMOL.name) is not None:
        assert time.monotonic() < deadline, "the sleeping model's worker is still there"
        time.sleep(0.05)
    status, _, body = sleepy.get("/v1/models")
    assert body["data"][0]["status"]["value"] == "sleeping"
    assert sleepy.get("/health")[0] == 200
    status, _, body = sleepy.post("/completion", {"prompt": "Hi", "n_predict": 2})
    assert status == 200 and body["tokens_predicted"] > 0
    assert sleepy.get("/props")[2]["is_sleeping"] is False


# -- presets, no autoload -------------------------------------------------------------------

PRESET = """version = 1

[*]
ctx-size = 256
; offgrid runs on the CPU: ignored with a warning
n-gpu-layers = 99

[smollm2-135m-instruct-q4_1]
alias = tiny, smol
tags = chat, small
ctx-size = 1024
parallel = 2
load-on-startup = true

[gemma-3-270m-q4_k_m]
chat-template = chatml
stop-timeout = 2
"""


@pytest.fixture(scope="module")
def preset(tmp_path_factory, folder):
    ini = tmp_path_factory.mktemp("preset") / "models.ini"
    ini.write_text(PRESET)
    with ShelfServer("--models-dir", folder, "--models-preset", ini,
                     "--no-models-autoload", "--pin", QWEN.stem) as s:
        s.wait_status("smollm2-135m-instruct-q4_1", ("loaded",))
        yield s


def test_a_preset_sets_each_models_settings_and_loads_on_startup(preset):
    m = preset.models()
    smol = m["smollm2-135m-instruct-q4_1"]
    assert smol["status"]["value"] == "loaded"
    assert smol["settings"]["n_ctx"] == 1024 and smol["settings"]["parallel"] == 2
    assert smol["aliases"] == ["smol", "tiny"] and smol["tags"] == ["chat", "small"]
    assert "ctx-size = 1024" in smol["status"]["preset"]
    assert any("n-gpu-layers" in line for line in preset.output)
    status, _, body = preset.chat("tiny")
    assert status == 200 and body["model"] == "smollm2-135m-instruct-q4_1"


def test_a_pinned_model_loads_at_start(preset):
    preset.wait_status(QWEN.stem, ("loaded",), timeout=120)
    assert preset.models()[QWEN.stem]["pinned"] is True


def test_without_autoload_a_model_not_loaded_is_a_400_until_loaded(preset):
    name = "gemma-3-270m-q4_k_m"
    status, _, body = preset.chat(name)
    assert status == 400 and "POST /models/load" in body["error"]["message"]
    assert preset.status_of(name) == "unloaded"
    assert preset.post("/models/load", {"model": name})[0] == 200
    preset.wait_status(name, ("loaded",))
    assert preset.models()[name]["settings"]["n_ctx"] == 256      # from [*]
    status, _, body = preset.chat(name)
    assert status == 200, body


# -- loading progress -------------------------------------------------------------------------

def test_a_loading_worker_reports_its_progress_to_the_front():
    from offgrid.flags import parse_args
    from offgrid.server.models.launch import worker_args
    from offgrid.server.models.worker_client import WorkerClient

    args = parse_args(["-m", str(SMOL), "-t", "1", "-c", "256"])
    seen = []
    worker = WorkerClient("smol", worker_args(str(SMOL), args))
    worker.on_progress = seen.append        # what GET /models shows as status.progress
    try:
        worker.start(timeout=120)
    finally:
        worker.close()
    assert seen and seen == sorted(seen) and seen[-1] == 1.0


# -- what the shelf reads from disk ----------------------------------------------------------

def test_a_folder_scan_names_models_by_stem_and_split_files_as_one(tmp_path):
    from offgrid.server.models.folders import scan
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "notes.txt").write_text("not a model")
    (tmp_path / "mmproj-a.gguf").write_bytes(b"GGUF")
    big = tmp_path / "big"
    big.mkdir()
    for i in (1, 2, 3):
        (big / ("big-q4-%05d-of-00003.gguf" % i)).write_bytes(b"GGUF")
    deep = tmp_path / "two" / "deeper"
    deep.mkdir(parents=True)
    (deep / "too-deep.gguf").write_bytes(b"GGUF")
    found = {name: (os.path.basename(path), more) for name, path, more in scan([tmp_path])}
    assert found == {"a": ("a.gguf", []),
                     "big-q4": ("big-q4-00001-of-00003.gguf", ["big"])}


def test_a_preset_reads_llama_servers_keys_and_reports_the_rest(tmp_path):
    from offgrid.server.models.folders import PresetError, read_preset
    ini = tmp_path / "p.ini"
    ini.write_text(PRESET)
    defaults, models, ignored = read_preset(str(ini))
    assert defaults == {"ctx_size": 256}
    assert models["smollm2-135m-instruct-q4_1"] == {
        "alias": ["tiny", "smol"], "tags": ["chat", "small"], "ctx_size": 1024, "parallel": 2,
        "load_on_startup": True}
    assert models["gemma-3-270m-q4_k_m"] == {"chat_template": "chatml", "stop_timeout": 2.0}
    assert ignored == ["[*] n-gpu-layers"]
    ini.write_text("[m]\nparallel = two\n")
    with pytest.raises(PresetError, match="parallel"):
        read_preset(str(ini))


@pytest.mark.parametrize("value,seconds", [(0, 0.0), (30, 30.0), ("5m", 300.0),
                                           ("1h30m", 5400.0), ("250ms", 0.25), ("-1", -1.0),
                                           (-5, -1.0), ("-1m", -1.0), ("90", 90.0)])
def test_keep_alive_reads_as_ollama_reads_it(value, seconds):
    from offgrid.server.models.folders import parse_duration
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", "", [], True, {"m": 5}])
def test_keep_alive_that_is_no_duration_is_refused(value):
    from offgrid.server.models.folders import parse_duration
    with pytest.raises(ValueError):
        parse_duration(value)


def test_a_preset_takes_the_cache_types_load_mode_and_reasoning_budget_under_the_flags(tmp_path):
    """A preset's -ctk/-ctv, -lm and --reasoning-budget reach that model's worker
    settings; a flag given on the command line wins; a value they do not take is an
    error naming it."""
    from offgrid.flags import parse_args
    from offgrid.server.models.entry import ModelEntry
    from offgrid.server.models.folders import PresetError, read_preset
    from offgrid.server.models.launch import model_args, worker_settings
    ini = tmp_path / "p.ini"
    ini.write_text("[m]\nctk = q8_0\ncache-type-v = q4_0\nlm = none\nreasoning-budget = 64\n")
    _, models, ignored = read_preset(str(ini))
    assert not ignored
    entry = ModelEntry("m", path="m.gguf")
    entry.preset = models["m"]
    s = worker_settings("m.gguf", model_args(entry, parse_args(["-m", "x.gguf"])))
    assert (s.cache_type_k, s.cache_type_v, s.load_mode, s.reasoning_budget) == (
        "q8_0", "q4_0", "none", 64)
    s = worker_settings("m.gguf", model_args(entry, parse_args(["-m", "x.gguf", "-ctk", "f16"])))
    assert (s.cache_type_k, s.cache_type_v) == ("f16", "q4_0")
    for bad in ("ctk = q3_k", "lm = fast", "reasoning-budget = -2"):
        ini.write_text("[m]\n%s\n" % bad)
        with pytest.raises(PresetError, match=bad.split(" ")[0]):
            read_preset(str(ini))


def test_a_preset_takes_the_overrides_and_template_kwargs_as_the_flags_read_them(tmp_path):
    """A preset's --override-kv, -ot with --cpu-moe/--n-cpu-moe and --chat-template-kwargs
    reach that model's worker settings, read by the flags' own readers; a flag given wins;
    a value they do not take is an error that says why."""
    from offgrid.flags import parse_args
    from offgrid.server.models.entry import ModelEntry
    from offgrid.server.models.folders import PresetError, read_preset
    from offgrid.server.models.launch import model_args, worker_settings
    from offgrid.server.models.overrides import FFN_EXPS_REGEX
    ini = tmp_path / "p.ini"
    ini.write_text("[*]\nchat-template-kwargs = {\"enable_thinking\": false}\n"
                   "[m]\noverride-kv = general.name=str:renamed,x.y=int:3\n"
                   "ot = blk\\.0\\.=CPU\nn-cpu-moe = 1\n")
    defaults, models, ignored = read_preset(str(ini))
    assert not ignored
    entry = ModelEntry("m", path="m.gguf")
    entry.preset = dict(defaults, **models["m"])
    s = worker_settings("m.gguf", model_args(entry, parse_args(["-m", "x.gguf"])))
    assert s.override_kv == [["general.name", "str", "renamed"], ["x.y", "int", 3]]
    assert s.override_tensor == [[r"blk\.0\.", "CPU"], [r"blk\.0" + FFN_EXPS_REGEX, "CPU"]]
    assert s.template_kwargs == {"enable_thinking": False}
    given = parse_args(["-m", "x.gguf", "--override-kv", "a.b=bool:true", "--cpu-moe",
                        "--reasoning-effort", "low"])
    s = worker_settings("m.gguf", model_args(entry, given))
    assert s.override_kv == [["a.b", "bool", True]]
    assert s.override_tensor == [[FFN_EXPS_REGEX, "CPU"]]
    assert s.template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}
    for bad, why in (("override-kv = name=int:x", "not a value of type int"),
                     ("ot = nothing", "give REGEX=BUFFER_TYPE"),
                     ("chat-template-kwargs = [1]", "must be a JSON object"),
                     ("n-cpu-moe = -1", "not a valid value")):
        ini.write_text("[m]\n%s\n" % bad)
        with pytest.raises(PresetError, match=why):
            read_preset(str(ini))


def test_a_presets_override_kv_reaches_libllama(tmp_path, gemma_path, smollm_path):
    """The classic use again, from a preset: gemma's tokenizer adds no BOS in [g], and
    does in [h], the same file without the override (by another path: one path is one
    model)."""
    link = tmp_path / "gemma-link.gguf"
    link.symlink_to(gemma_path)
    ini = tmp_path / "p.ini"
    ini.write_text("[g]\nmodel = %s\noverride-kv = tokenizer.ggml.add_bos_token=bool:false\n"
                   "ctx-size = 256\n[h]\nmodel = %s\nctx-size = 256\n" % (link, gemma_path))
    with ServerProcess(smollm_path, "--models-preset", ini, ctx=256) as s:
        tokens = {m: s.post("/tokenize", {"content": "hi", "add_special": True, "model": m})[2]
                  for m in ("g", "h")}
        listed = {m["id"]: m for m in s.get("/models")[2]["data"]}
    # /models writes the preset back in its own words
    assert "override-kv = tokenizer.ggml.add_bos_token=bool:false\n" in \
        listed["g"]["status"]["preset"], listed["g"]
    assert tokens["g"]["tokens"] == [2202], tokens
    assert tokens["h"]["tokens"] == [2, 2202], tokens


def test_a_presets_rope_keys_stretch_that_models_context(tmp_path, plain_model_path):
    """A preset's rope-scaling, rope-scale and yarn-* keys, as the flags: the preset's
    tiny model takes 8,192 positions where it was trained on 4,096; -m's stays at its
    own; a value the flags refuse stops the start."""
    from offgrid.flags import parse_args
    from offgrid.server.models.launch import build_shelf
    link = tmp_path / "tiny-link.gguf"         # another path: another model than -m's
    link.symlink_to(plain_model_path)
    ini = tmp_path / "p.ini"
    ini.write_text("[long]\nmodel = %s\nrope-scaling = linear\nrope-scale = 2\n"
                   "ctx-size = 8192\n" % link)
    with ServerProcess(plain_model_path, "--models-preset", ini, ctx=8192) as s:
        s.post("/models/load", {"model": "long"})
        listed = {m["id"]: m for m in s.get("/models")[2]["data"]}
        long_ctx = s.post("/completion", {"prompt": "Hi", "n_predict": 1, "model": "long"})[2]
        own_ctx = s.get("/props")[2]["default_generation_settings"]["n_ctx"]
    assert long_ctx["generation_settings"]["n_ctx"] == 8192, long_ctx
    assert own_ctx == 4096
    assert "rope-scale = 2.0\n" in listed["long"]["status"]["preset"], listed["long"]
    ini.write_text("[long]\nmodel = %s\nrope-scale = 0\n" % plain_model_path)
    with pytest.raises(ValueError, match=r"\[long\] --rope-scale 0"):
        build_shelf(parse_args(["--models-preset", str(ini)]), None)
