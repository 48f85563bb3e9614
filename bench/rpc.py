"""``make bench-rpc``: single-stream generation with the model's layers on rpc-servers.

    python3 bench/rpc.py [--model M] [--rounds 3] [--reps 2] [--servers 2] [--threads 2]

Starts ``--servers`` ggml-rpc-servers (``make rpc-server``, from lib/) on
loopback ports, an offgrid with ``--rpc`` to all of them (every layer
there: none local) and an offgrid with every layer local, both up at once,
and runs the bench's single-stream generation scenario (scenarios.generation:
128 tokens, greedy, cache off, the client's clock) on each in turn, A B B A,
as bench/run.py's single phase does.  Prints the medians side by side and
writes bench/results/rpc-latest.json.  A benchmark: it reports, it never
fails on a figure.

Over loopback this measures what the RPC round trips cost a token, not what
other machines' memory and cores bring: every process shares this machine's
cores (each rpc-server gets ``--threads``, and they compute one after the
other, as a layer split does).
"""

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import scenarios  # noqa: E402
from run import IDLE_GAP_S, load, log, machine, merge, source_hash  # noqa: E402
from servers import Config, free_port, offgrid  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def rpc_servers(exe, n, threads):
    """``n`` ggml-rpc-servers on free loopback ports: their endpoints; killed on exit."""
    procs, endpoints = [], []
    try:
        for _ in range(n):
            port = free_port()
            procs.append(subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port),
                                           "-t", str(threads)], stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
            endpoints.append("127.0.0.1:%d" % port)
            deadline = time.monotonic() + 30
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), 1).close()
                    break
                except OSError:
                    if procs[-1].poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("ggml-rpc-server on port %d did not start" % port)
                    time.sleep(0.1)
        yield endpoints
    finally:
        for p in procs:
            p.kill()
            p.wait()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/gemma-3-270m-q4_k_m.gguf")
    p.add_argument("--threads", type=int, default=2, help="threads of each server and rpc-server")
    p.add_argument("--servers", type=int, default=2, help="rpc-servers (default 2)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=2, help="generation samples per round")
    p.add_argument("--lib", default=str(ROOT / "lib"), help="folder with libllama and "
                   "ggml-rpc-server (default lib/, `make rpc-server`)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "rpc-latest.json"))
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    exe = Path(args.lib) / "ggml-rpc-server"
    if not exe.is_file():
        sys.exit("no %s: run `make rpc-server` first" % exe)
    base = ("--lib", args.lib)
    samples = {"local": {}, "rpc": {}}
    l0 = load()
    with rpc_servers(exe, args.servers, args.threads) as endpoints:
        cfgs = {"local": Config(args.model, args.threads, extra=base),
                "rpc": Config(args.model, args.threads,
                              extra=base + ("--rpc", ",".join(endpoints)))}
        with contextlib.ExitStack() as stack:
            servers = {name: stack.enter_context(offgrid(cfg)) for name, cfg in cfgs.items()}
            for s in servers.values():
                scenarios.warm_up(s.port)
            order = list(servers)
            for rnd in range(args.rounds):
                for name in (order if rnd % 2 == 0 else order[::-1]):
                    time.sleep(IDLE_GAP_S)
                    got = scenarios.generation(servers[name].port, args.reps, first=rnd)
                    merge(samples[name], {"generation": got})
                log("round %d/%d done, load %.2f" % (rnd + 1, args.rounds, load()))
    result = {"model": args.model, "threads": args.threads, "rpc_servers": args.servers,
              "rounds": args.rounds, "reps": args.reps, "load_at_start": l0,
              "load_at_end": load(), "machine": machine(), "source": source_hash(),
              "when": time.strftime("%Y-%m-%d %H:%M:%S"), "samples": samples}
    print("single-stream generation, %d tokens, greedy (median of %d samples; tok/s)"
          % (scenarios.GEN_TOKENS, args.rounds * args.reps))
    print("%-28s %10s %10s" % ("", "client", "timings"))
    for name, what in (("local", "every layer local"),
                       ("rpc", "none local, %d rpc-servers" % args.servers)):
        g = samples[name]["generation"]
        result[name] = {"client_tps": statistics.median(g["client_tps"]),
                        "server_tps": statistics.median(g["server_tps"])}
        print("%-28s %10.1f %10.1f" % (what, result[name]["client_tps"],
                                       result[name]["server_tps"]))
    ratio = result["rpc"]["client_tps"] / result["local"]["client_tps"]
    result["rpc_over_local"] = ratio
    print("rpc / local: %.2f   (load %.2f -> %.2f; the machine is shared)"
          % (ratio, l0, result["load_at_end"]))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
