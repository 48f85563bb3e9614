"""llama-server's own API: /tokenize, /detokenize, /completion and /infill."""

import functools

from ...request import PromptProgress
from ..httpd.httperrors import BadRequest
from . import formats
from .prompts import infill_prepare, infill_tokens
from .fields import (Fields, generation_from, id_slot_from, infill_from, native_probs_from,
                     output_schema_from, prompts_from, response_fields_from, text_tokenizer,
                     MAX_N_CMPL)


# -- tokens -------------------------------------------------------------------------

def tokenize(h, body):
    f = Fields(body)
    entry = h.service.entry_for(f.raw("model"))
    content = f.str("content")
    if content is None:
        raise BadRequest("'content' is required")
    out = entry.call("tokenize", "POST /tokenize", text=content,
                     add_special=f.bool("add_special", False),
                     parse_special=f.bool("parse_special", True),
                     with_pieces=f.bool("with_pieces", False))
    if "body" in out:
        # with pieces, the worker writes the body itself (one fragment per distinct token)
        h.send_raw_json(200, out["body"].encode("utf-8", "replace"))
    else:
        h.send_json(200, {"tokens": out["tokens"]})


def detokenize(h, body):
    f = Fields(body)
    entry = h.service.entry_for(f.raw("model"))
    tokens = f.raw("tokens", [])
    if not isinstance(tokens, list):
        raise BadRequest("'tokens' must be a list of token ids")
    h.send_json(200, entry.call("detokenize", "POST /detokenize", tokens=tokens))


# -- llama-server's native completions ---------------------------------------------

def completion(h, body):
    f = Fields(body)
    svc = h.service
    entry = svc.entry_for(f.raw("model"))
    if not f.has("prompt"):
        raise BadRequest('"prompt" must be provided')
    prompts = prompts_from(f.raw("prompt"))
    gen = generation_from(f, entry.n_vocab, svc.n_predict_default,
                          sampling_default=svc.sampling_default, tokenize=text_tokenizer(entry))
    native_probs_from(f, gen, entry.n_vocab)
    schema, grammar = output_schema_from(f)
    jobs = []
    # the worker makes a lone prompt as it starts: one round trip, not two
    deferred = svc.deferred_prepare(entry, len(prompts) * _n_cmpl(f), f.bool("stream", False))
    for prompt in prompts:
        args = dict(parts=prompt.parts, add_special=True, schema=schema, grammar=grammar)
        text = prompt.parts[0] if prompt.is_text else ""
        if deferred:
            jobs.append((None, text, ("prepare_completion", args)))
            continue
        out = entry.call("prepare_completion", "POST /completion", **args)
        gen.sampling.grammar = out["grammar"]
        jobs.append((out["tokens"], text, None))
    _run_native(h, f, entry, jobs, gen, "completion")


def infill(h, body):
    f = Fields(body)
    svc = h.service
    entry = svc.entry_for(f.raw("model"), fim=True)
    req = infill_from(f)
    gen = generation_from(f, entry.n_vocab, svc.n_predict_default,
                          sampling_default=svc.sampling_default, tokenize=text_tokenizer(entry))
    native_probs_from(f, gen, entry.n_vocab)
    gen.cache_reuse = cache_reuse_of(f, svc)
    if svc.deferred_prepare(entry, _n_cmpl(f), f.bool("stream", False)):
        # the worker lays out the prompt as it starts: one round trip, not two
        job = (None, "", ("prepare_infill", infill_prepare(f, req, gen)))
    else:
        job = (infill_tokens(f, entry, req, gen, "POST /infill"), "", None)
    _run_native(h, f, entry, [job], gen, "infill")


def _n_cmpl(f):
    return f.int("n_cmpl" if f.has("n_cmpl") else "n", 1, lo=1, hi=MAX_N_CMPL)


def cache_reuse_of(f, svc):
    """Chunk reuse for a FIM request: llama-server's n_cache_reuse, else the server's."""
    return f.int("n_cache_reuse", svc.cache_reuse, lo=0, hi=1 << 20)


def _run_native(h, f, entry, jobs, gen, endpoint):
    """Run /completion or /infill: one result, or an array for several prompts or n_cmpl > 1.

    ``jobs``: (prompt tokens, prompt text, prepare) per prompt; ``prepare``
    (then tokens is None) is the (method, args) call with which the worker
    makes the prompt itself (Service.deferred_prepare).  Each prompt runs
    ``n_cmpl`` times, all of them at once where the model has the sessions
    (Service.run_choices: decoded in one batch); results are numbered as
    llama-server's: the prompts in order, each followed by its further
    completions.
    """
    svc = h.service
    svc.metrics.request(endpoint)
    stream = f.bool("stream", False)
    id_slot = id_slot_from(f)
    fields = response_fields_from(f)
    return_tokens = f.bool("return_tokens", False)
    n_cmpl = _n_cmpl(f)
    gen.return_progress = stream and f.bool("return_progress", False)
    timings_per_token = f.bool("timings_per_token", False)
    es = h.event_stream() if stream else None
    base_seed = gen.sampling.seed
    finals = {}     # index -> the final object of that result

    alone = len(jobs) * n_cmpl == 1

    def job(index, tokens, prompt_text, prepare, k):
        g = gen if alone else gen.copy()    # its own seed: jobs may run at once
        if base_seed is not None:
            g.sampling.seed = base_seed + k
        counter = {"n": 0}

        def on_piece(text, probs=None):
            if isinstance(text, PromptProgress):    # return_progress
                return es.send(formats.native_progress(text, index, id_slot, len(tokens),
                                                       timings_per_token))
            counter["n"] += len(probs) if probs else 1
            return es.send(formats.native_partial(text, index, id_slot, counter["n"],
                                                  len(tokens), probs, g.post_sampling_probs))

        c = svc.generate(entry, tokens, g, id_slot, on_piece if stream else None,
                         sock=h.connection, what="POST /" + endpoint, prepare=prepare)
        obj = formats.native_final(c, entry.id, g, entry.n_ctx, id_slot, prompt_text,
                                   index=index, stream=stream, return_tokens=return_tokens)
        if stream:
            obj["content"] = ""     # the pieces already carried it, as in llama-server
        if fields:
            obj = formats.select_fields(obj, fields)
        if stream:
            es.send(obj)
        finals[index] = obj
        return c

    jobs = [functools.partial(job, index, tokens, prompt_text, prepare, k)
            for index, (tokens, prompt_text, prepare, k)
            in enumerate((t, p, q, k) for t, p, q in jobs for k in range(n_cmpl))]
    results = [finals[i] for i in range(len(svc.run_choices(entry, jobs, id_slot)))]
    if stream:
        es.end()
    else:
        h.send_json(200, results[0] if len(results) == 1 else results)


