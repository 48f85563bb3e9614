"""llama-server's own API: /tokenize, /detokenize, /completion and /infill."""

from ..httpd.httperrors import BadRequest
from . import formats, media, pipeline
from .fields import (Fields, cache_reuse_from, choices_from, generation_from, id_slot_from,
                     infill_from, native_probs_from, output_schema_from, prompts_from,
                     response_fields_from, text_tokenizer)
from .pipeline import Format, Generation, Prompt
from .prompts import infill_prepare, infill_tokens


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
    """POST /completion (and /completions): one result, or an array for several prompts
    or n_cmpl > 1."""
    f = Fields(body)
    svc = h.service
    entry = svc.entry_for(f.raw("model"))
    if not f.has("prompt"):
        raise BadRequest('"prompt" must be provided')
    raw, files = media.native_prompts(f.raw("prompt"))
    prompts = prompts_from(raw)
    n = choices_from(f)
    gen = generation_from(f, entry.n_vocab, svc.generation_default,
                          sampling_default=entry.sampling, tokenize=text_tokenizer(entry))
    native_probs_from(f, gen, entry.n_vocab)
    schema, grammar = output_schema_from(f)
    stream = f.bool("stream", False)
    ready = []
    # the worker makes a lone prompt as it starts: one round trip, not two
    deferred = svc.deferred_prepare(entry, len(prompts) * n, stream)
    for i, prompt in enumerate(prompts):
        args = dict(parts=prompt.parts, add_special=True, schema=schema, grammar=grammar)
        if i < len(files) and files[i]:
            args["media"] = files[i]
        text = prompt.parts[0] if prompt.is_text else ""
        if deferred:
            ready.append(Prompt(None, text, ("prepare_completion", args)))
            continue
        out = entry.call("prepare_completion", "POST /completion", **args)
        gen.sampling.grammar = out["grammar"]
        ready.append(Prompt(out["tokens"], text))
    _run(h, f, entry, ready, gen, n, "completion")


def infill(h, body):
    """POST /infill: fill-in-the-middle with the model's FIM tokens."""
    f = Fields(body)
    svc = h.service
    entry = svc.entry_for(f.raw("model"), fim=True)
    req = infill_from(f)
    n = choices_from(f)
    gen = generation_from(f, entry.n_vocab, svc.generation_default,
                          sampling_default=entry.sampling, tokenize=text_tokenizer(entry))
    native_probs_from(f, gen, entry.n_vocab)
    gen.cache_reuse = cache_reuse_of(f, svc)
    if svc.deferred_prepare(entry, n, f.bool("stream", False)):
        # the worker lays out the prompt as it starts: one round trip, not two
        prompt = Prompt(None, "", ("prepare_infill", infill_prepare(f, req, gen)))
    else:
        prompt = Prompt(infill_tokens(f, entry, req, gen, "POST /infill"))
    _run(h, f, entry, [prompt], gen, n, "infill")


def cache_reuse_of(f, svc):
    """Chunk reuse for a FIM request: llama-server's n_cache_reuse, else the server's."""
    return cache_reuse_from(f, svc.cache_reuse)


def _run(h, f, entry, prompts, gen, n, endpoint):
    stream = f.bool("stream", False)
    gen.return_progress = stream and f.bool("return_progress", False)
    # llama-server's chunks carry their token ids always, their timings when asked
    gen.piece_tokens = stream
    gen.timings_per_token = stream and f.bool("timings_per_token", False)
    g = Generation(entry, gen, prompts, endpoint, "POST /" + endpoint, n=n, stream=stream,
                   id_slot=id_slot_from(f))
    pipeline.run(h, g, NativeFormat(f, g))


class NativeFormat(Format):
    """llama-server's shapes: ``{"content": piece, "stop": false}`` events, then each
    result's final object (``formats.native_final``); a lone result, or an array."""

    def __init__(self, f, g):
        self.g = g
        self.fields = response_fields_from(f)
        self.return_tokens = f.bool("return_tokens", False)
        self.timings_per_token = g.gen.timings_per_token
        self.n_pieces = {}      # job index -> tokens streamed so far

    def progress(self, out, job, p):
        return out.send(formats.native_progress(p, job.index, self.g.id_slot,
                                                len(job.prompt.tokens), self.timings_per_token))

    def piece(self, out, job, text, probs, tokens=(), usage=None):
        n = self.n_pieces.get(job.index, 0) + len(tokens)
        self.n_pieces[job.index] = n
        obj = formats.native_partial(text, job.index, self.g.id_slot, n,
                                     len(job.prompt.tokens), probs, job.gen.post_sampling_probs,
                                     tokens)
        if usage is not None:
            obj["timings"] = formats.timings(usage)
        return out.send(obj)

    def _final(self, job, c, stream):
        g = self.g
        obj = formats.native_final(c, g.entry.id, job.gen, g.entry.n_ctx, g.id_slot,
                                   job.prompt.text, index=job.index, stream=stream,
                                   return_tokens=self.return_tokens)
        if stream:
            obj["content"] = ""     # the pieces already carried it, as in llama-server
        if self.fields:
            obj = formats.select_fields(obj, self.fields)
        return obj

    def choice_end(self, out, job, c):
        out.send(self._final(job, c, True))

    def body(self, jobs, done):
        results = [self._final(job, c, False) for job, c in zip(jobs, done)]
        return results[0] if len(results) == 1 else results
