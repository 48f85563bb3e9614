"""The throughput and overhead scenarios, each one run against one server.

Every function takes the server's port, sends the same requests whichever
server it is, and returns a dict of samples (lists, so the caller can pool
repetitions across rounds and quote medians).  The editor replay lives in
editor.py.

Figures come from the client's clock where that is possible, so neither
server grades itself; the servers' own ``timings`` are kept alongside.
Both servers report ``timings`` alike (llama-server's fields): ``prompt_n``
prompt tokens evaluated in ``prompt_ms``, ``predicted_n`` tokens generated in
``predicted_ms``, ``cache_n`` prompt tokens reused.  Rates from them are
computed here with one formula for both (n / ms), not taken from the
``*_per_second`` fields.
"""

import statistics
import threading
import time
from pathlib import Path

from servers import post, stream

DATA = Path(__file__).resolve().parent / "data"

GEN_TOKENS = 128
PROMPT_TOKENS = 500
OVERHEAD_REQUESTS = 30
CLIENTS, REQUESTS_PER_CLIENT, CONCURRENT_PREDICT = 4, 8, 32
CONCURRENT_DEADLINE_S = 300     # a server this slow gets no figure, not a hung bench


def rate(n, ms):
    return 1000.0 * n / ms if ms > 0 else 0.0


def warm_up(port):
    """One small request, so the first measured one does not pay for page faults."""
    post(port, "/completion", {"prompt": "Hello", "n_predict": 4, "temperature": 0,
                               "cache_prompt": False})


# -- 1. generation --------------------------------------------------------------

def generation(port, reps, first=0, n_predict=GEN_TOKENS):
    """One stream, n_predict tokens (GEN_TOKENS), greedy, cache off.

    client tok/s: (n - 1) token intervals between the first streamed piece and
    the final event, on the client's clock.  server tok/s: predicted_n /
    predicted_ms from the final event's timings.
    """
    out = {"client_tps": [], "server_tps": [], "predicted_n": []}
    for i in range(first, first + reps):
        body = {"prompt": "Here is a long story about a lighthouse keeper named %d:" % i,
                "n_predict": n_predict, "temperature": 0, "ignore_eos": True,
                "cache_prompt": False}
        events = stream(port, "/completion", body)
        pieces = [t for t, e in events if not e.get("stop") and e.get("content")]
        final = events[-1][1]
        t = final["timings"]
        n = t["predicted_n"]
        if n != n_predict or not pieces:
            raise RuntimeError("generation: %d tokens, %d pieces (wanted %d tokens)"
                               % (n, len(pieces), n_predict))
        out["client_tps"].append((n - 1) / (events[-1][0] - pieces[0]))
        out["server_tps"].append(rate(n, t["predicted_ms"]))
        out["predicted_n"].append(n)
    return out


# -- 2. prompt ------------------------------------------------------------------

_PROMPT_TEXT = None


def prompt_tokens(port):
    """Token ids of the bench's long text (both servers tokenize it alike)."""
    global _PROMPT_TEXT
    if _PROMPT_TEXT is None:
        _PROMPT_TEXT = (DATA / "context_files.py.txt").read_text("utf-8")
    obj, _ = post(port, "/tokenize", {"content": _PROMPT_TEXT})
    return obj["tokens"]


def prompt(port, reps, first=0):
    """A PROMPT_TOKENS-token prompt, n_predict 1, cache off: prompt_n / prompt_ms.

    The prompt is sent as token ids, so both servers evaluate exactly the same
    tokens; each repetition starts at a different place in the text.
    """
    ids = prompt_tokens(port)
    out = {"server_tps": [], "client_tps": [], "prompt_n": []}
    for i in range(first, first + reps):
        start = (i * 37) % (len(ids) - PROMPT_TOKENS)
        body = {"prompt": ids[start:start + PROMPT_TOKENS], "n_predict": 1, "temperature": 0,
                "cache_prompt": False}
        obj, wall = post(port, "/completion", body)
        t = obj["timings"]
        if t["prompt_n"] != PROMPT_TOKENS:
            raise RuntimeError("prompt: evaluated %d tokens, wanted %d"
                               % (t["prompt_n"], PROMPT_TOKENS))
        out["server_tps"].append(rate(t["prompt_n"], t["prompt_ms"]))
        out["client_tps"].append(t["prompt_n"] / wall)
        out["prompt_n"].append(t["prompt_n"])
    return out


# -- 4. per-request overhead ----------------------------------------------------

def overhead(port, n=OVERHEAD_REQUESTS):
    """n_predict 0 on a cached prompt: wall time of a request, new connection each.

    llama-server always decodes the last prompt token again (~one token's
    decode time); a server may skip that when nothing is generated, so
    outside_ms (wall minus the timings' prompt_ms + predicted_ms) is kept too:
    the part spent outside the engine.
    """
    body = {"prompt": "The quick brown fox jumps over the lazy dog. " * 3, "n_predict": 0,
            "temperature": 0, "cache_prompt": True}
    post(port, "/completion", body)         # caches the prompt
    out = {"wall_ms": [], "outside_ms": [], "cache_n": [], "prompt_n": []}
    for _ in range(n):
        obj, wall = post(port, "/completion", body)
        t = obj["timings"]
        out["wall_ms"].append(wall * 1000.0)
        # what the engine's own clock does not cover: HTTP, JSON, queueing
        out["outside_ms"].append(wall * 1000.0 - t["prompt_ms"] - t["predicted_ms"])
        out["cache_n"].append(obj["timings"].get("cache_n", obj.get("tokens_cached", 0)))
        out["prompt_n"].append(obj["timings"]["prompt_n"])
    return out


# -- 5. concurrent clients ------------------------------------------------------

def concurrent(port):
    """CLIENTS clients x REQUESTS_PER_CLIENT requests each, all at once: total tok/s.

    Each client sends its requests one after another on new connections;
    greedy, ignore_eos, CONCURRENT_PREDICT tokens each.  Throughput is all
    generated tokens over the wall time from the start to the last answer.
    """
    results = [[] for _ in range(CLIENTS)]
    errors = []
    start = threading.Barrier(CLIENTS + 1)

    def client(c):
        try:
            start.wait(60)
            for i in range(REQUESTS_PER_CLIENT):
                body = {"prompt": "Client %d, question %d: describe a city you would like "
                                  "to visit, and why." % (c, i),
                        "n_predict": CONCURRENT_PREDICT, "temperature": 0, "ignore_eos": True}
                obj, wall = post(port, "/completion", body, timeout=CONCURRENT_DEADLINE_S)
                results[c].append((obj["timings"]["predicted_n"], wall))
        except Exception as e:      # reported after the join
            errors.append(e)

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(CLIENTS)]
    for th in threads:
        th.start()
    start.wait(60)
    t0 = time.perf_counter()
    deadline = t0 + CONCURRENT_DEADLINE_S
    for th in threads:
        th.join(max(0.0, deadline - time.perf_counter()))
    elapsed = time.perf_counter() - t0
    if errors:
        raise RuntimeError("concurrent: %r" % errors[0])
    if any(th.is_alive() for th in threads):
        raise RuntimeError("concurrent: clients still running after %d s"
                           % CONCURRENT_DEADLINE_S)
    tokens = sum(n for r in results for n, _ in r)
    walls = [w for r in results for _, w in r]
    return {"tps": [tokens / elapsed], "tokens": [tokens], "elapsed_s": [elapsed],
            "request_p50_s": [statistics.median(walls)]}

