"""Fill-in-the-middle prompts, laid out as llama-server's /infill lays them.

    [FIM_REP]myproject\\n                      (only if the model has FIM_REP)
    [FIM_SEP]{filename}\\n{text}  ...          one per input_extra chunk
    [FIM_SEP]filename\\n
    [BOS?][FIM_PRE]{prefix}{prompt}[FIM_SUF]{suffix}[FIM_MID]

Without FIM_SEP each chunk is introduced by a plain "--- snippet ---" line
instead.  To fit a batch, the prefix keeps its last 3/4 * n_batch tokens and
the suffix its first n_batch/4 - (2 + len(prompt)) tokens; the extra chunks
fill what is left of the context, keeping their end.  ``spm_infill`` puts the
suffix first (SPM order), for models trained that way.
"""

from ..errors import NotSupported
from ..request import InfillRequest  # noqa: F401

# llama-server's chunk separator when the model has no FIM_SEP token
_CHUNK_PREFIX = "\n\n--- snippet ---\n\n"


def build_infill_prompt(model, req, n_ctx, n_batch, n_predict=-1):
    """Token ids of the FIM prompt for ``req``; raises NotSupported without FIM tokens."""
    missing = [name for name, tok in (("prefix", model.fim_pre), ("suffix", model.fim_suf),
                                      ("middle", model.fim_mid)) if tok is None]
    if missing:
        raise NotSupported("Infill is not supported by this model: %s token%s missing"
                           % (", ".join(missing), "s are" if len(missing) > 1 else " is"))

    def tok(text):
        return model.tokenize(text, add_special=False, parse_special=False)

    extra = []
    if model.fim_rep is not None:
        extra += [model.fim_rep] + tok("myproject\n")
    for filename, text in req.input_extra:
        if model.fim_sep is not None:
            extra += [model.fim_sep] + tok(filename + "\n")
        else:
            extra += tok(_CHUNK_PREFIX)
        extra += tok(text)
    if model.fim_sep is not None:
        extra += [model.fim_sep] + tok("filename\n")

    prefix = tok(req.input_prefix)
    suffix = tok(req.input_suffix)
    prompt = model.tokenize(req.prompt, add_special=False, parse_special=True) if req.prompt else []

    n_prefix_take = min(len(prefix), 3 * (n_batch // 4))
    n_suffix_take = min(len(suffix), max(0, n_batch // 4 - (2 + len(prompt))))
    n_extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra))

    prefix = [model.fim_pre] + prefix[len(prefix) - n_prefix_take:] + prompt
    suffix = [model.fim_suf] + suffix[:n_suffix_take]
    first, second = (suffix, prefix) if req.spm_infill else (prefix, suffix)
    head = [model.bos] if model.add_bos and model.bos is not None else []
    return extra[len(extra) - n_extra_take:] + head + first + second + [model.fim_mid]
