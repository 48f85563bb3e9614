"""``make bench``: offgrid against llama-server on the same model, side by side.

    python3 bench/run.py [--rounds 3] [--keys 100] [--only editor] ...

Builds (or finds cached) llama-server and llama-bench from the pinned
llama.cpp source via ``scripts/build_lib.sh --server``, makes the FIM copy of
the model for the editor replay (fimmodel.py), then runs every scenario on
both servers, one server process at a time, and writes a table to the
terminal and ``bench/results/latest.json``.

Rounds and alternation: the scenarios are grouped into phases, one server
configuration each.  Each round runs every phase on both servers, and the
server that goes first alternates from round to round (ABBA), so load that
drifts during a run hits both.  The single-stream phase goes further: both
servers are up at once and its generation and prompt samples alternate
request by request (A B B A ...), because this VM's speed wanders by several
per cent within a minute, and a ratio near 1 is only meaningful if both
sides see the same machine.  Figures are medians over all samples of all
rounds (the editor's p50/p95 over all pauses of all rounds).

    phase     server flags (both)                     scenarios
    single    -np 1 -c CTX -b 512 -ub 512             generation, prompt, overhead, RSS
    parallel  -np 2 -c CTX (per slot) -b 512          4 clients x 8 requests
    editor    FIM copy, -np 1 -c CTX -b 2048 -ub 512  /infill typing replay

The editor phase uses llama-server's default batch (2048, ubatch 512) for
both servers: /infill keeps 3/4 of the batch for the prefix and 1/4 for the
suffix, so this gives the ~1500-token prefix and ~500-token suffix an
editor's request has.  Benchmarks report; they never fail on a figure.
"""

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import busy as busy_phase  # noqa: E402
import editor  # noqa: E402
import fimmodel  # noqa: E402
import scenarios  # noqa: E402
from servers import SERVERS, Config, CpuMeter  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NAMES = {"offgrid": "offgrid", "llama_server": "llama-server"}

# name -> (unit, higher_is_better, what); the order of the table
ROWS = [
    ("generation_tok_s", "tok/s", True,
     "generation: 1 stream, 128 tokens, greedy, cache off (client clock)"),
    ("generation_tok_s_timings", "tok/s", True, "generation, by the servers' timings"),
    ("prompt_tok_s", "tok/s", True, "prompt: 500 tokens, n_predict 1, cache off (timings)"),
    ("prompt_tok_s_client", "tok/s", True, "prompt, by request wall time"),
    ("editor_p50_ms", "ms", False, "editor replay: last keystroke to answer at a pause, p50"),
    ("editor_p95_ms", "ms", False, "editor replay: last keystroke to answer at a pause, p95"),
    ("editor_own_p50_ms", "ms", False,
     "editor replay: those answers' own prompt_ms + predicted_ms, p50"),
    ("editor_cached_fraction", "", True, "editor replay: mean cached fraction of the prompt"),
    ("overhead_p50_ms", "ms", False, "request overhead: n_predict 0 on a cached prompt, p50"),
    ("overhead_outside_p50_ms", "ms", False,
     "request overhead outside the engine (wall - prompt_ms - predicted_ms), p50"),
    ("parallel_tok_s", "tok/s", True, "parallel: 4 clients x 8 requests x 32 tokens, -np 2"),
    ("peak_rss_mib", "MiB", False, "peak RSS (VmHWM) after the single-stream scenarios"),
]


# -- machine ---------------------------------------------------------------------

def machine():
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = "%.1f GiB" % (int(line.split()[1]) / 1024 / 1024)
                    break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu": cpu, "memory": mem,
            "os": "%s %s" % (platform.system(), platform.release()),
            "python": platform.python_version()}


def git_revision():
    try:
        rev = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=str(ROOT),
                                      stderr=subprocess.DEVNULL, text=True).strip()
        dirty = subprocess.call(["git", "diff", "--quiet", "HEAD", "--", "offgrid"],
                                cwd=str(ROOT), stderr=subprocess.DEVNULL) != 0
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return ""


