#!/usr/bin/env python3
"""Soak test: offgrid under mixed traffic from a few clients for a long while.

    python3 scripts/soak.py --model models/gemma-3-270m-q4_k_m.gguf [--minutes 10]

Starts ``python -m offgrid`` on a free loopback port and runs ``--clients``
threads until the time is up, each picking requests at random: completions
(JSON and streamed), OpenAI completions and chat, streams the client hangs up
on halfway, pairs that supersede each other by ``id_slot``, tokenize round
trips, the GET endpoints, and malformed requests that must get their 4xx.

An error is any answer other than the one expected, or a failed connection.
The server's resident memory is measured once the warm-up is over (every
kind of request has run once and the first minute of load has passed, so
buffers that are allocated once are in), and again at the end.

Prints the figures and exits 0 only with no errors and RSS growth under
``--max-growth`` percent.  `make soak` runs the 10-minute version; it is not
part of `make test`.
"""

import argparse
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
         "old jars of jam near the river bank and count their silver coins").split()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_of(pid):
    with open("/proc/%d/status" % pid) as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def mib(n):
    return n / (1024.0 * 1024.0)


class Unexpected(Exception):
    """An answer that is not the one the request should get."""


class Client:
    """One client thread's requests; each method is one kind of traffic."""

    def __init__(self, port, rng, index):
        self.port, self.rng, self.index = port, rng, index

    def prompt(self, lo=3, hi=400):
        n = self.rng.randint(lo, hi)
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def call(self, method, path, body=None, expect=200, raw=None, timeout=300):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = raw if raw is not None else (json.dumps(body).encode() if body is not None
                                                else None)
            c.request(method, path, body=data, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            payload = r.read()
            if r.status != expect:
                raise Unexpected("%s %s: %d %s" % (method, path, r.status, payload[:200]))
            return payload
        finally:
            c.close()

    def json(self, *args, **kw):
        return json.loads(self.call(*args, **kw))

    # -- the kinds of traffic ----------------------------------------------------
    def completion(self):
        n = self.rng.randint(1, 48)
        body = self.json("POST", "/completion", {"prompt": self.prompt(), "n_predict": n,
                                                 "ignore_eos": True})
        if body["tokens_predicted"] != n:
            raise Unexpected("completion: %d tokens, wanted %d" % (body["tokens_predicted"], n))

    def completion_stream(self):
        data = self.call("POST", "/completion", {"prompt": self.prompt(), "n_predict": 32,
                                                 "stream": True})
        if b'"stop":true' not in data:
            raise Unexpected("stream did not end with its final object")

    def hang_up_mid_stream(self):
        body = json.dumps({"prompt": self.prompt(), "n_predict": 200, "stream": True,
                           "ignore_eos": True}).encode()
        with socket.create_connection(("127.0.0.1", self.port), timeout=300) as s:
            s.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                      % (len(body), body))
            got, wanted = b"", self.rng.randint(1, 10)
            while got.count(b"data: ") < wanted:
                data = s.recv(4096)
                if not data:
                    raise Unexpected("stream closed before the client hung up")
                got += data

    def openai_completion(self):
        body = self.json("POST", "/v1/completions", {"prompt": self.prompt(), "max_tokens": 16})
        if body["object"] != "text_completion":
            raise Unexpected("v1/completions: %r" % body)

    def chat(self):
        stream = self.rng.random() < 0.5
        data = self.call("POST", "/v1/chat/completions", {
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": self.prompt(3, 60)}],
            "max_tokens": 24, "stream": stream})
        if stream and not data.rstrip().endswith(b"data: [DONE]"):
            raise Unexpected("chat stream did not end with [DONE]")

    def supersede(self):
        # two requests with one id_slot: the first is cancelled, both answer 200
        slot = 100 + self.index
        out = {}

        def first():
            try:
                out["first"] = self.json("POST", "/completion", {
                    "prompt": self.prompt(), "n_predict": 300, "ignore_eos": True,
                    "id_slot": slot})
            except Exception as e:      # reported below, as this thread's error
                out["error"] = e
        t = threading.Thread(target=first)
        t.start()
        time.sleep(self.rng.uniform(0.0, 0.5))
        second = self.json("POST", "/completion", {"prompt": self.prompt(), "n_predict": 8,
                                                   "id_slot": slot, "ignore_eos": True})
        t.join(300)
        if "error" in out:
            raise out["error"]
        if second["tokens_predicted"] != 8:
            raise Unexpected("the superseding request was cut short")

    def tokens(self):
        text = self.prompt(1, 200)
        toks = self.json("POST", "/tokenize", {"content": text})["tokens"]
        back = self.json("POST", "/detokenize", {"tokens": toks})["content"]
        if back.strip() != text.strip():
            raise Unexpected("tokenize round trip changed the text")

    def reads(self):
        for path in ("/health", "/metrics", "/v1/models", "/props", "/slots"):
            self.call("GET", path)

    def bad(self):
        self.call("POST", "/completion", raw=b'{"prompt": ', expect=400)
        self.call("POST", "/completion", {"prompt": [1, -5]}, expect=400)
        self.call("GET", "/nowhere", expect=404)

    KINDS = [(completion, 5), (completion_stream, 3), (hang_up_mid_stream, 2),
             (openai_completion, 2), (chat, 2), (supersede, 1), (tokens, 2), (reads, 2), (bad, 1)]


