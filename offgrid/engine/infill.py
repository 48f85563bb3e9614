"""Fill-in-the-middle prompts, laid out as llama-server's /infill lays them.

    [FIM_REP]myproject\\n                      (only if the model has FIM_REP)
    [FIM_SEP]{filename}\\n{text}  ...          one per input_extra chunk
    [FIM_SEP]filename\\n
    [BOS?][FIM_PRE]{prefix}{prompt}[FIM_SUF]{suffix}[FIM_MID]

Without FIM_SEP each chunk is introduced by a plain "--- snippet ---" line
instead.  To fit a batch, the prefix keeps its last 3/4 * n_batch tokens and
the suffix its first n_batch/4 - (2 + len(prompt)) tokens; the extra chunks
fill what is left of the context, keeping their end.  ``spm_infill`` (the worker's
--spm-infill) puts the suffix first (SPM order), for models trained that way.
"""

from ..errors import NotSupported


# llama-server's chunk separator when the model has no FIM_SEP token
CHUNK_PREFIX = "\n\n--- snippet ---\n\n"


def build_infill_prompt(model, req, n_ctx, n_batch, n_predict=-1):
    """Token ids of the FIM prompt for ``req``; raises NotSupported without FIM tokens."""
    return layout_infill(model, req, n_ctx, n_batch, n_predict)[0]


def layout_infill(model, req, n_ctx, n_batch, n_predict=-1):
    """(tokens, spans) of the FIM prompt for ``req``.

    ``spans`` says where each part landed in ``tokens``, as (start, end):
    ``chunks`` one per input_extra chunk (empty where the window cut it),
    ``prefix``, ``prompt`` and ``suffix`` (their text's tokens, as cut to
    fit); engine/promptfit.py weighs the parts with them.
    """
    missing = [name for name, tok in (("prefix", model.fim_pre), ("suffix", model.fim_suf),
                                      ("middle", model.fim_mid)) if tok is None]
    if missing:
        raise NotSupported("Infill is not supported by this model: %s token%s missing"
                           % (", ".join(missing), "s are" if len(missing) > 1 else " is"))

    def tok(text):
        return model.tokenize(text, add_special=False, parse_special=False)

    extra, chunk_ends = [], []
    if model.fim_rep is not None:
        extra += [model.fim_rep] + tok("myproject\n")
    first = len(extra)      # the repository's header belongs to no chunk
    for filename, text in req.input_extra:
        extra += _chunk_tokens(model, filename, text)
        chunk_ends.append(len(extra))
    if model.fim_sep is not None:
        extra += [model.fim_sep] + tok("filename\n")

    prefix = tok(req.input_prefix)
    suffix = tok(req.input_suffix)
    prompt = model.tokenize(req.prompt, add_special=False, parse_special=True) if req.prompt else []

    n_prefix_take = min(len(prefix), 3 * (n_batch // 4))
    n_suffix_take = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra))

    head = [model.bos] if model.add_bos and model.bos is not None else []
    cut = len(extra) - n_extra_take
    tokens = extra[cut:] + head
    spans = {"chunks": [], "prefix": None, "prompt": None, "suffix": None}
    start = first
    for end in chunk_ends:
        spans["chunks"].append((max(0, start - cut), max(0, end - cut)))
        start = end
    parts = [("prefix", [model.fim_pre], prefix[len(prefix) - n_prefix_take:]),
             ("prompt", [], prompt), ("suffix", [model.fim_suf], suffix[:n_suffix_take])]
    if req.spm_infill:
        parts = parts[2:] + parts[:2]
    for name, marker, part in parts:
        tokens += marker
        spans[name] = (len(tokens), len(tokens) + len(part))
        tokens += part
    tokens.append(model.fim_mid)
    return tokens, spans


def _chunk_tokens(model, filename, text):
    """An extra chunk's tokens, header included.  Editors send the same chunks
    with every request (a ring of the last files seen), so the model keeps
    their tokens whatever their length (Model.tokenize's ``keep``)."""
    if model.fim_sep is not None:
        head = [model.fim_sep] + model.tokenize(filename + "\n", add_special=False,
                                                parse_special=False, keep=True)
    else:
        head = model.tokenize(CHUNK_PREFIX, add_special=False, parse_special=False, keep=True)
    return head + model.tokenize(text, add_special=False, parse_special=False, keep=True)
