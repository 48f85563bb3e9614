"""A preset's settings: what each of llama-server's preset keys gives offgrid, in one table.

One row a setting: its name (our flag's argparse name where it is a flag), the
INI keys that give it (llama-server's long and short flag names, the
LLAMA_ARG_* names we know; the first is what ``/models`` writes back), how
its value reads, its least value, and how a worker gets it (``via``):

- "flag": model_args sets the flag of that name from it, where the command
  line did not give the flag;
- "moe", "rope", "control": model_args reads the group together, as the flags
  read (-ot with --cpu-moe and --n-cpu-moe; overrides.rope_settings; the
  control vector files and their layer range);
- "": read where it is used (the shelf: model, alias, tags, pin, keep-alive,
  load-on-startup, stop-timeout; the chat template; chat-template-kwargs).

The sampling keys (temp, top-k, ...) are models/sampling.py's table; folders.py
reads them beside these.
"""

import json
from typing import Callable, NamedTuple, Optional, Tuple

from ...request import KV_CACHE_TYPES, LAZY_MODES, LOAD_MODES
from . import overrides


class Setting(NamedTuple):
    name: str
    keys: Tuple[str, ...]
    # int, float, str, "bool", "duration", "list" (a comma list of words), a tuple of
    # the words it may be, or a reader of overrides.py (ValueError says what is wrong)
    kind: object
    via: str = ""
    low: Optional[float] = None         # the least value a number may take
    shown: bool = True                  # in /models' settings and its preset INI
    write: Optional[Callable] = None    # the INI's words for a value (default: as it is)


def _csv(items):
    return ",".join(items)


SETTINGS = (
    Setting("ctx_size", ("ctx-size", "c", "llama_arg_ctx_size"), int, "flag"),
    Setting("parallel", ("parallel", "np", "llama_arg_n_parallel"), int, "flag"),
    Setting("threads", ("threads", "t", "llama_arg_threads"), int, "flag"),
    Setting("threads_batch", ("threads-batch", "tb"), int, "flag"),
    Setting("batch_size", ("batch-size", "b"), int, "flag"),
    Setting("ubatch_size", ("ubatch-size", "ub"), int, "flag"),
    Setting("cache_type_k", ("cache-type-k", "ctk"), KV_CACHE_TYPES, "flag"),
    Setting("cache_type_v", ("cache-type-v", "ctv"), KV_CACHE_TYPES, "flag"),
    Setting("cache_type_k_draft", ("cache-type-k-draft", "ctkd"), KV_CACHE_TYPES, "flag"),
    Setting("cache_type_v_draft", ("cache-type-v-draft", "ctvd"), KV_CACHE_TYPES, "flag"),
    Setting("load_mode", ("load-mode", "lm"), LOAD_MODES, "flag"),
    Setting("lazy_mode", ("lazy-mode", "lzm"), LAZY_MODES, "flag"),
    Setting("reasoning_budget", ("reasoning-budget",), int, "flag", low=-1),
    Setting("chat_template", ("chat-template", "chat-template-file", "llama_arg_chat_template"),
            str),
    Setting("load_on_startup", ("load-on-startup",), "bool"),
    Setting("stop_timeout", ("stop-timeout",), float),
    Setting("keep_alive", ("keep-alive",), "duration"),
    Setting("override_kv", ("override-kv",), overrides.kv_overrides, "flag",
            write=lambda v: _csv("%s=%s:%s" % (k, t, str(x).lower() if t == "bool" else x)
                                 for k, t, x in v)),
    Setting("override_tensor", ("override-tensor", "ot"), overrides.tensor_overrides, "moe",
            write=lambda v: _csv("%s=%s" % tuple(o) for o in v)),
    Setting("cpu_moe", ("cpu-moe", "cmoe"), "bool", "moe"),
    Setting("n_cpu_moe", ("n-cpu-moe", "ncmoe"), int, "moe", low=0),
    Setting("template_kwargs", ("chat-template-kwargs",), overrides.template_kwargs,
            write=json.dumps),
    Setting("ctx_checkpoints", ("ctx-checkpoints", "ctxcp", "swa-checkpoints"), int, "flag",
            low=0),
    Setting("checkpoint_min_step", ("checkpoint-min-step", "cms"), int, "flag", low=0),
    Setting("rope_scaling", ("rope-scaling",), ("none", "linear", "yarn"), "rope"),
    Setting("rope_scale", ("rope-scale",), float, "rope"),
    Setting("rope_freq_base", ("rope-freq-base",), float, "rope"),
    Setting("rope_freq_scale", ("rope-freq-scale",), float, "rope"),
    Setting("yarn_orig_ctx", ("yarn-orig-ctx",), int, "rope"),
    Setting("yarn_ext_factor", ("yarn-ext-factor",), float, "rope"),
    Setting("yarn_attn_factor", ("yarn-attn-factor",), float, "rope"),
    Setting("yarn_beta_slow", ("yarn-beta-slow",), float, "rope"),
    Setting("yarn_beta_fast", ("yarn-beta-fast",), float, "rope"),
    # both file keys add to the model's one list of control vectors
    Setting("control_vector", ("control-vector",), overrides.control_vectors, "control",
            write=lambda v: _csv(p for p, _ in v)),
    Setting("control_vector_scaled", ("control-vector-scaled",),
            lambda v: overrides.control_vectors(v, "--control-vector-scaled"), "control",
            write=lambda v: _csv("%s:%s" % (p, s) for p, s in v)),
    Setting("control_vector_layer_range", ("control-vector-layer-range",),
            overrides.control_vector_layer_range, "control", write=lambda v: "%d %d" % tuple(v)),
    # the shelf's own, not shown among the settings (/models has them as fields)
    Setting("model", ("model", "m", "llama_arg_model"), str, shown=False),
    Setting("alias", ("alias", "a", "llama_arg_alias"), "list", shown=False),
    Setting("tags", ("tags", "llama_arg_tags"), "list", shown=False),
    Setting("pin", ("pin",), "bool", shown=False),
)

BY_NAME = {s.name: s for s in SETTINGS}
BY_KEY = {key: s for s in SETTINGS for key in s.keys}


def names(via):
    """The names of the settings a worker gets ``via`` one way (see the module's text)."""
    return tuple(s.name for s in SETTINGS if s.via == via)


SHOWN = tuple(s.name for s in SETTINGS if s.shown)


def ini_line(name, value):
    """A setting's line in a preset INI, as /models writes it back."""
    s = BY_NAME[name]
    if s.write is not None:
        value = s.write(value)
    elif isinstance(value, bool):
        value = "true" if value else "false"
    return "%s = %s" % (s.keys[0], value)