def source_hash():
    """sha256 of offgrid/'s Python files: which code was measured, committed or not."""
    h = hashlib.sha256()
    for path in sorted((ROOT / "offgrid").rglob("*.py")):
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def load():
    return round(os.getloadavg()[0], 2)


# -- llama-server / llama-bench ----------------------------------------------------

def llama_bin(path):
    if path:
        return Path(path)
    log("building or finding llama-server (scripts/build_lib.sh --server)")
    out = subprocess.check_output(["bash", "scripts/build_lib.sh", "--server"], cwd=str(ROOT),
                                  text=True, timeout=3600)
    return Path(out.strip().splitlines()[-1])


def llama_bench(bindir, model, threads, reps):
    """llama-bench pp512 and tg128: {test: tok/s}."""
    cmd = [str(bindir / "llama-bench"), "-m", model, "-t", str(threads), "-p", "512",
           "-n", "128", "-r", str(reps), "-o", "json"]
    out = subprocess.check_output(cmd, cwd=str(ROOT), text=True, stderr=subprocess.DEVNULL,
                                  timeout=900)
    res = {}
    for entry in json.loads(out):
        name = ("pp%d" % entry["n_prompt"]) if entry["n_prompt"] else ("tg%d" % entry["n_gen"])
        res[name] = {"tok_s": entry["avg_ts"], "stddev": entry["stddev_ts"]}
    return res


# -- phases ------------------------------------------------------------------------

IDLE_GAP_S = 1.0       # before each paired sample: the other server's threads go to sleep


def run_single(servers, order, reps):
    """The single-stream scenarios on servers that are all up at once.

    Generation and prompt samples alternate between the servers one request
    at a time (A B B A ...), so a sample of one is never more than a few
    seconds from a sample of the other.  Before each, a pause: after a
    decode, ggml's worker threads keep polling for the next one for a while
    (up to a few hundred ms here) before they sleep, and the other server's
    must not be spinning while this one is measured.
    """
    out = {name: {} for name in servers}
    for name in order:
        scenarios.warm_up(servers[name].port)

    def quiet(fn, *a, **kw):
        time.sleep(IDLE_GAP_S)
        return fn(*a, **kw)

    for i in range(reps + 1):
        for name in (order if i % 2 == 0 else order[::-1]):
            port = servers[name].port
            got = {"prompt": quiet(scenarios.prompt, port, 1, first=i)}
            if i < reps:
                got["generation"] = quiet(scenarios.generation, port, 1, first=i)
            merge(out[name], got)
    for name in order:
        merge(out[name], {"overhead": quiet(scenarios.overhead, servers[name].port)})
    return out


def run_parallel(port, reps):
    scenarios.warm_up(port)
    return {"concurrent": scenarios.concurrent(port)}


def phases(args, fim):
    """(name, server config, what to run on one server's port); None: run_paired."""
    return [
        ("single", Config(args.model, args.threads, args.ctx, 1, 512, 512), None),
        ("parallel", Config(args.model, args.threads, args.ctx, 2, 512, 512), run_parallel),
        ("editor", Config(str(fim), args.threads, args.ctx, 1, 2048, 512),
         lambda port, reps: {"editor": editor.replay(port, args.keys)}),
    ]


def for_server(cfg, name, args):
    """The config of one server: offgrid's threads may differ (--offgrid-threads auto)."""
    if name == "offgrid" and args.offgrid_threads != "same":
        return dataclasses.replace(
            cfg, threads=None if args.offgrid_threads == "auto" else int(args.offgrid_threads))
    return cfg


def merge(into, new):
    """Append the lists of ``new`` to those of ``into`` (nested by scenario)."""
    for scen, samples in new.items():
        dst = into.setdefault(scen, {})
        for k, v in samples.items():
            if isinstance(v, list):
                dst.setdefault(k, []).extend(v)
            else:
                dst[k] = dst.get(k, 0) + v


