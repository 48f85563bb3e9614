"""Response bodies, field for field as the clients read them.

Two families:
  * llama-server's native shape (``/completion``, ``/infill``): ``content``,
    ``stop``, ``stop_type``, ``tokens_cached``, ``generation_settings``,
    ``timings`` ...; streams send ``{"content": piece, "stop": false}`` events
    and then the final object.
  * OpenAI's (``/v1/completions``, ``/v1/chat/completions``): ``choices``,
    ``usage``, ``finish_reason``; streams end with ``data: [DONE]``.

Functions here are pure: typed results in, dicts out.
"""

import codecs
import math
import time
import uuid

from ...request import FinishReason, Usage



def timings(usage):
    """llama-server's ``timings`` object.

    As llama-server counts, the first generated token comes with the prompt's
    logits, so per-token generation figures divide by n-1 decode steps.
    """
    n_gen = usage.completion_tokens
    steps = max(n_gen - 1, 0)
    prompt_n = usage.evaluated_tokens
    out = {
        "cache_n": usage.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": usage.prompt_ms,
        "prompt_per_token_ms": usage.prompt_ms / prompt_n if prompt_n else 0.0,
        "prompt_per_second": 1000.0 * prompt_n / usage.prompt_ms if usage.prompt_ms > 0 else 0.0,
        "predicted_n": n_gen,
        "predicted_ms": usage.generation_ms,
        "predicted_per_token_ms": usage.generation_ms / steps if steps else 0.0,
        "predicted_per_second": 1000.0 * steps / usage.generation_ms
        if steps and usage.generation_ms > 0 else 0.0,
    }
    if usage.draft_tokens:
        # as llama-server, only where the request drafted (engine/lookup.py)
        out.update(draft_n=usage.draft_tokens, draft_n_accepted=usage.draft_accepted)
    if usage.dropped:
        # FIM under t_max_prompt_ms: what the prompt left out (engine/promptfit.py)
        out["dropped"] = dict(usage.dropped)
    return out


def generation_settings(gen, n_ctx, model_name, stream=False):
    """llama-server's ``generation_settings`` for a request's GenerationParams."""
    s = gen.sampling
    return {
        "n_ctx": n_ctx,
        "n_predict": gen.n_predict,
        "model": model_name,
        "seed": s.seed if s.seed is not None else 0xFFFFFFFF,
        "temperature": s.temperature,
        "dynatemp_range": s.dynatemp_range,
        "dynatemp_exponent": s.dynatemp_exponent,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "typical_p": s.typical_p,
        "repeat_last_n": s.repeat_last_n,
        "repeat_penalty": s.repeat_penalty,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "max_tokens": gen.n_predict,
        "n_keep": gen.n_keep,
        "n_discard": gen.n_discard,
        "ignore_eos": gen.ignore_eos,
        "stream": stream,
        "n_probs": gen.n_probs if gen.with_probs else 0,
        "post_sampling_probs": gen.post_sampling_probs,
        "min_keep": s.min_keep,
        "samplers": list(s.effective_samplers),     # infill is dropped under a grammar
        "stop": list(gen.stop),
        "n_indent": gen.n_indent,
        "t_max_predict_ms": gen.t_max_predict_ms,
        "cache_prompt": gen.cache_prompt,
        "logit_bias": [[t, b if b != float("-inf") else False] for t, b in s.logit_bias],
        "timings_per_token": False,
        # the adapter scales it ran with (api/lora.py); [] with no --lora
        "lora": [{"id": i, "scale": sc} for i, sc in (gen.lora or ())],
    }


def native_final(c, model_name, gen, n_ctx, id_slot, prompt_text, index=0, stream=False,
                 return_tokens=False):
    """The final object of /completion and /infill."""
    out = {
        "index": index,
        "content": c.text,
        "tokens": list(c.tokens) if return_tokens else [],
        "id_slot": id_slot,
        "stop": True,
        "model": model_name,
        "tokens_predicted": c.usage.completion_tokens,
        "tokens_evaluated": c.usage.prompt_tokens,
        "generation_settings": generation_settings(gen, n_ctx, model_name, stream),
        "prompt": prompt_text,
        "has_new_line": "\n" in c.text,
        "truncated": c.truncated,
        "stop_type": c.stop_type,
        "stopping_word": c.stopping_word,
        # what the session's cache holds now, prompt and output (llama-server's n_past);
        # how much of the prompt came from it is timings.cache_n
        "tokens_cached": c.n_cached,
        "timings": timings(c.usage),
    }
    if not stream and c.probs:
        out["completion_probabilities"] = probs_json(c.probs, gen.post_sampling_probs)
    return out


