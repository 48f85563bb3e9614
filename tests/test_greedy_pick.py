"""A greedy chain's pick (scripts/patches/0004): llama_sampler_sample finds it
in the logits rather than in an n_vocab candidates array, and must pick what
the array path picks, token for token.

Each case compares chain.sample (the patched path) with the same chain
applied to a Candidates array (llama_sampler_apply, which the patch leaves
alone) and with the rule itself worked out here: the first token of the
largest biased logit, where a NaN never beats anything (and one at token 0
stays the pick, as greedy's loop starts there).
"""

import array
import ctypes
import math

import pytest

from offgrid import libllama
from offgrid.libllama import Candidates, ContextHandle

try:
    from .serverproc import TEST_THREADS
except ImportError:
    from serverproc import TEST_THREADS

Sampler = libllama.SamplerHandle


def _chain(lib, n_vocab, biases=()):
    chain = Sampler.chain(lib)
    if biases:
        chain.add(Sampler.logit_bias(lib, n_vocab, list(biases)))
    chain.add(Sampler.greedy(lib))
    return chain


def _by_rule(logits, biases=()):
    values = list(logits)
    for t, b in biases:
        if 0 <= t < len(values):
            values[t] += b
    pick = 0
    for i in range(1, len(values)):
        if values[i] > values[pick]:
            pick = i
    return pick


def _picks(lib, ctx, idx, n_vocab, biases=()):
    """(patched path, array path) for output ``idx``."""
    fast = _chain(lib, n_vocab, biases)
    slow = _chain(lib, n_vocab, biases)
    cands = Candidates(lib, n_vocab)
    try:
        cands.load(ctx, idx)
        slow.apply(cands)
        return fast.sample(ctx, idx), cands.selected()[0]
    finally:
        fast.close()
        slow.close()


@pytest.fixture
def decoded(gemma):
    """A context after one decode of a prompt with every position's logits kept."""
    lib, n_vocab = gemma.lib, gemma.n_vocab
    ctx = ContextHandle(lib, gemma.handle, 256, 64, 64, TEST_THREADS, TEST_THREADS)
    tokens = gemma.tokenize("The capital of France is Paris, and the capital of Italy is",
                            add_special=True)
    assert ctx.decode_parts([(tokens, 0, (0,), ctx.OUT_ALL)]) == 0
    yield lib, ctx, n_vocab, len(tokens)
    ctx.close()


def _logits(ctx, idx, n_vocab):
    out = array.array("f", bytes(4 * n_vocab))
    ctypes.memmove(out.buffer_info()[0], ctx.logits(idx), 4 * n_vocab)
    return out


def test_real_logits_pick_the_same_token_every_way(decoded):
    lib, ctx, n_vocab, n = decoded
    for idx in range(n):
        logits = _logits(ctx, idx, n_vocab)
        top = _by_rule(logits)
        second = _by_rule(logits, [(top, -math.inf)])
        cases = [(), [(top, -math.inf)],                    # the pick banned: the next one
                 [(second, -math.inf), (7, -2.5)],          # bans elsewhere: the same pick
                 [(second, 100.0)],                         # a positive bias lifts another
                 [(top, -0.5)], [(n_vocab + 5, -math.inf)]]
        for biases in cases:
            got, by_array = _picks(lib, ctx, idx, n_vocab, biases)
            assert got == by_array == _by_rule(logits, biases), (idx, biases)


@pytest.mark.parametrize("name, values", [
    ("a tie: the first", {10: 5.0, 200: 5.0, 9000: 5.0}),
    ("a tie in the last, unaligned lanes", {"last": 7.0, "last-1": 7.0}),
    ("NaN elsewhere is passed over", {3: float("nan"), 50: 1.0}),
    ("NaN at token 0 stays the pick", {0: float("nan"), 50: 1.0}),
    ("every logit -inf: token 0", {"all": -math.inf}),
    ("+inf wins", {42: math.inf, 43: 3.0}),
])
def test_written_logits_pick_as_greedy_does(decoded, name, values):
    lib, ctx, n_vocab, n = decoded
    logits = array.array("f", [-1.0] * n_vocab)
    for k, v in values.items():
        if k == "all":
            logits = array.array("f", [v] * n_vocab)
        else:
            logits[{"last": n_vocab - 1, "last-1": n_vocab - 2}.get(k, k)] = v
    # the output buffer of the last decode, overwritten in place
    ctypes.memmove(ctx.logits(n - 1), logits.buffer_info()[0], 4 * n_vocab)
    want = _by_rule(logits)
    for biases in ((), [(n_vocab - 3, -math.inf)]):
        got, by_array = _picks(lib, ctx, n - 1, n_vocab, biases)
        assert got == by_array == _by_rule(logits, biases), (name, biases, got, want)
