"""Every context decodes on one persistent ggml thread pool per thread count.

Without an attached pool, ggml starts and joins its worker threads inside
each llama_decode; with several sessions that costs half the throughput
(see session._POOLS).  What a pool changes is visible from outside: its
workers exist from the moment the first context attaches it, survive every
decode, and are not multiplied by more sessions.  The threads are counted in
a fresh interpreter, where nothing else starts threads.
"""

import subprocess
import sys
from pathlib import Path

from offgrid import libllama

ROOT = Path(__file__).resolve().parent.parent

_PROBE = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
from offgrid.engine.model import Model
from offgrid.request import SamplingParams
from offgrid.engine.session import ChatSession, GenerationParams

def threads():
    return len(os.listdir("/proc/self/task"))

model = Model.load(sys.argv[2], progress=False)
counts = [threads()]
a = ChatSession(model, n_ctx=256, n_batch=64, n_threads=2)
counts.append(threads())
b = ChatSession(model, n_ctx=256, n_batch=64, n_threads=2)
counts.append(threads())
greedy = GenerationParams(n_predict=8, sampling=SamplingParams(temperature=0.0))
prompt = model.tokenize("The capital of France is")
texts = [a.complete(prompt, greedy).text, b.complete(prompt, greedy).text]
counts.append(threads())
a.close(); b.close(); model.close()
print(counts)
print(texts[0] == texts[1] and len(texts[0]) > 0)
"""


def test_sessions_share_one_persistent_pool(gemma_path):
    out = subprocess.run([sys.executable, "-c", _PROBE, str(ROOT), str(gemma_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    counts, same = out.stdout.split("\n")[:2]
    before, first, second, after_decodes = eval(counts)
    # a 2-thread pool has one worker besides the thread that calls decode
    assert first == before + 1
    assert second == first, "a second session made a second pool"
    assert after_decodes == first, "decodes started or stopped threads"
    assert same == "True"


def test_a_pool_closes_once(lib):
    pool = libllama.ThreadPool(lib, 1)
    assert pool.ptr is not None, "the CPU backend offers no ggml_threadpool_new"
    assert pool._pause is not None, "the registry hands out no ggml_threadpool_pause (patch 0003)"
    pool.close()
    pool.close()
    assert pool.ptr is None


_IDLE_PROBE = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from offgrid import libllama
from offgrid.engine.model import Model
from offgrid.request import SamplingParams
from offgrid.engine.session import ChatSession, GenerationParams, pause_pools

poll, _, then = sys.argv[3].partition("+")
if poll != "default":
    libllama.ThreadPool.POLL = int(poll)
model = Model.load(sys.argv[2], progress=False)
s = ChatSession(model, n_ctx=256, n_batch=64, n_threads=2)
s.complete(model.tokenize("The capital of France is"),
           GenerationParams(n_predict=8, sampling=SamplingParams(temperature=0.0)))
if then == "pause":
    pause_pools()
t0 = time.process_time()
time.sleep(0.3)
print(time.process_time() - t0)
"""


def _cpu_after_decodes(gemma_path, poll):
    out = subprocess.run([sys.executable, "-c", _IDLE_PROBE, str(ROOT), str(gemma_path), poll],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return float(out.stdout.split()[-1])


def _polling_control(gemma_path):
    # ggml's default poll level (50, as llama-server's): its worker polls for
    # ~0.2 s here; how long depends on the CPU's pause instruction (far
    # shorter on some), so the checks below compare with this, measured here
    control = _cpu_after_decodes(gemma_path, "50")
    assert control > 0.01, "the control did not poll: the probe measures nothing"
    return control


def test_a_pools_threads_sleep_soon_after_the_last_decode(gemma_path):
    # The process's CPU time in the 0.3 s after its last decode: its pool's
    # worker polling for the next graph is all that could spend it.
    control = _polling_control(gemma_path)
    spent = _cpu_after_decodes(gemma_path, "default")
    assert spent < min(0.03, control / 4), \
        "the pool's worker polled %.3f s of CPU after the decodes (control %.3f)" % (spent,
                                                                                     control)


def test_a_paused_pool_sleeps_at_once(gemma_path):
    # what a worker does when another model's worker waits for the decode
    # turn (engine/worker.FileTurns): even at ggml's default poll level
    control = _polling_control(gemma_path)
    spent = _cpu_after_decodes(gemma_path, "50+pause")
    assert spent < min(0.03, control / 4), \
        "the paused pool's worker polled %.3f s of CPU (control %.3f)" % (spent, control)