def native_partial(piece, index, id_slot, n_predicted, n_evaluated, probs=None, post=False,
                   tokens=()):
    """One streamed piece of /completion and /infill (``probs``: its tokens' TokenProbs;
    ``tokens``: their ids, which llama-server's chunks always carry)."""
    out = {
        "index": index,
        "content": piece,
        "tokens": list(tokens),
        "stop": False,
        "id_slot": id_slot,
        "tokens_predicted": n_predicted,
        "tokens_evaluated": n_evaluated,
    }
    if probs:
        out["completion_probabilities"] = probs_json(probs, post)
    return out


def progress_json(p):
    """llama-server's ``prompt_progress`` of a PromptProgress."""
    return {"total": p.total, "cache": p.cache, "processed": p.processed,
            "time_ms": int(p.time_ms)}


def progress_timings(p):
    """``timings`` at a prompt progress report (timings_per_token): the prompt so far,
    nothing generated yet; nothing decoded is no time spent."""
    n = p.processed - p.cache
    return timings(Usage(prompt_tokens=p.total, cached_tokens=p.cache, evaluated=n,
                         prompt_ms=p.time_ms if n > 0 else 0.0))


def native_progress(p, index, id_slot, n_evaluated, with_timings=False):
    """A /completion stream event reporting prompt progress (``return_progress``)."""
    out = native_partial("", index, id_slot, 0, n_evaluated)
    out["prompt_progress"] = progress_json(p)
    if with_timings:
        out["timings"] = progress_timings(p)
    return out


# -- token probabilities ----------------------------------------------------------

# llama-server's logarithm(): log(0) is -inf, which JSON cannot carry, so the
# lowest float stands for it
_LOG_ZERO = -3.4028234663852886e38


def logprob(p):
    return math.log(p) if p > 0.0 else _LOG_ZERO


def token_str(data):
    """A token's bytes as text: an unfinished UTF-8 character at the end is cut
    (llama-server's validate_utf8), other bad bytes become U+FFFD."""
    return codecs.getincrementaldecoder("utf-8")("replace").decode(data)


def probs_json(probs, post=False):
    """llama-server's probs_vector_to_json: per token ``id``, ``token``, ``bytes``
    and ``logprob`` with ``top_logprobs`` (or, after the sampler chain,
    ``prob`` with ``top_probs``)."""
    key, top_key = ("prob", "top_probs") if post else ("logprob", "top_logprobs")
    value = (lambda p: p) if post else logprob
    return [{"id": p.id, "token": token_str(p.bytes), "bytes": list(p.bytes), key: value(p.prob),
             top_key: [{"id": t.id, "token": token_str(t.bytes), "bytes": list(t.bytes),
                        key: value(t.prob)} for t in p.top]}
            for p in probs]


def oai_completion_logprobs(probs, offset=0):
    """OpenAI's legacy ``logprobs`` of /v1/completions, and the text offset after it.

    ``tokens``, ``token_logprobs``, ``top_logprobs`` (a {token: logprob} per
    token) and ``text_offset`` (where each token starts in the completion's
    text, from ``offset``); plus llama-server's own ``content`` (the chat
    shape, which is what llama-server sends here).
    """
    tokens, offsets = [], []
    for p in probs:
        offsets.append(offset)
        t = token_str(p.bytes)
        tokens.append(t)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [logprob(p.prob) for p in probs],
        "top_logprobs": [{token_str(t.bytes): logprob(t.prob) for t in p.top} for p in probs],
        "text_offset": offsets,
        "content": probs_json(probs),
    }, offset


