"""OpenAI's /v1/completions: text prompts, several of them, or a prefix and ``suffix``
(fill-in-the-middle)."""

from ...request import InfillRequest
from ..httpd.httperrors import BadRequest
from . import formats, pipeline
from .fields import (Fields, choices_from, completion_probs_from, include_usage_from,
                     generation_from, id_slot_from, output_schema_from, prompt_from, prompts_from,
                     text_tokenizer)
from .native import cache_reuse_of
from .pipeline import Format, Generation, Prompt
from .prompts import infill_tokens


def v1_completions(h, body):
    """POST /v1/completions."""
    f = Fields(body)
    svc = h.service
    n = choices_from(f)
    suffix = f.str("suffix")
    if not f.has("prompt"):
        raise BadRequest("'prompt' is required")
    if suffix is not None:
        prompt = prompt_from(f.raw("prompt"))
        if not prompt.is_text:
            raise BadRequest("with 'suffix', 'prompt' must be a string")
        entry = svc.entry_for(f.raw("model"), fim=True)
        gen = generation_from(f, entry.n_vocab, svc.generation_default,
                              sampling_default=entry.sampling,
                              tokenize=text_tokenizer(entry))
        completion_probs_from(f, gen, entry.n_vocab)
        gen.cache_reuse = cache_reuse_of(f, svc)
        req = InfillRequest(input_prefix=prompt.parts[0], input_suffix=suffix)
        prompts = [Prompt(infill_tokens(f, entry, req, gen, "POST /v1/completions"))]
    else:
        entry = svc.entry_for(f.raw("model"))
        gen = generation_from(f, entry.n_vocab, svc.generation_default,
                              sampling_default=entry.sampling,
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
            prompts.append(Prompt(out["tokens"]))
    g = Generation(entry, gen, prompts, "v1/completions", "POST /v1/completions", n=n,
                   stream=f.bool("stream", False), id_slot=id_slot_from(f))
    pipeline.run(h, g, CompletionsFormat(g, include_usage_from(f)))


class CompletionsFormat(Format):
    """OpenAI's text_completion objects: a choice per job; streams end with ``[DONE]``."""

    def __init__(self, g, include_usage):
        self.g, self.include_usage = g, include_usage
        self.cid, self.created = formats.new_id("cmpl"), formats.now()
        self.offsets = {}       # job index -> where its next token starts in its text

    def piece(self, out, job, text, probs):
        lp = None
        if probs is not None:
            lp, self.offsets[job.index] = formats.oai_completion_logprobs(
                probs, self.offsets.get(job.index, 0))
        return out.send(formats.oai_completion_chunk(text, self.g.entry.id, self.cid,
                                                     self.created, logprobs=lp,
                                                     index=job.index))

    def choice_end(self, out, job, c):
        out.send(formats.oai_completion_chunk("", self.g.entry.id, self.cid, self.created,
                                              formats.finish_reason(c), index=job.index))

    def _prompt_tokens(self):
        return sum(len(p.tokens) for p in self.g.prompts)

    def end(self, out, done):
        if self.include_usage:
            chunk = formats.oai_usage_chunk(done[0], "text_completion", self.g.entry.id,
                                            self.cid, self.created)
            chunk["usage"] = formats.usage_of_choices(done, self._prompt_tokens())
            out.send(chunk)
        out.send(b"[DONE]")

    def body(self, jobs, done):
        return formats.oai_completion(done, self.g.entry.id, self.cid, self.created,
                                      self._prompt_tokens())
