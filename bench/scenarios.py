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
REQUESTS_PER_CLIENT, CONCURRENT_PREDICT = 8, 64
CONCURRENT_DEADLINE_S = 600     # a server this slow gets no figure, not a hung bench
STALL_GEN_TOKENS = 384          # the generating stream; outlasts the other's prompt
STALL_LEAD_TOKENS = 16          # streamed before the long prompt arrives
STALL_PROMPT_TOKENS = 2000
CONT_TOKENS = 128
CONT_CONTEXT_LINES = 60         # lines of the file before the cut: ~600 tokens
CONT_CUTS = (114, 168, 234, 277, 304, 191)    # 0-based lines where a sample's prompt ends


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
        merge_samples(out, stream_rate(port, body, "generation"))
    return out


def stream_rate(port, body, what):
    """One streamed /completion of exactly body["n_predict"] tokens: its rates."""
    events = stream(port, "/completion", body)
    pieces = [t for t, e in events if not e.get("stop") and e.get("content")]
    t = events[-1][1]["timings"]
    n = t["predicted_n"]
    if n != body["n_predict"] or not pieces:
        raise RuntimeError("%s: %d tokens, %d pieces (wanted %d tokens)"
                           % (what, n, len(pieces), body["n_predict"]))
    out = {"client_tps": (n - 1) / (events[-1][0] - pieces[0]),
           "server_tps": rate(n, t["predicted_ms"]), "predicted_n": n}
    for k in ("draft_n", "draft_n_accepted"):      # with speculation, both servers
        if k in t:
            out[k] = t[k]
    return out


def merge_samples(out, one):
    for k, v in one.items():
        out.setdefault(k, []).append(v)
    return out


# -- 2. prompt ------------------------------------------------------------------

def prompt_tokens(port):
    """Token ids of the bench's long text (both servers tokenize it alike)."""
    obj, _ = post(port, "/tokenize", {"content": (DATA / "context_files.py.txt").read_text(
        "utf-8")})
    return obj["tokens"]


def prompt(port, reps, first=0, n_tokens=PROMPT_TOKENS):
    """An n_tokens-token prompt (PROMPT_TOKENS), n_predict 1, cache off:
    prompt_n / prompt_ms.

    The prompt is sent as token ids, so both servers evaluate exactly the same
    tokens; each repetition starts at a different place in the text.
    """
    ids = prompt_tokens(port)
    out = {"server_tps": [], "client_tps": [], "prompt_n": []}
    for i in range(first, first + reps):
        start = (i * 37) % (len(ids) - n_tokens)
        body = {"prompt": ids[start:start + n_tokens], "n_predict": 1, "temperature": 0,
                "cache_prompt": False}
        obj, wall = post(port, "/completion", body)
        t = obj["timings"]
        if t["prompt_n"] != n_tokens:
            raise RuntimeError("prompt: evaluated %d tokens, wanted %d"
                               % (t["prompt_n"], n_tokens))
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

def concurrent(port, clients, requests=REQUESTS_PER_CLIENT, n_predict=CONCURRENT_PREDICT):
    """``clients`` clients x ``requests`` requests each, all at once: total tok/s.

    Each client sends its requests one after another on new connections;
    greedy, ignore_eos, n_predict tokens each.  Throughput is all generated
    tokens over the wall time from the start to the last answer; one client
    gives the single-stream rate on the same server, with the same requests.
    """
    results = [[] for _ in range(clients)]
    errors = []
    start = threading.Barrier(clients + 1)

    def client(c):
        try:
            start.wait(60)
            for i in range(requests):
                body = {"prompt": "Client %d, question %d: describe a city you would like "
                                  "to visit, and why." % (c, i),
                        "n_predict": n_predict, "temperature": 0, "ignore_eos": True}
                obj, wall = post(port, "/completion", body, timeout=CONCURRENT_DEADLINE_S)
                results[c].append((obj["timings"]["predicted_n"], wall,
                                   obj["timings"]["prompt_n"]))
        except Exception as e:      # reported after the join
            errors.append(e)

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
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
    tokens = sum(n for r in results for n, _, _ in r)
    walls = [w for r in results for _, w, _ in r]
    # the prompt tokens the server evaluated (what its cache did not hold):
    # llama-batched-bench's limit for the same work counts them (run.py)
    return {"tps": [tokens / elapsed], "tokens": [tokens], "elapsed_s": [elapsed],
            "request_p50_s": [statistics.median(walls)],
            "prompt_tokens": [sum(p for r in results for _, _, p in r)]}


