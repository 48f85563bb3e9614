"""``make bench``: offgrid against llama-server on the same model, side by side.

    python3 bench/run.py [--rounds 3] [--keys 100] [--only editor] ...

Builds (or finds cached) llama-server and llama-bench from the pinned
llama.cpp source with our patch (``scripts/build_lib.sh --server``) and a
stock llama-server from the same source without it (``--stock-server``: what
users run), makes the FIM copy of gemma for its editor replay (fimmodel.py),
then runs every phase on the servers, and writes a table to the terminal and
``bench/results/latest.json``.

Rounds and alternation: each phase is one server configuration.  Each round
runs every phase on every server, and the server that goes first alternates
from round to round (ABBA), so load that drifts during a run hits all alike.
The "together" phases go further: all their servers are up at once and
their samples alternate request by request (A B C C B A ...), because this
VM's speed wanders by several per cent within a minute, and a ratio near 1
is only meaningful if both sides see the same machine.  Figures are medians
over all samples of all rounds (the editor's p50/p95 over all pauses).
Phases cost differently, so each has its own number of rounds; ``--rounds N``
gives every phase N.

    phase          model  server flags                          rounds  scenarios
    single         gemma  -np 1 -b 512, together, + stock       3       generation, prompt,
                                                                        overhead, RSS
    continuation   code   -np 1 -b 512, together, speculation   2       code continuation
                          variants (see below)
    batched        gemma  -np 4, then -np 8, -b 512, each      1       1, 4 and 8 clients
                          with one KV cache (both), then a              x 8 requests x 64
                          stream per session (both)
    stall          gemma  -np 2 -b 512                          1       a 2,000-token prompt
                                                                        during a stream
    editor         code   -np 1 -b 1024 -ub 1024                1       /infill typing replay
    editor-gemma   gemma FIM copy, -np 1 -b 2048 -ub 512        1       the same, faster
    edits          code   -np 1 -c 8192, together: offgrid      1       the edit scenarios
                          default and none, llama-server plain          (bench/edits.py)
                          and its n-gram --spec-types
    copies         code   as edits                              1       the out-of-order copy
                                                                        (bench/copies.py)
    busy           see busy.py                                  once

"code" is --code-model (Qwen2.5-Coder-0.5B), "gemma" --model.  The stock
llama-server joins the single phase (the no-regression figures: generation,
prompt, overhead); the others compare offgrid with the patched build.  The
continuation phase runs offgrid without and with ``--spec-type
ngram-simple`` and llama-server without speculation and with each of
``--spec-type ngram-mod``, ``ngram-simple`` and ``ngram-map-k`` (the best is
reported), all up at once.  The Qwen editor replay gets ``-b 1024 -ub 1024``
as issue #18's measurement did (/infill keeps 3/4 of the batch for the
prefix, 1/4 for the suffix); the gemma one llama-server's default batch
(2048, ubatch 512), as the earlier tables.  Benchmarks report; they never
fail on a figure, but the goals of issues #18 and #20 are printed under the
table with the ratios that meet them or not.
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
from typing import Callable, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

import busy as busy_phase  # noqa: E402
import copies  # noqa: E402
import editor  # noqa: E402
import edits  # noqa: E402
import fimmodel  # noqa: E402
import scenarios  # noqa: E402
from servers import SERVERS, Config, CpuMeter  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NAMES = {"offgrid": "offgrid", "llama_server": "llama-server",
         "llama_server_stock": "llama-server-stock"}
SPEC_TYPES = ("ngram-mod", "ngram-simple", "ngram-map-k")      # llama-server's n-gram drafts

def _editor_rows(key, model):
    return [
        (key + "_p50_ms", "ms", False,
         "editor replay (%s): last keystroke to answer at a pause, p50" % model),
        (key + "_p95_ms", "ms", False,
         "editor replay (%s): last keystroke to answer at a pause, p95" % model),
        (key + "_own_p50_ms", "ms", False,
         "editor replay (%s): those answers' own prompt_ms + predicted_ms, p50" % model),
        (key + "_cached_fraction", "", True,
         "editor replay (%s): mean cached fraction of the prompt" % model),
    ]


def _batched_rows(key, layout):
    return [
        ("%s_1_tok_s" % key, "tok/s", True,
         "batched, %s: 1 client x 8 requests x 64 tokens, -np 4" % layout),
        ("%s_4_tok_s" % key, "tok/s", True,
         "batched, %s: 4 clients x 8 requests x 64 tokens, -np 4" % layout),
        ("%s_4_gain" % key, "x", True, "batched, %s: 4 clients' tok/s / 1 client's" % layout),
        ("%s_8_tok_s" % key, "tok/s", True,
         "batched, %s: 8 clients x 8 requests x 64 tokens, -np 8" % layout),
        ("%s_8_gain" % key, "x", True,
         "batched, %s: 8 clients' tok/s / 1 client's (on -np 4)" % layout),
    ]


EDIT_SCENARIOS = (("next_edit", "edit (a) next-edit: a 21-line window rewritten, Sweep prompt, "
                                "/v1/completions"),
                  ("apply_edit", "edit (b) apply-edit in chat: a 40-line function with a rename"),
                  ("rewrite", "edit (c) whole-file rewrite in chat: ~150 lines, two edits"))


COPY_SCENARIOS = (("out_of_order", "out-of-order copy in chat: ten stubs, their docstrings "
                                     "put in, lines of the prompt in another order"),)


def _edit_rows(scenarios=EDIT_SCENARIOS):
    rows = []
    for key, what in scenarios:
        rows += [
            ("%s_tok_s" % key, "tok/s", True,
             "%s, greedy (offgrid default --spec-type; llama-server no speculation)" % what),
            ("%s_spec_tok_s" % key, "tok/s", True,
             "%s (offgrid default; llama-server its best n-gram --spec-type)" % what),
            ("%s_plain_tok_s" % key, "tok/s", True,
             "%s, offgrid --spec-type none (without drafts)" % what),
        ] + [("%s_%s_tok_s" % (key, t), "tok/s", True,
              "%s, llama-server --spec-type %s" % (what, t)) for t in SPEC_TYPES] + [
            ("%s_wall_s" % key, "s", False,
             "%s: request wall time (offgrid default; llama-server no speculation)" % what),
            ("%s_spec_wall_s" % key, "s", False,
             "%s: request wall time (offgrid default; llama-server its best n-gram)" % what),
            ("%s_accept" % key, "", True,
             "%s: drafted tokens that came true (offgrid default; llama-server its best)" % what),
            ("%s_mean_len" % key, "", True,
             "%s: mean accepted length, 1 + accepted per verify step (same)" % what),
        ]
    return rows


# name -> (unit, higher_is_better, what); the order of the table
ROWS = [
    ("generation_tok_s", "tok/s", True,
     "generation: 1 stream, 128 tokens, greedy, cache off (client clock)"),
    ("generation_tok_s_timings", "tok/s", True, "generation, by the servers' timings"),
    ("prompt_tok_s", "tok/s", True, "prompt: 500 tokens, n_predict 1, cache off (timings)"),
    ("prompt_tok_s_client", "tok/s", True, "prompt, by request wall time"),
    ("overhead_p50_ms", "ms", False, "request overhead: n_predict 0 on a cached prompt, p50"),
    ("overhead_outside_p50_ms", "ms", False,
     "request overhead outside the engine (wall - prompt_ms - predicted_ms), p50"),
    ("peak_rss_mib", "MiB", False, "peak RSS (VmHWM) after the single-stream scenarios"),
    ("continuation_tok_s", "tok/s", True,
     "code continuation: 128 tokens after 60 lines of a source file, greedy, no speculation"),
    ("continuation_spec_tok_s", "tok/s", True,
     "code continuation, n-gram speculation (offgrid ngram-simple; llama-server its best)"),
] + [("continuation_%s_tok_s" % t, "tok/s", True,
      "code continuation, llama-server --spec-type %s" % t) for t in SPEC_TYPES] + \
    _editor_rows("editor", "code model") + _editor_rows("editor_gemma", "gemma FIM copy") + [
    ("batched_1_tok_s", "tok/s", True, "batched: 1 client x 8 requests x 64 tokens, -np 4"),
    ("batched_4_tok_s", "tok/s", True, "batched: 4 clients x 8 requests x 64 tokens, -np 4"),
    ("batched_4_gain", "x", True, "batched: 4 clients' tok/s / 1 client's, -np 4"),
    ("batched_8_tok_s", "tok/s", True, "batched: 8 clients x 8 requests x 64 tokens, -np 8"),
    ("batched_8_gain", "x", True, "batched: 8 clients' tok/s / 1 client's (on -np 4)"),
] + _batched_rows("batched_unified", "both one KV cache for all sessions (offgrid's default, "
                                     "llama-server -kvu)") + \
    _batched_rows("batched_split", "both a KV stream per session (llama-server's default "
                                   "with -np N, offgrid --no-kv-unified)") + [
    ("stall_alone_tok_s", "tok/s", True, "stall: a 384-token stream alone, -np 2"),
    ("stall_during_tok_s", "tok/s", True,
     "stall: that stream while another session's 2,000-token prompt is evaluated"),
    ("stall_kept", "x", True, "stall: the stream's rate during the prompt / alone"),
    ("stall_max_gap_ms", "ms", False, "stall: the stream's longest wait for a token then"),
    ("stall_prompt_alone_s", "s", False, "stall: the 2,000-token prompt's wall time alone"),
    ("stall_prompt_during_s", "s", False, "stall: its wall time during the stream"),
    ("stall_prompt_cost", "x", False, "stall: the prompt's wall time during the stream / alone"),
] + _edit_rows() + _edit_rows(COPY_SCENARIOS) + [
    ("out_of_order_gain", "x", True,
     "out-of-order copy: offgrid's default / its --spec-type none (tok/s)"),
    ("out_of_order_lines_copied", "", True,
     "out-of-order copy: share of the answer's lines that are lines of the prompt"),
    ("out_of_order_lines_moved", "", True,
     "out-of-order copy: share of them whose line before is another than in the prompt"),
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

def llama_bins(args):
    """{server name: folder with its llama-server}, built (once, cached) where not given."""
    def build(flag, given):
        if given:
            return Path(given)
        log("building or finding llama-server (scripts/build_lib.sh %s)" % flag)
        out = subprocess.check_output(["bash", "scripts/build_lib.sh", flag], cwd=str(ROOT),
                                      text=True, timeout=3600)
        return Path(out.strip().splitlines()[-1])
    bins = {"llama_server": build("--server", args.llama_bin)}
    if "llama_server_stock" in args.servers:
        bins["llama_server_stock"] = build("--stock-server", args.stock_bin)
    return bins


def llama_bench(bindir, model, threads, reps, extra=()):
    """llama-bench pp512 and tg128 (``extra``: more of its flags): {test: tok/s}."""
    cmd = [str(bindir / "llama-bench"), "-m", str(model), "-t", str(threads), "-p", "512",
           "-n", "128", "-r", str(reps), "-o", "json"] + list(extra)
    out = subprocess.check_output(cmd, cwd=str(ROOT), text=True, stderr=subprocess.DEVNULL,
                                  timeout=900)
    res = {}
    for entry in json.loads(out):
        name = ("pp%d" % entry["n_prompt"]) if entry["n_prompt"] else ("tg%d" % entry["n_gen"])
        res[name] = {"tok_s": entry["avg_ts"], "stddev": entry["stddev_ts"]}
    return res


BATCHED_BENCH_PROMPT = 24     # tokens: about the batched phase's prompts


def same_work_limit(result, scenario, bound):
    """offgrid's generated tok/s in ``scenario`` had it evaluated its prompt tokens
    and generated its tokens at llama-batched-bench's rates (``bound``: its
    "pp" and "tg" for as many sequences): the time those rates give the
    phase's own work, medians of offgrid's samples.  The servers evaluate
    every request's prompt among the others' steps, which "tg" alone leaves
    out; batched-bench's prompts go in one batch of all sequences', faster
    a token than a server's few-token pieces, so this is still a bound.
    None where a figure is missing (results from before prompt_tokens)."""
    s = result.get("samples", {}).get("offgrid", {}).get(scenario, {})
    if not s.get("prompt_tokens") or not s.get("tokens") or not bound.get("pp"):
        return None
    tokens = statistics.median(s["tokens"])
    prompt = statistics.median(s["prompt_tokens"])
    return tokens / (prompt / bound["pp"] + tokens / bound["tg"])


def llama_batched_bench(bindir, model, threads):
    """llama-batched-bench, the limit of the batched phases (issue #52): 1, 4 and 8
    sequences of a BATCHED_BENCH_PROMPT-token prompt and CONCURRENT_PREDICT
    generated tokens each, in both KV layouts: {layout: {clients: {"tg": tok/s of
    generation, "pp": tok/s of the prompts (all sequences' in one batch), "all":
    tok/s of prompt and generation}}}."""
    tg = scenarios.CONCURRENT_PREDICT
    out = {}
    for layout, flags in (("unified", ["-kvu"]), ("split", [])):
        cmd = [str(bindir / "llama-batched-bench"), "-m", model, "-t", str(threads),
               "-tb", str(threads), "-c", "4096", "-b", "512", "-ub", "512",
               "-npp", str(BATCHED_BENCH_PROMPT), "-ntg", str(tg), "-npl", "1,4,8",
               "--output-format", "jsonl"] + flags
        text = subprocess.check_output(cmd, cwd=str(ROOT), text=True,
                                       stderr=subprocess.DEVNULL, timeout=900)
        rows = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        out[layout] = {r["pl"]: {"tg": r["speed_tg"], "pp": r["speed_pp"], "all": r["speed"]}
                       for r in rows}
    return out


# -- phases ------------------------------------------------------------------------

IDLE_GAP_S = 1.0       # before each paired sample: the other server's threads go to sleep


@dataclasses.dataclass
class Phase:
    """One server configuration and what runs on it.

    ``run(port, reps, rnd)`` measures one server; a "together" phase instead
    has ``variants`` ({key: (server name, Config)}, all started at once) and
    ``run(servers, order, reps, rnd)`` gets them all.  Either returns
    {server name: {scenario: samples}} or, for one server, {scenario: samples}.
    """
    name: str                   # what --only selects (several phases may share one)
    label: str                  # in the log
    rounds: int
    cfg: Optional[Config] = None
    run: Callable = None
    servers: Sequence[str] = ("offgrid", "llama_server")
    variants: Optional[dict] = None
    flags: Optional[dict] = None    # {server name: flags for it alone} (cfg.extra's)
    # (prefix, servers): these servers' scenarios named prefix_* count as
    # batched_* too (the batched phases: the layout that is their default)
    default_for: Optional[tuple] = None


def quiet(fn, *a, **kw):
    """fn after IDLE_GAP_S: after a decode, ggml's worker threads keep polling for
    the next one for a while (up to a few hundred ms here) before they sleep, and
    another server's must not be spinning while this one is measured."""
    time.sleep(IDLE_GAP_S)
    return fn(*a, **kw)


def run_single(servers, order, reps, rnd):
    """The single-stream scenarios on servers that are all up at once.

    Generation and prompt samples alternate between the servers one request
    at a time (A B B A ...), so a sample of one is never more than a few
    seconds from a sample of the other.
    """
    out = {name: {} for name in servers}
    for name in order:
        scenarios.warm_up(servers[name].port)
    for i in range(reps + 1):
        for name in (order if i % 2 == 0 else order[::-1]):
            port = servers[name].port
            got = {"prompt": quiet(scenarios.prompt, port, 1, first=i)}
            if i < reps:
                got["generation"] = quiet(scenarios.generation, port, 1, first=i)
            merge(out[name], got)
    for name in order:
        merge(out[name], {"overhead": quiet(scenarios.overhead, servers[name].port)})
    for name, server in servers.items():
        out[name]["rss"] = {"peak_mib": [server.peak_rss_mb()]}
    return out


def continuation_variants(args):
    """{variant: (server, Config)}: offgrid without and with ngram-simple, llama-server
    without speculation and with each of SPEC_TYPES."""
    cfg = Config(args.code_model, args.threads, args.ctx, 1, 512, 512)

    def spec(t):
        return dataclasses.replace(cfg, extra=("--spec-type", t))
    # offgrid's "none" is explicit: its default may turn speculation on
    return _with_llama_server(args, cfg, {
        "offgrid": ("offgrid", spec("none")),
        "offgrid+ngram-simple": ("offgrid", spec("ngram-simple"))})


def _with_llama_server(args, cfg, out):
    """``out`` (offgrid's variants) and llama-server's, without speculation and
    with each of SPEC_TYPES, of the servers in --servers."""
    if "llama_server" in args.servers:
        out["llama_server"] = ("llama_server", cfg)
        for t in SPEC_TYPES:
            out["llama_server+" + t] = ("llama_server",
                                        dataclasses.replace(cfg, extra=("--spec-type", t)))
    return {k: v for k, v in out.items() if v[0] in args.servers}


def run_continuation(servers, order, reps, rnd):
    """Code continuation on every variant, samples alternating (ABC..CBA)."""
    out = {}
    for key in order:
        scenarios.warm_up(servers[key].port)
    for i in range(reps):
        for key in (order if i % 2 == 0 else order[::-1]):
            server, _, spec = key.partition("+")
            scen = "continuation" + ("" if not spec else
                                     "_spec" if server == "offgrid" else "_" + spec)
            got = quiet(scenarios.continuation, servers[key].port, 1, first=rnd * reps + i)
            merge(out.setdefault(server, {}), {scen: got})
    return out


EDIT_ONLY = []      # --edit-scenario: the edit scenarios to run (default all)


def edit_variants(args):
    """{variant: (server, Config)}: offgrid with its default --spec-type and with
    none (the figure before copy drafts), llama-server without speculation and
    with each of SPEC_TYPES."""
    cfg = Config(args.code_model, args.threads, 8192, 1, 512, 512)

    return _with_llama_server(args, cfg, {
        "offgrid": ("offgrid", cfg),
        "offgrid+none": ("offgrid", dataclasses.replace(cfg, extra=("--spec-type", "none")))})


def run_edits(servers, order, reps, rnd, module=edits):
    """The edit scenarios (bench/edits.py, or ``module``'s: bench/copies.py) on
    every variant, request by request, alternating (ABC..CBA), one request of
    each scenario per variant per rep."""
    out = {}
    for key in order:
        scenarios.warm_up(servers[key].port)
    i = 0
    for _ in range(reps):
        for scen in (EDIT_ONLY if module is edits else ()) or module.N_PREDICT:
            for key in (order if i % 2 == 0 else order[::-1]):
                server, _, spec = key.partition("+")
                name = "edit_" + scen + ("" if not spec else
                                         "_plain" if server == "offgrid" else "_" + spec)
                sample, text = quiet(module.run_one, servers[key].port, scen)
                sample["load"] = load()
                if module is copies:
                    n, copied, moved = copies.lines_from(copies.out_of_order_text(), text)
                    sample["lines_copied"] = copied / n if n else 0.0
                    sample["lines_moved"] = moved / copied if copied else 0.0
                merge(out.setdefault(server, {}), {name: {k: [v] for k, v in sample.items()}})
            i += 1
    return out


# The batched phases run twice, so that each server is compared with the other
# laid out alike (issue #52): every session's cells in one unified KV cache
# (offgrid's default; llama-server's -kvu, its default only where -np is auto)
# and a KV stream per session (llama-server's default with an explicit -np N;
# offgrid's --no-kv-unified).  {layout: (scenario prefix, {server: flags})}
# The plain "batched" rows are each server's default, as they were before
# there were two: offgrid's samples of the unified phases, llama-server's of
# the split ones.  {layout: (scenario prefix, {server: flags}, the servers
# whose default it is)}
KV_LAYOUTS = {
    "unified": ("batched_unified", {"llama_server": ("-kvu",)}, ("offgrid",)),
    "split": ("batched_split", {"offgrid": ("--no-kv-unified",)},
              ("llama_server", "llama_server_stock")),
}


def run_batched(port, reps, rnd, clients, prefix="batched"):
    scenarios.warm_up(port)
    out = {}
    for n in clients:
        out["%s_%d" % (prefix, n)] = scenarios.concurrent(port, n)
    return out


def batched_phases(cfg):
    """The batched phases: -np 4 (1 and 4 clients), then -np 8 (8 clients), each in
    both KV layouts (KV_LAYOUTS)."""
    out = []
    for layout, (prefix, flags, default_for) in KV_LAYOUTS.items():
        for np_, clients in ((4, (1, 4)), (8, (8,))):
            out.append(Phase(
                "batched", "batched-np%d-%s" % (np_, layout), 1, cfg(np_),
                lambda port, reps, rnd, c=clients, p=prefix: run_batched(port, reps, rnd, c, p),
                flags=flags, default_for=(prefix, default_for)))
    return out


def run_editor(key, keys):
    def run(port, reps, rnd):
        return {key: editor.replay(port, keys)}
    return run


def phases(args, fim):
    """Every phase, in the order they run."""
    def cfg(parallel, batch=512, ubatch=512, model=None):
        return Config(model or args.model, args.threads, args.ctx, parallel, batch, ubatch)
    return [
        Phase("single", "single", 3, cfg(1), run_single, servers=args.servers,
              variants={name: (name, cfg(1)) for name in args.servers}),
        Phase("continuation", "continuation", 2, run=run_continuation,
              variants=continuation_variants(args)),
    ] + batched_phases(cfg) + [
        Phase("stall", "stall", 1, cfg(2),
              lambda port, reps, rnd: {"stall": scenarios.stall(port, reps)}),
        Phase("editor", "editor", 1, cfg(1, 1024, 1024, args.code_model),
              run_editor("editor", args.keys)),
        Phase("editor-gemma", "editor-gemma", 1, cfg(1, 2048, 512, str(fim) if fim else None),
              run_editor("editor_gemma", args.keys)),
        Phase("edits", "edits", 1, run=run_edits, variants=edit_variants(args)),
        Phase("copies", "copies", 1, variants=edit_variants(args),
              run=lambda servers, order, reps, rnd: run_edits(servers, order, reps, rnd,
                                                              module=copies)),
    ]


PHASES = ("single", "continuation", "batched", "stall", "editor", "editor-gemma", "edits",
          "copies", "busy")


def for_server(cfg, name, args):
    """The config of one server: offgrid's threads may differ (--offgrid-threads auto)."""
    if name == "offgrid" and args.offgrid_threads != "same":
        return dataclasses.replace(
            cfg, threads=None if args.offgrid_threads == "auto" else int(args.offgrid_threads))
    return cfg


def defaults(phase, name, got):
    """Scenarios ``got`` by server ``name`` that count under their default name too."""
    if not phase.default_for or name not in phase.default_for[1]:
        return {}
    prefix = phase.default_for[0]
    return {"batched" + k[len(prefix):]: v for k, v in got.items() if k.startswith(prefix)}


def server_config(phase, name, args):
    """The config server ``name`` runs a one-by-one phase with: its own flags too."""
    cfg = phase.cfg
    if phase.flags and phase.flags.get(name):
        cfg = dataclasses.replace(cfg, extra=tuple(cfg.extra) + tuple(phase.flags[name]))
    return for_server(cfg, name, args)


def merge(into, new):
    """Append the lists of ``new`` to those of ``into`` (nested by scenario)."""
    for scen, samples in new.items():
        dst = into.setdefault(scen, {})
        for k, v in samples.items():
            if isinstance(v, list):
                dst.setdefault(k, []).extend(v)
            else:
                dst[k] = dst.get(k, 0) + v


class Rounds:
    """Runs phases and keeps their samples, the CPU others took, and failures."""

    def __init__(self, args, bins):
        self.args, self.bins = args, bins
        self.samples = {s: {} for s in args.servers}
        self.busy, self.errors = [], []

    def _measured(self, rnd, phase, names, pids, fn):
        """Merges fn()'s {server: {scenario: samples}}, metering pids(); a failure is
        logged and kept, and the next phase runs."""
        l0 = load()
        t0 = time.monotonic()
        try:
            meter = CpuMeter(*pids())
            meter.start()
            got = fn()
            others = meter.others()
        except Exception as e:      # one failed phase must not lose the others
            log("round %d %s %s FAILED: %s" % (rnd + 1, phase.label, names, e))
            self.errors.append("round %d %s %s: %s" % (rnd + 1, phase.label, names, e))
            return
        for name, scen in got.items():
            merge(self.samples[name], scen)
        self.busy.append({"round": rnd + 1, "phase": phase.label, "server": names,
                          "load": l0, "others_cpu": round(others, 3)})
        log("round %d/%d %-13s %-26s %6.1f s  load %.2f, other processes %2.0f%% CPU"
            % (rnd + 1, self.rounds(phase), phase.label, names, time.monotonic() - t0, l0,
               100 * others))

    def rounds(self, phase):
        return self.args.rounds if self.args.rounds else phase.rounds

    def together(self, rnd, phase):
        """Round ``rnd`` of a phase whose variants are all up at once."""
        keys = list(phase.variants)
        order = keys if rnd % 2 == 0 else keys[::-1]
        servers = {k: SERVERS[name](for_server(cfg, name, self.args), self.bins)
                   for k, (name, cfg) in phase.variants.items()}
        try:
            with contextlib.ExitStack() as stack:
                for server in servers.values():
                    stack.enter_context(server)
                self._measured(rnd, phase, ", ".join(NAMES.get(k, k) for k in order),
                               lambda: [s.proc.pid for s in servers.values()],
                               lambda: phase.run(servers, order, self.args.reps, rnd))
        except Exception as e:      # a server that did not start
            log("round %d %s FAILED: %s" % (rnd + 1, phase.label, e))
            self.errors.append("round %d %s: %s" % (rnd + 1, phase.label, e))

    def one_by_one(self, rnd, phase):
        order = [s for s in self.args.servers if s in phase.servers]
        for name in (order if rnd % 2 == 0 else order[::-1]):
            server = SERVERS[name](server_config(phase, name, self.args), self.bins)

            def measure():
                got = phase.run(server.port, self.args.reps, rnd)
                got.update(defaults(phase, name, got))
                got["rss_" + phase.label] = {"peak_mib": [server.peak_rss_mb()]}
                return {name: got}
            try:
                with server:
                    self._measured(rnd, phase, NAMES[name], lambda: [server.proc.pid],
                                   measure)
            except Exception as e:
                log("round %d %s %s FAILED: %s" % (rnd + 1, phase.label, NAMES[name], e))
                self.errors.append("round %d %s %s: %s" % (rnd + 1, phase.label, name, e))

    def run(self, todo):
        """Round 1 of every phase, then round 2 of those that have one, and so on."""
        for rnd in range(max((self.rounds(p) for p in todo), default=0)):
            for phase in todo:
                if rnd >= self.rounds(phase):
                    continue
                if phase.variants is not None:
                    self.together(rnd, phase)
                else:
                    self.one_by_one(rnd, phase)


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

    def ratio(a, b):
        return a / b if a is not None and b else None

    f["generation_tok_s"] = med("generation", "client_tps")
    f["generation_tok_s_timings"] = med("generation", "server_tps")
    f["prompt_tok_s"] = med("prompt", "server_tps")
    f["prompt_tok_s_client"] = med("prompt", "client_tps")
    f["overhead_p50_ms"] = med("overhead", "wall_ms")
    f["overhead_outside_p50_ms"] = med("overhead", "outside_ms")
    f["peak_rss_mib"] = med("rss", "peak_mib")
    f["continuation_tok_s"] = med("continuation", "client_tps")
    f["continuation_spec_tok_s"] = med("continuation_spec", "client_tps")
    spec = {t: med("continuation_" + t, "client_tps") for t in SPEC_TYPES}
    for t, v in spec.items():
        f["continuation_%s_tok_s" % t] = v
    spec = {t: v for t, v in spec.items() if v is not None}
    if spec:                        # llama-server: its best n-gram option
        f["continuation_spec_tok_s"] = max(spec.values())
    for key in ("editor", "editor_gemma"):
        if key in s:
            e = s[key]
            f[key + "_p50_ms"] = percentile(e["latency_ms"], 50)
            f[key + "_p95_ms"] = percentile(e["latency_ms"], 95)
            f[key + "_own_p50_ms"] = percentile(e["own_ms"], 50)
            f[key + "_cached_fraction"] = statistics.mean(e["cached_fraction"])
    for key in ("batched", "batched_unified", "batched_split"):
        for n in (1, 4, 8):
            f["%s_%d_tok_s" % (key, n)] = med("%s_%d" % (key, n), "tps")
        for n in (4, 8):
            f["%s_%d_gain" % (key, n)] = ratio(f["%s_%d_tok_s" % (key, n)],
                                               f["%s_1_tok_s" % key])
    f["stall_alone_tok_s"] = med("stall", "alone_tps")
    f["stall_during_tok_s"] = med("stall", "during_tps")
    f["stall_kept"] = ratio(f["stall_during_tok_s"], f["stall_alone_tok_s"])
    f["stall_max_gap_ms"] = med("stall", "max_gap_ms")
    f["stall_prompt_alone_s"] = med("stall", "prompt_alone_s")
    f["stall_prompt_during_s"] = med("stall", "prompt_during_s")
    f["stall_prompt_cost"] = ratio(f["stall_prompt_during_s"], f["stall_prompt_alone_s"])
    f.update(edit_figures(s, med))
    return {k: v for k, v in f.items() if v is not None}


def edit_figures(s, med):
    """The edit rows of one server's samples: llama-server's best n-gram variant
    per scenario is the one with the highest median tok/s."""
    f = {}

    def sums(scen, key):
        return sum(s[scen][key]) if s.get(scen, {}).get(key) else 0

    def accept(scen):
        n = sums(scen, "draft_n")
        return sums(scen, "draft_n_accepted") / n if n else None

    def mean_len(scen):
        n = sums(scen, "draft_steps")
        return 1 + sums(scen, "draft_n_accepted") / n if n else None

    for key, _ in EDIT_SCENARIOS + COPY_SCENARIOS:
        base = "edit_" + key
        f[key + "_tok_s"] = med(base, "tps")
        f[key + "_wall_s"] = med(base, "wall_s")
        f[key + "_plain_tok_s"] = med(base + "_plain", "tps")
        spec = {t: med("%s_%s" % (base, t), "tps") for t in SPEC_TYPES}
        for t, v in spec.items():
            f["%s_%s_tok_s" % (key, t)] = v
        spec = {t: v for t, v in spec.items() if v is not None}
        if spec:        # llama-server: its best n-gram option
            best = max(spec, key=spec.get)
            scen = "%s_%s" % (base, best)
            f[key + "_spec_tok_s"] = spec[best]
            f[key + "_spec_wall_s"] = med(scen, "wall_s")
            f[key + "_accept"], f[key + "_mean_len"] = accept(scen), mean_len(scen)
        elif base in s:     # offgrid: its default drafts
            f[key + "_spec_tok_s"] = f[key + "_tok_s"]
            f[key + "_spec_wall_s"] = f[key + "_wall_s"]
            f[key + "_accept"], f[key + "_mean_len"] = accept(base), mean_len(base)
    if f.get("out_of_order_plain_tok_s"):
        f["out_of_order_gain"] = f["out_of_order_tok_s"] / f["out_of_order_plain_tok_s"]
    f["out_of_order_lines_copied"] = med("edit_out_of_order", "lines_copied")
    f["out_of_order_lines_moved"] = med("edit_out_of_order", "lines_moved")
    return f


def best_spec_type(s):
    """The --spec-type whose continuation ran fastest on llama-server's samples."""
    meds = {t: statistics.median(s["continuation_" + t]["client_tps"])
            for t in SPEC_TYPES if s.get("continuation_" + t, {}).get("client_tps")}
    return max(meds, key=meds.get) if meds else None


def goals(result):
    """(what, ratio or figure, goal, met) for the goals of issues #18, #20, #40 and #52."""
    sc = result["scenarios"]

    def get(row, server):
        return sc.get(row, {}).get(server)

    def ratio(a, b):
        return a / b if a is not None and b else None

    out = []

    def goal(what, value, op, bound):
        if value is not None:
            out.append((what, value, "%s %g" % (op, bound),
                        value <= bound if op == "<=" else value >= bound if op == ">=" else
                        value < bound))

    goal("#18 editor replay (code model) p50, offgrid / llama-server",
         get("editor_p50_ms", "ratio"), "<=", 0.07)
    goal("#18 editor replay (code model) p95, offgrid / llama-server",
         get("editor_p95_ms", "ratio"), "<=", 0.15)
    best = [v for v in (get("continuation_tok_s", "offgrid"),
                        get("continuation_spec_tok_s", "offgrid")) if v is not None]
    best = max(best) if best else None
    goal("#18 continuation, offgrid's best / llama-server without speculation",
         ratio(best, get("continuation_tok_s", "llama_server")), ">=", 1.5)
    goal("#18 continuation, offgrid's best / llama-server's best n-gram (%s)"
         % result.get("llama_server_best_spec_type"),
         ratio(best, get("continuation_spec_tok_s", "llama_server")), ">=", 1.1)
    for row, what in (("generation_tok_s", "generation"), ("prompt_tok_s", "prompt")):
        goal("#18 %s, offgrid / llama-server" % what, get(row, "ratio"), ">=", 0.98)
        goal("#18 %s, offgrid / llama-server-stock" % what, get(row, "ratio_stock"),
             ">=", 0.98)
    goal("#18 request overhead outside the engine, offgrid (ms)",
         get("overhead_outside_p50_ms", "offgrid"), "<", 2)
    goal("#18 request overhead, offgrid, p50 wall (ms)", get("overhead_p50_ms", "offgrid"),
         "<", 2)
    for n in (4, 8):
        goal("#20 batched %d clients, offgrid / its own single stream" % n,
             get("batched_%d_gain" % n, "offgrid"), ">=", 1.5)
        goal("#52 batched %d clients, offgrid / llama-server, both one KV cache "
             "(offgrid's default; -kvu)" % n,
             get("batched_unified_%d_tok_s" % n, "ratio"), ">=", 1.0)
        goal("#52 batched %d clients, offgrid / llama-server, both a KV stream per "
             "session (llama-server's default)" % n,
             get("batched_split_%d_tok_s" % n, "ratio"), ">=", 1.0)
        goal("#20 batched %d clients, offgrid / llama-server, each its default "
             "(one KV cache; a stream per slot)" % n,
             get("batched_%d_tok_s" % n, "ratio"), ">=", 1.0)
    limit = (result.get("llama_bench") or {}).get("batched", {})
    for layout, by_n in sorted(limit.items()):
        bound = by_n.get(8) or by_n.get("8")
        if bound:
            goal("#52 batched 8 clients, %s KV: offgrid / llama-batched-bench's generation "
                 "(tok/s)" % layout,
                 ratio(get("batched_%s_8_tok_s" % layout, "offgrid"), bound["tg"]), ">=", 1.0)
            goal("#52 batched 8 clients, %s KV: offgrid / llama-batched-bench's rates for "
                 "the same prompt and generated tokens (tok/s)" % layout,
                 ratio(get("batched_%s_8_tok_s" % layout, "offgrid"),
                       same_work_limit(result, "batched_%s_8" % layout, bound)), ">=", 1.0)
    goal("#20 stall: offgrid's stream during another's 2,000-token prompt / alone",
         get("stall_kept", "offgrid"), ">=", 0.5)
    goal("#52 stall: offgrid's 2,000-token prompt beside a stream / alone (wall time)",
         get("stall_prompt_cost", "offgrid"), "<=", 1.3)
    goal("#52 stall: the stream beside that prompt, offgrid / llama-server (tok/s)",
         get("stall_during_tok_s", "ratio"), ">=", 10)
    goal("#52 stall: the stream's longest wait for a token beside it, offgrid (ms)",
         get("stall_max_gap_ms", "offgrid"), "<=", 250)
    goal("#52 out-of-order copy, offgrid's default drafts / its --spec-type none (tok/s)",
         get("out_of_order_gain", "offgrid"), ">=", 1.5)
    for key, _ in EDIT_SCENARIOS:
        goal("#40 %s, offgrid / llama-server without speculation (tok/s)" % key,
             get(key + "_tok_s", "ratio"), ">=", 2.0)
        goal("#40 %s, offgrid / llama-server's best n-gram (tok/s)" % key,
             get(key + "_spec_tok_s", "ratio"), ">=", 1.2)
    return out


COLUMNS = [("offgrid", "offgrid"), ("llama_server", "llama-server"), ("ratio", "ratio"),
           ("llama_server_stock", "stock"), ("ratio_stock", "ratio")]


def table(result):
    sc = result["scenarios"]
    cols = [c for c in COLUMNS if any(c[0] in r and r[c[0]] is not None for r in sc.values())]
    head = "%-" + str(max(len(r[0]) for r in ROWS)) + "s" + " %12s" * len(cols) + "  %-6s %s"
    lines = [head % (("scenario",) + tuple(t for _, t in cols) + ("unit", ""))]
    for name, unit, higher, what in ROWS:
        if name not in sc:
            continue
        r = sc[name]
        lines.append(head % ((name,) + tuple(cell(r, k) for k, _ in cols) + (
            unit, "higher is better" if higher else "lower is better")))
    lb = result.get("llama_bench")
    if lb:
        lines.append("llama-bench (-t %d): %s" % (result["settings"]["threads"], ", ".join(
            "%s %.1f ± %.1f tok/s" % (k, v["tok_s"], v["stddev"])
            for k, v in sorted(lb.items()) if k != "batched")))
        for layout, by_n in sorted(lb.get("batched", {}).items()):
            lines.append("llama-batched-bench, %s KV: %s" % (layout, ", ".join(
                "%s seqs %.1f tok/s generating (%.1f with the prompts%s)" % (
                    n, v["tg"], v["all"], ", prompts %.0f" % v["pp"] if v.get("pp") else "")
                for n, v in sorted(by_n.items(), key=lambda kv: int(kv[0])))))
    g = goals(result)
    if g:
        lines.append("")
        lines.append("goals (issues #18, #20, #40 and #52):")
        for what, value, bound, met in g:
            lines.append("  %-74s %8s  %-8s %s" % (what, "%.2f" % value, bound,
                                                    "met" if met else "NOT met"))
    return "\n".join(lines)


def markdown(result):
    """The table as Markdown, for docs/performance.md (tests/test_docs.py checks those)."""
    sc = result["scenarios"]
    cols = [c for c in COLUMNS if any(c[0] in r and r[c[0]] is not None for r in sc.values())]
    titles = {"ratio": "offgrid / llama-server", "ratio_stock": "offgrid / stock",
              "llama_server_stock": "llama-server (stock)"}
    lines = ["| scenario | %s |" % " | ".join(titles.get(k, t) for k, t in cols),
             "| --- |%s" % (" ---: |" * len(cols))]
    for name, unit, higher, what in ROWS:
        r = sc.get(name)
        if r is None:
            continue
        label = "%s (%s)" % (what, unit) if unit else what
        lines.append("| %s | %s |" % (label, " | ".join(cell(r, k) for k, _ in cols)))
    return "\n".join(lines)


def cell(row, key):
    """One table cell: ratios with two decimals, figures by their size."""
    x = row.get(key)
    if x is not None and key.startswith("ratio"):
        return "%.2f" % x
    return fmt(x)


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
    p.add_argument("--model", default="models/gemma-3-270m-q4_k_m.gguf",
                   help="the model of the single, batched, stall, editor-gemma and busy phases")
    p.add_argument("--code-model", default="models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                   help="the model of the continuation and editor phases (with FIM tokens)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=4096, help="context per session/slot")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of every phase (default: each phase's own, 1 to 3)")
    p.add_argument("--reps", type=int, default=2,
                   help="samples per round (generation/prompt, continuation, stall)")
    p.add_argument("--keys", type=int, default=editor.N_KEYS,
                   help="keystrokes (= /infill requests) per editor replay (>= 60)")
    p.add_argument("--only", action="append", choices=PHASES,
                   help="run only these phases (repeatable)")
    p.add_argument("--no-busy", action="store_true",
                   help="leave out the busy-machine phase (bench/busy.py, ~10 minutes)")
    p.add_argument("--offgrid-threads", default="same", metavar="N|auto",
                   help="offgrid's -t in the idle phases (default: --threads, as "
                   "llama-server's; auto: offgrid's default)")
    p.add_argument("--busy-hogs", type=int, default=0, metavar="N",
                   help="CPU-bound processes in the busy phase (default: one per core but one)")
    p.add_argument("--servers", default="offgrid,llama_server,llama_server_stock",
                   help="comma list of offgrid, llama_server (patched), llama_server_stock "
                   "(the stock build is in the single phase only)")
    p.add_argument("--llama-bin", help="folder with the patched llama-server and llama-bench "
                   "(default: scripts/build_lib.sh --server)")
    p.add_argument("--stock-bin", help="folder with the stock llama-server "
                   "(default: scripts/build_lib.sh --stock-server)")
    p.add_argument("--no-llama-bench", action="store_true")
    p.add_argument("--edit-scenario", action="append", choices=tuple(edits.N_PREDICT),
                   help="the edits phase runs only these scenarios (repeatable; default all)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "latest.json"))
    p.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    args = p.parse_args(argv)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    for s in args.servers:
        if s not in SERVERS:
            p.error("unknown server %r (%s)" % (s, ", ".join(SERVERS)))
    args.model = os.path.abspath(args.model)
    args.code_model = os.path.abspath(args.code_model)
    if args.keys < 60:
        p.error("--keys: the replay needs at least 60 keystrokes (requests)")
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds: at least 1")
    return args


def selected_phases(args, fim):
    return [ph for ph in phases(args, fim) if not args.only or ph.name in args.only]


def main(argv=None):
    args = parse_args(argv)
    EDIT_ONLY[:] = args.edit_scenario or []
    # SIGTERM unwinds like Ctrl-C, so the server being measured is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = time.monotonic()
    bins = llama_bins(args)
    fim = None
    run_busy = not args.no_busy and (not args.only or "busy" in args.only)
    if not args.only or "editor-gemma" in args.only or run_busy:
        log("FIM copy of the model (cached): ...")
        fim = fimmodel.fim_copy(args.model)
        log("  %s" % fim)
    load_start = load()
    source_at_start = source_hash()
    rounds = Rounds(args, bins)
    rounds.run(selected_phases(args, fim))
    samples, busy, errors = rounds.samples, rounds.busy, rounds.errors
    busy_figs = {}
    if run_busy:
        busy_figs, busy_errors = busy_phase.run(args, bins, fim, log)
        errors += busy_errors
    if source_hash() != source_at_start:
        errors.append("offgrid/ changed during the run: the rounds measured different code")
    lb = {}
    if not args.no_llama_bench:
        log("llama-bench pp512 / tg128, -t %d" % args.threads)
        lb = llama_bench(bins["llama_server"], args.model, args.threads, 3)
        if not args.only or "batched" in args.only:
            log("llama-batched-bench: 1, 4, 8 sequences, -t %d" % args.threads)
            lb["batched"] = llama_batched_bench(bins["llama_server"], args.model, args.threads)
    load_end = load()

    figs = {name: figures(samples[name]) for name in args.servers}

    def rel(path):
        return os.path.relpath(path, str(ROOT)) if path.startswith(str(ROOT)) else path

    result = {
        "machine": machine(),
        "model": rel(args.model),
        "code_model": rel(args.code_model),
        "fim_model": str(fim) if fim else None,
        "revision": git_revision(),
        "offgrid_source": source_at_start,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "settings": {"threads": args.threads, "ctx_per_session": args.ctx,
                     "llama_server_ctx": "ctx x parallel (its -c is shared by its slots)",
                     "rounds": {ph.label: rounds.rounds(ph) for ph in phases(args, fim)},
                     "reps": args.reps, "editor_keys": args.keys,
                     "llama_server_flags": "--swa-full --cache-reuse 256 --metrics",
                     "llama_server_bins": {k: str(v) for k, v in bins.items()}},
        # load average (counts the bench itself) and the CPU share other
        # processes took while each server was measured (see CpuMeter)
        "load": {"start": load_start, "end": load_end,
                 "others_cpu_median": statistics.median(b["others_cpu"] for b in busy)
                 if busy else None,
                 "others_cpu_max": max(b["others_cpu"] for b in busy) if busy else None,
                 "phases": busy},
        "runtime_s": round(time.monotonic() - t_start, 1),
        "scenarios": {},
        "llama_server_best_spec_type": best_spec_type(samples.get("llama_server", {})),
        "llama_bench": lb,
        "busy_machine": busy_figs,
        "errors": errors,
        "samples": samples,
    }
    for name, unit, higher, what in ROWS:
        vals = {s: figs[s].get(name) for s in args.servers}
        if all(v is None for v in vals.values()):
            continue
        a, b, c = vals.get("offgrid"), vals.get("llama_server"), vals.get("llama_server_stock")
        result["scenarios"][name] = {
            "offgrid": a, "llama_server": b, "llama_server_stock": c,
            "ratio": a / b if a is not None and b else None,
            "ratio_stock": a / c if a is not None and c else None,
            "unit": unit, "higher_is_better": higher, "what": what}

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, out)

    m = result["machine"]
    print()
    print("offgrid vs llama-server, %s (code: %s), %d threads; %s (%s cores)"
          % (result["model"], result["code_model"], args.threads, m["cpu"], m["nproc"]))
    if busy:
        print("load average %.2f -> %.2f; other processes took %.0f%% of the CPU (median "
              "over phases, max %.0f%%)" % (load_start, load_end,
                                             100 * result["load"]["others_cpu_median"],
                                             100 * result["load"]["others_cpu_max"]))
    print("llama-server gets -c %d x np (its context is shared by its slots), --swa-full "
          "--cache-reuse 256; stock: the same flags, built without our patch" % args.ctx)
    if result["llama_server_best_spec_type"]:
        print("code continuation: llama-server's best n-gram option here was --spec-type %s"
              % result["llama_server_best_spec_type"])
    if fim and "editor_gemma_p50_ms" in result["scenarios"]:
        print("editor-gemma replay on %s: gemma-3-270m whose metadata names FIM tokens "
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
