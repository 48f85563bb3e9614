"""Sampling settings and the libllama samplers built from them.

SamplingParams (``offgrid.request``) is the typed form of the sampling fields
of a request; the defaults are llama-server's, so a client that sends nothing
gets the same behaviour from both.  build_sampler() turns it into a
TokenSampler: a libllama chain in llama-server's order (penalties, top_k,
typical_p, top_p, min_p, temperature, then the random pick), or a greedy pick
when temperature <= 0, and the grammar apart from the chain.

Why the grammar is kept apart.  libllama's grammar sampler throws from
``llama_sampler_accept`` when the token picked is one it does not allow (a
logit_bias that bans the grammar's only token), and GGML_ABORTs when an
end-of-generation token is accepted before the grammar is complete (a
finished grammar with every EOG banned, or the infill sampler, which picks
EOT when nothing else passes).  Both happen inside ``llama_sampler_sample``
and both end the process.  So with a grammar, TokenSampler.sample() does what
llama.cpp's common_sampler_sample does, in steps it can check:

  1. fill a reusable candidates array from the logits (libllama.Candidates),
     run the chain, and ask the grammar about the one token picked;
  2. if the grammar refuses it (or it is -inf), fill again, run the grammar
     over every candidate, then the chain;
  3. if what is picked now is still not a finite candidate the grammar
     allows, nothing can be generated: sample() returns None and the
     request ends as if at end-of-generation (STOP, the text so far);
  4. otherwise accept the token on the grammar and on the chain.

Step 1 is llama-server's rejection sampling: the grammar, the costly part,
runs over the whole vocabulary only when the chain's pick breaks it.
Without a grammar the chain runs inside ``llama_sampler_sample``, in C.
The ``infill`` sampler is never combined with a grammar (see
SamplingParams.effective_samplers).

A chat request with tools may also carry the tool-call rescue
(``chat/rescue.py``): CallRescue follows the start of the reply with a
grammar of its own and, when the reply opens as a bare call to one of the
tools, that grammar becomes the sampler's (see CallRescue).
"""

import math
import re

from .. import libllama
from ..errors import InvalidRequest

Sampler = libllama.SamplerHandle


class TokenSampler:
    """The samplers of one request; owns its chain and grammar, close() frees both once.

    Made by build_sampler(); used by one thread, one token at a time.
    """

    def __init__(self, chain, grammar=None, candidates=None, keep_candidates=False,
                 rescue=None):
        self._chain = chain
        self._grammar = grammar
        self._candidates = candidates
        # sample in steps over ``candidates`` even without a grammar, so the
        # chain's result stays there to be read (post_sampling_probs)
        self._keep = keep_candidates
        self._rescue = rescue           # a CallRescue watching the reply's start, or None
        if (grammar is not None or keep_candidates or rescue is not None) \
                and candidates is None:
            raise ValueError("a grammar needs a Candidates array")

    def sample(self, ctx, idx=-1):
        """The next token from output ``idx`` of ``ctx``'s last decode, accepted;
        None when the grammar allows no candidate the chain would pick."""
        token = self._pick(ctx, idx)
        if token is not None:
            self.observe(token)
        return token

    def observe(self, token):
        """A token now part of the reply (sampled and accepted): the tool-call
        rescue's watch sees it, and may hand over the grammar that holds the rest."""
        if self._rescue is None:
            return
        held = self._rescue.follow(token)
        if held is not None:
            # the reply opened a bare call: from here on that grammar holds it
            if self._grammar is not None:
                self._grammar.close()
            self._grammar = held
        if self._rescue.done:
            self._rescue.close()
            self._rescue = None

    def _pick(self, ctx, idx):
        grammar = self._grammar
        if grammar is None:
            if not self._keep:
                return self._chain.sample(ctx, idx)
            # what llama_sampler_sample does, with the candidates ours
            cands = self._candidates
            cands.load(ctx, idx)
            self._chain.apply(cands)
            picked = cands.selected()
            if picked is None:
                return None
            self._chain.accept(picked[0])
            return picked[0]
        cands, chain = self._candidates, self._chain
        cands.load(ctx, idx)
        chain.apply(cands)
        picked = cands.selected()
        if not self._allowed(picked):
            cands.load(ctx, idx)
            grammar.apply(cands)
            chain.apply(cands)
            picked = cands.selected()
            if not self._allowed(picked):
                return None
        token = picked[0]
        grammar.accept(token)
        chain.accept(token)
        return token

    def allows(self, token):
        """Whether the grammar (if any) lets ``token`` come next."""
        return self._grammar is None or self._grammar.allows(token)

    def _allowed(self, picked):
        return (picked is not None and math.isfinite(picked[1])
                and self._grammar.allows(picked[0]))

    def accept(self, token, grammar=True):
        """Record a token that is part of the text (``grammar``) or only of the
        prompt (penalties count it; the grammar constrains only the output)."""
        if grammar and self._grammar is not None:
            self._grammar.accept(token)
        self._chain.accept(token)

    def close(self):
        self._chain.close()
        if self._grammar is not None:
            self._grammar.close()
        if self._rescue is not None:
            self._rescue.close()


