"""The edit scenarios: requests whose answer is mostly a copy of the prompt.

Editors ask a model to rewrite a window, chat clients to return code with a
change made; either way most of the answer repeats text the prompt already
holds, which is where drafting from the prompt pays (engine/copydraft.py).
Three requests on Qwen2.5-Coder, all greedy, built from
bench/data/typed_file.py.txt:

* ``next_edit``: a Sweep-style next-edit prompt, as Zed's sweep_prompt.rs
  lays it out (``<|file_sep|>`` blocks: a related file, the recent change as
  original/updated, the window as it was and as it is, then
  ``<|file_sep|>updated/<path>``), sent to ``/v1/completions`` as Zed's
  OpenAI-compatible provider does (``max_tokens``, ``stop`` ["<|file_sep|>",
  "</s>"]), answered with the whole 21-line window rewritten;
* ``apply_edit``: a chat request quoting a 40-line function and asking for it
  back with one name changed;
* ``rewrite``: a chat request quoting ~150 lines and asking for the whole
  file back with two changes made.

Each is measured as the client's wall time and the generated tokens per
second of the generation (predicted_n / predicted_ms from the servers' own
timings, one formula for both), with the drafts' acceptance where a server
drafted.
"""

from pathlib import Path

from servers import post, request

DATA = Path(__file__).resolve().parent / "data"
PATH = "offgrid/gguf.py"
SWEEP_STOP = ["<|file_sep|>", "</s>"]


def _lines():
    return (DATA / "typed_file.py.txt").read_text("utf-8").split("\n")


def _block(path, text):
    return "<|file_sep|>%s\n%s%s" % (path, text, "" if text.endswith("\n") else "\n")


def next_edit_prompt():
    """(prompt, window): Zed's Sweep layout around the cursor in read().

    The user renamed ``n_kv`` to ``kv_count`` where it is read; the model is
    to carry the rename through the window (where it is used below).
    """
    lines = _lines()
    start = 240     # 10 lines above the cursor and 10 below: 21 lines
    current = lines[start:start + 21]
    original = list(current)
    i = next(j for j, ln in enumerate(current) if "n_kv = _read_scalar" in ln)
    current[i] = current[i].replace("n_kv", "kv_count")
    related = "\n".join(_lines()[114:167]) + "\n"
    diff = "original:\n%s\nupdated:\n%s\n" % (original[i], current[i])
    prompt = (_block("offgrid/gguf_types.py", related) + _block(PATH + ".diff", diff)
              + _block("original/" + PATH, "\n".join(original) + "\n")
              + _block("current/" + PATH, "\n".join(current) + "\n")
              + "<|file_sep|>updated/%s\n" % PATH)
    return prompt, "\n".join(current) + "\n"


def apply_edit_messages():
    """A 40-line function quoted in a chat request, to come back with a rename."""
    func = "\n".join(_lines()[233:273])
    return [{"role": "user", "content":
             "Return this function with `metadata` renamed to `meta`. Reply with the "
             "whole function in one code block and nothing else.\n\n```python\n%s\n```"
             % func}]


def rewrite_messages():
    """~150 lines quoted whole, to come back with two changes."""
    text = "\n".join(_lines()[167:317])
    return [{"role": "user", "content":
             "Rewrite this file with two changes: rename `_read_exact` to `_read_bytes` "
             "everywhere, and make `pad` raise ValueError when `alignment` is not "
             "positive. Reply with the whole file in one code block and nothing else."
             "\n\n```python\n%s\n```" % text}]


N_PREDICT = {"next_edit": 400, "apply_edit": 700, "rewrite": 2200}


def bodies(model="model"):
    """{scenario: (path, body)} as a client sends them (greedy, cache off)."""
    prompt, _ = next_edit_prompt()
    return {
        "next_edit": ("/v1/completions", {
            "model": model, "prompt": prompt, "max_tokens": N_PREDICT["next_edit"],
            "temperature": 0, "stop": SWEEP_STOP, "cache_prompt": False}),
        "apply_edit": ("/v1/chat/completions", {
            "model": model, "messages": apply_edit_messages(), "temperature": 0,
            "max_tokens": N_PREDICT["apply_edit"], "cache_prompt": False}),
        "rewrite": ("/v1/chat/completions", {
            "model": model, "messages": rewrite_messages(), "temperature": 0,
            "max_tokens": N_PREDICT["rewrite"], "cache_prompt": False}),
    }


def text_of(path, obj):
    if path == "/v1/completions":
        return obj["choices"][0]["text"]
    return obj["choices"][0]["message"]["content"]


DRAFTS = ("llamacpp:spec_decode_num_draft_tokens_total",
          "llamacpp:spec_decode_num_accepted_tokens_total",
          "llamacpp:spec_decode_num_drafts_total")


def draft_counters(port):
    """The speculation counters of /metrics (both servers name them alike):
    drafted tokens, accepted ones, verify steps."""
    status, text, _ = request(port, "GET", "/metrics")
    out = dict.fromkeys(DRAFTS, 0.0)
    if status != 200 or not isinstance(text, str):
        return out
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in out:
            out[parts[0]] = float(parts[1])
    return out


def run_one(port, name, model="model", bodies=None):
    """One request of scenario ``name`` (of ``bodies``, default this module's):
    its sample (wall, rates, drafts).

    ``steps``: the verify decodes the request made (from /metrics around it),
    so that the mean accepted length (llama-server's "mean len": 1 + accepted
    per verify step) is the same measure for both servers.
    """
    path, body = (bodies or globals()["bodies"](model))[name]
    before = draft_counters(port)
    obj, wall = post(port, path, body, timeout=900)
    after = draft_counters(port)
    t = obj.get("timings") or {}
    n = t.get("predicted_n") or obj["usage"]["completion_tokens"]
    ms = t.get("predicted_ms") or 0.0
    out = {"wall_s": wall, "predicted_n": n, "tps": 1000.0 * n / ms if ms > 0 else 0.0,
           "wall_tps": n / wall if wall > 0 else 0.0, "chars": len(text_of(path, obj))}
    d = [after[k] - before[k] for k in DRAFTS]
    out.update(draft_n=d[0], draft_n_accepted=d[1], draft_steps=d[2])
    return out, text_of(path, obj)


def run(port, reps, first=0):
    """Every scenario once per rep: {scenario: samples}."""
    out = {}
    for _ in range(reps):
        for name in N_PREDICT:
            sample, _ = run_one(port, name)
            got = out.setdefault(name, {})
            for k, v in sample.items():
                got.setdefault(k, []).append(v)
    return out
