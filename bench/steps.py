"""Where a batched run's time goes: every decode step of each server, timed.

    sudo .venv/bin/python bench/steps.py [--clients 4] [--servers offgrid,llama_server]

The "batched" phase of run.py says which server is faster with N clients;
this says why.  It runs the same load (scenarios.concurrent) on each server
while ``perf`` times every call of ``llama_context::decode`` in the process
that decodes (offgrid's model worker, llama-server itself) with a uprobe on
its entry and its return.  Both servers reach that one function, whichever
batch API they call, so the steps are counted alike: the time inside the
decodes, and the gaps between them (sampling, and whatever a server does
between two steps), and per step size: how a server packs its clients'
work into steps.  Needs Linux perf and the right to add uprobes (root);
nothing else in the bench uses it.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import run as bench_run
import scenarios
import servers

SYMBOL = "_ZN13llama_context6decodeERK15llama_batch_ext"   # llama_context::decode
GROUP = "offgrid_steps"
# Each step's size: the batch's tokens are a std::vector<llama_batch_ext::token>
# at offset 64 of the batch, 96 bytes a token (src/llama-batch.h of the pinned
# source; tests/test_bench_cli.py compiles it to check), and the entry probe
# reads its begin and end through the reference in %si (x86-64's second
# argument register, after this)
TOKENS_AT, TOKEN_SIZE = 64, 96
_EVENT = re.compile(r"\s(\d+\.\d+):\s+%s:(enter|leave)(?:__return)?:"
                    r"(?:.*\bb=(0x[0-9a-f]+)\s+e=(0x[0-9a-f]+))?" % GROUP)


def symbol_address(path):
    """The address of llama_context::decode in the ELF file ``path``."""
    out = subprocess.run(["nm", "--defined-only", str(path)], capture_output=True, text=True,
                         check=True).stdout
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == SYMBOL:
            return int(parts[0], 16)
    raise RuntimeError("%s has no %s" % (path, SYMBOL))


def add_probes(path):
    addr = symbol_address(path)
    remove_probes()
    enter = "%s:enter=0x%x b=+%d(%%si):x64 e=+%d(%%si):x64" % (GROUP, addr, TOKENS_AT,
                                                              TOKENS_AT + 8)
    for spec in (enter, "%s:leave=0x%x%%return" % (GROUP, addr)):
        subprocess.run(["perf", "probe", "-q", "-x", str(path), "-a", spec], check=True,
                       stdout=subprocess.DEVNULL)


def remove_probes():
    subprocess.run(["perf", "probe", "-q", "-d", GROUP + ":*"], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


def parse_steps(text):
    """(start, end, tokens) of every decode in ``perf script`` output: an
    entry followed by its return (a return without an entry is dropped);
    tokens is None where the entry did not record the batch."""
    steps, start = [], None
    for line in text.splitlines():
        m = _EVENT.search(line)
        if not m:
            continue
        t = float(m.group(1))
        if m.group(2) == "enter":
            n = (int(m.group(4), 16) - int(m.group(3), 16)) // TOKEN_SIZE if m.group(3) else None
            start = (t, n)
        elif start is not None:
            steps.append((start[0], t, start[1]))
            start = None
    return steps


def summary(steps):
    """Totals of a run's steps."""
    if len(steps) < 2:
        raise RuntimeError("only %d decode steps traced" % len(steps))
    decode = [b - a for a, b, _ in steps]
    gaps = [steps[i + 1][0] - steps[i][1] for i in range(len(steps) - 1)]
    by_size = {}
    for a, b, n in steps:
        by_size.setdefault(n, []).append(b - a)
    return {"steps": len(steps), "span_s": steps[-1][1] - steps[0][0],
            "decode_s": sum(decode), "gaps_s": sum(gaps),
            "step_p50_ms": 1000 * statistics.median(decode),
            "gap_p50_ms": 1000 * statistics.median(gaps),
            "steps_over_40ms": sum(1 for d in decode if d > 0.040),
            # tokens in a step -> [steps, seconds in them, median ms, steps over 40 ms]
            "by_tokens": {n: [len(v), sum(v), 1000 * statistics.median(v),
                              sum(1 for d in v if d > 0.040)]
                          for n, v in sorted(by_size.items(), key=lambda kv: kv[0] or 0)}}


