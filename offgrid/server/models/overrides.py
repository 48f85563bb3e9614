"""What a model's file and its load are told to do otherwise, read alike from the command
line (flagvalues.py) and a preset's keys (folders.py): --override-kv, -ot with
--cpu-moe and --n-cpu-moe, --chat-template-kwargs, RoPE's and YaRN's settings, and
control vectors.  Each reader raises ValueError naming the flag and what it takes."""

import csv
import json
import math
import re

# llama.cpp's LLM_FFN_EXPS_REGEX (common.h): a Mixture of Experts layer's expert weights
FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


def tensor_overrides(text, flag="-ot"):
    """-ot's REGEX=BUFT items, a comma list, as [[regex, buffer type name], ...]."""
    out = []
    for item in text.split(","):
        pattern, sep, buft = item.rpartition("=")
        if not sep or not pattern or not buft:
            raise ValueError("%s %s: give REGEX=BUFFER_TYPE, e.g. '\\.ffn_.*_exps\\.=CPU'"
                             % (flag, item))
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError("%s %s: not a regular expression (%s)" % (flag, item, e))
        out.append([pattern, buft])
    return out


def moe_overrides(cpu_moe, n_cpu_moe):
    """--cpu-moe's and --n-cpu-moe's items (after -ot's, as llama-server orders them): every
    layer's expert weights, or the first N layers', in host memory."""
    if n_cpu_moe < 0:
        raise ValueError("--n-cpu-moe must be 0 or more")
    out = [[FFN_EXPS_REGEX, "CPU"]] if cpu_moe else []
    return out + [[r"blk\.%d%s" % (i, FFN_EXPS_REGEX), "CPU"] for i in range(n_cpu_moe)]


def kv_override(item):
    """One --override-kv item, KEY=TYPE:VALUE, as [key, type, value] (as llama.cpp's
    string_parse_kv_override reads it)."""
    key, sep, rest = item.partition("=")
    kind, colon, text = rest.partition(":")
    if not sep or not key or len(key.encode()) >= 128 or not colon:
        raise ValueError("--override-kv %s: give KEY=TYPE:VALUE (TYPE int, float, bool or "
                         "str)" % item)
    try:
        value = {"int": int, "float": float, "str": str,
                 "bool": {"true": True, "false": False}.__getitem__}[kind](text)
    except (KeyError, ValueError):
        raise ValueError("--override-kv %s: not a value of type int, float, bool (true or "
                         "false) or str" % item)
    if kind == "int" and not -2 ** 63 <= value < 2 ** 63:
        raise ValueError("--override-kv %s: an int is 64 bits" % item)
    if kind == "str" and len(text.encode()) > 127:
        raise ValueError("--override-kv %s: a str value may be at most 127 bytes" % key)
    return [key, kind, value]


def kv_overrides(text):
    """--override-kv's comma list of items."""
    return [kv_override(item) for item in text.split(",") if item]


def template_kwargs(text):
    """--chat-template-kwargs: a JSON object, whose enable_thinking (if any) is a bool."""
    try:
        kwargs = json.loads(text)
    except ValueError as e:
        raise ValueError("--chat-template-kwargs: not JSON (%s)" % e)
    if not isinstance(kwargs, dict):
        raise ValueError("--chat-template-kwargs must be a JSON object")
    if not isinstance(kwargs.get("enable_thinking", False), bool):
        raise ValueError("--chat-template-kwargs: enable_thinking must be true or false")
    return kwargs


def rope_settings(args):
    """--rope-scaling, --rope-scale, --rope-freq-*, --yarn-* as {llama_context_params
    field: value} of those given (llama-server's reading: --rope-scale N is a frequency
    scale of 1/N, and --rope-freq-scale wins over it; the scaling type by its name,
    libllama.ModelHandle's to turn into its enum); ValueError for a value libllama
    cannot use."""
    out = {}
    if args.rope_scaling is not None:
        out["rope_scaling_type"] = args.rope_scaling
    for flag, field, value in (("--rope-scale", "rope_freq_scale", args.rope_scale),
                               ("--rope-freq-scale", "rope_freq_scale", args.rope_freq_scale),
                               ("--rope-freq-base", "rope_freq_base", args.rope_freq_base)):
        if value is not None:
            if not 0 < value < float("inf"):
                raise ValueError("%s %s: give a number above 0" % (flag, value))
            out[field] = 1.0 / value if flag == "--rope-scale" else value
    for field in ("yarn_ext_factor", "yarn_attn_factor", "yarn_beta_slow", "yarn_beta_fast"):
        value = getattr(args, field)
        if value is not None:
            if not value == value or abs(value) == float("inf"):
                raise ValueError("--%s %s: give a number" % (field.replace("_", "-"), value))
            out[field] = value
    if args.yarn_orig_ctx is not None:
        if args.yarn_orig_ctx < 0:
            raise ValueError("--yarn-orig-ctx %d: give 0 (the file's) or more"
                             % args.yarn_orig_ctx)
        out["yarn_orig_ctx"] = args.yarn_orig_ctx
    return out


def control_vectors(text, flag="--control-vector"):
    """--control-vector's files (each at scale 1), or --control-vector-scaled's
    FNAME:SCALE items (``flag``), a comma list read as llama-server's CSV row
    (quotes allowed), as [[path, scale], ...]."""
    try:
        items = [item.strip() for item in next(csv.reader([text])) if item.strip()]
    except (csv.Error, StopIteration):
        items = []
    if not items:
        raise ValueError("%s %r: give a file name" % (flag, text))
    if flag == "--control-vector":
        return [[item, 1.0] for item in items]
    out = []
    for item in items:
        parts = item.split(":")
        if len(parts) != 2 or not parts[0]:
            raise ValueError("%s %s: give FNAME:SCALE (a file name without ':')"
                             % (flag, item))
        try:
            scale = float(parts[1])
        except ValueError:
            scale = math.nan
        if not math.isfinite(scale):
            raise ValueError("%s %s: the scale %r is not a number" % (flag, item, parts[1]))
        out.append([parts[0], scale])
    return out


def control_vector_layers(start, end):
    """--control-vector-layer-range START END as [START, END] (0 or less: the first
    layer, the last; as llama-server's), both inclusive."""
    try:
        start, end = int(start), int(end)
    except ValueError:
        raise ValueError("--control-vector-layer-range %s %s: give two layer numbers"
                         % (start, end))
    if start > 0 and end > 0 and start > end:
        raise ValueError("--control-vector-layer-range %d %d: START is past END, so no "
                         "layer would get the vector" % (start, end))
    return [start, end]


def control_vector_layer_range(text):
    """A preset's control-vector-layer-range: START END (or START,END), as the flag's
    two values."""
    parts = text.replace(",", " ").split()
    if len(parts) != 2:
        raise ValueError("--control-vector-layer-range %s: give START END" % text)
    return control_vector_layers(*parts)