class CallRescue:
    """Follows the start of a reply with the rescue grammar (chat/rescue.py).

    Each token the model picks is offered to the grammar: while it allows
    them the reply may still be a bare call and the grammar accepts them
    (so it always stands exactly where the reply does); the first it refuses
    ends the watch, as do ``watch_chars`` characters without an opener.  When
    the text matches the opener with one of the tools' names, follow()
    returns the grammar sampler, to be the request's grammar from there on.
    Owns that sampler until then; close() frees what it still holds.
    """

    def __init__(self, grammar, opener, names, watch_chars, piece_of):
        self._grammar = grammar
        self._opener = re.compile(opener)
        self._names = frozenset(names)
        self._watch = watch_chars
        self._piece_of = piece_of
        self._text = b""
        self.done = False

    def follow(self, token):
        """Offer one picked token; the grammar sampler that holds the reply from
        now on, or None."""
        g = self._grammar
        if self.done or g is None:
            return None
        if not g.allows(token):
            self.done = True        # not a bare call: the reply goes on as it was
            return None
        g.accept(token)
        self._text += self._piece_of(token)
        m = self._opener.match(self._text.decode("utf-8", "ignore"))
        if m is not None and m.group(1) in self._names:
            self._grammar, self.done = None, True
            return g
        if len(self._text) > self._watch:
            self.done = True
        return None

    def close(self):
        g, self._grammar = self._grammar, None
        if g is not None:
            g.close()


def build_sampler(lib, params, n_vocab, n_ctx, eog_tokens=(), vocab=None, candidates=None,
                  keep_candidates=False, piece_of=None):
    """A TokenSampler for one request.  ``eog_tokens`` are banned (ignore_eos).

    A grammar and the infill sampler need the model's ``vocab``
    (ModelHandle.vocab).  ``candidates`` (a
    libllama.Candidates of n_vocab) may be passed to reuse one array across
    requests; one is made when a grammar needs it.  ``keep_candidates``
    leaves each step's chain result in ``candidates`` (for ProbsReader).
    ``piece_of(token)``: a token's bytes, which the tool-call rescue reads
    (params.rescue_grammar; without ``piece_of`` there is no rescue).
    """
    grammar = chain = rescue = None
    try:
        if params.rescue_grammar is not None and piece_of is not None and vocab is not None:
            ptr = libllama.init_grammar_sampler(lib, vocab, params.rescue_grammar)
            if ptr:     # checked in the worker's prepare; NULL would only lose the rescue
                rescue = CallRescue(Sampler.adopt(lib, ptr, "grammar"), params.rescue_opener,
                                    params.rescue_names, params.rescue_watch_chars, piece_of)
        if candidates is None and (params.grammar is not None or keep_candidates
                                   or rescue is not None):
            candidates = libllama.Candidates(lib, n_vocab)
        if params.grammar is not None:
            if vocab is None:
                raise ValueError("build_sampler needs the model's vocab for a grammar")
            grammar = Sampler.adopt(lib, _grammar(lib, vocab, params.grammar,
                                                  params.grammar_triggers), "grammar")
        chain = Sampler.chain(lib)
        biases = list(params.logit_bias) + [(t, -math.inf) for t in eog_tokens]
        if biases:
            chain.add(Sampler.logit_bias(lib, n_vocab, biases))
        seed = params.seed
        if seed is None or seed < 0:
            seed = libllama.LLAMA_DEFAULT_SEED
        if params.mirostat:
            # as common_sampler_init: the chain's samplers give way to temperature and
            # the mirostat pick (penalties too)
            chain.add(Sampler.temp(lib, params.temperature))
            chain.add(Sampler.mirostat(lib, n_vocab, seed, params.mirostat_tau,
                                       params.mirostat_eta) if params.mirostat == 1
                      else Sampler.mirostat_v2(lib, seed, params.mirostat_tau,
                                               params.mirostat_eta))
            return TokenSampler(chain, grammar, candidates, keep_candidates, rescue)
        if params.greedy:
            if params.has_penalties:
                chain.add(_penalties(lib, params, n_vocab, n_ctx))
            chain.add(Sampler.greedy(lib))
            return TokenSampler(chain, grammar, candidates, keep_candidates, rescue)
        for name in params.effective_samplers:
            if name == "penalties":
                if params.has_penalties:
                    chain.add(_penalties(lib, params, n_vocab, n_ctx))
            elif name == "top_k":
                if params.top_k > 0:
                    chain.add(Sampler.top_k(lib, params.top_k))
            elif name == "typ_p":
                if params.typical_p < 1.0:
                    chain.add(Sampler.typical(lib, params.typical_p, params.min_keep))
            elif name == "top_p":
                if params.top_p < 1.0:
                    chain.add(Sampler.top_p(lib, params.top_p, params.min_keep))
            elif name == "min_p":
                if params.min_p > 0.0:
                    chain.add(Sampler.min_p(lib, params.min_p, params.min_keep))
            elif name == "top_n_sigma":
                if params.top_n_sigma > 0:
                    chain.add(Sampler.top_n_sigma(lib, params.top_n_sigma))
            elif name == "xtc":
                if params.xtc_acts:
                    chain.add(Sampler.xtc(lib, params.xtc_probability, params.xtc_threshold,
                                          params.min_keep, seed))
            elif name == "infill":
                if vocab is not None:
                    chain.add(Sampler.infill(lib, vocab))
            elif name == "temperature":
                chain.add(Sampler.temp_ext(lib, params.temperature, params.dynatemp_range,
                                           params.dynatemp_exponent))
        chain.add(Sampler.dist(lib, seed))
        return TokenSampler(chain, grammar, candidates, keep_candidates, rescue)
    except BaseException:
        for s in (chain, grammar, rescue):
            if s is not None:
                s.close()
        raise


