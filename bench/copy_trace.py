"""Where an edit's copy drafts win and lose, step by step, in load-independent terms.

The bench's wall-clock rates move with whatever else the machine runs; this
script measures what does not:

* each scenario's greedy answer (bench/copies.py's out-of-order copy and
  bench/edits.py's three edits, rendered as the worker renders them),
  generated once plainly;
* the cost of a verify decode of n tokens against a single one's, for every n
  from 1 to 64, at the scenario's context (medians of several tries; the
  ratio moves much less with load than either time);
* engine/copydraft.py's CopyDraft driven over each answer as the session
  drives it (draft() before each decode, append() for the tokens the step
  keeps), on a clock that advances by each step's modelled cost: decode
  steps per token, drafted and accepted tokens, tokens kept per step, the
  modelled speed-up over plain decoding, and the oracle (the best schedule
  of the drafter's own drafts, bench/spec_bound.py);
* where the time goes: the steps whose drafts failed (their cost beyond a
  single decode), the plain steps (no draft: line starts, the model's own
  lines, the judge's timing steps), and the drafter's own Python time per
  step (measured here, not modelled).

    python3 bench/copy_trace.py [--samples /tmp/s.json] [--costs /tmp/c.json] [--steps]

``--samples``/``--costs``: files that keep the answers and the costs between
runs (made on the first run, read after), so that changes to the drafter are
compared on the same answers and the same costs (a costs file may also be a
model of them: {n: seconds}).  ``--scenarios`` picks the scenarios (the
rewrite's 2,200 tokens take minutes under load); ``--steps`` prints every
step of the first (or ``--only``) scenario: each draft, what came true, and
the text the step kept.
"""

import argparse
import json
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import copies  # noqa: E402
import edits  # noqa: E402
from spec_bound import oracle_time, verify_costs  # noqa: E402

MODEL = ROOT / "models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
SIZES = list(range(1, 65))


def render(model, template, path, body):
    from offgrid.chat.prompt import prepare_chat
    from offgrid.request import Message
    if "messages" in body:
        msgs = [Message(m["role"], m["content"]) for m in body["messages"]]
        return prepare_chat(model, template, msgs).text, []
    return body["prompt"], body.get("stop", [])


def collect(model, session, out, path, names):
    """{name: (prompt tokens, answer tokens)}: each scenario of ``names`` not in
    ``out`` answered greedily, added to ``out`` and written to ``path``."""
    from offgrid.chat.select import template_for
    from offgrid.request import GenerationParams, SamplingParams
    template = template_for(types.SimpleNamespace(model=model, chat_template=None))
    scenarios = dict(copies.bodies())
    scenarios.update(edits.bodies())
    limits = dict(copies.N_PREDICT, **edits.N_PREDICT)
    for name in names:
        if name in out:
            continue
        route, body = scenarios[name]
        text, stop = render(model, template, route, body)
        prompt = model.tokenize(text, add_special=True, parse_special=True)
        params = GenerationParams(n_predict=limits[name], stop=stop, speculate=False,
                                  sampling=SamplingParams(temperature=0.0))
        session.reset()
        got = session.complete(prompt, params)
        out[name] = (list(prompt), list(got.tokens))
        Path(path).write_text(json.dumps(out))
        print("%s: %d prompt tokens, %d answer tokens" % (name, len(prompt), len(got.tokens)),
              flush=True)
    return out


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def drive(prompt, answer, cost, newline, cap=63, blank=None):
    """CopyDraft over ``answer`` as the session drives it; the figures of its
    schedule (see the module docstring)."""
    from offgrid.engine.copydraft import CopyDraft
    clock = Clock()
    t0 = time.perf_counter()
    lk = CopyDraft(prompt, k_max=cap, clock=clock, newline=newline, blank=blank)
    setup = time.perf_counter() - t0
    lk.append(answer[0])
    pos = 1
    steps = []       # (pos, draft length, hits, mode)
    py = 0.0
    while pos < len(answer):
        # "line": lines drafted one at a time; "order": the copy in order;
        # "-off": the judge has stopped drafting for the request
        mode = ("line" if not lk.in_order() else "order") + ("" if lk.paying else "-off")
        t0 = time.perf_counter()
        d = lk.draft(cap)
        py += time.perf_counter() - t0
        clock.t += cost[1 + len(d)]
        h = 0
        while h < len(d) and pos + h < len(answer) and answer[pos + h] == d[h]:
            h += 1
        steps.append((pos, len(d), h, mode))
        t0 = time.perf_counter()
        for t in answer[pos:pos + h + 1]:
            lk.append(t)
        py += time.perf_counter() - t0
        pos += h + 1
    return steps, py, setup


def runs_of(prompt, answer, newline, cap=63, blank=None):
    """For each step (answer[i] just sampled): how many of the draft CopyDraft
    would give there (at the longest size) come true."""
    from offgrid.engine.copydraft import CopyDraft
    lk = CopyDraft(prompt, k_max=cap, newline=newline, blank=blank)
    runs = []
    for i, tok in enumerate(answer):
        lk.append(tok)
        d = lk.lookup(cap)
        m = 0
        for a, b in zip(d, answer[i + 1:]):
            if a != b:
                break
            m += 1
        runs.append(m)
    return runs