def decoding_process(name, server):
    """(pid, ELF file holding the decode) of a started server."""
    if name == "offgrid":
        for pid in servers._children(server.proc.pid):      # the model's worker
            with open("/proc/%d/maps" % pid) as maps:
                for line in maps:
                    if "libllama.so" in line:
                        return pid, line.split()[-1]
        raise RuntimeError("no worker of offgrid's has libllama mapped")
    return server.proc.pid, os.path.realpath("/proc/%d/exe" % server.proc.pid)


def trace(name, cfg, bins, clients, out_dir):
    make = {"offgrid": servers.offgrid, "llama_server": servers.llama_server}[name]
    with make(cfg, bins) as server:
        scenarios.warm_up(server.port)
        pid, elf = decoding_process(name, server)
        add_probes(elf)
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        data = Path(out_dir) / ("%s.perf" % name)
        perf = subprocess.Popen(["perf", "record", "-q", "-o", str(data), "-p", str(pid),
                                 "-e", GROUP + ":enter", "-e", GROUP + ":leave__return"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(1.0)         # perf attaches
            got = scenarios.concurrent(server.port, clients)
        finally:
            perf.send_signal(2)
            perf.wait(60)
            remove_probes()
    text = subprocess.run(["perf", "script", "-i", str(data)], capture_output=True,
                          text=True).stdout
    out = summary(parse_steps(text))   # perf starts after the warm-up
    out["tok_s"] = got["tps"][0]
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(bench_run.ROOT / "models/gemma-3-270m-q4_k_m.gguf"))
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--servers", default="offgrid,llama_server")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--layout", choices=sorted(bench_run.KV_LAYOUTS), default=None,
                   help="both servers' KV cells laid out alike, as run.py's batched phases "
                        "(default: each server's own default)")
    p.add_argument("--llama-bin", help="folder with the patched llama-server (default: "
                   "scripts/build_lib.sh --server)")
    p.add_argument("--parallel", type=int, default=None,
                   help="each server's sessions/slots, -np (default: --clients)")
    p.add_argument("--out-dir", default="/tmp", help="where perf's recordings go")
    args = p.parse_args(argv)
    names = args.servers.split(",")
    bins = bench_run.llama_bins(argparse.Namespace(llama_bin=args.llama_bin, stock_bin=None,
                                                   servers=names))
    flags = bench_run.KV_LAYOUTS[args.layout][1] if args.layout else {}
    print("%-13s %6s %6s %8s %8s %7s %9s %8s %6s" % (
        "server", "tok/s", "steps", "decode s", "gaps s", "span s", "step p50", "gap p50",
        ">40ms"))
    for rnd in range(args.rounds):
        for name in (names if rnd % 2 == 0 else names[::-1]):
            cfg = servers.Config(args.model, args.threads, 4096, args.parallel or args.clients,
                                 extra=tuple(flags.get(name, ())))
            s = trace(name, cfg, bins, args.clients, args.out_dir)
            print("%-13s %6.1f %6d %8.2f %8.2f %7.2f %6.2f ms %5.2f ms %6d" % (
                name, s["tok_s"], s["steps"], s["decode_s"], s["gaps_s"], s["span_s"],
                s["step_p50_ms"], s["gap_p50_ms"], s["steps_over_40ms"]), flush=True)
            print("    by tokens in a step (steps, seconds, p50 ms, >40ms): " + ", ".join(
                "%s: %d %.2f %.1f %d" % ((n,) + tuple(v)) for n, v in s["by_tokens"].items()))


if __name__ == "__main__":
    sys.exit(main())
