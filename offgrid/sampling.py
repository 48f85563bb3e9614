"""Sampling settings and the libllama sampler chain built from them.

SamplingParams is the typed form of the sampling fields of a request; the
defaults are llama-server's, so a client that sends nothing gets the same
behaviour from both.  build_sampler() turns it into a libllama chain in
llama-server's order (penalties, top_k, typical_p, top_p, min_p, temperature,
then the random pick), or a greedy pick when temperature <= 0.
"""

import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from . import libllama
from .errors import InvalidRequest

# llama-server's default sampler order (common_params_sampling::samplers);
# a request may reorder or drop them with "samplers".
DEFAULT_SAMPLERS = ("penalties", "top_k", "typ_p", "top_p", "min_p", "temperature")

# Names a request may use for each sampler: llama-server accepts these
# aliases in "samplers" (e.g. llama.vscode sends ["top_k", "top_p", "infill"]).
SAMPLER_ALIASES = {
    "penalties": "penalties", "top_k": "top_k", "typ_p": "typ_p", "typical_p": "typ_p",
    "typ": "typ_p", "typical": "typ_p", "top_p": "top_p", "nucleus": "top_p",
    "min_p": "min_p", "temperature": "temperature", "temp": "temperature",
    # samplers offgrid does not run; accepted and skipped, as llama-server
    # skips names it does not know
    "dry": None, "top_n_sigma": None, "xtc": None,
    # FIM: merges candidates that share a prefix, prefers ending when likely
    "infill": "infill",
}


@dataclass
class SamplingParams:
    """How to pick each next token (llama-server's names and defaults)."""
    temperature: float = 0.8
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None          # None or -1: a random seed each request
    samplers: Tuple[str, ...] = DEFAULT_SAMPLERS
    logit_bias: List[Tuple[int, float]] = field(default_factory=list)
    grammar: Optional[str] = None       # GBNF (rule "root"): only text it matches is sampled
    # regexes that make the grammar lazy: free text until the output matches one
    # (offgrid's own fixed patterns only: libllama cannot report a bad one)
    grammar_triggers: Tuple[str, ...] = ()

    @property
    def greedy(self):
        return self.temperature <= 0

    @property
    def has_penalties(self):
        return (self.repeat_last_n != 0 and
                (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                 or self.frequency_penalty != 0.0))

    def validate(self):
        """Raise InvalidRequest for values libllama must never see (NaN, inf, nonsense)."""
        for name in ("temperature", "dynatemp_range", "dynatemp_exponent", "top_p", "min_p",
                     "typical_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not math.isfinite(v):
                raise InvalidRequest("%s must be a finite number" % name)
        if self.repeat_penalty < 0:
            raise InvalidRequest("repeat_penalty must not be negative")
        if self.repeat_last_n < -1:
            raise InvalidRequest("repeat_last_n must be -1 (the whole context) or more")
        for token, bias in self.logit_bias:
            if not math.isfinite(bias) and bias != -math.inf:
                raise InvalidRequest("logit_bias values must be numbers or -inf")


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


def check_grammar(lib, vocab, grammar, triggers=()):
    """Raise InvalidRequest unless libllama accepts ``grammar``; nothing is kept."""
    lib.llama_sampler_free(_grammar(lib, vocab, grammar, triggers))