def select_fields(obj, paths):
    """llama-server's ``response_fields``: each path ``a/b`` becomes a top-level key.

    Paths that do not exist are left out, as llama-server leaves them out.
    """
    out = {}
    for path in paths:
        cur, ok = obj, True
        for key in path.split("/"):
            if isinstance(cur, dict) and key in cur:
                cur = cur[key]
            else:
                ok = False
                break
        if ok:
            out[path] = cur
    return out


# -- OpenAI ---------------------------------------------------------------------

def new_id(prefix):
    return "%s-%s" % (prefix, uuid.uuid4().hex[:24])


def finish_reason(c):
    """OpenAI's finish_reason: a cancelled request (superseded, its client gone, the
    server stopping) ended before a limit, as a stop does; OpenAI has no other word."""
    if c.finish_reason is FinishReason.CANCELLED:
        return FinishReason.STOP.value
    return c.finish_reason.value


def usage(c):
    u = c.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def _envelope(obj, model_name, cid, created, choices):
    """The fields every OpenAI response and chunk carries around its choices."""
    return {"id": cid, "object": obj, "created": created, "model": model_name,
            "system_fingerprint": FINGERPRINT, "choices": choices}


def oai_completion_choice(c, index=0):
    lp = oai_completion_logprobs(c.probs)[0] if c.probs is not None else None
    return {"text": c.text, "index": index, "logprobs": lp, "finish_reason": finish_reason(c)}


def oai_completion(completions, model_name, cid, created, prompt_tokens=None):
    """/v1/completions' answer: a choice per completion (several prompts, or ``n``)."""
    out = _envelope("text_completion", model_name, cid, created,
                    [oai_completion_choice(c, i) for i, c in enumerate(completions)])
    out.update(usage=usage_of_choices(completions, prompt_tokens),
               timings=timings(completions[0].usage))
    return out


def oai_completion_chunk(text, model_name, cid, created, finish=None, logprobs=None, index=0):
    """A /v1/completions chunk; ``logprobs`` from oai_completion_logprobs."""
    return _envelope("text_completion", model_name, cid, created,
                     [{"text": text, "index": index, "logprobs": logprobs,
                       "finish_reason": finish}])


def oai_chat_logprobs(probs, post=False):
    """A chat choice's ``logprobs``: {"content": [per token]} (None without probabilities)."""
    return None if probs is None else {"content": probs_json(probs, post)}


def oai_chat_choice(c, index=0, message=None, finish=None, post=False):
    """One choice of a chat completion (``n`` > 1 gives several)."""
    msg = message or {"role": "assistant", "content": c.text}
    return {"index": index, "message": msg, "logprobs": oai_chat_logprobs(c.probs, post),
            "finish_reason": finish or finish_reason(c)}


def oai_chat(c, model_name, cid, created, message=None, finish=None, post=False):
    out = _envelope("chat.completion", model_name, cid, created,
                    [oai_chat_choice(c, 0, message, finish, post)])
    out.update(usage=usage(c), timings=timings(c.usage))
    return out


def usage_of_choices(completions, prompt_tokens=None):
    """``usage`` of a request with several choices: every choice's tokens, and the
    prompts' (``prompt_tokens``; default: the first choice's prompt, the same for all).
    OpenAI's count; llama-server reports the first choice's alone."""
    out = usage(completions[0])
    if prompt_tokens is not None:
        out["prompt_tokens"] = prompt_tokens
    out["completion_tokens"] = sum(c.usage.completion_tokens for c in completions)
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    return out


def oai_chat_chunk(delta, model_name, cid, created, finish=None, probs=None, post=False,
                   index=0):
    return _envelope("chat.completion.chunk", model_name, cid, created,
                     [{"index": index, "delta": delta,
                       "logprobs": oai_chat_logprobs(probs, post), "finish_reason": finish}])


def oai_usage_chunk(c, obj, model_name, cid, created):
    """The extra chunk ``stream_options.include_usage`` asks for: no choices, usage."""
    out = _envelope(obj, model_name, cid, created, [])
    out.update(usage=usage(c), timings=timings(c.usage))
    return out


def now():
    return int(time.time())


def _fingerprint():
    """llama-server's shape, ``b<build>-<commit>`` (clients check the "b"): the pinned
    source has no git history, so its build number is 0, as its llama-server says."""
    from ... import __version__
    return "b0-offgrid-" + __version__


FINGERPRINT = _fingerprint()