def report(name, prompt, answer, cost, newline, show_steps=False, piece=None, single_s=1.0,
           blank=None):
    steps, py, setup = drive(prompt, answer, cost, newline, blank=blank)
    n_tok = len(answer)
    plain_t = cost[1] * (n_tok - 1)
    spec_t = sum(cost[1 + n] for _, n, _, _ in steps)
    drafted = [(n, h) for _, n, h, _ in steps if n]
    n_draft = sum(n for n, _ in drafted)
    n_acc = sum(h for _, h in drafted)
    # what a failed draft cost beyond the draft of its true part alone
    failed_extra = sum(cost[1 + n] - cost[1 + h] for n, h in drafted if h < n)
    plain_steps = [s for s in steps if s[1] == 0]
    runs = runs_of(prompt, answer, newline, blank=blank)
    # the oracle over the drafter's own drafts, every draft length 0..63 allowed
    oracle = plain_t / oracle_time(runs[1:], cost, range(0, 64)) if len(runs) > 1 else 1.0
    modes = {}
    for _, n, h, m in steps:
        c = modes.setdefault(m, [0, 0, 0, 0])
        c[0] += 1
        c[1] += n
        c[2] += h
        c[3] += 1 + h
    print("%s: %d tokens, %d decode steps (%.3f a token), %d drafts: %d drafted, %d accepted "
          "(%.2f), mean kept a step %.2f" % (
              name, n_tok, len(steps), len(steps) / max(1, n_tok - 1), len(drafted), n_draft,
              n_acc, n_acc / max(1, n_draft), (n_tok - 1) / max(1, len(steps))))
    print("  modelled: %.2fx plain (oracle of these drafts %.2fx); plain steps %d (%.0f%% of "
          "time), failed drafts' extra cost %.0f%% of time" % (
              plain_t / spec_t, oracle, len(plain_steps),
              100 * len(plain_steps) * cost[1] / spec_t, 100 * failed_extra / spec_t))
    print("  by mode: " + "; ".join("%s %d steps, %d drafted, %d accepted, %d tokens"
                                    % ((m,) + tuple(c)) for m, c in sorted(modes.items())))
    print("  drafter's Python: %.3f ms a step (%.2f%% of a single decode), setup %.1f ms" % (
        1000 * py / len(steps), 100 * py / len(steps) / single_s, 1000 * setup))
    if show_steps and piece is not None:
        for pos, n, h, m in steps:
            txt = piece(answer[pos - 1])
            print("   %4d %-5s k=%2d hit=%2d  after %r  -> %r" % (
                pos, m, n, h, txt, "".join(piece(t) for t in answer[pos:pos + h + 1])))
    return {"tokens": n_tok, "steps": len(steps), "drafted": n_draft, "accepted": n_acc,
            "modelled": plain_t / spec_t, "oracle": oracle,
            "python_ms_step": 1000 * py / len(steps)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", default="/tmp/copy_trace_samples.json")
    p.add_argument("--costs", default="/tmp/copy_trace_costs.json")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", action="store_true")
    p.add_argument("--only", help="one scenario")
    p.add_argument("--scenarios", default="out_of_order,apply_edit,next_edit,rewrite",
                   help="which scenarios, comma-separated")
    args = p.parse_args(argv)
    from offgrid.engine.model import Model
    from offgrid.engine.session import ChatSession
    model = Model.load(str(MODEL), progress=False)
    try:
        samples, costs = {}, None
        names = args.scenarios.split(",")
        if Path(args.samples).exists():
            samples = {k: tuple(v) for k, v in json.loads(Path(args.samples).read_text()).items()}
        if Path(args.costs).exists():
            costs = {int(k): v for k, v in json.loads(Path(args.costs).read_text()).items()}
        if any(n not in samples for n in names) or costs is None:
            with ChatSession(model, n_ctx=8192, n_threads=args.threads,
                             n_threads_batch=args.threads) as session:
                collect(model, session, samples, args.samples, names)
                if costs is None:
                    prompt = samples["out_of_order"][0]
                    session.reset()
                    costs = verify_costs(session, prompt, reps=7, sizes=SIZES)
                    Path(args.costs).write_text(json.dumps(costs))
        rel = {n: costs[n] / costs[1] for n in SIZES}
        print("a single decode %.1f ms; verify of n / single: %s" % (
            1000 * costs[1], " ".join("%d:%.2f" % (n, rel[n]) for n in SIZES)))
        token_bytes = model.token_bytes

        def newline(t):
            return b"\n" in token_bytes(t)

        def blank(t):
            return not token_bytes(t).strip()

        def piece(t):
            return token_bytes(t).decode("utf-8", "replace")
        for name in names:
            prompt, answer = samples[name]
            if args.only and name != args.only:
                continue
            report(name, prompt, answer, rel, newline,
                   show_steps=args.steps and name == (args.only or "out_of_order"), piece=piece,
                   single_s=costs[1], blank=blank)
    finally:
        model.close()


if __name__ == "__main__":
    main()
