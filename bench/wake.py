"""The editor's first completion after a sleep and after a restart, against a warm one.

    python3 bench/wake.py [--rounds 2] [--sleep 5] [--servers offgrid,llama_server_stock]

Issue 39's second goal.  On each server, started with ``--sleep-idle-seconds``
(offgrid also with a ``--cache-dir`` of its own, where it writes its prompt
states when the model sleeps or the server stops): the editor replay's
request for the file as opened (bench/editor.py: llama.vscode's /infill with
~3,000 tokens of prefix, suffix and extra chunks) is answered cold; then
one key is typed at a time, a second apart, and each answer's latency (send
to answer, as the editor waits) is a sample:

warm            three keys with the model loaded and its cache warm (the median),
                after FILE_OPEN_S idle as the replay has (offgrid's idle fill
                brings in what the first answer's t_max_prompt_ms left out)
after_sleep     the next key once the server has slept (``--sleep`` seconds
                idle and a few more): the model reloads, and offgrid reads the
                state it wrote when it slept
after_restart   the next key after the server was stopped and started again
                with the same flags

The goal is after_sleep and after_restart each at most 1.5x warm.  Each
sample is the whole latency (``s``) and the part before generation
(``pre_s``: latency less the server's predicted_ms; a wake's load and a
prefill land there, while the answer's length, sampled with one seed, moves
the rest).
llama-server sleeps and restarts with nothing kept (its --cache-ram lives in
the process), for comparison.  The servers take turns round by round; the
load average is printed with every figure.  Results go to
bench/results/wake-latest.json.
"""

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from editor import DATA, FILE_OPEN_S, ChunkRing, Document, InFlight, body_for  # noqa: E402
from servers import SERVERS, Config  # noqa: E402
from turns import bins, median  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PAUSE_S = 1.0


def ask(port, doc, ring, timeout=600.0):
    """One /infill for the document as it is now: its latency in seconds and
    the server's timings."""
    time.sleep(PAUSE_S)
    # one seed: the answers' lengths, and so their generation times, alike
    req = InFlight(port, dict(body_for(doc, ring, 0), seed=1), timeout)
    req.thread.join(timeout)
    if req.answer is None:
        raise RuntimeError("/infill failed: %r" % (req.error,))
    t = req.answer["timings"]
    return {"s": req.latency_s, "pre_s": req.latency_s - t["predicted_ms"] / 1000.0,
            "prompt_n": t["prompt_n"], "cache_n": t.get("cache_n"),
            "predicted_n": t["predicted_n"], "load": round(os.getloadavg()[0], 2)}


def one_round(server, sleep_s):
    doc = Document((DATA / "typed_file.py.txt").read_text("utf-8"))
    ring = ChunkRing((DATA / "context_files.py.txt").read_text("utf-8"))
    keys = iter(doc.keys)
    out = {}

    def key(label):
        doc.type(next(keys))
        got = ask(server.port, doc, ring)
        print("  %-18s %-13s %.3f s (%.3f s before the first token), prompt_n %d, "
              "cache_n %s, predicted_n %d (load %.2f)"
              % (server.name, label, got["s"], got["pre_s"], got["prompt_n"], got["cache_n"],
                 got["predicted_n"], got["load"]), flush=True)
        out.setdefault(label, []).append(got)

    with server:
        got = ask(server.port, doc, ring)
        print("  %-18s %-13s %.3f s, prompt_n %d" % (server.name, "cold", got["s"],
                                                     got["prompt_n"]), flush=True)
        out["cold"] = [got]
        time.sleep(FILE_OPEN_S)
        for _ in range(3):
            key("warm")
        time.sleep(sleep_s + 3.0)
        key("after_sleep")
        # offgrid's load line of the wake: what the model's reload took of it
        loads = re.findall(r"loaded \S+ in ([\d.]+) s", server.log_text())
        out["reload_s"] = float(loads[-1]) if len(loads) > 1 else None
        server.stop()
        server.start()
        key("after_restart")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sleep", type=int, default=5, help="--sleep-idle-seconds")
    p.add_argument("--servers", default="offgrid,llama_server_stock")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "wake-latest.json"))
    args = p.parse_args(argv)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    found = bins() if any(n.startswith("llama") for n in names) else {}
    results = {"uptime_before": os.getloadavg(), "config": vars(args),
               "servers": {n: [] for n in names}}
    with tempfile.TemporaryDirectory(prefix="offgrid-wake-") as states:
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                cfg = Config(args.model, args.threads, 8192, 1, 512, 512,
                             extra=("--sleep-idle-seconds", str(args.sleep)),
                             cache_dir=os.path.join(states, "r%d" % r))
                results["servers"][name].append(one_round(SERVERS[name](cfg, found), args.sleep))
    results["uptime_after"] = os.getloadavg()
    summary = {}
    for name, rounds in results["servers"].items():
        row = {}
        for key in ("s", "pre_s"):
            warm = median([x[key] for r in rounds for x in r["warm"]])
            row["warm_" + key] = warm
            for label in ("after_sleep", "after_restart"):
                row[label + "_" + key] = median([x[key] for r in rounds for x in r[label]])
                row[label + "_" + key + "_over_warm"] = row[label + "_" + key] / warm
        reloads = [r["reload_s"] for r in rounds if r.get("reload_s") is not None]
        row["reload_s"] = median(reloads) if reloads else None
        summary[name] = row
    results["summary"] = summary
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    for name, row in summary.items():
        print("%-18s " % name + ", ".join("%s %s" % (k, "-" if v is None else "%.3f" % v)
                                          for k, v in row.items()))
    print("wrote %s" % args.out)


if __name__ == "__main__":
    main()
