"""Request bodies become typed objects here, once, at the edge.

Every field offgrid reads is type-checked; a wrong type is a 400 that names
the field.  Fields offgrid does not read (``time``, ``lora``, anything new a
client sends) are ignored whatever their type, as llama-server ignores them.
Nothing below this module sees a dict from a client.
"""

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import List, Union

from ...request import (SAMPLERS_NOT_RUN, GenerationParams, InfillRequest, SamplingParams,
                        sampler_acts, sampler_chain)
from ..httpd.httperrors import BadRequest
from .lora import request_lora

# Limits on what a request may ask for; beyond them it is refused, not clamped,
# so a client learns its request was odd.
MAX_STOP_STRINGS = 64
MAX_STOP_LEN = 1024
MAX_N_CMPL = 16
# prompts in one /completion or /v1/completions request (run at once where they can)
MAX_PROMPTS = 64
# logit_bias entries given as text: each is tokenized by the model's worker
MAX_LOGIT_BIAS_TEXTS = 1024
MAX_N_PREDICT = 2 ** 31 - 1
# libllama allocates a buffer of repeat_last_n tokens per request; a window
# wider than any context would only waste memory (2**31 would be 8 GiB).
MAX_REPEAT_LAST_N = 1 << 20
MAX_N_CACHE_REUSE = 1 << 20
# Token probabilities: llama-server sets no upper bound on n_probs (it clips
# to the vocabulary), but each generated token then carries n_probs entries
# in the response (95 KB of JSON and 1 MB of the front's memory per token at
# 1024).  Every field that asks for alternatives is held to OpenAI's bound
# on top_logprobs, 20 (its logprobs on /v1/completions is 5; llama-server
# allows more, and so does this, up to the same 20); server/budget.py bounds
# what a whole response may hold.
MAX_N_PROBS = 20
MAX_TOP_LOGPROBS = MAX_N_PROBS


class Fields:
    """Typed reads of a JSON object's fields, raising BadRequest on a wrong type."""

    def __init__(self, body, where="request body"):
        if not isinstance(body, dict):
            raise BadRequest("the %s must be a JSON object" % where)
        self.body = body

    def has(self, name):
        return self.body.get(name) is not None

    def raw(self, name, default=None):
        v = self.body.get(name)
        return default if v is None else v

    def int(self, name, default, lo=None, hi=None):
        v = self.body.get(name)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer() and abs(v) < 2 ** 53:
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise BadRequest("'%s' must be an integer" % name)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise BadRequest("'%s' must be between %s and %s, got %d"
                             % (name, lo if lo is not None else "-inf",
                                hi if hi is not None else "inf", v))
        return v

    def float(self, name, default, lo=None, hi=None):
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise BadRequest("'%s' must be a number" % name)
        try:
            v = float(v)
        except OverflowError:       # an integer with hundreds of digits
            v = math.inf
        if not math.isfinite(v):
            raise BadRequest("'%s' must be a finite number" % name)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise BadRequest("'%s' must be between %s and %s" % (name, lo, hi))
        return v

    def bool(self, name, default):
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise BadRequest("'%s' must be true or false" % name)
        return v

    def str(self, name, default=None):
        v = self.body.get(name)
        if v is None:
            return default
        if not isinstance(v, str):
            raise BadRequest("'%s' must be a string" % name)
        return v

    def stop_list(self, name="stop"):
        """``stop``: a string or a list of strings (empty strings are dropped)."""
        v = self.body.get(name)
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise BadRequest("'%s' must be a string or a list of strings" % name)
        if len(v) > MAX_STOP_STRINGS:
            raise BadRequest("'%s' has %d entries; at most %d are allowed"
                             % (name, len(v), MAX_STOP_STRINGS))
        if any(len(s) > MAX_STOP_LEN for s in v):
            raise BadRequest("each '%s' string must be at most %d characters" % (name, MAX_STOP_LEN))
        return [s for s in v if s]


