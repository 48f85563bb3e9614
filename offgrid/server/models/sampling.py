"""What a model's requests sample with where they do not say: llama-server's order.

A sampling field a request leaves out takes its model's default, which is, from
the weakest: llama-server's own (SamplingParams'), the model file's
``general.sampling.*`` keys (convert_hf_to_gguf.py writes the model's
generation_config.json there: the temperature, top_k, top_p, ... its makers
recommend), the model's preset keys (``[*]``, then its section), and the
flags given on the command line (``--temp``, ``--top-k``, ...).  So a flag the
user gave wins over the file, as in llama.cpp's common_init_sampler_from_model,
and over a preset, as every flag does.

DRY, which offgrid does not run, is taken at the value that leaves it off: a
flag or a preset key that turns it on is an error at start.
"""

import dataclasses

from ...errors import InvalidRequest
from ...request import SAMPLERS_NOT_RUN, SamplingParams, sampler_acts, sampler_chain

# SamplingParams' fields with llama-server's flags for them, their values' type and
# what each is.  A preset key is any of the long flags without its dashes ("top-k").
FLAGS = (
    ("temperature", ("--temp", "--temperature"), float, "temperature (0: greedy)"),
    ("top_k", ("--top-k",), int, "top-k (0: off)"),
    ("top_p", ("--top-p",), float, "top-p (1: off)"),
    ("min_p", ("--min-p",), float, "min-p (0: off)"),
    ("typical_p", ("--typical", "--typical-p"), float, "locally typical p (1: off)"),
    ("repeat_penalty", ("--repeat-penalty",), float, "repeat penalty (1: off)"),
    ("repeat_last_n", ("--repeat-last-n",), int, "tokens the penalties look back on"),
    ("presence_penalty", ("--presence-penalty",), float, "presence penalty"),
    ("frequency_penalty", ("--frequency-penalty",), float, "frequency penalty"),
    ("dynatemp_range", ("--dynatemp-range",), float, "dynamic temperature range"),
    ("dynatemp_exponent", ("--dynatemp-exp",), float, "dynamic temperature exponent"),
    ("seed", ("-s", "--seed"), int, "seed (-1: random each request)"),
    ("samplers", ("--samplers",), str, "the samplers in order: names split by ';'"),
    ("sampling_seq", ("--sampling-seq", "--sampler-seq"), str,
     "the samplers in order, as letters (kfypmt)"),
    ("xtc_probability", ("--xtc-probability",), float, "XTC probability (0: off)"),
    ("xtc_threshold", ("--xtc-threshold",), float, "XTC threshold (over 0.5: off)"),
    ("top_n_sigma", ("--top-nsigma", "--top-n-sigma"), float, "top-n-sigma (-1: off)"),
    ("mirostat", ("--mirostat",), int, "mirostat version (0: off, 1, 2)"),
    ("mirostat_tau", ("--mirostat-ent",), float, "mirostat target entropy (tau)"),
    ("mirostat_eta", ("--mirostat-lr",), float, "mirostat learning rate (eta)"),
)
# DRY, the sampler offgrid does not run, by the flag that makes it act (SAMPLERS_NOT_RUN):
# taken at the value that leaves it off
NOT_RUN_FLAGS = (("dry_multiplier", ("--dry-multiplier",), float, "0 only (no DRY)"),)
# its parameters' flags, taken and unused: they do nothing while DRY is off
IDLE_FLAGS = ("--dry-base", "--dry-allowed-length", "--dry-penalty-last-n",
              "--dry-sequence-breaker")

# the file's keys (general.sampling.NAME), as common_init_sampler_from_model reads them
FILE_KEYS = (("temp", "temperature", float), ("top_k", "top_k", int),
             ("top_p", "top_p", float), ("min_p", "min_p", float),
             ("penalty_last_n", "repeat_last_n", int),
             ("penalty_repeat", "repeat_penalty", float),
             ("xtc_probability", "xtc_probability", float),
             ("xtc_threshold", "xtc_threshold", float), ("mirostat", "mirostat", int),
             ("mirostat_tau", "mirostat_tau", float), ("mirostat_eta", "mirostat_eta", float))


def add_flags(p):
    """The sampling flags on the command line's parser (dest: the field's name; default
    None, so that only a flag given counts)."""
    for field, flags, kind, what in FLAGS + NOT_RUN_FLAGS:
        p.add_argument(*flags, dest=field, type=kind, default=None, metavar="N",
                       help="requests' default %s" % what)
    for flag in IDLE_FLAGS:
        p.add_argument(flag, action="append", default=None, metavar="V",
                       help="taken and unused (its sampler is not run)")


