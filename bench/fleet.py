"""What HAProxy in front of offgrid replicas costs in throughput (docs/fleet.md).

    python3 bench/fleet.py [--model M] [--replicas 2] [--clients 4] [--seconds 15] [--rounds 2]

Starts ``--replicas`` offgrid replicas on loopback ports and Debian's HAProxy
with docs/fleet.md's configuration (its ports moved to these, its server
lines cut to the replicas started), then runs the same closed loop twice per
round, through HAProxy and directly, A B B A: ``--clients`` clients, each
with a session key of its own and one kept-alive connection, sending short
greedy completions one after another for ``--seconds``.  Directly, each
client talks to the replica HAProxy sends its key to (asked once, before the
rounds), so both ways spread the same clients over the same replicas and the
difference is the balancer's.  Prints generated tokens per second each way
and their ratio, and writes bench/results/fleet-latest.json.  A benchmark: it
reports, it never fails on a figure.
"""

import argparse
import http.client
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import IDLE_GAP_S, load, log, machine, source_hash  # noqa: E402
from servers import Config, free_port, offgrid  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOC_REPLICAS = ["127.0.0.1:8101", "127.0.0.1:8102", "127.0.0.1:8103"]
N_PREDICT = 32


def haproxy_config(front_port, replica_ports):
    """docs/fleet.md's HAProxy block, on these ports, with a server line per replica."""
    text = (ROOT / "docs" / "fleet.md").read_text()
    (block,) = [b for b in re.findall(r"```text\n(.*?)```", text, re.S) if "backend offgrid" in b]
    block = block.replace("127.0.0.1:8000", "127.0.0.1:%d" % front_port)
    lines = [line for line in block.splitlines()
             if not any(line.strip().startswith("server") and d in line
                        for d in DOC_REPLICAS[len(replica_ports):])]
    block = "\n".join(lines) + "\n"
    for doc, port in zip(DOC_REPLICAS, replica_ports):
        block = block.replace(doc, "127.0.0.1:%d" % port)
    return block


class HAProxy:
    def __init__(self, replica_ports, folder):
        self.port = free_port()
        self.conf = Path(folder) / "haproxy.cfg"
        self.conf.write_text(haproxy_config(self.port, replica_ports))
        self.proc = None

    def __enter__(self):
        exe = shutil.which("haproxy") or "/usr/sbin/haproxy"
        if not os.path.exists(exe):
            sys.exit("no haproxy: `make fleet-tools` installs it")
        self.proc = subprocess.Popen([exe, "-f", str(self.conf), "-db"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                if request(self.port, "/health")[0] == 200:
                    return self
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("haproxy did not start")
            time.sleep(0.1)

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait(10)


def request(port, path, body=None, key=None, conn=None):
    """(status, headers, parsed JSON) of one request, on ``conn`` if given."""
    c = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        headers = {"Content-Type": "application/json"}
        if key:
            headers["X-Session-Id"] = key
        c.request("POST" if body is not None else "GET", path,
                  json.dumps(body).encode() if body is not None else None, headers)
        r = c.getresponse()
        data = r.read()
        # header names in lower case: HAProxy sends them so
        return (r.status, {k.lower(): v for k, v in r.getheaders()},
                json.loads(data) if data else None)
    finally:
        if conn is None:
            c.close()


def closed_loop(ports, keys, seconds):
    """Each client (its key, its port) sends completions one after another for ``seconds``:
    (generated tokens per second, requests, errors)."""
    tokens, requests, errors = [0], [0], [0]
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client(i, port, key):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        k = 0
        while time.monotonic() < deadline:
            k += 1
            try:
                status, _, body = request(port, "/completion", {
                    "prompt": "Client %d, request %d: a sentence about lighthouses." % (i, k),
                    "n_predict": N_PREDICT, "temperature": 0}, key=key, conn=conn)
            except (OSError, http.client.HTTPException):
                status, body = 0, None
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            with lock:
                requests[0] += 1
                if status == 200:
                    tokens[0] += body["tokens_predicted"]
                else:
                    errors[0] += 1
        conn.close()

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(i, port, key))
               for i, (port, key) in enumerate(zip(ports, keys))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tokens[0] / (time.monotonic() - t0), requests[0], errors[0]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct-q4_1.gguf")
    p.add_argument("--replicas", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--parallel", type=int, default=2, help="sessions of each replica (-np)")
    p.add_argument("--threads", type=int, default=1, help="threads of each replica")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--seconds", type=float, default=15.0, help="of each closed loop")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "fleet-latest.json"))
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    samples = {"haproxy": [], "direct": []}
    l0 = load()
    with tempfile.TemporaryDirectory(prefix="offgrid-bench-fleet-") as folder:
        replicas = []
        try:
            for i in range(args.replicas):
                cfg = Config(args.model, args.threads, ctx=2048, parallel=args.parallel,
                             extra=("--instance-name", "r%d" % i))
                replicas.append(offgrid(cfg).start())
            by_name = {"r%d" % i: r.port for i, r in enumerate(replicas)}
            with HAProxy([r.port for r in replicas], folder) as balancer:
                keys = ["client-%d" % i for i in range(args.clients)]
                direct = [by_name[request(balancer.port, "/health", key=k)[1][
                    "x-offgrid-instance"]] for k in keys]
                log("clients per replica: %s" % {n: direct.count(p) for n, p in by_name.items()})
                ways = {"haproxy": [balancer.port] * len(keys), "direct": direct}
                closed_loop(ways["direct"], keys, 3)        # warm every replica up
                order = ["haproxy", "direct"]
                for rnd in range(args.rounds):
                    for way in (order if rnd % 2 == 0 else order[::-1]):
                        time.sleep(IDLE_GAP_S)
                        tps, n, errors = closed_loop(ways[way], keys, args.seconds)
                        samples[way].append({"tps": tps, "requests": n, "errors": errors})
                        log("round %d %s: %.1f tok/s, %d requests, %d errors, load %.2f"
                            % (rnd + 1, way, tps, n, errors, load()))
        finally:
            for r in replicas:
                r.stop()
    result = {"model": args.model, "replicas": args.replicas, "parallel": args.parallel,
              "threads": args.threads, "clients": args.clients, "seconds": args.seconds,
              "rounds": args.rounds, "n_predict": N_PREDICT, "load_at_start": l0,
              "load_at_end": load(), "machine": machine(), "source": source_hash(),
              "when": time.strftime("%Y-%m-%d %H:%M:%S"), "samples": samples}
    for way in samples:
        result[way] = statistics.median(s["tps"] for s in samples[way])
    result["haproxy_over_direct"] = result["haproxy"] / result["direct"]
    print("%d clients over %d replicas, %d-token greedy completions (median of %d; tok/s)"
          % (args.clients, args.replicas, N_PREDICT, args.rounds))
    print("through HAProxy %8.1f\ndirect         %8.1f\nratio          %8.2f   (load %.2f -> %.2f)"
          % (result["haproxy"], result["direct"], result["haproxy_over_direct"], l0,
             result["load_at_end"]))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
