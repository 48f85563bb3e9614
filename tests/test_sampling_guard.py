"""Sampling with a grammar never reaches libllama's throw or abort (issue 12).

libllama's grammar sampler throws (std::terminate: the process dies) when
it accepts a token it does not allow, and GGML_ABORTs when it accepts an
end-of-generation token before the grammar is complete.  Each request shape
below did one or the other inside llama_sampler_sample, killing the server;
now each ends as a normal Completion: STOP ("eos"), with the text so far.

Also here: a cancel's own decode errors stay off the terminal (issue 14),
and what the grammar path costs per token.
"""

import math
import time

import pytest

from offgrid import libllama
from offgrid.engine.session import ChatSession, FinishReason, GenerationParams
from offgrid.request import SamplingParams

try:
    from .serverproc import TEST_THREADS
except ImportError:
    from serverproc import TEST_THREADS

STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def greedy(n_predict, **kw):
    grammar = kw.pop("grammar", None)
    bias = kw.pop("logit_bias", [])
    return GenerationParams(n_predict=n_predict, sampling=SamplingParams(
        temperature=0, grammar=grammar, logit_bias=bias), **kw)


@pytest.fixture
def session_of():
    made = []

    def make(model, **kw):
        kw.setdefault("n_ctx", 512)
        session = ChatSession(model, n_batch=64, n_threads=TEST_THREADS, **kw)
        made.append(session)
        return session

    yield make
    for session in made:
        session.close()


def one_token(model, text):
    ids = model.tokenize(text, add_special=False)
    assert len(ids) == 1, "%r is %d tokens in this vocabulary" % (text, len(ids))
    return ids[0]


def assert_ends_as_eos(result, text):
    assert result.finish_reason is FinishReason.STOP
    assert result.stop_type == "eos"
    assert result.text == text


# --------------------------------------------------------------------------
# The shapes that killed the process
# --------------------------------------------------------------------------

def test_a_grammar_whose_only_token_is_banned_ends_with_no_text(plain_model, session_of):
    banned = one_token(plain_model, "a")
    result = session_of(plain_model).complete(
        plain_model.tokenize("hello"), greedy(8, grammar='root ::= "a"',
                                              logit_bias=[(banned, -math.inf)]))
    assert_ends_as_eos(result, "")
    assert result.tokens == []


def test_a_finished_grammar_with_end_of_generation_ignored_ends_there(gemma, session_of):
    result = session_of(gemma).complete(gemma.tokenize(STORY),
                                        greedy(8, grammar='root ::= "a"', ignore_eos=True))
    assert_ends_as_eos(result, "a")


def test_a_finished_grammar_with_every_eog_token_banned_ends_there(gemma, session_of):
    bans = [(t, -math.inf) for t in gemma.eog_tokens()]
    assert gemma.eos in gemma.eog_tokens() and gemma.eot in gemma.eog_tokens()
    result = session_of(gemma).complete(gemma.tokenize(STORY),
                                        greedy(8, grammar='root ::= "a"', logit_bias=bans))
    assert_ends_as_eos(result, "a")


CALL = r'root ::= [A-Za-z_]+ "(" [a-z]* ")"'


@pytest.mark.parametrize("seed", range(4))
def test_infill_with_a_grammar_never_aborts(fim_model, session_of, seed):
    # the infill sampler picks EOT when no text candidate passes; accepting it
    # before the ")" aborted libllama.  With a grammar, infill is left out.
    sampling = SamplingParams(samplers=("top_k", "top_p", "infill"), grammar=CALL, seed=seed)
    assert sampling.effective_samplers == ("top_k", "top_p")
    result = session_of(fim_model).complete(
        [fim_model.fim_pre] + fim_model.tokenize("def f(x):\n    return ", add_special=False)
        + [fim_model.fim_suf, fim_model.fim_mid],
        GenerationParams(n_predict=24, sampling=sampling))
    assert result.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert result.text and (result.text[0].isalpha() or result.text[0] == "_")


def test_without_a_grammar_infill_stays_in_the_chain():
    sampling = SamplingParams(samplers=("top_k", "top_p", "infill"))
    assert sampling.effective_samplers == ("top_k", "top_p", "infill")


# --------------------------------------------------------------------------
# What the guard must not change
# --------------------------------------------------------------------------

PERMISSIVE = r'root ::= ([^\n] | "\n")*'


def test_greedy_with_a_permissive_grammar_is_plain_greedy(gemma, session_of):
    prompt = gemma.tokenize(STORY)
    plain = session_of(gemma).complete(prompt, greedy(24))
    constrained = session_of(gemma).complete(prompt, greedy(24, grammar=PERMISSIVE))
    assert plain.text.strip()
    assert (constrained.text, constrained.tokens) == (plain.text, plain.tokens)
    assert constrained.finish_reason is plain.finish_reason


def test_a_grammar_still_constrains_the_text(gemma, session_of):
    result = session_of(gemma).complete(gemma.tokenize(STORY),
                                        greedy(16, grammar='root ::= "yes" | "no"'))
    assert result.text in ("yes", "no")
    assert result.finish_reason is FinishReason.STOP


def test_a_seeded_sampled_generation_with_a_grammar_repeats(gemma, session_of):
    params = GenerationParams(n_predict=16, sampling=SamplingParams(
        seed=7, grammar=r'root ::= [a-z ]+', repeat_penalty=1.1))
    prompt = gemma.tokenize(STORY)
    first = session_of(gemma).complete(prompt, params)
    second = session_of(gemma).complete(prompt, params)
    assert first.text == second.text
    assert set(first.text) <= set("abcdefghijklmnopqrstuvwxyz ")


def test_per_token_cost_of_a_grammar(gemma, session_of):
    """Not a pass/fail speed test: prints the figures (tok/s) for the report."""
    prompt = gemma.tokenize(STORY)
    n = 48
    rates = {}
    for label, grammar in (("plain", None), ("grammar", PERMISSIVE)):
        session = session_of(gemma)
        session.complete(prompt, greedy(1, grammar=grammar))     # warm
        start = time.perf_counter()
        result = session.complete(prompt, greedy(n, grammar=grammar, ignore_eos=True))
        rates[label] = result.usage.completion_tokens / (time.perf_counter() - start)
    print("figures: greedy tok/s on gemma, plain %.1f, permissive grammar %.1f"
          % (rates["plain"], rates["grammar"]))
    assert rates["grammar"] > 0


# --------------------------------------------------------------------------
# Issue 14: our own aborts are quiet, libllama's other failures are not
# --------------------------------------------------------------------------

ABORT_LINE = b"llama_decode: failed to decode, ret = 2\n"


def test_decode_failure_lines_show_unless_the_abort_is_ours(plain_model, capsys):
    log = libllama._log_callback
    log(libllama.GGML_LOG_LEVEL_ERROR, ABORT_LINE, None)
    assert "failed to decode" in capsys.readouterr().err

    with ChatSession(plain_model, n_ctx=64, n_threads=1) as session:
        session._ctx.request_abort()
        log(libllama.GGML_LOG_LEVEL_ERROR, ABORT_LINE, None)
        assert "failed to decode" not in capsys.readouterr().err
        session._ctx.clear_abort()
    log(libllama.GGML_LOG_LEVEL_ERROR, ABORT_LINE, None)
    assert "failed to decode" in capsys.readouterr().err