def run_paired(rnd, args, cfg, bindir, order, samples, busy, errors):
    """Round ``rnd`` of the single-stream phase: every server up at once."""
    servers = {name: SERVERS[name](for_server(cfg, name, args), bindir) for name in order}
    l0 = load()
    t0 = time.monotonic()
    try:
        with contextlib.ExitStack() as stack:
            for server in servers.values():
                stack.enter_context(server)
            meter = CpuMeter(*(server.proc.pid for server in servers.values()))
            meter.start()
            got = run_single(servers, order, args.reps)
            for name, server in servers.items():
                got[name]["rss"] = {"peak_mib": [server.peak_rss_mb()]}
            others = meter.others()
    except Exception as e:
        log("round %d single FAILED: %s" % (rnd + 1, e))
        errors.append("round %d single: %s" % (rnd + 1, e))
        return
    for name in order:
        busy.append({"round": rnd + 1, "phase": "single", "server": name,
                     "load": l0, "others_cpu": round(others, 3)})
        merge(samples[name], got[name])
    log("round %d/%d %-8s %-12s %5.1f s  load %.2f, other processes %2.0f%% CPU"
        % (rnd + 1, args.rounds, "single", "+".join(NAMES[n] for n in order),
           time.monotonic() - t0, l0, 100 * others))


def run_all(args, bindir, fim):
    samples = {s: {} for s in args.servers}
    busy, errors = [], []
    for rnd in range(args.rounds):
        order = args.servers if rnd % 2 == 0 else list(reversed(args.servers))
        for phase, cfg, fn in phases(args, fim):
            if args.only and phase not in args.only:
                continue
            if fn is None:
                run_paired(rnd, args, cfg, bindir, order, samples, busy, errors)
                continue
            for name in order:
                server = SERVERS[name](for_server(cfg, name, args), bindir)
                l0 = load()
                t0 = time.monotonic()
                try:
                    with server:
                        meter = CpuMeter(server.proc.pid)
                        meter.start()
                        got = fn(server.port, args.reps)
                        key = "rss" if phase == "single" else "rss_" + phase
                        got[key] = {"peak_mib": [server.peak_rss_mb()]}
                        others = meter.others()
                except Exception as e:      # one failed phase must not lose the others
                    log("round %d %s %s FAILED: %s" % (rnd + 1, phase, NAMES[name], e))
                    errors.append("round %d %s %s: %s" % (rnd + 1, phase, name, e))
                    continue
                busy.append({"round": rnd + 1, "phase": phase, "server": name,
                             "load": l0, "others_cpu": round(others, 3)})
                log("round %d/%d %-8s %-12s %5.1f s  load %.2f, other processes %2.0f%% CPU"
                    % (rnd + 1, args.rounds, phase, NAMES[name], time.monotonic() - t0, l0,
                       100 * others))
                merge(samples[name], got)
    return samples, busy, errors


# -- figures -----------------------------------------------------------------------