def _read(field, value):
    """(field, value) as SamplingParams takes it; ValueError where it cannot be."""
    if field == "samplers":
        return field, sampler_chain([s for s in value.split(";") if s])
    if field == "sampling_seq":
        return "samplers", sampler_chain(value)
    return field, value


def _refuse_not_run(values, where):
    for name, _idle, what in SAMPLERS_NOT_RUN:
        if values.get(name) is not None and sampler_acts(name, values[name]):
            raise ValueError("%s: offgrid does not run the %s sampler; leave %s off"
                             % (where, what, name))


def _given(values, where, label=None):
    """{field: value} of given sampling settings (``values``, None: not given) as
    SamplingParams takes them; ValueError naming ``where`` (or a field's ``label``) for
    one that asks a sampler offgrid does not run to act, or does not read."""
    _refuse_not_run(values, where)
    not_run = {n for n, _i, _w in SAMPLERS_NOT_RUN}
    got = {}
    for field, v in values.items():
        if v is None or field in not_run:
            continue
        try:
            k, v = _read(field, v)
        except ValueError as e:
            raise ValueError("%s: %s" % ((label or {}).get(field, where), e))
        got[k] = v
    return checked(got, where)


def from_args(args):
    """{field: value} of the sampling flags given (``from_preset``'s reading), and -l's
    (token id, bias) pairs as ``logit_bias`` (model_defaults checks the ids)."""
    values = {field: getattr(args, field, None) for field, *_ in FLAGS + NOT_RUN_FLAGS}
    values["logit_bias"] = getattr(args, "logit_bias", None)
    return _given(values, "the command line",
                  dict({field: flags[-1] for field, flags, *_ in FLAGS}, logit_bias="-l"))


def preset_keys():
    """{preset key: ("sampling.FIELD", type)}: every long flag of FLAGS and
    NOT_RUN_FLAGS without its dashes (folders.read_preset reads them)."""
    return {flag[2:]: ("sampling." + field, kind)
            for field, flags, kind, _what in FLAGS + NOT_RUN_FLAGS
            for flag in flags if flag.startswith("--")}


def from_preset(preset, where="--models-preset"):
    """{field: value} of a model's preset settings (their "sampling.FIELD" keys)."""
    return _given({k[len("sampling."):]: v for k, v in (preset or {}).items()
                   if k.startswith("sampling.")}, where)


def from_file(meta):
    """({field: value}, notes) of a GGUF's general.sampling.* keys (``meta``: its
    metadata as strings); a value that does not read or is out of range is left out
    with a note."""
    got, notes = {}, []
    for key, field, kind in FILE_KEYS:
        raw = meta.get("general.sampling." + key)
        if raw is None:
            continue
        try:
            v = kind(raw)
            checked({field: v}, "general.sampling.%s" % key)
        except ValueError:
            notes.append("general.sampling.%s = %r: not a value it takes, left out"
                         % (key, raw))
            continue
        got[field] = v
    raw = meta.get("general.sampling.sequence")
    if raw is not None:
        try:
            got["samplers"] = sampler_chain([s for s in raw.split(";") if s])
        except ValueError as e:
            notes.append("general.sampling.sequence: %s: left out" % e)
    return got, notes


def checked(values, where):
    """``values`` if SamplingParams takes them; ValueError naming ``where`` if not."""
    try:
        dataclasses.replace(SamplingParams(), **values).validate()
    except InvalidRequest as e:
        raise ValueError("%s: %s" % (where, e))
    return values


def model_defaults(meta, preset, flags, n_vocab=None):
    """(SamplingParams, notes): a model's defaults from its file's metadata, its preset
    settings and the command line's flags (``from_args``), the last winning.  -l's
    token ids outside the model's vocabulary (``n_vocab``) are left out with a note."""
    got, notes = from_file(meta or {})
    got.update(from_preset(preset))
    got.update(flags or {})
    if got.get("logit_bias") and n_vocab is not None:
        bias = got["logit_bias"]
        got["logit_bias"] = [(t, b) for t, b in bias if t < n_vocab]
        notes += ["-l %d: not a token of this model (its vocabulary has %d): left out"
                  % (t, n_vocab) for t, _b in bias if t >= n_vocab]
    if "seed" in got and (got["seed"] < 0 or got["seed"] == 0xFFFFFFFF):
        got["seed"] = None
    if "temperature" in got:
        got["temperature"] = max(0.0, got["temperature"])
    return dataclasses.replace(SamplingParams(), **got), notes