def sampling_from(f, n_vocab, base=None, tokenize=None):
    """SamplingParams from llama-server's / OpenAI's sampling fields.

    A field the request leaves out takes its value from ``base``: the model's
    defaults (its file's, its preset's, the command line's: models/sampling.py).
    ``tokenize`` (text -> token ids) lets ``logit_bias`` name tokens by their
    text; without it only ids are taken.
    """
    p = dataclasses.replace(base) if base is not None else SamplingParams()
    p.temperature = f.float("temperature", p.temperature, lo=0.0)
    p.dynatemp_range = f.float("dynatemp_range", p.dynatemp_range, lo=0.0)
    p.dynatemp_exponent = f.float("dynatemp_exponent", p.dynatemp_exponent)
    p.top_k = f.int("top_k", p.top_k, lo=-1, hi=MAX_N_PREDICT)
    p.top_p = f.float("top_p", p.top_p, lo=0.0, hi=1.0)
    p.min_p = f.float("min_p", p.min_p, lo=0.0, hi=1.0)
    p.typical_p = f.float("typical_p", p.typical_p, lo=0.0, hi=1.0)
    p.min_keep = f.int("min_keep", p.min_keep, lo=0, hi=MAX_N_PREDICT)
    p.repeat_penalty = f.float("repeat_penalty", p.repeat_penalty, lo=0.0)
    p.repeat_last_n = f.int("repeat_last_n", p.repeat_last_n, lo=-1, hi=MAX_REPEAT_LAST_N)
    p.presence_penalty = f.float("presence_penalty", p.presence_penalty, lo=-2.0, hi=2.0)
    p.frequency_penalty = f.float("frequency_penalty", p.frequency_penalty, lo=-2.0, hi=2.0)
    p.xtc_probability = f.float("xtc_probability", p.xtc_probability, lo=0.0, hi=1.0)
    p.xtc_threshold = f.float("xtc_threshold", p.xtc_threshold, lo=0.0, hi=1.0)
    p.top_n_sigma = f.float("top_n_sigma", p.top_n_sigma)
    p.mirostat = f.int("mirostat", p.mirostat, lo=0, hi=2)
    p.mirostat_tau = f.float("mirostat_tau", p.mirostat_tau, lo=0.0)
    p.mirostat_eta = f.float("mirostat_eta", p.mirostat_eta, lo=0.0)
    seed = f.int("seed", -1 if p.seed is None else p.seed, lo=-(2 ** 63), hi=2 ** 64 - 1)
    p.seed = None if seed < 0 or seed == 0xFFFFFFFF else seed
    samplers = f.raw("samplers")
    if samplers is not None:
        if not (isinstance(samplers, str) or isinstance(samplers, list)
                and all(isinstance(s, str) for s in samplers)):
            raise BadRequest("'samplers' must be a list of sampler names")
        try:
            p.samplers = sampler_chain(samplers)
        except ValueError as e:
            raise BadRequest("'samplers': %s" % e)
    _refuse_inactive_samplers(f)
    if f.raw("logit_bias") is not None:     # else the server's (-l), as llama-server
        p.logit_bias = _logit_bias(f.raw("logit_bias"), n_vocab, tokenize)
    else:
        p.logit_bias = list(p.logit_bias)
    return p


def _refuse_inactive_samplers(f):
    for name, idle, what in SAMPLERS_NOT_RUN:
        if sampler_acts(name, f.float(name, idle)):
            raise BadRequest("'%s': offgrid does not run the %s sampler; leave '%s' at %s"
                             % (name, what, name, idle))


def _logit_bias(v, n_vocab, tokenize=None):
    """llama-server's [[token, bias|false], ...] or OpenAI's {"token": bias}.

    A token is an id, or (as llama-server) a piece of text: every token of
    that text gets the bias (``tokenize(text)``, without BOS and without
    special tokens).  An id outside the vocabulary is a 400 here, where
    llama-server skips it silently: a typo in a ban should not pass unseen.
    """
    if v is None:
        return []
    if isinstance(v, dict):
        items = list(v.items())
    elif isinstance(v, list):
        items = v
    else:
        raise BadRequest("'logit_bias' must be an object or a list of [token, bias] pairs")
    if sum(isinstance(i, (list, tuple)) and len(i) == 2 and isinstance(i[0], str)
           and not _is_id_text(i[0]) for i in items) > MAX_LOGIT_BIAS_TEXTS:
        raise BadRequest("'logit_bias' names more than %d tokens by their text"
                         % MAX_LOGIT_BIAS_TEXTS)
    out = []
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise BadRequest("'logit_bias' entries must be [token, bias] pairs")
        tok, bias = item
        if isinstance(tok, str) and _is_id_text(tok):
            tok = int(tok)
        if bias is False:
            bias = -math.inf
        elif not isinstance(bias, (int, float)) or isinstance(bias, bool) or not math.isfinite(bias):
            raise BadRequest("'logit_bias' bias for token %r must be a number or false" % (tok,))
        if isinstance(tok, str) and tokenize is not None:
            if not tok or len(tok) > MAX_STOP_LEN:
                raise BadRequest("'logit_bias' text must be 1 to %d characters" % MAX_STOP_LEN)
            out += [(t, float(bias)) for t in tokenize(tok)]
            continue
        if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < n_vocab:
            raise BadRequest("'logit_bias' token %r is not a token id of this model" % (tok,))
        out.append((tok, float(bias)))
    return out