def percentile(xs, p):
    """Nearest-rank-interpolated percentile (statistics.quantiles' inclusive method)."""
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    k = (len(xs) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def figures(s):
    """The table's figures for one server's samples (missing scenarios left out)."""
    f = {}

    def med(scen, key):
        if scen in s and s[scen].get(key):
            return statistics.median(s[scen][key])
        return None

    f["generation_tok_s"] = med("generation", "client_tps")
    f["generation_tok_s_timings"] = med("generation", "server_tps")
    f["prompt_tok_s"] = med("prompt", "server_tps")
    f["prompt_tok_s_client"] = med("prompt", "client_tps")
    if "editor" in s:
        e = s["editor"]
        f["editor_p50_ms"] = percentile(e["latency_ms"], 50)
        f["editor_p95_ms"] = percentile(e["latency_ms"], 95)
        f["editor_own_p50_ms"] = percentile(e["own_ms"], 50)
        f["editor_cached_fraction"] = statistics.mean(e["cached_fraction"])
    f["overhead_p50_ms"] = med("overhead", "wall_ms")
    f["overhead_outside_p50_ms"] = med("overhead", "outside_ms")
    f["parallel_tok_s"] = med("concurrent", "tps")
    f["peak_rss_mib"] = med("rss", "peak_mib")
    return {k: v for k, v in f.items() if v is not None}


def table(result):
    sc = result["scenarios"]
    lines = ["%-26s %12s %13s %7s  %-6s %s" % ("scenario", "offgrid", "llama-server", "ratio",
                                              "unit", "")]
    for name, unit, higher, what in ROWS:
        if name not in sc:
            continue
        r = sc[name]
        ratio = "%.2f" % r["ratio"] if r.get("ratio") is not None else "-"
        lines.append("%-26s %12s %13s %7s  %-6s %s" % (
            name, fmt(r.get("offgrid")), fmt(r.get("llama_server")), ratio, unit,
            ("higher is better" if higher else "lower is better")))
    lb = result.get("llama_bench")
    if lb:
        lines.append("llama-bench (-t %d): %s" % (result["settings"]["threads"], ", ".join(
            "%s %.1f ± %.1f tok/s" % (k, v["tok_s"], v["stddev"]) for k, v in sorted(lb.items()))))
    return "\n".join(lines)


def markdown(result):
    """The table as Markdown, for README's Performance section."""
    lines = ["| scenario | offgrid | llama-server | offgrid / llama-server |",
             "| --- | ---: | ---: | ---: |"]
    for name, unit, higher, what in ROWS:
        r = result["scenarios"].get(name)
        if r is None:
            continue
        label = "%s (%s)" % (what, unit) if unit else what
        ratio = "%.2f" % r["ratio"] if r.get("ratio") is not None else "-"
        lines.append("| %s | %s | %s | %s |" % (label, fmt(r.get("offgrid")),
                                              fmt(r.get("llama_server")), ratio))
    return "\n".join(lines)


def fmt(x):
    if x is None:
        return "-"
    if abs(x) >= 100:
        return "%.0f" % x
    if abs(x) >= 1:
        return "%.1f" % x
    return "%.3f" % x


def log(msg):
    print("[bench] %s" % msg, file=sys.stderr, flush=True)


# -- main --------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/gemma-3-270m-q4_k_m.gguf")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=4096, help="context per session/slot")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every phase on both servers")
    p.add_argument("--reps", type=int, default=2, help="generation/prompt samples per round")
    p.add_argument("--keys", type=int, default=editor.N_KEYS,
                   help="keystrokes (= /infill requests) per editor replay (>= 60)")
    p.add_argument("--only", action="append", choices=["single", "parallel", "editor", "busy"],
                   help="run only these phases (repeatable)")
    p.add_argument("--no-busy", action="store_true",
                   help="leave out the busy-machine phase (bench/busy.py, ~10 minutes)")
    p.add_argument("--offgrid-threads", default="same", metavar="N|auto",
                   help="offgrid's -t in the idle phases (default: --threads, as "
                   "llama-server's; auto: offgrid's default)")
    p.add_argument("--busy-hogs", type=int, default=0, metavar="N",
                   help="CPU-bound processes in the busy phase (default: one per core but one)")
    p.add_argument("--servers", default="offgrid,llama_server")
    p.add_argument("--llama-bin", help="folder with llama-server and llama-bench "
                   "(default: scripts/build_lib.sh --server)")
    p.add_argument("--no-llama-bench", action="store_true")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "latest.json"))
    p.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    args = p.parse_args(argv)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    for s in args.servers:
        if s not in SERVERS:
            p.error("unknown server %r (offgrid, llama_server)" % s)
    args.model = os.path.abspath(args.model)
    if args.keys < 60:
        p.error("--keys: the replay needs at least 60 keystrokes (requests)")
    return args


