"""Conversations taking turns on one session: time to first token per turn.

    python3 bench/turns.py [--turns 10] [--tokens 4000] [--servers offgrid,llama_server_stock]

Issue 39's goal, as its two phases, every server up at once and each turn
sent to each server in alternating order (A B, B A, ...: this shared VM's
speed drifts within a minute, so a server run after the other would be
measured on another machine; a second's pause before each turn):

single    one client, a long prompt of its own (~``--tokens`` tokens of a code
          file and a question), ``--turns`` turns: each turn's prompt is the
          previous one and a new question, so from the second turn on only
          the question is evaluated.  Its median is the baseline.
rotation  three other clients with prompts of their own take turns on a
          server of one session (``-np 1``): A, B, C, A, B, C, ... for
          ``--turns`` rounds.  A server that keeps only its session's cache
          evaluates every prompt whole every turn; one that keeps prompt
          states (offgrid's ``--cache-ram``, llama-server's ``--cache-ram``,
          both at their defaults here) evaluates the question only, from the
          second round on.

Per turn: the time to the first streamed token on the client's clock, and
the server's own ``timings`` (``prompt_n`` evaluated, ``cache_n`` reused).
The summary gives each server's median over the turns after each client's
first (the warm turns) in both phases, rotation over single (the goal: at
most 1.2) and offgrid's rotation median over each llama-server's (at most
1.0).  The load average is printed with every figure: this measures a
shared machine.  Results go to bench/results/turns-latest.json.
"""

import argparse
import contextlib
import json
import os
import time
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import SERVERS, Config, stream  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
PAUSE_S = 1.0       # before each turn on each server, as bench/run.py's phases


def prompts(n_tokens, n=4):
    """``n`` long, different prompts: the bench's code files, cut and rotated."""
    text = (DATA / "context_files.py.txt").read_text() + (DATA / "typed_file.py.txt").read_text()
    n_chars = int(n_tokens * 4.2)      # Qwen2.5-Coder: ~4.2 characters a token of these files
    text = text * (1 + n_chars // len(text))    # the files are ~3,000 tokens together
    out = []
    for i, role in enumerate(("reviewer", "tester", "documenter", "maintainer")[:n]):
        start = (i * len(text)) // n
        body = (text[start:] + text[:start])[:n_chars]
        out.append("You are a careful code %s.\n\n%s\n" % (role, body))
    return out


def turn(port, prompt, k):
    """One turn: the streamed /completion of the prompt and question k."""
    body = {"prompt": prompt + "\nQuestion %d: what does the code above do?\nAnswer:" % k,
            "n_predict": 8, "temperature": 0, "cache_prompt": True}
    events = stream(port, "/completion", body, timeout=900)
    first = next(t for t, e in events if e.get("content") or e.get("stop"))
    t = events[-1][1]["timings"]
    return {"ttft_s": first, "prompt_n": t["prompt_n"], "cache_n": t["cache_n"],
            "load": round(os.getloadavg()[0], 2)}


def run(servers, phase, clients, turns):
    """``turns`` rounds of every client's turn, each turn on every server,
    the servers' order alternating; returns {server name: [turn, ...]}."""
    out = {s.name: [] for s in servers}
    k = 0
    for r in range(turns):
        for c, (label, text) in enumerate(clients):
            order = servers if k % 2 == 0 else servers[::-1]
            k += 1
            for s in order:
                # ggml's idle threads poll for a while after a decode: a server
                # sampled right after another one would be slowed by its threads
                time.sleep(PAUSE_S)
                got = turn(s.port, text, r)
                got.update(round=r, client=label)
                print("  %-8s %-18s round %d client %s: first token %.3f s, prompt_n %d, "
                      "cache_n %d (load %.2f)" % (phase, s.name, r, label, got["ttft_s"],
                                                  got["prompt_n"], got["cache_n"], got["load"]),
                      flush=True)
                out[s.name].append(got)
    return out


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return (xs[n // 2] + xs[(n - 1) // 2]) / 2 if xs else None


def summary(results):
    """Each server's warm medians (turns after each client's first), their ratio,
    and offgrid's rotation median over each other server's."""
    out = {}
    for name in results["single"]:
        warm = {ph: median([t["ttft_s"] for t in results[ph][name] if t["round"] > 0])
                for ph in ("single", "rotation")}
        out[name] = {"single_warm_median_s": warm["single"],
                     "rotation_warm_median_s": warm["rotation"],
                     "rotation_over_single": warm["rotation"] / warm["single"]}
    if "offgrid" in out:
        for name, row in out.items():
            if name != "offgrid":
                out["offgrid"]["rotation_over_" + name] = (
                    out["offgrid"]["rotation_warm_median_s"] / row["rotation_warm_median_s"])
                # turn by turn (the two were sampled a second apart): steadier
                # than the medians' ratio where the machine's load moved
                pairs = zip(results["rotation"]["offgrid"], results["rotation"][name])
                out["offgrid"]["rotation_paired_over_" + name] = median(
                    [a["ttft_s"] / b["ttft_s"] for a, b in pairs if a["round"] > 0])
    return out


def bins():
    out = subprocess.check_output(["bash", "scripts/build_lib.sh", "--stock-server"],
                                  cwd=str(ROOT), text=True, timeout=3600)
    return {"llama_server_stock": Path(out.strip().splitlines()[-1]),
            "llama_server": None}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=4000, help="tokens of each client's prompt")
    p.add_argument("--turns", type=int, default=10, help="turns of each client")
    p.add_argument("--servers", default="offgrid,llama_server_stock")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "turns-latest.json"))
    args = p.parse_args(argv)
    texts = prompts(args.tokens)
    cfg = Config(args.model, args.threads, args.tokens + 1024, 1, 512, 512)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    found = bins() if any(n.startswith("llama") for n in names) else {}
    results = {"uptime_before": os.getloadavg(), "config": vars(args)}
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(SERVERS[n](cfg, found)) for n in names]
        results["single"] = run(servers, "single", [("S", texts[3])], args.turns)
        results["rotation"] = run(servers, "rotation", list(zip("ABC", texts[:3])), args.turns)
    results["uptime_after"] = os.getloadavg()
    results["summary"] = summary(results)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    for name, row in results["summary"].items():
        print("%-18s " % name + ", ".join("%s %.3f" % kv for kv in row.items()))
    print("wrote %s" % args.out)


if __name__ == "__main__":
    main()