def reasoning_budget_from(f):
    """llama-server's reasoning_budget_tokens (or thinking_budget_tokens): tokens of
    thinking before its end is forced; None (and -1): the server's --reasoning-budget."""
    v = f.int("reasoning_budget_tokens", None, lo=-1, hi=2 ** 31 - 1)
    if v is None:
        v = f.int("thinking_budget_tokens", None, lo=-1, hi=2 ** 31 - 1)
    return None if v is None or v == -1 else v


def text_tokenizer(entry):
    """For ``logit_bias`` keyed by text: text -> its token ids by the model's worker, as
    llama-server's common_tokenize (no BOS, special tokens read as text)."""
    def tokenize(text):
        return entry.call("tokenize", "logit_bias", text=text, add_special=False,
                          parse_special=False)["tokens"]
    return tokenize


def _is_id_text(s):
    """A token id written as a string (OpenAI's logit_bias keys): "123", "-1"."""
    return isinstance(s, str) and _ID_TEXT.fullmatch(s) is not None


_ID_TEXT = re.compile(r"-?[0-9]{1,30}")


# llama-server's n_predict and its aliases, in the order it reads them: the same on
# every route of its API and OpenAI's (Anthropic's and Responses' have their own)
MAX_TOKENS_NAMES = ("n_predict", "max_completion_tokens", "max_tokens")


def choices_from(f):
    """Choices of each prompt: llama-server's ``n_cmpl``, OpenAI's ``n`` its fallback, as
    llama-server reads them on every route; ``best_of`` and ``echo`` refused."""
    if f.int("best_of", 1) != 1:
        raise BadRequest("'best_of' must be 1: offgrid does not rank several completions")
    if f.bool("echo", False):
        raise BadRequest("'echo' is not supported: the response never repeats the prompt")
    return f.int("n_cmpl" if f.has("n_cmpl") else "n", 1, lo=1, hi=MAX_N_CMPL)


def generation_from(f, n_vocab, defaults=None, max_tokens_names=MAX_TOKENS_NAMES,
                    sampling_default=None, tokenize=None):
    """GenerationParams from a request's generation fields; what it leaves out comes
    from ``defaults`` (the server's: -n, -r, --ignore-eos, --keep, --cache-prompt) and
    ``sampling_default`` (``tokenize``: see sampling_from)."""
    d = defaults if defaults is not None else GenerationParams()
    g = GenerationParams()
    n_predict = d.n_predict
    for name in max_tokens_names:
        if f.has(name):
            lo = -1 if name == "n_predict" else 0
            n_predict = f.int(name, n_predict, lo=lo, hi=MAX_N_PREDICT)
            break
    g.n_predict = n_predict
    # llama-server's -r strings where the request gives no stop string of its own
    g.stop = f.stop_list("stop") or list(d.stop)
    g.sampling = sampling_from(f, n_vocab, sampling_default, tokenize)
    g.ignore_eos = f.bool("ignore_eos", d.ignore_eos)
    g.special = d.special
    g.cache_prompt = f.bool("cache_prompt", d.cache_prompt)
    g.t_max_predict_ms = f.int("t_max_predict_ms", 0, lo=0, hi=MAX_N_PREDICT)
    # llama-server's default is -1 (none), as any value <= 0 here
    g.t_max_prompt_ms = f.int("t_max_prompt_ms", 0, lo=-1, hi=MAX_N_PREDICT)
    # llama-server's per-request draft limit: 0 turns speculation off for the request
    g.speculate = f.int("speculative.n_max", 16, lo=0, hi=MAX_N_PREDICT) > 0
    g.n_indent = f.int("n_indent", 0, lo=0, hi=MAX_N_PREDICT)
    g.n_keep = f.int("n_keep", d.n_keep, lo=-1, hi=MAX_N_PREDICT)
    g.n_discard = f.int("n_discard", 0, lo=0, hi=MAX_N_PREDICT)
    g.lora = request_lora(f.raw("lora"))      # llama-server's per-request adapters
    g.cache_reuse = cache_reuse_from(f)
    return g


