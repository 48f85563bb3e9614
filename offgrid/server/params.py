"""Request bodies become typed objects here, once, at the edge.

Every field offgrid reads is type-checked; a wrong type is a 400 that names
the field.  Fields offgrid does not read (``time``, ``lora``, anything new a
client sends) are ignored whatever their type, as llama-server ignores them.
Nothing below this module sees a dict from a client.
"""

import math
from dataclasses import dataclass, field
from typing import List, Optional, Union

from ..infill import InfillRequest
from ..sampling import DEFAULT_SAMPLERS, SAMPLER_ALIASES, SamplingParams
from ..session import GenerationParams
from .errors import BadRequest

# Limits on what a request may ask for; beyond them it is refused, not clamped,
# so a client learns its request was odd.
MAX_STOP_STRINGS = 64
MAX_STOP_LEN = 1024
MAX_N_CMPL = 16
MAX_N_PREDICT = 2 ** 31 - 1


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
        v = float(v)
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


def sampling_from(f, n_vocab):
    """SamplingParams from llama-server's / OpenAI's sampling fields."""
    p = SamplingParams()
    p.temperature = f.float("temperature", p.temperature, lo=0.0)
    p.dynatemp_range = f.float("dynatemp_range", p.dynatemp_range, lo=0.0)
    p.dynatemp_exponent = f.float("dynatemp_exponent", p.dynatemp_exponent)
    p.top_k = f.int("top_k", p.top_k, lo=-1, hi=MAX_N_PREDICT)
    p.top_p = f.float("top_p", p.top_p, lo=0.0, hi=1.0)
    p.min_p = f.float("min_p", p.min_p, lo=0.0, hi=1.0)
    p.typical_p = f.float("typical_p", p.typical_p, lo=0.0, hi=1.0)
    p.repeat_penalty = f.float("repeat_penalty", p.repeat_penalty, lo=0.0)
    p.repeat_last_n = f.int("repeat_last_n", p.repeat_last_n, lo=-1, hi=MAX_N_PREDICT)
    p.presence_penalty = f.float("presence_penalty", p.presence_penalty, lo=-2.0, hi=2.0)
    p.frequency_penalty = f.float("frequency_penalty", p.frequency_penalty, lo=-2.0, hi=2.0)
    seed = f.int("seed", -1, lo=-(2 ** 63), hi=2 ** 64 - 1)
    p.seed = None if seed < 0 or seed == 0xFFFFFFFF else seed
    samplers = f.raw("samplers")
    if samplers is not None:
        if isinstance(samplers, str):
            samplers = list(samplers)   # llama-server's one-letter form, e.g. "kfypmt"
            samplers = [_LETTERS.get(c, c) for c in samplers]
        if not isinstance(samplers, list) or not all(isinstance(s, str) for s in samplers):
            raise BadRequest("'samplers' must be a list of sampler names")
        p.samplers = tuple(SAMPLER_ALIASES[s] for s in samplers
                           if SAMPLER_ALIASES.get(s) is not None)
    p.logit_bias = _logit_bias(f.raw("logit_bias"), n_vocab)
    return p


_LETTERS = {"e": "penalties", "k": "top_k", "y": "typ_p", "p": "top_p", "m": "min_p",
            "t": "temperature", "d": "dry", "x": "xtc", "s": "top_n_sigma"}


def _logit_bias(v, n_vocab):
    """llama-server's [[token, bias|false], ...] or OpenAI's {"token": bias}."""
    if v is None:
        return []
    if isinstance(v, dict):
        items = list(v.items())
    elif isinstance(v, list):
        items = v
    else:
        raise BadRequest("'logit_bias' must be an object or a list of [token, bias] pairs")
    out = []
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise BadRequest("'logit_bias' entries must be [token, bias] pairs")
        tok, bias = item
        if isinstance(tok, str) and tok.lstrip("-").isdigit():
            tok = int(tok)
        if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < n_vocab:
            raise BadRequest("'logit_bias' token %r is not a token id of this model" % (tok,))
        if bias is False:
            bias = -math.inf
        elif not isinstance(bias, (int, float)) or isinstance(bias, bool) or not math.isfinite(bias):
            raise BadRequest("'logit_bias' bias for token %d must be a number or false" % tok)
        out.append((tok, float(bias)))
    return out


def generation_from(f, n_vocab, n_predict_default=-1, max_tokens_names=("n_predict", "max_tokens")):
    """GenerationParams from a request's generation fields."""
    g = GenerationParams()
    n_predict = n_predict_default
    for name in max_tokens_names:
        if f.has(name):
            lo = -1 if name == "n_predict" else 0
            n_predict = f.int(name, n_predict, lo=lo, hi=MAX_N_PREDICT)
            break
    g.n_predict = n_predict
    g.stop = f.stop_list("stop")
    g.sampling = sampling_from(f, n_vocab)
    g.ignore_eos = f.bool("ignore_eos", False)
    g.cache_prompt = f.bool("cache_prompt", True)
    g.t_max_predict_ms = f.int("t_max_predict_ms", 0, lo=0, hi=MAX_N_PREDICT)
    g.n_indent = f.int("n_indent", 0, lo=0, hi=MAX_N_PREDICT)
    return g


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


def prompt_from(v, where="prompt"):
    """``prompt``: a string, a token list, a mixed list, or a one-element list of those.

    Returns a Prompt.  Several prompts (OpenAI's batch form) are refused: n=1 only.
    """
    if isinstance(v, str):
        return Prompt([v])
    if isinstance(v, list):
        if len(v) == 1 and isinstance(v[0], (str, list)):
            return prompt_from(v[0], where)
        if all(isinstance(x, str) for x in v) and len(v) > 1:
            raise BadRequest("'%s' with several prompts is not supported; send one per request"
                             % where)
        parts = []
        for x in v:
            if isinstance(x, str):
                parts.append(x)
            elif isinstance(x, int) and not isinstance(x, bool):
                if parts and isinstance(parts[-1], list):
                    parts[-1].append(x)
                else:
                    parts.append([x])
            else:
                raise BadRequest("'%s' must be a string or a list of token ids and strings" % where)
        return Prompt(parts)
    raise BadRequest("'%s' must be a string or a list of token ids" % where)


def tokens_of(model, prompt, add_special=True):
    """Token ids of a Prompt; BOS is added only when it starts with text.

    Token ids from the client are checked against the vocabulary here, before
    anything reaches libllama.
    """
    out = []
    for i, part in enumerate(prompt.parts):
        if isinstance(part, str):
            out += model.tokenize(part, add_special=add_special and i == 0, parse_special=True)
        else:
            model.check_tokens(part)
            out += part
    return out


@dataclass
class ChatMessage:
    role: str
    content: str


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def messages_from(v):
    """OpenAI ``messages`` as ChatMessages (text content, or text parts)."""
    if not isinstance(v, list) or not v:
        raise BadRequest("'messages' must be a non-empty array")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise BadRequest("messages[%d] must be an object" % i)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise BadRequest("messages[%d].role must be one of %s" % (i, ", ".join(CHAT_ROLES)))
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            pieces = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise BadRequest("messages[%d].content[%d] must be a text part "
                                     "({\"type\": \"text\", \"text\": ...}); only text is supported"
                                     % (i, j))
                pieces.append(part["text"])
            text = "\n".join(pieces)
        else:
            raise BadRequest("messages[%d].content must be a string or an array of parts" % i)
        out.append(ChatMessage("system" if role == "developer" else role, text))
    return out
