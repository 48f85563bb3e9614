"""Conversations taking turns on one session: time to first token per turn.

    python3 bench/turns.py [--rounds 2] [--tokens 4000] [--servers offgrid,llama_server_stock]

Three clients, each with a long prompt of its own (~``--tokens`` tokens of a
code file and a question), take turns on a server of one session (``-np 1``):
A, B, C, A, B, C, ...  Each turn's prompt is the client's previous one and a
new question, so a server that keeps only its session's cache evaluates the
whole prompt every turn, and one that keeps prompt states (offgrid's
``--cache-ram``, llama-server's ``--cache-ram``, both at their defaults here)
evaluates the new question only from the second round on.

Per turn: the time to the first streamed token on the client's clock, and
the server's own ``timings`` (``prompt_n`` evaluated, ``cache_n`` reused).
The load average is printed with every figure: this measures a shared
machine.  Results go to bench/results/turns-latest.json.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from servers import SERVERS, Config, stream  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"


def prompts(n_tokens):
    """Three long, different prompts: the bench's code files, cut and rotated."""
    text = (DATA / "context_files.py.txt").read_text() + (DATA / "typed_file.py.txt").read_text()
    n_chars = int(n_tokens * 3.3)      # Qwen2.5-Coder: ~3.3 characters a token of Python
    out = []
    for i, role in enumerate(("reviewer", "tester", "documenter")):
        start = (i * len(text)) // 3
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


def run(server, texts, rounds):
    out = []
    with server as s:
        for r in range(rounds):
            for c, text in enumerate(texts):
                got = turn(s.port, text, r)
                got.update(round=r, client="ABC"[c])
                print("  %-18s round %d client %s: first token %.2f s, prompt_n %d, "
                      "cache_n %d (load %.2f)" % (server.name, r, got["client"], got["ttft_s"],
                                                  got["prompt_n"], got["cache_n"], got["load"]),
                      flush=True)
                out.append(got)
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
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--servers", default="offgrid,llama_server_stock")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "turns-latest.json"))
    args = p.parse_args(argv)
    texts = prompts(args.tokens)
    cfg = Config(args.model, args.threads, args.tokens + 1024, 1, 512, 512)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    found = bins() if any(n.startswith("llama") for n in names) else {}
    results = {"uptime_before": os.getloadavg(), "config": vars(args), "servers": {}}
    for name in names:
        results["servers"][name] = run(SERVERS[name](cfg, found), texts, args.rounds)
    results["uptime_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print("wrote %s" % args.out)


if __name__ == "__main__":
    main()