def run(args):
    port = free_port()
    cmd = [sys.executable, "-m", "offgrid", "-m", args.model, "--port", str(port),
           "-np", str(args.parallel), "-c", str(args.ctx)]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    proc = subprocess.Popen(cmd, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    log = []
    ready = threading.Event()

    def read_log():
        for line in proc.stdout:
            log.append(line)
            if line.startswith("listening on http://"):
                ready.set()
    threading.Thread(target=read_log, daemon=True).start()
    if not ready.wait(300):
        proc.kill()
        sys.exit("offgrid did not start:\n" + "".join(log))

    counts, errors, lock = {}, [], threading.Lock()
    stop = threading.Event()

    def client(index):
        rng = random.Random(args.seed * 100 + index)
        c = Client(port, rng, index)
        kinds = [k for k, _ in Client.KINDS]
        weights = [w for _, w in Client.KINDS]
        while not stop.is_set():
            kind = rng.choices(kinds, weights)[0]
            try:
                kind(c)
                ok = True
            except Exception as e:
                ok = False
                with lock:
                    errors.append("%s: %s: %s" % (kind.__name__, type(e).__name__, e))
            with lock:
                counts[kind.__name__] = counts.get(kind.__name__, 0) + 1
            if not ok:
                time.sleep(0.5)

    # warm-up, before memory is measured: every kind of request once, and every
    # session's whole KV cache touched (its pages are only resident once used),
    # then load for a while
    warm = Client(port, random.Random(args.seed), 99)
    for kind, _ in Client.KINDS:
        kind(warm)
    text = " ".join(WORDS[i % len(WORDS)] for i in range(2 * args.ctx))
    ids = warm.json("POST", "/tokenize", {"content": text})["tokens"][:args.ctx - 80]
    fill = [threading.Thread(target=warm.call, args=("POST", "/completion", {
        "prompt": ids, "n_predict": 64, "ignore_eos": True, "cache_prompt": False}))
        for _ in range(args.parallel)]
    for t in fill:
        t.start()
    for t in fill:
        t.join(600)
    threads = [threading.Thread(target=client, args=(i,), daemon=True)
               for i in range(args.clients)]
    t_start = time.monotonic()
    for t in threads:
        t.start()
    warmup = min(60.0, args.minutes * 60 * 0.2)
    time.sleep(warmup)
    rss_start = rss_of(proc.pid)
    print("soak: %d clients, %.0f s; RSS after %.0f s of warm-up: %.1f MiB"
          % (args.clients, args.minutes * 60, warmup, mib(rss_start)), flush=True)
    deadline = t_start + args.minutes * 60
    next_report = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        if time.monotonic() >= next_report:
            next_report += 60
            with lock:
                n, e = sum(counts.values()), len(errors)
            print("soak: %4.0f s  requests %d  errors %d  RSS %.1f MiB"
                  % (time.monotonic() - t_start, n, e, mib(rss_of(proc.pid))), flush=True)
    stop.set()
    for t in threads:
        t.join(600)
    rss_end = rss_of(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "killed"

    growth = 100.0 * (rss_end - rss_start) / rss_start
    total = sum(counts.values())
    print("soak: %s" % ", ".join("%s %d" % kv for kv in sorted(counts.items())))
    print("soak: clients %d, requests %d, errors %d" % (args.clients, total, len(errors)))
    for e in errors[:20]:
        print("soak: error: %s" % e)
    print("soak: RSS start %.1f MiB, end %.1f MiB, growth %+.2f%% (limit %.0f%%)"
          % (mib(rss_start), mib(rss_end), growth, args.max_growth))
    print("soak: server exit code %s" % code)
    ok = not errors and growth < args.max_growth and code == 0
    print("soak: %s" % ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"))
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--parallel", type=int, default=2, help="the server's -np")
    p.add_argument("--ctx", type=int, default=2048, help="the server's -c")
    p.add_argument("--threads", type=int, default=0, help="the server's -t (default: its own)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-growth", type=float, default=5.0, help="allowed RSS growth, percent")
    return run(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
