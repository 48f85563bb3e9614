"""What the memory-class tests share: the tiny models' classes, prompts, and a
greedy answer compared with a fresh reference server's, token by token.

tests/test_memory_classes.py, test_memory_states.py and test_memory_cuts.py
(three files, so that the suite's workers share them out) use it.
"""

from serverproc import ServerProcess

CLASSES = {
    "llama": "dense", "qwen3moe": "dense", "deepseek2": "dense", "qwen2vl": "dense",
    "gemma3": "swa", "gpt-oss": "swa", "llama4": "swa",
    "lfm2": "hybrid", "granitehybrid": "hybrid", "qwen3next": "hybrid",
    "nemotron_h": "hybrid", "qwen35": "hybrid",
    "falcon-h1": "hybrid", "jamba": "hybrid",
    "mamba2": "recurrent", "rwkv6": "recurrent",
}
# architectures whose recurrent state libllama snapshots (llm_arch_supports_rs_rollback)
ROLLBACK = {"lfm2", "nemotron_h", "qwen35", "qwen35moe"}

WORDS = ("river stone cloud maple harbor lantern copper meadow violet thunder anchor "
         "willow ember falcon garnet orchard pebble saffron tundra velvet").split()


def text(n, seed):
    """n words, a different sequence for each seed (prompts a few hundred tokens long)."""
    return " ".join(WORDS[(i * 7 + seed * 3 + i // 5) % len(WORDS)] for i in range(n))


BASE = text(180, 1)


def reference_server(model, ctx=4096):
    """A server of ``model`` that caches nothing and drafts nothing: every answer
    computed from scratch (use as a context manager)."""
    return ServerProcess(model, "--spec-type", "none", "-cram", "0", "--no-cache-disk",
                         ctx=ctx)


def complete(srv, prompt, n=16, **extra):
    status, _, body = srv.post("/completion", dict(
        {"prompt": prompt, "n_predict": n, "temperature": 0, "return_tokens": True}, **extra))
    assert status == 200, body
    return body


# A random model's top two logits can lie within rounding of each other, and a
# prompt evaluated in other batches (cached, batched beside another session)
# may then pick the other one: a flip is accepted only at such a near tie,
# reported by the reference itself (its top two log-probabilities).
NEAR_TIE = 1e-3


class Fresh:
    """The reference's answer to a prompt, compared token by token."""

    def __init__(self, reference, prompt, n=16):
        self.body = complete(reference, prompt, n, cache_prompt=False, n_probs=2)

    def __eq__(self, got):
        if isinstance(got, str):
            return got == self.body["content"]
        mine, theirs = self.body["tokens"], got["tokens"]
        if mine == theirs:
            return True
        i = next(i for i, (a, b) in enumerate(zip(mine + [None], theirs + [None])) if a != b)
        if i >= len(mine) or i >= len(theirs):
            return False
        top = self.body["completion_probabilities"][i]["top_logprobs"]
        return len(top) == 2 and top[1]["id"] == theirs[i] \
            and top[0]["logprob"] - top[1]["logprob"] < NEAR_TIE

    def __repr__(self):
        return repr(self.body["content"])


def fresh(reference, prompt, n=16):
    return Fresh(reference, prompt, n)


def tokens_of(srv, text_):
    status, _, body = srv.post("/tokenize", {"content": text_, "add_special": True})
    assert status == 200, body
    return body["tokens"]


def answered(srv, prompt, n=16):
    """``prompt`` (text or tokens) and its greedy answer: a prompt going on from
    them continues the state after it exactly (which holds all but the answer's
    last token: sampled, never decoded)."""
    body = complete(srv, prompt, n, return_tokens=True)
    ids = tokens_of(srv, prompt) if isinstance(prompt, str) else list(prompt)
    return ids + body["tokens"]
