"""OpenAI's /v1/completions: text prompts, several of them, or a prefix and ``suffix``
(fill-in-the-middle)."""

import functools

from ...request import InfillRequest
from ..httpd.httperrors import BadRequest
from . import formats
from .native import cache_reuse_of
from .prompts import infill_tokens
from .fields import (Fields, completion_probs_from, include_usage_from, generation_from,
                     id_slot_from, output_schema_from, prompt_from, prompts_from, text_tokenizer,
                     MAX_N_CMPL)


# -- OpenAI -------------------------------------------------------------------------

def _openai_checks(f):
    """``n`` choices of each prompt (llama-server's n_cmpl), checked; best_of and echo refused."""
    if f.int("best_of", 1) != 1:
        raise BadRequest("'best_of' must be 1: offgrid does not rank several completions")
    if f.bool("echo", False):
        raise BadRequest("'echo' is not supported: the response never repeats the prompt")
    return f.int("n", 1, lo=1, hi=MAX_N_CMPL)


def v1_completions(h, body):
    f = Fields(body)
    svc = h.service
    n = _openai_checks(f)
    suffix = f.str("suffix")
    if not f.has("prompt"):
        raise BadRequest("'prompt' is required")
    if suffix is not None:
        prompt = prompt_from(f.raw("prompt"))
        if not prompt.is_text:
            raise BadRequest("with 'suffix', 'prompt' must be a string")
        entry = svc.entry_for(f.raw("model"), fim=True)
        gen = generation_from(f, entry.n_vocab, svc.n_predict_default,
                              ("max_tokens", "n_predict"), svc.sampling_default,
                              tokenize=text_tokenizer(entry))
        completion_probs_from(f, gen, entry.n_vocab)
        gen.cache_reuse = cache_reuse_of(f, svc)
        req = InfillRequest(input_prefix=prompt.parts[0], input_suffix=suffix)
        prompts = [infill_tokens(f, entry, req, gen, "POST /v1/completions")]
    else:
        entry = svc.entry_for(f.raw("model"))
        gen = generation_from(f, entry.n_vocab, svc.n_predict_default,
                              ("max_tokens", "n_predict"), svc.sampling_default,
                              tokenize=text_tokenizer(entry))
        completion_probs_from(f, gen, entry.n_vocab)
        schema, grammar = output_schema_from(f)
        prompts = []
        for prompt in prompts_from(f.raw("prompt")):
            if prompt.is_text and not prompt.parts[0]:
                # nothing to continue (with a suffix, an empty prefix is a fine FIM request)
                raise BadRequest("'prompt' must not be empty")
            out = entry.call("prepare_completion", "POST /v1/completions", parts=prompt.parts,
                             add_special=True, schema=schema, grammar=grammar)
            gen.sampling.grammar = out["grammar"]
            prompts.append(out["tokens"])
    svc.metrics.request("v1/completions")
    stream = f.bool("stream", False)
    include_usage = include_usage_from(f)
    id_slot = id_slot_from(f)
    cid, created = formats.new_id("cmpl"), formats.now()
    es = h.event_stream() if stream else None
    base_seed = gen.sampling.seed

    def choice(index, tokens, k):
        g = gen.copy()      # its own seed: choices may run at once
        if base_seed is not None:
            g.sampling.seed = base_seed + k
        offset = [0]        # where the next token starts in the completion's text

        def on_piece(text, probs=None):
            lp = None
            if probs is not None:
                lp, offset[0] = formats.oai_completion_logprobs(probs, offset[0])
            return es.send(formats.oai_completion_chunk(text, entry.id, cid, created,
                                                        logprobs=lp, index=index))

        c = svc.generate(entry, tokens, g, id_slot, on_piece if stream else None,
                         sock=h.connection, what="POST /v1/completions")
        if stream:
            es.send(formats.oai_completion_chunk("", entry.id, cid, created,
                                                 formats.finish_reason(c), index=index))
        return c

    # each prompt n times, numbered in that order (llama-server's child tasks)
    done = svc.run_choices(entry, [
        functools.partial(choice, index, tokens, k) for index, (tokens, k)
        in enumerate((t, k) for t in prompts for k in range(n))], id_slot)
    prompt_tokens = sum(len(t) for t in prompts)
    if not stream:
        h.send_json(200, formats.oai_completion(done, entry.id, cid, created, prompt_tokens))
        return
    if include_usage:
        chunk = formats.oai_usage_chunk(done[0], "text_completion", entry.id, cid, created)
        chunk["usage"] = formats.usage_of_choices(done, prompt_tokens)
        es.send(chunk)
    es.send(b"[DONE]")
    es.end()


