"""LoRA adapters of a worker's model: checked, loaded, and applied per decode step.

llama-server's ``--lora FILE`` / ``--lora-scaled FILE:SCALE`` load adapters
beside the model; every request runs with a scale for each (the global ones,
which ``POST /lora-adapters`` sets, or the request's own ``lora`` list, in
which an adapter left out has scale 0).  Here the front keeps the global
scales and sends every generation its resolved list (request.GenerationParams
.lora); this module turns such a list into an **adapter key**, the sorted
``(id, scale)`` pairs of non-zero scale, which is what everything downstream
compares:

- a decode step holds only parts of one key (engine/batch.py): the context
  has one adapter set at a time (``llama_set_adapters_lora``);
- a session's cache, the kept prompt states and slot files carry the key of
  the adapter set they were computed with, and serve only a request of the
  same key (llama-server reuses a cache made at the old scale after a global
  change, so setting a scale to 0 does not give the base text back).

A scale of 0 is left out of the key and of the set given to libllama, so
scale 0 is the base model exactly (not base plus 0 times a product).

Checked first: libllama catches most of what is wrong with an adapter file
(it returns NULL and logs why), but a token_embd pair whose ranks differ,
a pair of more than two dimensions or of a type matrix products do not take
passes its checks and aborts the process at the first decode (ggml asserts).
So the file's header is read here (``read_header``: bounded, no tensor data)
and every pair is held against the model's tensor of that name before
libllama sees the file, and the error says which adapter and why.
"""

import math
import os

from ..errors import ModelLoadError
from .ggufheader import read_header

# ggml types a pair may have: those convert_lora_to_gguf.py writes, which the
# CPU's matrix product and get_rows take (F32, F16, Q8_0, BF16)
PAIR_TYPES = {0: "F32", 1: "F16", 8: "Q8_0", 30: "BF16"}
def key_of(scales):
    """The adapter key of a resolved list of ``[id, scale]`` pairs (or None: no
    adapters): the pairs of non-zero scale, by id."""
    if not scales:
        return ()
    return tuple(sorted((int(i), float(s)) for i, s in scales if s != 0))


# --------------------------------------------------------------------------
# The checks: what libllama would refuse, and what it would abort on
# --------------------------------------------------------------------------

def check(path, model_path, model_arch):
    """Raise ModelLoadError, saying why, unless the adapter file ``path`` fits
    the model file ``model_path`` of architecture ``model_arch``."""
    name = os.path.basename(path)

    def refuse(why):
        raise ModelLoadError("LoRA adapter %s cannot be used with this model: %s" % (name, why))

    meta, tensors = read_header(path)
    if meta.get("general.type") != "adapter":
        refuse("it is not an adapter (general.type is %r, not 'adapter')"
               % meta.get("general.type", ""))
    if meta.get("adapter.type") != "lora":
        refuse("adapter.type is %r, not 'lora'" % meta.get("adapter.type", ""))
    arch = meta.get("general.architecture", "")
    if arch != model_arch:
        refuse("it is for architecture %r, the model is %r (an adapter for another model)"
               % (arch, model_arch))
    alpha = meta.get("adapter.lora.alpha", 0.0)
    if not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        refuse("adapter.lora.alpha is not a number")
    pairs = {}
    for tname, (ttype, shape) in tensors.items():
        for suffix in (".lora_a", ".lora_b"):
            if tname.endswith(suffix):
                pairs.setdefault(tname[:-len(suffix)], {})[suffix[-1]] = (ttype, shape, tname)
                break
        else:
            if not tname.endswith("_norm.weight"):
                refuse("tensor %s is neither a lora_a nor a lora_b" % tname)
    if not pairs:
        refuse("it holds no lora_a/lora_b pair")
    model_meta, model_tensors = read_header(model_path)
    # a model split in several files (split.count): its other tensors are in the
    # others, where libllama finds (and checks) them
    split = (model_meta.get("split.count") or 1) > 1
    for base, ab in sorted(pairs.items()):
        if "a" not in ab or "b" not in ab:
            refuse("tensor %s has no %s" % (base, "lora_b" if "a" in ab else "lora_a"))
        for ttype, shape, tname in ab.values():
            if ttype not in PAIR_TYPES:
                refuse("tensor %s has ggml type %d; a pair must be one of %s"
                       % (tname, ttype, ", ".join(sorted(PAIR_TYPES.values()))))
            if len(shape) < 2 or any(d != 1 for d in shape[2:]):
                refuse("tensor %s has %d dimensions, a pair 2" % (tname, len(shape)))
        a, b = ab["a"][1][:2], ab["b"][1][:2]
        if a[0] == 0 or b[0] == 0 or a[1] == 0 or b[1] == 0:
            refuse("tensor %s has an empty pair" % base)
        embd = base.endswith("token_embd.weight")
        # the ranks must agree whatever the model: libllama checks them only for
        # the other weights (and a token_embd pair of unequal ranks aborts)
        if (a[0] != b[0]) if embd else (a[1] != b[0]):
            refuse("tensor %s: lora_a %s and lora_b %s are of different ranks"
                   % (base, list(a), list(b)))
        model = model_tensors.get(base)
        if model is None:
            if split:
                continue        # a split model's tensors are in its other files
            refuse("the model has no tensor %s" % base)
        w = model[1]
        if len(w) != 2:
            refuse("tensor %s of the model has %d dimensions; adapters here take "
                   "matrices" % (base, len(w)))
        if embd:
            # libllama: B not transposed, A and B swapped (llm_build_inp_embd)
            ok = w[0] == b[1] and w[1] == a[1]
        else:
            ok = w[0] == a[0] and w[1] == b[1]
        if not ok:
            refuse("tensor %s: lora_a %s and lora_b %s do not fit the model's %s"
                   % (base, list(a), list(b), list(w)))
    return meta


