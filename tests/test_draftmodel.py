"""Draft-model speculation (-md, engine/draftmodel.py) on a real server.

No two models of the registry share a vocabulary with a smaller draft, so
the pair here is gemma-3-270m drafting for itself, as llama.cpp's own
conformance run uses it (tests/conformance/local_models.py): a draft that
is the target's own guess comes true nearly always, which tells a drafter
that keeps its context in step from one that does not.  Whether a draft
model pays is a matter of the pair and the machine (docs/cli.md).
"""

import subprocess
import sys
import threading

import pytest

try:
    from .serverproc import ROOT, ServerProcess
except ImportError:
    from serverproc import ROOT, ServerProcess

GEMMA = ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"
QWEN = ROOT / "models" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
PROMPTS = ["def fib(n):\n", "The capital of France is",
           "# Shopping list\n\n- eggs\n- milk\n-"]
# nats between the two most likely tokens: a token's log-probability after
# a one-token decode and after a batch's differ by up to 0.27 nats on this
# q4 gemma (measured here over 36 steps of these prompts; they sum in other
# orders), so the two picks can differ where the margin is under twice that
NEAR_TIE = 0.6


@pytest.fixture(scope="module")
def plain():
    with ServerProcess(GEMMA, ctx=1024) as s:
        yield s


@pytest.fixture(scope="module", params=["shared cache", "streams"])
def drafted(request):
    # streams: --no-kv-unified gives the draft model's context a stream per session too
    extra = ["--no-kv-unified"] if request.param == "streams" else []
    with ServerProcess(GEMMA, "-md", GEMMA, "-np", "2", *extra, ctx=1024) as s:
        yield s


def _greedy(server, prompt, n=40):
    status, _, body = server.post("/completion", {"prompt": prompt, "temperature": 0,
                                                  "n_predict": n, "return_tokens": True,
                                                  "cache_prompt": False})
    assert status == 200, body
    return body


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_output_is_plain_decodings(plain, drafted, prompt):
    a, b = _greedy(plain, prompt), _greedy(drafted, prompt)
    t = b["timings"]
    assert t["draft_n"] > 0, "no draft was made"
    # the target's own guesses: nearly all come true (a drafter out of step
    # with what the target kept drafts from the wrong text)
    assert t["draft_n_accepted"] >= 0.7 * t["draft_n"], t
    if a["tokens"] == b["tokens"]:
        return
    # a batch of several tokens sums in another order than one token does:
    # where the two part, plain decoding's pick must have been a near-tie
    i = next(i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y)
    status, _, tok = plain.post("/tokenize", {"content": prompt, "add_special": True})
    status, _, probe = plain.post("/completion", {
        "prompt": tok["tokens"] + a["tokens"][:i], "temperature": 0, "n_predict": 1,
        "n_probs": 2, "cache_prompt": False})
    top = probe["completion_probabilities"][0]["top_logprobs"]
    assert {top[0]["id"], top[1]["id"]} == {a["tokens"][i], b["tokens"][i]}, (i, top)
    assert top[0]["logprob"] - top[1]["logprob"] < NEAR_TIE, (i, top)


def test_sessions_draft_side_by_side(drafted):
    """-np 2: each session has its own sequence in the draft model's context."""
    out = {}

    def run(prompt):
        out[prompt] = _greedy(drafted, prompt, 48)
    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS[:2]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for prompt in PROMPTS[:2]:
        t = out[prompt]["timings"]
        assert t["draft_n"] > 0 and t["draft_n_accepted"] >= 0.7 * t["draft_n"], (prompt, t)
        alone = _greedy(drafted, prompt, 48)
        assert _same_or_near(drafted, prompt, alone["tokens"], out[prompt]["tokens"])


def _same_or_near(server, prompt, a, b):
    if a == b:
        return True
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return False
    status, _, tok = server.post("/tokenize", {"content": prompt, "add_special": True})
    status, _, probe = server.post("/completion", {
        "prompt": tok["tokens"] + a[:i], "temperature": 0, "n_predict": 1, "n_probs": 2,
        "cache_prompt": False})
    top = probe["completion_probabilities"][0]["top_logprobs"]
    return abs(top[0]["logprob"] - top[1]["logprob"]) < NEAR_TIE


def test_a_second_request_drafts_from_what_the_first_left(drafted):
    """The draft context keeps each sequence: a request that repeats the last
    one's prompt drafts on at once, and still gets the same text."""
    first = _greedy(drafted, PROMPTS[0], 24)
    again = _greedy(drafted, PROMPTS[0], 24)
    assert again["tokens"] == first["tokens"]
    assert again["timings"]["draft_n_accepted"] >= 0.7 * again["timings"]["draft_n"]


def test_sampled_requests_keep_their_length_and_draft(drafted):
    status, _, body = drafted.post("/completion", {
        "prompt": PROMPTS[1], "temperature": 0.8, "seed": 42, "n_predict": 32,
        "ignore_eos": True})
    assert status == 200, body
    assert body["tokens_predicted"] == 32
    assert body["timings"]["draft_n"] > 0


def test_p_min_and_n_min_hold_drafts_back():
    with ServerProcess(GEMMA, "-md", GEMMA, "--spec-draft-p-min", "1.0", ctx=1024) as s:
        body = _greedy(s, PROMPTS[0], 24)
        assert body["timings"].get("draft_n", 0) == 0, body["timings"]
    with ServerProcess(GEMMA, "-md", GEMMA, "--spec-draft-n-max", "4",
                       "--spec-draft-n-min", "5", ctx=1024) as s:
        body = _greedy(s, PROMPTS[0], 24)
        assert body["timings"].get("draft_n", 0) == 0, body["timings"]


def test_a_draft_model_of_another_vocabulary_is_refused():
    server = ServerProcess(QWEN, "-md", GEMMA, ctx=1024, startup_timeout=60)
    with pytest.raises(RuntimeError) as e:
        server.start()
    text = str(e.value)
    assert "cannot draft for" in text and "tokenizer" in text, text[-2000:]


@pytest.mark.parametrize("flags, words", [
    (["--spec-type", "draft-simple"], "needs a draft model"),
    (["-md", str(GEMMA), "--spec-type", "ngram-simple"], "--spec-type draft-simple"),
    (["-md", "/nonexistent.gguf"], "draft model file not found"),
    (["-md", str(GEMMA), "--spec-draft-p-min", "2"], "--spec-draft-p-min"),
])
def test_flags_that_cannot_work_are_refused(flags, words):
    run = subprocess.run([sys.executable, "-m", "offgrid", "-m", str(GEMMA)] + flags,
                         cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and words in run.stderr, run.stderr


def test_the_draft_models_cache_takes_its_own_types():
    """-ctkd/-ctvd (llama-server's): the draft model's KV cache in q8_0 beside the target's
    f16 (libllama's own lines say so), and its drafts still come true."""
    with ServerProcess(GEMMA, "-md", GEMMA, "-ctkd", "q8_0", "-ctvd", "q8_0", "-np", "1", "-v",
                       ctx=1024) as s:
        t = _greedy(s, PROMPTS[0])["timings"]
    assert t["draft_n"] > 0 and t["draft_n_accepted"] >= 0.7 * t["draft_n"], t
    caches = [line for line in s.output if "llama_kv_cache: size =" in line]
    assert any("K (f16)" in line for line in caches), caches
    assert any("K (q8_0)" in line and "V (q8_0)" in line for line in caches), caches