def main(argv=None):
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the server being measured is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = time.monotonic()
    bindir = llama_bin(args.llama_bin)
    fim = None
    run_busy = not args.no_busy and (not args.only or "busy" in args.only)
    if not args.only or "editor" in args.only or run_busy:
        log("FIM copy of the model (cached): ...")
        fim = fimmodel.fim_copy(args.model)
        log("  %s" % fim)
    load_start = load()
    source_at_start = source_hash()
    samples, busy, errors = run_all(args, bindir, fim)
    busy_figs = {}
    if run_busy:
        busy_figs, busy_errors = busy_phase.run(args, bindir, fim, log)
        errors += busy_errors
    if source_hash() != source_at_start:
        errors.append("offgrid/ changed during the run: the rounds measured different code")
    lb = {}
    if not args.no_llama_bench:
        log("llama-bench pp512 / tg128, -t %d" % args.threads)
        lb = llama_bench(bindir, args.model, args.threads, 3)
    load_end = load()

    figs = {name: figures(samples[name]) for name in args.servers}
    result = {
        "machine": machine(),
        "model": os.path.relpath(args.model, str(ROOT)) if args.model.startswith(str(ROOT))
        else args.model,
        "fim_model": str(fim) if fim else None,
        "revision": git_revision(),
        "offgrid_source": source_at_start,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "settings": {"threads": args.threads, "ctx_per_session": args.ctx,
                     "llama_server_ctx": "ctx x parallel (its -c is shared by its slots)",
                     "rounds": args.rounds, "reps": args.reps, "editor_keys": args.keys,
                     "llama_server_flags": "--swa-full --cache-reuse 256 --metrics"},
        # load average (counts the bench itself) and the CPU share other
        # processes took while each server was measured (see CpuMeter)
        "load": {"start": load_start, "end": load_end,
                 "others_cpu_median": statistics.median(b["others_cpu"] for b in busy)
                 if busy else None,
                 "others_cpu_max": max(b["others_cpu"] for b in busy) if busy else None,
                 "phases": busy},
        "runtime_s": round(time.monotonic() - t_start, 1),
        "scenarios": {},
        "llama_bench": lb,
        "busy_machine": busy_figs,
        "errors": errors,
        "samples": samples,
    }
    for name, unit, higher, what in ROWS:
        vals = {s: figs[s].get(name) for s in args.servers}
        if all(v is None for v in vals.values()):
            continue
        a, b = vals.get("offgrid"), vals.get("llama_server")
        result["scenarios"][name] = {
            "offgrid": a, "llama_server": b,
            "ratio": a / b if a is not None and b else None,
            "unit": unit, "higher_is_better": higher, "what": what}

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, out)

    m = result["machine"]
    print()
    print("offgrid vs llama-server, %s, %d threads; %s (%s cores)"
          % (result["model"], args.threads, m["cpu"], m["nproc"]))
    if busy:
        print("load average %.2f -> %.2f; other processes took %.0f%% of the CPU (median "
              "over phases, max %.0f%%)" % (load_start, load_end,
                                             100 * result["load"]["others_cpu_median"],
                                             100 * result["load"]["others_cpu_max"]))
    print("llama-server gets -c %d x np (its context is shared by its slots), --swa-full "
          "--cache-reuse 256" % args.ctx)
    if fim:
        print("editor replay on %s: gemma-3-270m whose metadata names FIM tokens "
              "(<unused0..2>); its completions are not trained FIM output" % fim.name)
    print(table(result))
    if busy_figs:
        print()
        print("busy machine: %d CPU-bound processes, %d cores (bench/busy.py), %d-token "
              "streams" % (args.busy_hogs or max(1, (m["nproc"] or 1) - 1), m["nproc"] or 1,
                           busy_phase.BUSY_GEN_TOKENS))
        for what, a, b, r, goal in busy_phase.rows(busy_figs, m["nproc"] or 1):
            print("  %-72s %8s %8s %6s  %s" % (what, fmt(a), fmt(b), fmt(r),
                                               ("goal " + goal) if goal else ""))
    if args.markdown:
        print()
        print(markdown(result))
    for e in errors:
        print("FAILED: %s" % e)
    print("%s written; %.0f s in all" % (os.path.relpath(str(out)), result["runtime_s"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
