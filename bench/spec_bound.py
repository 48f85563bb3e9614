"""How much prompt-lookup speculation could win here, at best: a bound, measured.

A speculative step decodes the next token and a draft of k tokens in one
decode, and keeps 1 + the drafted tokens that come true.  Whether that pays
depends on two things this script measures on this machine and model:

* what a verify decode costs: the time of a decode of 1 + k tokens (every
  output kept, as a verify decode keeps them) against a single token's, at
  the context sizes of the two workloads; and
* how far drafts come true: each workload's greedy output, generated plainly,
  then walked with engine/lookup.py's PromptLookup (the drafter offgrid
  uses, over the prompt and the output so far).

From these it computes, per sample, the **oracle**: the fastest schedule of
draft lengths (0 to K_MAX at every step, chosen knowing which drafts will
come true: a dynamic program over positions), as a speed-up over plain
decoding.  No real drafter, which must choose k before it knows, does
better, so a goal above the oracle's figure cannot be met by drafting from
the request's text on this machine.  Beside it: fixed draft lengths, and
the ceiling of a drafter that is always right (the best (1 + k) / cost).

The workloads are the bench's own (bench/scenarios.py, bench/editor.py,
bench/edits.py):
"continuation" (60 lines of bench/data/typed_file.py.txt before each of
CONT_CUTS, 128 greedy tokens) and "editor" (the /infill prompt at each pause
of the replay, greedy, n_predict as the replay sends, stopping where the
completion meets the suffix, as the server does).  Greedy rather than the
replay's sampling: a sampled token matches a draft no more often.
"edits" (``--edits``): the three edit requests of bench/edits.py (a
next-edit window, an apply-edit and a whole-file rewrite in chat, rendered
with the model's template), greedy; there the drafts are
engine/copydraft.py's, the draft lengths 0 and EDIT_K (1 + k a multiple of
4, up to 64 tokens), and beside the oracle the real drafter's schedule
(``copydraft``: CopyDraft driven as the session drives it, with these
costs), so the gap between what the drafter does and what any drafter of
its drafts could do is measured too.

    python3 bench/spec_bound.py [--model M] [--threads 2] [--json out.json]

It runs the engine in this process (as a worker does), about two minutes on
2 cores for Qwen2.5-Coder-0.5B; run it on a quiet machine.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import editor  # noqa: E402
import scenarios  # noqa: E402
from offgrid.engine.infill import layout_infill  # noqa: E402
from offgrid.engine.lookup import PromptLookup  # noqa: E402
from offgrid.engine.model import Model  # noqa: E402
from offgrid.engine.session import ChatSession  # noqa: E402
from offgrid.request import GenerationParams, InfillRequest, SamplingParams  # noqa: E402

K_MAX = 15              # drafts up to this many tokens (16-token verify decodes)
EDIT_K = (0, 3, 7, 15, 31, 63)      # the edit workload's draft lengths
COST_REPS = 9           # decodes timed per size; the median is kept
FIXED_K = (1, 2, 3, 4, 7, 15)


def verify_costs(session, tokens, reps=COST_REPS, sizes=None):
    """{n: median seconds of a decode of n tokens after ``tokens``}, n = 1..K_MAX + 1
    (or ``sizes``).

    Uses the session's own verify path (_decode_one with a draft keeps every
    output, as speculation does) and drops what it decoded after each try.
    """
    session.evaluate(tokens)
    pos = len(session.cached)
    out = {}
    for n in sizes or range(1, K_MAX + 2):
        times = []
        for _ in range(reps):
            draft = tokens[-n + 1:] if n > 1 else []
            t0 = time.perf_counter()
            status = session._decode_one(tokens[-1], pos, draft)
            times.append(time.perf_counter() - t0)
            if status != 0:
                raise RuntimeError("decode failed: %d" % status)
            session._drop_after(pos)
        out[n] = statistics.median(times)
    return out


def true_runs(prompt, output, k_max=K_MAX):
    """For each step i (output[i] just sampled, about to be decoded): how many of
    the draft PromptLookup gives then match output[i + 1:] (at most k_max)."""
    return drafter_runs(PromptLookup(prompt), output, k_max)


def drafter_runs(lookup, output, k_max):
    """true_runs with any drafter (its append(token) and lookup(k))."""
    runs = []
    for i, tok in enumerate(output):
        lookup.append(tok)
        draft = lookup.lookup(k_max)
        m = 0
        for d, real in zip(draft, output[i + 1:]):
            if d != real:
                break
            m += 1
        runs.append(m)
    return runs


def oracle_time(runs, cost, k_choices):
    """Least time to produce every token after the first, choosing each step's
    draft length from k_choices knowing ``runs`` (the dynamic program)."""
    n = len(runs)
    best = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        options = []
        for k in k_choices:
            gain = 1 + min(k, runs[i])
            options.append(cost[1 + k] + best[min(n, i + gain)])
        best[i] = min(options)
    return best[0]


def fixed_time(runs, cost, k):
    """Time with a draft of k tokens at every step (0: plain decoding)."""
    i, t, n = 0, 0.0, len(runs)
    while i < n:
        t += cost[1 + k]
        i += 1 + min(k, runs[i])
    return t


def judge(prompt, output, cost):
    runs = true_runs(prompt, output)
    plain = fixed_time(runs, cost, 0)
    return {
        "tokens": len(output),
        "drafted_true_share": sum(1 for r in runs if r > 0) / max(1, len(runs)),
        "oracle": plain / oracle_time(runs, cost, range(0, K_MAX + 1)),
        "fixed": {k: plain / fixed_time(runs, cost, k) for k in FIXED_K},
    }


def greedy(session, tokens, n_predict, fim_suffix=None, fim_indent=0):
    params = GenerationParams(n_predict=n_predict, sampling=SamplingParams(temperature=0.0),
                              speculate=False)
    params.fim_suffix, params.fim_indent = fim_suffix, fim_indent
    return session.complete(tokens, params)


def continuation_samples(model, session):
    lines = (editor.DATA / "typed_file.py.txt").read_text("utf-8").split("\n")
    out = []
    for cut in scenarios.CONT_CUTS:
        text = "".join(ln + "\n" for ln in lines[max(0, cut - scenarios.CONT_CONTEXT_LINES):cut])
        prompt = model.tokenize(text, add_special=True)
        got = greedy(session, prompt, scenarios.CONT_TOKENS)
        out.append(("cut %d" % cut, prompt, list(got.tokens)))
    return out


def editor_samples(model, session):
    """The replay's pauses (same keys, same rule), each answered greedily."""
    doc = editor.Document((editor.DATA / "typed_file.py.txt").read_text("utf-8"))
    ring = editor.ChunkRing((editor.DATA / "context_files.py.txt").read_text("utf-8"))
    out, since, pauses = [], 0, 0
    for i, ch in enumerate(doc.keys[:editor.N_KEYS]):
        doc.type(ch)
        since += 1
        if not editor.pauses_after(ch, since, i == editor.N_KEYS - 1):
            continue
        body = editor.body_for(doc, ring, i)
        req = InfillRequest(input_prefix=body["input_prefix"], input_suffix=body["input_suffix"],
                            input_extra=[(c["filename"], c["text"]) for c in body["input_extra"]],
                            prompt=body["prompt"])
        prompt = layout_infill(model, req, session.n_ctx, session.n_batch, body["n_predict"])[0]
        line = (req.input_prefix + req.prompt).rsplit("\n", 1)[-1]
        got = greedy(session, prompt, body["n_predict"], req.input_suffix,
                     len(line) - len(line.lstrip(" \t")))
        out.append(("pause %d" % pauses, prompt, list(got.tokens)))
        pauses += 1
        since = 0
        if pauses % editor.ROTATE_EVERY == 0:
            ring.rotate()
    return out