class ProbsReader:
    """The probabilities llama-server's ``n_probs`` reports for each sampled token.

    Read with libllama's own samplers over a Candidates array, in C: no
    Python loop over the vocabulary (262k entries for gemma-3).

    Before sampling (the default, llama-server's get_token_probabilities):
    the softmax of the raw logits.  load() copies them in vocabulary order; a
    dist sampler's apply computes every ``p`` (in float32, as llama-server)
    without reordering, so the sampled token's ``p`` is entry ``token``
    (dist's own pick is unused); then a top_k(n) sorts the n most likely to
    the front.

    After sampling (``post_sampling_probs``): the ``p`` the chain's last
    sampler (dist) left on the candidates it kept, which a TokenSampler made
    with keep_candidates leaves in the array; top_k(n) sorts those, and
    entries of p 0 are cut as llama-server cuts them.  A greedy chain
    computes no ``p``: the token picked had probability 1, the only one
    (what llama-server's temperature-0 chain gives).

    Made per request with the session's Candidates; close() frees its samplers.
    """

    def __init__(self, lib, candidates, n_probs, post_sampling=False, greedy=False):
        self._cands = candidates
        self._n = max(0, n_probs)
        self._post = post_sampling
        self._greedy = greedy
        self._softmax = self._top = None
        try:
            if not post_sampling:
                self._softmax = Sampler.dist(lib, 0)
            if self._n > 0:
                self._top = Sampler.top_k(lib, self._n)
        except BaseException:
            self.close()
            raise

    def read(self, ctx, token, idx=-1):
        """(p of ``token``, [(token, p), ...] the n most likely) at output ``idx``.

        Call right after sampling ``token``, before the next decode.
        """
        cands = self._cands
        if self._post:
            if self._greedy:
                return 1.0, [(token, 1.0)] if self._n else []
            p = cands.p_at(cands.array.selected)
        else:
            cands.load(ctx, idx)
            self._softmax.apply(cands)
            p = cands.p_at(token)
        if self._top is None:
            return p, []
        self._top.apply(cands)
        top = cands.head(self._n)
        if self._post:
            for i, (_, q) in enumerate(top):
                if q == 0.0:
                    del top[i:]
                    break
        return p, top

    def close(self):
        for s in (self._softmax, self._top):
            if s is not None:
                s.close()


def _penalties(lib, params, n_vocab, n_ctx):
    # never wider than the context: libllama sizes a ring buffer by it
    last_n = n_ctx if params.repeat_last_n == -1 else min(params.repeat_last_n, n_ctx)
    return Sampler.penalties(lib, n_vocab, last_n, params.repeat_penalty,
                             params.frequency_penalty, params.presence_penalty)


def _grammar(lib, vocab, grammar, triggers=()):
    ptr = libllama.init_grammar_sampler(lib, vocab, grammar, triggers)
    if not ptr:
        raise InvalidRequest("the grammar is not valid GBNF with a 'root' rule "
                             "(the server log says where)")
    return ptr