# --------------------------------------------------------------------------
# The adapters of one model
# --------------------------------------------------------------------------

class Adapter:
    """One loaded adapter: its file, its start-up scale, what its GGUF says."""

    def __init__(self, index, path, scale, handle, task_name="", prompt_prefix=""):
        self.index = index
        self.path = path
        self.scale = scale
        self.handle = handle
        self.task_name = task_name
        self.prompt_prefix = prompt_prefix


class Adapters:
    """The adapters of a worker's model (``--lora``), and which of them the
    context applies now.  Owns their handles (close() frees them, before the
    model goes)."""

    def __init__(self, adapters=()):
        self.adapters = list(adapters)

    def __len__(self):
        return len(self.adapters)

    @classmethod
    def load(cls, model, specs):
        """Check and load ``specs`` ((path, scale) pairs) for the Model ``model``;
        ModelLoadError naming the adapter and why where one does not fit."""
        from ..libllama import AdapterHandle
        out = cls()
        arch = model.meta.get("general.architecture", "")
        try:
            for i, (path, scale) in enumerate(specs):
                check(path, model.path, arch)
                h = AdapterHandle(model.lib, model.handle.ptr, path)
                if not h.ptr:
                    raise ModelLoadError("libllama could not load LoRA adapter %s (its log "
                                         "says why)" % path)
                out.adapters.append(Adapter(i, path, float(scale), h,
                                            h.meta("adapter.lora.task_name") or "",
                                            h.meta("adapter.lora.prompt_prefix") or ""))
        except BaseException:
            out.close()
            raise
        return out

    def key(self, scales):
        """The adapter key of a request's resolved scales, ids this model lacks
        left out (as llama-server ignores them)."""
        return tuple((i, s) for i, s in key_of(scales) if 0 <= i < len(self.adapters))

    def apply(self, ctx, key):
        """Make ``ctx`` (a ContextHandle: the sessions' shared one, under the
        decoder's lock before a step, or the Embedder's) decode with the adapter
        set ``key``; the context remembers which set it has (``adapter_key``)."""
        if key == getattr(ctx, "adapter_key", ()):
            return
        ctx.set_adapters([self.adapters[i].handle.ptr for i, _ in key], [s for _, s in key])
        ctx.adapter_key = key

    def info(self):
        """What the worker reports of them (GET /lora-adapters' fields)."""
        return [{"id": a.index, "path": a.path, "scale": a.scale, "task_name": a.task_name,
                 "prompt_prefix": a.prompt_prefix} for a in self.adapters]

    def close(self):
        for a in self.adapters:
            a.handle.close()