def edit_samples(model, session):
    """bench/edits.py's three requests, rendered as the worker renders them, each
    answered greedily (as many tokens as the bench allows)."""
    import types
    import edits
    from offgrid.chat.prompt import prepare_chat
    from offgrid.chat.select import template_for
    from offgrid.request import Message
    template = template_for(types.SimpleNamespace(model=model, chat_template=None))
    out = []
    for name, (path, body) in edits.bodies().items():
        if "messages" in body:
            msgs = [Message(m["role"], m["content"]) for m in body["messages"]]
            text = prepare_chat(model, template, msgs).text
            stop = []
        else:
            text, stop = body["prompt"], body["stop"]
        prompt = model.tokenize(text, add_special=True, parse_special=True)
        params = GenerationParams(n_predict=edits.N_PREDICT[name], stop=stop, speculate=False,
                                  sampling=SamplingParams(temperature=0.0))
        got = session.complete(prompt, params)
        out.append((name, prompt, list(got.tokens)))
        # the same answer with the change the request asks for made (a small
        # model copies without making it): where drafts must follow an edit
        old, new = EDITED[name]
        if old in got.text:
            edited = model.tokenize(got.text.replace(old, new), add_special=False,
                                    parse_special=False)
            out.append((name + "+edit", prompt, edited))
    return out