def cache_reuse_from(f, default=0):
    """llama-server's ``n_cache_reuse``: move cached runs of at least that many
    tokens to where the prompt needs them.  Any request may ask for it; FIM
    requests default to --cache-reuse (native.cache_reuse_of), the rest to 0."""
    return f.int("n_cache_reuse", default, lo=0, hi=MAX_N_CACHE_REUSE)


def response_fields_from(f):
    v = f.raw("response_fields")
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise BadRequest("'response_fields' must be a list of strings")
    return v


def id_slot_from(f):
    return f.int("id_slot", -1, lo=-1, hi=MAX_N_PREDICT)


def infill_from(f):
    """InfillRequest from /infill's fields (llama-server's validation)."""
    prefix, suffix = f.str("input_prefix", ""), f.str("input_suffix", "")
    extra = f.raw("input_extra", [])
    if not isinstance(extra, list):
        raise BadRequest('"input_extra" must be an array of {"filename": string, "text": string}')
    chunks = []
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise BadRequest('extra_context chunk must contain a "text" field with a string value')
        name = chunk.get("filename", "tmp")
        if not isinstance(name, str):
            raise BadRequest('extra_context chunk\'s "filename" field must be a string')
        chunks.append((name, chunk["text"]))
    prompt = f.raw("prompt", "")
    if not isinstance(prompt, str):
        raise BadRequest('"prompt" must be a string')
    return InfillRequest(input_prefix=prefix, input_suffix=suffix, input_extra=chunks,
                         prompt=prompt)


@dataclass
class Prompt:
    """A prompt as the client gave it: text, token ids, or a mix of both."""
    parts: List[Union[str, List[int]]]

    @property
    def is_text(self):
        return len(self.parts) == 1 and isinstance(self.parts[0], str)


def prompts_from(v, where="prompt"):
    """``prompt`` as llama-server reads it: a list of one Prompt or several.

    An array with no token id at its top level is several prompts, each a
    string, a token list, a mixed list or ``{"prompt_string": ...}``
    (llama-server answers them as a list of results, or OpenAI's choices);
    anything else is one prompt (see prompt_from).
    """
    if isinstance(v, list) and len(v) > 1 and not any(_is_token_id(x) for x in v):
        if len(v) > MAX_PROMPTS:
            raise BadRequest("'%s' has %d prompts; at most %d are allowed in one request"
                             % (where, len(v), MAX_PROMPTS))
        return [prompt_from(x, "%s[%d]" % (where, i)) for i, x in enumerate(v)]
    return [prompt_from(v, where)]


def _is_token_id(x):
    return isinstance(x, int) and not isinstance(x, bool)


def prompt_from(v, where="prompt"):
    """One prompt: a string, a token list, a mixed list, or a one-element list of those.

    Returns a Prompt.  A list of several strings is several prompts
    (prompts_from), refused here.  llama-server's JSON prompt
    ``{"prompt_string": "..."}`` is the string; with ``multimodal_data`` it is
    refused here (/completion reads it first: api/media.py).
    """
    if isinstance(v, dict):
        if v.get("multimodal_data"):
            raise BadRequest("'%s' has multimodal_data, which /completion takes (images "
                             "elsewhere go in chat messages)" % where)
        v = v.get("prompt_string")
        if not isinstance(v, str):
            raise BadRequest("'%s' as an object needs a string 'prompt_string'" % where)
    while isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list, dict)):
        v = v[0]        # [[...]] and ["..."]: one prompt, unwrapped (a loop: no recursion)
        if isinstance(v, dict):
            return prompt_from(v, where)
    if isinstance(v, str):
        return Prompt([v])
    if isinstance(v, list):
        if all(isinstance(x, str) for x in v) and len(v) > 1:
            raise BadRequest("'%s' must be one prompt here: a string, or a list of token ids "
                             "and strings" % where)
        parts = []
        for x in v:
            if isinstance(x, str):
                parts.append(x)
            elif _is_token_id(x):
                if parts and isinstance(parts[-1], list):
                    parts[-1].append(x)
                else:
                    parts.append([x])
            else:
                raise BadRequest("'%s' must be a string or a list of token ids and strings" % where)
        return Prompt(parts)
    raise BadRequest("'%s' must be a string or a list of token ids" % where)


