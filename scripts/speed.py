#!/usr/bin/env python3
"""Report offgrid's prompt and generation speed on a model (default: gemma-3-270m).

    python3 scripts/speed.py [--model PATH] [--threads 2] [--n-prompt 512] [--n-gen 128]

Prints tokens per second for prompt evaluation (pp) and greedy generation (tg),
the median of a few runs, in the shape of llama-bench's pp512 / tg128 rows so
the two can be put side by side.  It reports and asserts nothing: speed
depends on the machine, and a test that failed on a slow one would teach
nothing.

Unlike llama-bench, the figures include everything offgrid does per token
(the Python loop, the sampler chain, turning bytes into text), which is what a
client of the server waits for.
"""

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from offgrid import libllama                                    # noqa: E402
from offgrid.engine.model import Model                                 # noqa: E402
from offgrid.request import SamplingParams                             # noqa: E402
from offgrid.engine.session import ChatSession, GenerationParams      # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"


def prompt_tokens(model, n):
    """``n`` tokens of plain English-like text, BOS first."""
    text = " ".join("Line %d of the report says the weather was %s and the road was %s."
                    % (i, ("mild", "cold", "wet")[i % 3], ("open", "closed")[i % 2])
                    for i in range(n))
    tokens = model.tokenize(text)[:n]
    assert len(tokens) == n
    return tokens


def measure_prompt(session, tokens):
    """Prompt tokens per second: the whole prompt evaluated, nothing from the cache."""
    done = session.complete(tokens, GenerationParams(n_predict=0, cache_prompt=False))
    return len(tokens) / (done.usage.prompt_ms / 1000.0)


def measure_generation(session, n_gen):
    """Greedy tokens per second over ``n_gen`` generated tokens (a one-token prompt)."""
    model = session.model
    params = GenerationParams(n_predict=n_gen, ignore_eos=True, cache_prompt=False,
                              sampling=SamplingParams(temperature=0))
    done = session.complete([model.bos if model.bos is not None else 0], params)
    assert done.usage.completion_tokens == n_gen
    return n_gen / (done.usage.generation_ms / 1000.0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--lib", default=None, help="libllama to use (default: lib/ or $OFFGRID_LIB)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n-prompt", type=int, default=512)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)

    lib = libllama.load(args.lib)
    model = Model.load(args.model, lib_path=args.lib, progress=False)
    n_ctx = args.n_prompt + args.n_gen + 16
    with ChatSession(model, n_ctx=n_ctx, n_batch=args.n_batch, n_threads=args.threads) as session:
        tokens = prompt_tokens(model, args.n_prompt)
        # one untimed run of each first: page in the weights, size the buffers
        measure_prompt(session, tokens)
        measure_generation(session, 8)
        pp = [measure_prompt(session, tokens) for _ in range(args.runs)]
        tg = [measure_generation(session, args.n_gen) for _ in range(args.runs)]
    model.close()

    print("model:   %s (%s, %.0f MiB)" % (model.name, model.desc, model.size / 2 ** 20))
    print("library: %s" % lib.path)
    print("cpu:     %d cores, %d threads used, n_batch %d"
          % (os.cpu_count() or 0, args.threads, args.n_batch))
    print("pp%-5d  %8.1f tokens/s  (median of %d; runs %s)"
          % (args.n_prompt, statistics.median(pp), len(pp), ", ".join("%.1f" % x for x in pp)))
    print("tg%-5d  %8.1f tokens/s  (median of %d; runs %s)"
          % (args.n_gen, statistics.median(tg), len(tg), ", ".join("%.1f" % x for x in tg)))


if __name__ == "__main__":
    main()
