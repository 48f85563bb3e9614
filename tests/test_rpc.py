"""A model split over rpc-servers (``--rpc``): llama.cpp's RPC backend, over loopback.

Two ``ggml-rpc-server`` processes (``make rpc-server``, the same build as
the libllama the servers here load) on free loopback ports stand for two
other machines.  offgrid with ``--rpc`` to both must answer greedy
``/completion`` and ``/infill`` with the same text as an offgrid with every
layer local, with no layer local and with half of them local; killing one
rpc-server mid-stream must fail that request within seconds with a 503
naming it, leave ``/health`` answering, and the model must come back when
the rpc-server does.

Both sides run with ``--no-repack``: locally ggml repacks some Q4_K weights
for kernels that sum in another order (CPU_REPACK), an rpc-server never
does, and greedy text follows the sums to the last bit.  The reference
runs the same kernels every rpc-server runs.

Every rpc-server started here is killed by its fixture's finalizer.  An
rpc-server serves one client at a time, so each offgrid gets rpc-servers
no other offgrid uses while it runs.
"""

import os
import subprocess
import sys
import time

import pytest

try:
    from .serverproc import ROOT, ServerProcess, free_port, parse_sse
except ImportError:  # tests/ is on sys.path rather than a package
    from serverproc import ROOT, ServerProcess, free_port, parse_sse

QWEN = ROOT / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
SMOL = ROOT / "models" / "smollm2-135m-instruct-q4_1.gguf"
N_LAYER = {QWEN: 24, SMOL: 30}      # block_count of each