def output_schema_from(f):
    """(json_schema, grammar) from ``response_format``, ``json_schema`` and ``grammar``.

    As llama-server: ``json_object`` with no schema means any object, an
    empty schema means any object, and a schema and a grammar together are
    refused.
    """
    schema = f.raw("json_schema")
    grammar = f.str("grammar")
    if schema is not None and grammar:
        raise BadRequest("cannot use both json_schema and grammar")
    rf = f.raw("response_format")
    if rf is not None:
        if not isinstance(rf, dict):
            raise BadRequest("'response_format' must be an object")
        kind = rf.get("type") or ""
        if kind == "json_object":
            if "schema" in rf or schema is None:
                schema = rf.get("schema") or {}
        elif kind == "json_schema":
            wrapper = rf.get("json_schema")
            if not isinstance(wrapper, dict):
                raise BadRequest("response_format.json_schema must be an object")
            schema = wrapper.get("schema") or {}
        elif kind != "text":
            raise BadRequest("response_format type must be one of \"text\", \"json_object\" "
                             "or \"json_schema\", got %r" % kind)
    if schema is not None and not isinstance(schema, (dict, bool)):
        raise BadRequest("the JSON schema must be an object")
    if isinstance(schema, dict) and not schema:
        schema = {"type": "object"}
    if schema is not None and grammar:
        raise BadRequest("cannot use both json_schema and grammar")
    return schema, grammar or None


def include_usage_from(f):
    """OpenAI's ``stream_options.include_usage``: add a usage chunk to a stream."""
    so = f.raw("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise BadRequest("'stream_options' must be an object")
    return Fields(so, "stream_options").bool("include_usage", False)


# -- token probabilities ------------------------------------------------------------

def native_probs_from(f, gen, n_vocab):
    """/completion and /infill: ``n_probs`` (alias ``logprobs``) and
    ``post_sampling_probs``, set on ``gen``.  As llama-server: 0 or less is off,
    more than the vocabulary is the vocabulary."""
    name = "n_probs" if f.has("n_probs") else "logprobs"
    n = _alternatives(f, name, None)
    post = f.bool("post_sampling_probs", False)
    if n > 0:
        gen.with_probs, gen.n_probs = True, min(n, n_vocab)
        gen.post_sampling_probs = post


def chat_probs_from(f, gen):
    """/v1/chat/completions: ``logprobs`` (a boolean) and ``top_logprobs`` (0..20).

    OpenAI's meaning: ``logprobs: true`` reports each token's logprob, with
    ``top_logprobs`` alternatives (default 0).  llama-server refuses
    top_logprobs without logprobs, and so does this.
    """
    on = f.bool("logprobs", False)
    top = _alternatives(f, "top_logprobs", 0)
    if f.has("top_logprobs") and not on:
        raise BadRequest("top_logprobs requires logprobs to be set to true")
    if on:
        gen.with_probs, gen.n_probs = True, top
        gen.post_sampling_probs = f.bool("post_sampling_probs", False)


def completion_probs_from(f, gen, n_vocab):
    """/v1/completions: ``logprobs``, the number of alternatives (OpenAI allows
    0..5; like llama-server this allows more, up to MAX_N_PROBS)."""
    if not f.has("logprobs"):
        return
    if f.raw("logprobs") is False:      # some clients send false for "none"
        return
    n = _alternatives(f, "logprobs", 0)
    gen.with_probs, gen.n_probs = True, min(n, n_vocab)


def _alternatives(f, name, lo):
    """A count of alternative tokens per generated token, at most MAX_N_PROBS."""
    n = f.int(name, 0, lo=lo)
    if n > MAX_N_PROBS:
        raise BadRequest("'%s' is at most %d (OpenAI's bound on top_logprobs): each generated "
                         "token carries that many alternatives, got %d" % (name, MAX_N_PROBS, n))
    return n