EDITED = {"next_edit": ("n_kv", "kv_count"), "apply_edit": ("metadata", "meta"),
          "rewrite": ("_read_exact", "_read_bytes")}


def copy_runs(prompt, output):
    """As true_runs, with CopyDraft's drafts (up to 63 tokens)."""
    from offgrid.engine.copydraft import CopyDraft
    return drafter_runs(CopyDraft(prompt), output, 63)


def copydraft_time(prompt, output, cost):
    """The time CopyDraft's own schedule takes with these costs (driven as the
    session drives it, on a clock that advances by each step's cost)."""
    from offgrid.engine.copydraft import CopyDraft

    class Clock:
        t = 0.0

        def __call__(self):
            return self.t
    clock = Clock()
    lk = CopyDraft(prompt, clock=clock)
    lk.append(output[0])
    pos, total, drafted, accepted, steps = 1, 0.0, 0, 0, 0
    while pos < len(output):
        d = lk.draft(63)
        c = cost[1 + len(d)]
        total += c
        clock.t += c
        h = 0
        while h < len(d) and pos + h < len(output) and output[pos + h] == d[h]:
            h += 1
        if d:
            drafted, accepted, steps = drafted + len(d), accepted + h, steps + 1
        for t in output[pos:pos + h + 1]:
            lk.append(t)
        pos += h + 1
    return total, drafted, accepted, steps


def ngram_mod_time(prompt, output, cost, n=24, n_min=48, n_max=64):
    """The time llama.cpp's ngram-mod schedule takes with these costs, as its
    code (common/speculative.cpp) reads: each n-gram of ``n`` tokens maps to
    the token that followed it last; a draft chains those up to ``n_max`` and
    is made only if it reaches ``n_min``."""
    t = list(prompt)
    mod = {tuple(t[i:i + n]): t[i + n] for i in range(len(t) - n)}
    last = max(0, len(t) - n)
    t.append(output[0])
    pos, total = 1, 0.0
    while pos < len(output):
        if last + 32 < len(t):
            for i in range(last, len(t) - n):
                mod[tuple(t[i:i + n])] = t[i + n]
            last = len(t) - n
        ctx, d = t[-n:], []
        while len(d) < n_max:
            nx = mod.get(tuple(ctx[-n:]))
            if nx is None:
                break
            d.append(nx)
            ctx.append(nx)
        if len(d) < n_min:
            d = []
        total += cost[1 + len(d)]
        h = 0
        while h < len(d) and pos + h < len(output) and output[pos + h] == d[h]:
            h += 1
        t.extend(output[pos:pos + h + 1])
        pos += h + 1
    return total


def judge_edits(prompt, output, cost):
    runs = copy_runs(prompt, output)
    plain = fixed_time(runs, cost, 0)
    t, drafted, accepted, steps = copydraft_time(prompt, output, cost)
    return {
        "ngram_mod": plain / ngram_mod_time(prompt, output, cost),
        "tokens": len(output),
        "drafted_true_share": sum(1 for r in runs if r > 0) / max(1, len(runs)),
        "oracle": plain / oracle_time(runs, cost, EDIT_K),
        "copydraft": plain / t,
        "acceptance": accepted / drafted if drafted else 0.0,
        "mean_len": 1 + accepted / steps if steps else 1.0,
        "fixed": {k: plain / fixed_time(runs, cost, k) for k in EDIT_K[1:]},
    }


