"""Sampling settings and the libllama sampler chain built from them.

SamplingParams (``offgrid.request``) is the typed form of the sampling fields
of a request; the defaults are llama-server's, so a client that sends nothing
gets the same behaviour from both.  build_sampler() turns it into a libllama chain in
llama-server's order (penalties, top_k, typical_p, top_p, min_p, temperature,
then the random pick), or a greedy pick when temperature <= 0.
"""

import math

from .. import libllama
from ..chat import gbnf
from ..errors import InvalidRequest
from ..request import DEFAULT_SAMPLERS, SAMPLER_ALIASES, SamplingParams  # noqa: F401


def build_sampler(lib, params, n_vocab, n_ctx, eog_tokens=(), vocab=None):
    """A SamplerHandle for one request.  ``eog_tokens`` are banned (ignore_eos).

    A grammar needs the model's ``vocab`` and goes first in the chain, so the
    samplers after it only ever see tokens the grammar allows.
    """
    chain = libllama.SamplerHandle(lib)
    try:
        if params.grammar is not None:
            if vocab is None:
                raise ValueError("build_sampler needs the model's vocab for a grammar")
            chain.add(_grammar(lib, vocab, params.grammar, params.grammar_triggers))
        biases = list(params.logit_bias) + [(t, -math.inf) for t in eog_tokens]
        if biases:
            chain.add(chain.logit_bias(n_vocab, biases))
        if params.greedy:
            if params.has_penalties:
                chain.add(_penalties(lib, params, n_vocab, n_ctx))
            chain.add(lib.llama_sampler_init_greedy())
            return chain
        for name in params.samplers:
            if name == "penalties":
                if params.has_penalties:
                    chain.add(_penalties(lib, params, n_vocab, n_ctx))
            elif name == "top_k":
                if params.top_k > 0:
                    chain.add(lib.llama_sampler_init_top_k(params.top_k))
            elif name == "typ_p":
                if params.typical_p < 1.0:
                    chain.add(lib.llama_sampler_init_typical(params.typical_p, 1))
            elif name == "top_p":
                if params.top_p < 1.0:
                    chain.add(lib.llama_sampler_init_top_p(params.top_p, 1))
            elif name == "min_p":
                if params.min_p > 0.0:
                    chain.add(lib.llama_sampler_init_min_p(params.min_p, 1))
            elif name == "infill":
                if vocab is not None:
                    chain.add(lib.llama_sampler_init_infill(vocab))
            elif name == "temperature":
                chain.add(lib.llama_sampler_init_temp_ext(
                    params.temperature, params.dynatemp_range, params.dynatemp_exponent))
        seed = params.seed
        if seed is None or seed < 0:
            seed = libllama.LLAMA_DEFAULT_SEED
        chain.add(lib.llama_sampler_init_dist(seed & 0xFFFFFFFF))
        return chain
    except BaseException:
        chain.close()
        raise


def _penalties(lib, params, n_vocab, n_ctx):
    # never wider than the context: libllama sizes a ring buffer by it
    last_n = n_ctx if params.repeat_last_n == -1 else min(params.repeat_last_n, n_ctx)
    return lib.llama_sampler_init_penalties(n_vocab, last_n, params.repeat_penalty,
                                            params.frequency_penalty, params.presence_penalty)


def _grammar(lib, vocab, grammar, triggers=()):
    ptr = libllama.init_grammar_sampler(lib, vocab, grammar, triggers)
    if not ptr:
        raise InvalidRequest("the grammar is not valid GBNF with a 'root' rule "
                             "(the server log says where)")
    return ptr


def check_grammar(model, grammar, triggers=()):
    """Raise GrammarError (a 400) unless ``grammar`` is safe to give libllama.

    Every grammar goes through here before build_sampler, whichever way it came
    (``grammar``, ``json_schema``, ``response_format``, tool grammars): the
    checks are Python's (``chat.gbnf``) with the model's vocabulary facts, and
    no libllama sampler is made until the request is running.
    """
    gbnf.check(grammar, model.grammar_facts)
    for t in triggers:
        if not isinstance(t, str) or "\x00" in t:
            raise gbnf.GrammarError("a grammar trigger must be a string without NUL")
