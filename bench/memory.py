"""Prompt reuse on every memory class: offgrid against llama-server, turn by turn.

For each tiny model of tests/archmodels.py (built by libllama, cached), both
servers (llama-server built from the same source, its default
``--ctx-checkpoints``) are started with the same model, threads and context,
one after the other, and asked the same requests:

* ``chat``: a chat's first turn (a system prompt and a question), then the
  second turn as a client sends it (the first turn, the reply as the server
  gave it, a new question): how many of the second turn's prompt tokens came
  from the cache (``cache_n`` of /completion, or ``cached_tokens``).
* ``append``: /completion of a prompt, then the same prompt with its answer's
  tokens and more appended (a turn that only appends): the share reused.
* ``edit``: /completion of a prompt, then the same prompt with one word
  changed two thirds in: the tokens reused before the change.

Prints a table and writes bench/results/memory-latest.json.  Not timed: what
is compared is what each server takes from its cache, which does not depend
on the load.

    python3 bench/memory.py [--archs lfm2,qwen35] [--llama-server DIR]
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import archmodels  # noqa: E402
import servers  # noqa: E402

ARCHS = ["llama", "gemma3", "lfm2", "granitehybrid", "qwen3next", "nemotron_h", "qwen35",
         "mamba2"]
WORDS = ("river stone cloud maple harbor lantern copper meadow violet thunder anchor "
         "willow ember falcon garnet orchard pebble saffron tundra velvet").split()


def text(n, seed):
    return " ".join(WORDS[(i * 7 + seed * 3 + i // 5) % len(WORDS)] for i in range(n))


def cached_of(body):
    t = body.get("timings") or {}
    if "cache_n" in t:
        return t["cache_n"], t["cache_n"] + t.get("prompt_n", 0)
    u = body["usage"]
    return u.get("prompt_tokens_details", {}).get("cached_tokens", 0), u["prompt_tokens"]


def scenarios(port):
    out = {}
    first = [{"role": "system", "content": text(80, 1)}, {"role": "user", "content": text(40, 2)}]
    one, _ = servers.post(port, "/v1/chat/completions",
                          {"messages": first, "max_tokens": 24, "temperature": 0})
    reply = one["choices"][0]["message"]["content"]
    second = first + [{"role": "assistant", "content": reply},
                      {"role": "user", "content": text(20, 3)}]
    two, _ = servers.post(port, "/v1/chat/completions",
                          {"messages": second, "max_tokens": 8, "temperature": 0})
    out["chat"] = cached_of(two)

    prompt = text(200, 4)
    toks, _ = servers.post(port, "/tokenize", {"content": prompt, "add_special": True})
    body, _ = servers.post(port, "/completion", {"prompt": prompt, "n_predict": 24,
                                                 "temperature": 0, "return_tokens": True})
    more, _ = servers.post(port, "/tokenize", {"content": " " + text(20, 5),
                                               "add_special": False})
    appended = toks["tokens"] + body["tokens"] + more["tokens"]
    body, _ = servers.post(port, "/completion", {"prompt": appended, "n_predict": 8,
                                                 "temperature": 0})
    out["append"] = cached_of(body)

    words = text(200, 6).split()
    servers.post(port, "/completion", {"prompt": " ".join(words), "n_predict": 8,
                                       "temperature": 0})
    words[133] = "granite"
    body, _ = servers.post(port, "/completion", {"prompt": " ".join(words), "n_predict": 8,
                                                 "temperature": 0})
    out["edit"] = cached_of(body)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--llama-server", help="folder with llama-server (default: built by "
                    "scripts/build_lib.sh --server)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    bindir = args.llama_server or subprocess.check_output(
        ["bash", "scripts/build_lib.sh", "--server"], cwd=str(ROOT), text=True).split()[-1]
    tiny = Path(os.environ.get("OFFGRID_CACHE") or Path.home() / ".cache" / "offgrid") \
        / "tiny-models"
    rows = {}
    for arch in args.archs.split(","):
        model = str(archmodels.build(arch, tiny))
        cfg = servers.Config(model, threads=args.threads, ctx=4096)
        rows[arch] = {}
        for name, make in (("offgrid", servers.offgrid),
                           ("llama-server", lambda c: servers.llama_server(
                               c, {"llama_server": bindir}))):
            with make(cfg) as srv:
                rows[arch][name] = scenarios(srv.port)
        print_row(arch, rows[arch])
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "commit": subprocess.check_output(["git", "rev-parse", "--short", "HEAD"],
                                                cwd=str(ROOT), text=True).strip(),
              "host": os.uname().nodename, "load": os.getloadavg(), "rows": rows}
    out = ROOT / "bench" / "results" / "memory-latest.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", out.relative_to(ROOT))


def print_row(arch, row):
    cells = []
    for scenario in ("chat", "append", "edit"):
        for name in ("offgrid", "llama-server"):
            n, total = row[name][scenario]
            cells.append("%s %s %d/%d" % (scenario, name, n, total))
    print("%-14s %s" % (arch, " | ".join(cells)), flush=True)


if __name__ == "__main__":
    main()