@pytest.fixture(scope="module")
def rpc_lib(tmp_path_factory):
    """A folder with libllama built with ggml's RPC backend and its ggml-rpc-server:
    scripts/build_lib.sh --rpc-server (cached; it builds once where the cache lacks it)."""
    dest = tmp_path_factory.mktemp("rpc-lib")
    done = subprocess.run(["bash", "scripts/build_lib.sh", "--rpc-server", str(dest)],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=3600,
                          env=dict(os.environ, PORTABLE="0", RPC="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (dest / "ggml-rpc-server").is_file()
    return dest


class RpcServer:
    """One ggml-rpc-server on a loopback port; kill() ends it, start() starts it again."""

    def __init__(self, lib, port=None):
        self.lib = lib
        self.port = port or free_port()
        self.endpoint = "127.0.0.1:%d" % self.port
        self.proc = None

    def start(self):
        # one thread: this machine's 2 cores are shared with the worker and the other
        self.proc = subprocess.Popen([str(self.lib / "ggml-rpc-server"), "-H", "127.0.0.1",
                                      "-p", str(self.port), "-t", "1"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not _answers(self.port):
            assert self.proc.poll() is None, "ggml-rpc-server exited with %s" % self.proc.returncode
            assert time.monotonic() < deadline, "ggml-rpc-server did not listen in 30 s"
            time.sleep(0.05)
        return self

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _answers(port):
    import socket
    try:
        socket.create_connection(("127.0.0.1", port), 1).close()
        return True
    except OSError:
        return False


@pytest.fixture
def rpc_servers(rpc_lib, request):
    """Two rpc-servers for one test, always killed after it."""
    servers = [RpcServer(rpc_lib), RpcServer(rpc_lib)]
    for s in servers:
        request.addfinalizer(s.kill)
        s.start()
    return servers


def offgrid(lib, model, *flags, ctx=1024):
    return ServerProcess(model, "--lib", lib, *flags, threads=1, ctx=ctx, startup_timeout=300)


@pytest.fixture(scope="module")
def local_qwen(rpc_lib):
    """The reference: qwen with every layer on this machine, the same library and kernels."""
    with offgrid(rpc_lib, QWEN, "--no-repack") as s:
        yield s


COMPLETION = {"prompt": "def fibonacci(n):\n", "n_predict": 24, "temperature": 0,
              "cache_prompt": False}
INFILL = {"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n",
          "n_predict": 16, "temperature": 0, "cache_prompt": False}


def texts(server):
    """Greedy /completion and /infill content."""
    out = []
    for path, body in (("/completion", COMPLETION), ("/infill", INFILL)):
        status, _, got = server.post(path, body, timeout=300)
        assert status == 200, got
        out.append(got["content"])
    return out


# -- the flags ----------------------------------------------------------------------------------

def run_offgrid(*flags, timeout=120):
    return subprocess.run([sys.executable, "-m", "offgrid"] + [str(f) for f in flags],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=timeout)


def test_a_remote_rpc_host_is_refused_without_rpc_allow_remote():
    done = run_offgrid("-m", SMOL, "--port", free_port(), "--rpc", "192.168.7.9:50052")
    assert done.returncode == 2
    assert "192.168.7.9:50052" in done.stderr and "--rpc-allow-remote" in done.stderr


def test_a_malformed_rpc_endpoint_is_refused():
    done = run_offgrid("-m", SMOL, "--port", free_port(), "--rpc", "127.0.0.1")
    assert done.returncode == 2 and "HOST:PORT" in done.stderr


def test_an_rpc_endpoint_down_at_start_is_an_error_naming_it(rpc_lib):
    dead = "127.0.0.1:%d" % free_port()     # nobody listens there
    t0 = time.monotonic()
    done = run_offgrid("-m", SMOL, "--port", free_port(), "--lib", rpc_lib, "-t", "1",
                       "--rpc", dead)
    assert done.returncode == 1, done.stderr
    assert dead in done.stderr and "unreachable" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert time.monotonic() - t0 < 60


# -- the same text, split or not ----------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("local_layers", [0, N_LAYER[QWEN] // 2], ids=["none-local", "half-local"])
def test_greedy_text_over_two_rpc_servers_equals_local(rpc_servers, local_qwen, rpc_lib,
                                                       local_layers):
    endpoints = ",".join(s.endpoint for s in rpc_servers)
    n_all = N_LAYER[QWEN] + 1           # the output layer counts as one
    flags = ["--rpc", endpoints, "-ngl", n_all - local_layers, "--no-repack"]
    with offgrid(rpc_lib, QWEN, *flags) as split:
        status, _, props = split.get("/props")
        assert status == 200
        devices = props["devices"]
        assert [d["name"] for d in devices] == ["CPU", "RPC0", "RPC1"]
        assert [d.get("endpoint") for d in devices[1:]] == [s.endpoint for s in rpc_servers]
        assert devices[0]["layers"] == local_layers
        assert sum(d["layers"] for d in devices) == n_all
        assert all(d["layers"] > 0 for d in devices[1:])
        metrics = split.metrics()
        for d in devices:
            key = 'offgrid_model_device_layers{model="%s",device="%s",endpoint="%s"}' % (
                QWEN.name, d["name"], d.get("endpoint") or "")
            assert metrics[key] == d["layers"]
        assert texts(split) == texts(local_qwen)


def test_a_tensor_split_puts_the_layers_in_those_proportions(rpc_servers, rpc_lib):
    endpoints = ",".join(s.endpoint for s in rpc_servers)
    with offgrid(rpc_lib, SMOL, "--rpc", endpoints, "-ts", "3,1") as split:
        _, _, props = split.get("/props")
        layers = [d["layers"] for d in props["devices"]]
        assert layers[0] == 0 and sum(layers) == N_LAYER[SMOL] + 1
        assert layers[1] == pytest.approx(3 * layers[2], abs=3)
        status, _, got = split.post("/completion", COMPLETION)
        assert status == 200 and got["content"]


# -- an rpc-server that goes away ---------------------------------------------------------------

def test_killing_an_rpc_server_mid_stream_fails_that_request_and_the_model_comes_back(
        rpc_servers, rpc_lib):
    endpoints = ",".join(s.endpoint for s in rpc_servers)
    gone = rpc_servers[1]
    with offgrid(rpc_lib, SMOL, "--rpc", endpoints) as split:
        conn = split.conn(timeout=60)
        conn.request("POST", "/completion", body=(
            b'{"prompt": "Once upon a time", "n_predict": 100000, "ignore_eos": true, '
            b'"temperature": 0, "stream": true}'), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200
        first = r.readline()            # the first piece: generation is under way
        gone.kill()
        t0 = time.monotonic()
        rest = r.read()                 # the stream ends, with an error event
        ended = time.monotonic() - t0
        conn.close()
        assert ended < 10, "the stream went on %.1f s after its rpc-server died" % ended
        last = parse_sse((first + rest).decode("utf-8", "replace"))[-1]
        assert last["error"]["code"] == 503 and gone.endpoint in last["error"]["message"], (
            last, "".join(split.output))

        status, _, body = split.get("/health", timeout=10)
        assert status in (200, 503) and isinstance(body, dict)
        # while the endpoint is down: an immediate 503 naming it, not a wait
        t0 = time.monotonic()
        status, _, body = split.post("/completion", {"prompt": "Hi", "n_predict": 4},
                                     timeout=60)
        assert status == 503 and gone.endpoint in body["error"]["message"], body
        assert time.monotonic() - t0 < 5

        # the rpc-server returns on its port: the model is loaded again
        gone.start()
        deadline = time.monotonic() + 90
        while True:
            status, _, body = split.post("/completion", {"prompt": "Hi", "n_predict": 4,
                                                         "temperature": 0}, timeout=120)
            if status == 200:
                break
            assert status == 503, body
            assert time.monotonic() < deadline, "the model did not come back: %s" % body
            time.sleep(1)
        assert body["content"]
        assert split.metrics()['offgrid_worker_deaths_total{model="%s"}' % SMOL.name] >= 1


@pytest.mark.slow
def test_an_rpc_endpoint_that_never_answers_the_handshake_is_an_error_naming_it(rpc_lib):
    # what an rpc-server busy with another client looks like: the connection is
    # taken (the listen backlog) and nothing comes back
    import socket
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        endpoint = "127.0.0.1:%d" % silent.getsockname()[1]
        t0 = time.monotonic()
        done = run_offgrid("-m", SMOL, "--port", free_port(), "--lib", rpc_lib, "-t", "1",
                           "--rpc", endpoint)
    assert done.returncode == 1, done.stderr
    assert endpoint in done.stderr and "did not answer" in done.stderr, done.stderr
    assert time.monotonic() - t0 < 60


# -- kept prompt states (issue 50) ------------------------------------------------------------

@pytest.mark.slow
def test_kept_prompt_states_are_off_with_rpc_layers_and_nothing_aborts(rpc_servers, rpc_lib,
                                                                      tmp_path):
    """llama.cpp aborts while copying a sequence's state out of RPC layers (llama.cpp
    #26128, #26529): with layers on rpc-servers the worker keeps no prompt states, says
    so as it loads, and two conversations taking turns on one session (each turn would
    keep the other's state), then a shutdown (which would write them to --cache-dir),
    all go through with no worker death."""
    endpoints = ",".join(s.endpoint for s in rpc_servers)
    states = tmp_path / "states"
    split = offgrid(rpc_lib, SMOL, "--rpc", endpoints, "-np", "1", "--cache-ram", "64",
                    "--cache-dir", states).start()
    try:
        out = "".join(split.output)
        assert "prompt states kept off for %s" % SMOL.name in out, out
        systems = ["You keep the %s. " % what + " ".join(
            "Note %d on the %s." % (i, what) for i in range(40)) for what in ("apples", "boats")]
        for turn in range(2):
            for system in systems:
                status, _, body = split.post("/v1/chat/completions", {
                    "messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": "Turn %d?" % turn}],
                    "max_tokens": 3, "temperature": 0}, timeout=120)
                assert status == 200, body
        m = split.metrics()
        assert m['offgrid_worker_deaths_total{model="%s"}' % SMOL.name] == 0
        assert not any(k.startswith("offgrid_state_cache_saves_total") for k in m), m
    finally:
        code = split.stop()
    assert code == 0
    assert not list(states.rglob("*.state")), list(states.rglob("*"))


@pytest.mark.slow
def test_kept_prompt_states_stay_on_with_every_layer_local(rpc_servers, rpc_lib):
    """--rpc with -ngl 0 puts no layer on the rpc-servers: the states are safe, and kept."""
    endpoints = ",".join(s.endpoint for s in rpc_servers)
    with offgrid(rpc_lib, SMOL, "--rpc", endpoints, "-ngl", "0", "-np", "1",
                 "--cache-ram", "64") as split:
        assert "prompt states kept off" not in "".join(split.output)
        for what in ("apples", "boats"):
            status, _, body = split.post("/completion", {
                "prompt": "Notes on %s: " % what + "a note. " * 60, "n_predict": 2}, timeout=120)
            assert status == 200, body
        saves = split.metrics()['offgrid_state_cache_saves_total{model="%s"}' % SMOL.name]
        assert saves >= 1


@pytest.mark.slow
def test_a_hybrid_on_rpc_layers_copies_no_state_and_serves(rpc_servers, rpc_lib, tiny_dir):
    """A hybrid model's checkpoints and draft replays copy its recurrent state out, which
    llama.cpp cannot do from RPC layers: with layers on rpc-servers it makes none (/props
    says so), and a conversation whose turns diverge, with drafts asked for, goes through
    with no worker death and the text of the same model all local."""
    import archmodels
    model = archmodels.build("granitehybrid", tiny_dir)
    endpoints = ",".join(s.endpoint for s in rpc_servers)
    words = " ".join("word%d" % (i % 17) for i in range(120))
    prompts = [words, words[:300] + " changed", words + " more"]
    with offgrid(rpc_lib, model, "--rpc", endpoints, "-md", model, ctx=2048) as split, \
            offgrid(rpc_lib, model, "--spec-type", "none", ctx=2048) as local:
        memory = split.get("/props")[2]["memory"]
        assert memory["checkpoints"] is False and memory["draft_rollback"] == "none"
        for prompt in prompts:
            got = [s.post("/completion", {"prompt": prompt, "n_predict": 12, "temperature": 0},
                          timeout=120) for s in (split, local)]
            assert got[0][0] == 200, got[0][2]
            assert got[0][2]["content"] == got[1][2]["content"]
        m = split.metrics()
        assert m['offgrid_worker_deaths_total{model="%s"}' % model.name] == 0
