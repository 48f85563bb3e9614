"""Prompts made ready by the model's worker, shared by the dialects' endpoints.

A fill-in-the-middle request is laid out by the worker (``prepare_infill``:
the model's FIM tokens, extra context fitted into the window); /infill,
/v1/completions with ``suffix`` and Ollama's /api/generate with ``suffix``
all come here, so they get the same prompt for the same text.
"""

from ... import protocol
from .fields import id_slot_from, output_schema_from

# Room kept free for generation when a FIM request fits extra context into
# the window and sets no n_predict.
INFILL_GENERATION_RESERVE = 256


def infill_tokens(f, entry, req, gen, what):
    """The FIM prompt of ``req`` (laid out by the worker), and its grammar set on ``gen``.

    With ``gen.t_max_prompt_ms`` (not for a warm-up, ``n_predict`` 0) the
    worker drops what does not fit the budget (engine/promptfit.py) and says
    what in ``gen.prompt_dropped``.

    ``f`` holds the request's output-format fields (``json_schema``, ``grammar``,
    ``response_format``) as ``params.output_schema_from`` reads them.
    """
    out = entry.call("prepare_infill", what, **infill_prepare(f, req, gen))
    gen.sampling.grammar = out["grammar"]
    gen.prompt_dropped = out.get("dropped")
    return out["tokens"]


def infill_prepare(f, req, gen):
    """The worker's prepare_infill arguments for ``req``; sets on ``gen`` the suffix
    stop's text and indent.  (The worker sets the grammar and what was dropped,
    from its answer, on its own copy when it prepares as it generates.)"""
    reserve = gen.n_predict if gen.n_predict > 0 else INFILL_GENERATION_RESERVE
    schema, grammar = output_schema_from(f)
    # stop where the completion meets the suffix (engine/textstream.SuffixStop)
    gen.fim_suffix = req.input_suffix
    line = (req.input_prefix + req.prompt).rsplit("\n", 1)[-1]
    gen.fim_indent = len(line) - len(line.lstrip(" \t"))
    return dict(request=protocol.encode_infill(req), reserve=reserve, schema=schema,
                grammar=grammar, t_max_prompt_ms=gen.t_max_prompt_ms if gen.n_predict != 0 else 0,
                id_slot=id_slot_from(f), cache_reuse=gen.cache_reuse)
