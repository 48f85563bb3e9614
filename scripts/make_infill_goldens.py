#!/usr/bin/env python3
"""Record llama-server's fill-in-the-middle prompts for tests/test_engine.py's infill cases.

    python3 scripts/make_infill_goldens.py [--server PATH]

offgrid lays out a FIM prompt as llama-server's format_prompt_infill does:
the repository header and the extra context's chunks, the prefix cut to its
end and the suffix to its start so that both fit a batch, the extra context
cut to what the context has room for.  The expected layouts must come from
llama-server, not from offgrid's own arithmetic: for each case of CASES
this starts the pinned llama-server (loopback only) on the tiny FIM model
the tests use, with the case's -c and -b, posts the case to /infill, and
keeps the "prompt" it answers (its prompt tokens, detokenized with the
special tokens written out) in tests/golden/infill_layouts.json.
tests/test_engine.py lays out the same cases with offgrid and compares,
so `make test` never needs llama-server.

llama-server comes from `bash scripts/build_lib.sh --server` (cached under
~/.cache/offgrid/llama-server-*/bin); the tiny models from tests/tinymodels.py
(built into ~/.cache/offgrid/tiny-models).
"""

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import tinymodels  # noqa: E402
from make_chat_goldens import find_server, free_port  # noqa: E402  (scripts/ is sys.path[0])

CACHE = Path(os.environ.get("OFFGRID_CACHE") or os.path.expanduser("~/.cache/offgrid"))
OUT = ROOT / "tests" / "golden" / "infill_layouts.json"

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n    return c\n"
EXTRA = [("util.py", "import os\n"), ("math.py", "PI = 3\n")]
LONG_PREFIX = "".join("a%d = %d\n" % (i, i) for i in range(100))
LONG_SUFFIX = "".join("b%d = %d\n" % (i, i) for i in range(100))
BIG = "".join("c%d = %d\n" % (i, i) for i in range(100))


def case(model, n_ctx, n_batch, prefix, suffix, extra=(), prompt="", n_predict=1, spm=False):
    return {"model": model, "n_ctx": n_ctx, "n_batch": n_batch, "spm_infill": spm,
            "request": {"input_prefix": prefix, "input_suffix": suffix,
                        "input_extra": [{"filename": f, "text": t} for f, t in extra],
                        "prompt": prompt, "n_predict": n_predict}}


# model: "fim" (the tiny model with repository tokens) or "fim_norepo" (without);
# n_predict: the server's -n, which llama-server (and the tests) lay out with
CASES = {
    "repo_tokens": case("fim", 4096, 512, PREFIX, SUFFIX, EXTRA),
    "no_repo_tokens": case("fim_norepo", 4096, 512, PREFIX, SUFFIX, EXTRA),
    "prompt_after_prefix": case("fim", 4096, 512, PREFIX, SUFFIX, prompt="x = "),
    "spm": case("fim", 4096, 512, PREFIX, SUFFIX, spm=True),
    "long_prefix_and_suffix": case("fim", 4096, 64, LONG_PREFIX, LONG_SUFFIX),
    "prompt_takes_room_from_suffix": case("fim", 4096, 64, PREFIX, LONG_SUFFIX, prompt="x = 1"),
    "extra_context_whole": case("fim", 4096, 64, PREFIX, SUFFIX, [("big.py", BIG)]),
    "extra_context_cut": case("fim", 256, 64, PREFIX, SUFFIX, [("big.py", BIG)]),
}


def model_paths():
    d = CACHE / "tiny-models"
    d.mkdir(parents=True, exist_ok=True)
    return {"fim": tinymodels.fim_model(d), "fim_norepo": tinymodels.fim_model(d, False)}


def post(port, path, body, timeout=60):
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path),
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def record(server, model, c):
    port = free_port()
    # the extra context's room is the server's -n, not the request's n_predict
    cmd = [str(server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-c", str(c["n_ctx"]), "-b", str(c["n_batch"]), "-ub", str(c["n_batch"]),
           "-n", str(c["request"]["n_predict"]), "-np", "1", "-t", "2", "-ngl", "0",
           "--no-webui"]
    if c["spm_infill"]:
        cmd.append("--spm-infill")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError("llama-server exited: %s" % proc.stderr.read()[-2000:])
            try:
                with urllib.request.urlopen("http://127.0.0.1:%d/health" % port, timeout=2) as r:
                    if r.status == 200:
                        break
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llama-server did not start")
            time.sleep(0.2)
        # the slot's context as the server made it (it is never under 256 tokens)
        with urllib.request.urlopen("http://127.0.0.1:%d/props" % port, timeout=10) as r:
            n_ctx = json.loads(r.read())["default_generation_settings"]["n_ctx"]
        if n_ctx != c["n_ctx"]:
            raise RuntimeError("llama-server made a context of %d, not %d" % (n_ctx, c["n_ctx"]))
        return post(port, "/infill", dict(c["request"], temperature=0, cache_prompt=False))
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", help="llama-server binary (default: the cached build)")
    args = p.parse_args()
    server = find_server(args.server)
    models = model_paths()
    out = {}
    for name, c in CASES.items():
        res = record(server, models[c["model"]], c)
        out[name] = dict(c, prompt=res["prompt"], tokens_evaluated=res["tokens_evaluated"])
        print("%-32s %4d prompt tokens" % (name, res["tokens_evaluated"]), flush=True)
    with open(OUT, "w", encoding="utf-8") as fh:
        json.dump({"about": "llama-server's /infill prompts; re-record with "
                            "`python3 scripts/make_infill_goldens.py`",
                   "server": server.parent.parent.name, "cases": out},
                  fh, indent=1, ensure_ascii=False)
        fh.write("\n")


if __name__ == "__main__":
    main()