# -- 6. a long prompt arriving while another session generates ------------------

def stall(port, reps):
    """Does one session's long prompt stall another session's stream?  (-np 2)

    Alone: a STALL_GEN_TOKENS-token stream, tok/s on the client's clock.
    With: the same stream; once STALL_LEAD_TOKENS pieces have arrived, a
    second client sends a STALL_PROMPT_TOKENS-token prompt (token ids, cache
    off, n_predict 1), so its answer comes when its prompt is evaluated.  The
    window is from that send to its answer (or the stream's end, if sooner);
    the stream's rate in the window is the pieces that arrived in it over its
    length.  A server that runs the sessions one after another shows a full
    rate here and a long wait on the prompt instead, so the prompt's wall time
    alone and during the stream is kept too, and the stream's longest gap.
    """
    ids = prompt_tokens(port)[:STALL_PROMPT_TOKENS]
    if len(ids) < STALL_PROMPT_TOKENS:
        raise RuntimeError("stall: the text has only %d tokens" % len(ids))
    out = {"alone_tps": [], "during_tps": [], "window_s": [], "max_gap_ms": [],
           "prompt_alone_s": [], "prompt_during_s": []}

    def gen_body(i):
        return {"prompt": "Here is a long story about a lighthouse keeper named %d:" % i,
                "n_predict": STALL_GEN_TOKENS, "temperature": 0, "ignore_eos": True,
                "cache_prompt": False}

    def long_prompt(i):
        # a different start each time, so no cache on either server helps
        return {"prompt": ids[i:] + ids[:i], "n_predict": 1, "temperature": 0,
                "cache_prompt": False}

    for i in range(reps):
        out["alone_tps"].append(stream_rate(port, gen_body(i), "stall")["client_tps"])
        out["prompt_alone_s"].append(post(port, "/completion", long_prompt(7 * i + 1))[1])
        origin = time.perf_counter()        # one clock for both clients
        span = {}

        def second(body):
            try:
                t0 = time.perf_counter() - origin
                post(port, "/completion", body, timeout=CONCURRENT_DEADLINE_S)
                span["s"] = (t0, time.perf_counter() - origin)
            except Exception as e:      # reported below
                span["error"] = e

        sender = threading.Thread(target=second, args=(long_prompt(7 * i + 2),), daemon=True)

        def on_event(n):
            if n == STALL_LEAD_TOKENS:
                sender.start()

        events = stream(port, "/completion", gen_body(100 + i), on_event=on_event,
                        origin=origin)
        sender.join(CONCURRENT_DEADLINE_S)
        if "s" not in span:
            raise RuntimeError("stall: the long prompt failed or never started: %r"
                               % (span.get("error"),))
        arrivals = [t for t, e in events if not e.get("stop") and e.get("content")]
        w0, w1 = span["s"][0], min(span["s"][1], arrivals[-1])
        inside = [t for t in arrivals if w0 <= t <= w1]
        # the longest wait for a token that overlaps the window
        edges = [w0] + inside + [w1]
        before = [t for t in arrivals if t < w0]
        if before:
            edges[0] = before[-1]
        out["during_tps"].append(len(inside) / (w1 - w0) if w1 > w0 else 0.0)
        out["window_s"].append(w1 - w0)
        out["max_gap_ms"].append(1000.0 * max(b - a for a, b in zip(edges, edges[1:])))
        out["prompt_during_s"].append(span["s"][1] - span["s"][0])
    return out


# -- 7. code continuation ---------------------------------------------------------

def continuation(port, reps, first=0):
    """/completion continuing a real source file: CONT_TOKENS tokens, greedy.

    Each sample's prompt is the CONT_CONTEXT_LINES lines of
    bench/data/typed_file.py.txt before one of CONT_CUTS (a different cut per
    sample, so no server answers from a cache or from n-grams of an identical
    earlier request), as text, cache on.  tok/s on the client's clock from the
    first streamed piece to the last, as generation's, which is what n-gram
    speculation changes; the servers' timings and draft counts are kept.
    """
    lines = (DATA / "typed_file.py.txt").read_text("utf-8").split("\n")
    out = {}
    for i in range(first, first + reps):
        cut = CONT_CUTS[i % len(CONT_CUTS)]
        text = "".join(ln + "\n" for ln in lines[max(0, cut - CONT_CONTEXT_LINES):cut])
        body = {"prompt": text, "n_predict": CONT_TOKENS, "temperature": 0,
                "ignore_eos": True, "cache_prompt": True}
        merge_samples(out, stream_rate(port, body, "continuation"))
    return out
