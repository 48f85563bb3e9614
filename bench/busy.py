"""The busy-machine phase: both servers while the bench's own hog holds the cores.

An editor's machine is never idle, and ggml's spinning threads collapse when
another program holds a core they need (see offgrid/engine/threads.py).  This
phase starts a CPU-bound process on every core but one (normal priority,
each ending by itself after HOG_LIMIT_S), then measures single-stream
generation on:

    offgrid            its default threads (-t auto)
    offgrid -t N       every core, pinned (what -t auto must beat)
    llama-server       its default threads (what users run)
    llama-server -t k  each k from 1 to N; the best is reported beside it

and the editor replay (fewer keys than the idle one: every answer is slow
on a pinned -t N) on offgrid with -t auto and with -t N.  Generation here is
BUSY_GEN_TOKENS tokens a sample: a server at 1 tok/s must not hold the bench
for minutes per sample.  Each server's first stream under the hog is not in
its median (for -t auto it pays for finding the load: a few decodes at too
many threads); offgrid's is reported on its own line.  Each server starts and
answers its first request on the idle machine, as a server on an editor's
machine was started before the compiler.
"""

import contextlib
import os
import statistics
import subprocess
import sys
import time

import editor
import scenarios
from servers import SERVERS, Config

BUSY_GEN_TOKENS = 32
BUSY_KEYS = 60
HOG_LIMIT_S = 1800          # a hog outlives no bench, even one killed with -9
SETTLE_S = 2.0              # after the hog starts, before the first sample

_HOG = ("import time\nend = time.monotonic() + %d\nwhile time.monotonic() < end:\n    pass\n"
        % HOG_LIMIT_S)


@contextlib.contextmanager
def hogs(n):
    """n CPU-bound processes while the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", _HOG]) for _ in range(n)]
    try:
        time.sleep(SETTLE_S)
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def _generation(kind, cfg, bins, reps, n_hogs, first=None):
    """Median tok/s of ``reps`` streams after the first one under the hog; that
    first stream (which pays for -t auto finding the load) goes to ``first``."""
    with SERVERS[kind](cfg, bins) as server:
        scenarios.warm_up(server.port)      # on the idle machine, as a server starts
        with hogs(n_hogs):
            got = scenarios.generation(server.port, reps + 1, n_predict=BUSY_GEN_TOKENS)
    if first is not None:
        first.append(got["client_tps"][0])
    return statistics.median(got["client_tps"][1:])


def _editor(cfg, bins, keys, n_hogs):
    with SERVERS["offgrid"](cfg, bins) as server:
        scenarios.warm_up(server.port)
        editor.warm(server.port)            # the file was open before the machine got busy
        with hogs(n_hogs):
            out = editor.replay(server.port, keys)
    return statistics.median(out["latency_ms"])


def run(args, bins, fim, log):
    """Every variant once; {figure: value}.  A variant that fails is left out."""
    cores = os.cpu_count() or 1
    n_hogs = args.busy_hogs or max(1, cores - 1)
    out, errors = {}, []

    def measure(key, fn, *a):
        t0 = time.monotonic()
        try:
            out[key] = fn(*a)
        except Exception as e:      # one failed variant must not lose the others
            errors.append("busy %s: %s" % (key, e))
            log("busy %-26s FAILED: %s" % (key, e))
            return
        log("busy %-26s %8.1f  (%.0f s, %d hog%s)" % (key, out[key], time.monotonic() - t0,
                                                       n_hogs, "" if n_hogs == 1 else "s"))

    def gen_cfg(threads):
        return Config(args.model, threads, args.ctx, 1, 512, 512)

    first = []
    measure("offgrid_auto_tok_s", _generation, "offgrid", gen_cfg(None), bins, args.reps,
            n_hogs, first)
    if first:
        out["offgrid_auto_first_tok_s"] = first[0]
    measure("offgrid_fixed_tok_s", _generation, "offgrid", gen_cfg(cores), bins, args.reps,
            n_hogs)
    measure("llama_server_default_tok_s", _generation, "llama_server", gen_cfg(None), bins,
            args.reps, n_hogs)
    for k in range(1, cores + 1):
        measure("llama_server_t%d_tok_s" % k, _generation, "llama_server", gen_cfg(k), bins,
                args.reps, n_hogs)
    fixed = {k: out.get("llama_server_t%d_tok_s" % k) for k in range(1, cores + 1)}
    fixed = {k: v for k, v in fixed.items() if v}
    if fixed:
        best = max(fixed, key=fixed.get)
        out["llama_server_best_t"] = best
        out["llama_server_best_tok_s"] = fixed[best]
    if fim is not None:
        def editor_cfg(threads):
            return Config(str(fim), threads, args.ctx, 1, 2048, 512)
        measure("editor_auto_p50_ms", _editor, editor_cfg(None), bins, BUSY_KEYS, n_hogs)
        measure("editor_fixed_p50_ms", _editor, editor_cfg(cores), bins, BUSY_KEYS, n_hogs)
    return out, errors


def rows(busy, cores):
    """(what, value, reference, ratio, goal) lines for the table."""
    def ratio(a, b):
        return a / b if a is not None and b else None
    a = busy.get("offgrid_auto_tok_s")
    out = [
        ("generation, offgrid -t auto vs offgrid -t %d (tok/s)" % cores, a,
         busy.get("offgrid_fixed_tok_s"), ratio(a, busy.get("offgrid_fixed_tok_s")), ""),
        ("generation, offgrid -t auto vs llama-server's default threads (tok/s)", a,
         busy.get("llama_server_default_tok_s"),
         ratio(a, busy.get("llama_server_default_tok_s")), ">= 5"),
        ("generation, offgrid -t auto vs llama-server's best -t (%s) (tok/s)"
         % busy.get("llama_server_best_t", "?"), a, busy.get("llama_server_best_tok_s"),
         ratio(a, busy.get("llama_server_best_tok_s")), ">= 0.8"),
    ]
    out.append(("generation, offgrid -t auto, the first stream after the load started (tok/s)",
                busy.get("offgrid_auto_first_tok_s"), None, None, ""))
    e = busy.get("editor_auto_p50_ms")
    if e is not None:
        out.append(("editor replay p50, offgrid -t auto vs -t %d (ms)" % cores, e,
                    busy.get("editor_fixed_p50_ms"), ratio(e, busy.get("editor_fixed_p50_ms")),
                    "<= 0.5"))
    return out