def interpolated(cost):
    """Every size from 1 to the largest measured, linear between measured ones."""
    ns = sorted(cost)
    out = dict(cost)
    for a, b in zip(ns, ns[1:]):
        for n in range(a + 1, b):
            out[n] = cost[a] + (cost[b] - cost[a]) * (n - a) / (b - a)
    return out


def run_edits(model, session, report):
    samples = edit_samples(model, session)
    context = statistics.median(len(s[1]) for s in samples)
    ctx_tokens = samples[0][1][:int(context)]
    session.reset()
    sizes = sorted({1 + k for k in EDIT_K} | {2})
    cost = interpolated(verify_costs(session, ctx_tokens, sizes=sizes))
    rel = {n: cost[n] / cost[1] for n in sizes}
    judged = [(label, judge_edits(prompt, out, cost)) for label, prompt, out in samples]
    report["workloads"]["edits"] = {
        "context_tokens": int(context), "single_decode_ms": cost[1] * 1000.0,
        "verify_cost": rel, "samples": dict(judged),
        "always_right": max(n / rel[n] for n in rel)}
    print("edits: %d samples, context ~%d tokens, a single decode %.1f ms"
          % (len(samples), context, cost[1] * 1000.0))
    print("  verify decode of n tokens / a single one: " +
          ", ".join("%d: %.2f" % (n, rel[n]) for n in sizes))
    for label, j in judged:
        print("  %-15s %4d tokens: oracle %.2fx, copydraft %.2fx, ngram-mod %.2fx (copydraft: "
              "acceptance %.0f%%, mean accepted length %.1f), fixed k %s" % (
                  label, j["tokens"], j["oracle"], j["copydraft"], j["ngram_mod"],
                  100 * j["acceptance"],
                  j["mean_len"], " ".join("%d:%.2f" % kv for kv in j["fixed"].items())))
    print("  a drafter always right: %.2fx" % max(n / rel[n] for n in rel))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(ROOT / "models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="write the figures here too")
    p.add_argument("--edits", action="store_true",
                   help="the edit workload (bench/edits.py) only")
    args = p.parse_args(argv)
    model = Model.load(args.model, progress=False)
    report = {"model": args.model, "threads": args.threads, "workloads": {}}
    try:
        with ChatSession(model, n_ctx=8192 if args.edits else 4096, n_threads=args.threads,
                         n_threads_batch=args.threads) as session:
            if args.edits:
                run_edits(model, session, report)
            for name, collect in () if args.edits else (("continuation", continuation_samples),
                                  ("editor", editor_samples)):
                samples = collect(model, session)
                context = statistics.median(len(s[1]) for s in samples)
                ctx_tokens = samples[0][1][:int(context)]
                session.reset()
                cost = verify_costs(session, ctx_tokens)
                rel = {n: c / cost[1] for n, c in cost.items()}
                judged = [(label, judge(prompt, out, cost)) for label, prompt, out in samples]
                total = {"oracle": statistics.mean(j["oracle"] for _, j in judged)}
                for k in FIXED_K:
                    total["fixed_%d" % k] = statistics.mean(j["fixed"][k] for _, j in judged)
                total["always_right"] = max(n / rel[n] for n in rel)
                report["workloads"][name] = {
                    "context_tokens": int(context), "single_decode_ms": cost[1] * 1000.0,
                    "verify_cost": rel, "samples": dict(judged), "mean": total}
                print("%s: %d samples, context ~%d tokens, a single decode %.1f ms"
                      % (name, len(samples), context, cost[1] * 1000.0))
                print("  verify decode of n tokens / a single one: " +
                      ", ".join("%d: %.2f" % (n, rel[n]) for n in sorted(rel)))
                for label, j in judged:
                    fixed = " ".join("%d:%.2f" % kv for kv in j["fixed"].items())
                    print("  %-9s %3d tokens, a draft came true at %3.0f%% of steps: "
                          "oracle %.2fx, fixed k %s" % (label, j["tokens"],
                                                        100 * j["drafted_true_share"],
                                                        j["oracle"], fixed))
                print("  mean: oracle %.2fx plain; fixed k %s; a drafter always right %.2fx"
                      % (total["oracle"], " ".join("%d:%.2f" % (k, total["fixed_%d" % k])
                                                    for k in FIXED_K), total["always_right"]))
                session.reset()
    finally:
        model.close()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
