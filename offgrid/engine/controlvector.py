"""Control vectors of a worker's model: read, checked, summed, and applied to its contexts.

llama-server's ``--control-vector FNAME`` (scale 1), ``--control-vector-scaled
FNAME:SCALE`` and ``--control-vector-layer-range START END`` (common/common.cpp:
common_control_vector_load, applied by common_init_from_params):

- a file is a GGUF of F32 vectors named ``direction.<layer>``, each n_embd
  long (one dimension); layer 0 is never one (llama.cpp adds a vector to a
  layer's output, after its residual add: llm_graph_context::build_cvec, and
  keeps none for layer 0);
- several files (and several directions of one layer) are summed, each times
  its scale, into one buffer of n_embd floats per layer from layer 1 on, which
  ``llama_set_adapter_cvec`` copies into the context;
- the range defaults to layer 1 (a START of 0 or less) up to the model's layer
  count (an END of 0 or less); layers outside it get no vector.

llama.cpp logs a bad file and serves on without the vector (or, for an n_embd
not the model's, without it either); here every file is read and checked in
Python before libllama sees any of it, and anything wrong fails the load with
an error naming the flag and the file: a server asked for a vector does not
quietly serve without one.

Every context the worker makes for the model gets the vector: the sessions'
shared one (engine/session.shared_decoder) and the embedding context
(engine/embed.py), as llama-server's one context serves both.  A draft model's
context (-md) gets none, as llama-server's (common_speculative_init_result
makes it with llama_init_from_model, not common_init_from_params).  The
vector's ``identity`` joins the identity of the states kept on disk
(engine/loaded.make_states) and is written beside a slot file
(engine/slotfile.py), so a state computed under one vector never serves a
worker with another, or none.
"""

import array
import hashlib
import json
import logging
import os
import re
import struct

from ..errors import ModelLoadError
from .ggufheader import GGML_F32, read_f32, read_header

_DIRECTION = re.compile(r"direction\.(\d+)$")


def _f32(x):
    """``x`` rounded to a float32, as llama.cpp's float arithmetic keeps it."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _n_dims(shape):
    """ggml_n_dims: the dimensions up to the last one of more than one element."""
    n = 1
    for i, d in enumerate(shape):
        if d > 1:
            n = i + 1
    return n


def read_file(path, scale, arch):
    """(n_embd, {layer: array('f') of direction x scale}) of one control vector
    file; ModelLoadError naming the file where it cannot be one, or is for a
    model of another architecture (its ``controlvector.model_hint``, which
    llama.cpp's cvector-generator writes, where it has one)."""
    def refuse(why):
        raise ModelLoadError("--control-vector %s: %s" % (path, why))

    if not os.path.isfile(path):
        refuse("no such file")
    try:
        meta, tensors = read_header(path)
    except ModelLoadError as e:
        raise ModelLoadError("--control-vector: %s" % e)      # it names the file
    hint = meta.get("controlvector.model_hint")
    if isinstance(hint, str) and hint and arch and hint != arch:
        refuse("it is a control vector for a model of architecture %r, the model is %r"
               % (hint, arch))
    if not tensors:
        refuse("it holds no direction tensors")
    layers = {}
    n_embd = None
    for name, (ttype, shape) in sorted(tensors.items()):
        m = _DIRECTION.match(name)
        if m is None:
            refuse("tensor %s is not a direction.<layer>" % name)
        layer = int(m.group(1))
        if layer == 0:
            refuse("tensor %s: layer 0 takes no control vector" % name)
        if ttype != GGML_F32:
            refuse("tensor %s has ggml type %d, not F32 (%d)" % (name, ttype, GGML_F32))
        if _n_dims(shape) != 1:
            refuse("tensor %s has shape %s, not one dimension" % (name, list(shape)))
        if n_embd is None:
            n_embd = shape[0]
        elif shape[0] != n_embd:
            refuse("tensor %s has %d values, the file's others %d" % (name, shape[0], n_embd))
        layers[layer] = name
    try:
        data = read_f32(path, layers.values())
    except ModelLoadError as e:
        raise ModelLoadError("--control-vector: %s" % e)
    scale = _f32(scale)
    return n_embd, {layer: array.array("f", (_f32(v * scale) for v in data[name]))
                    for layer, name in layers.items()}


class ControlVector:
    """The summed vector of a worker's control vector files, and its layer range."""

    def __init__(self, n_embd, data, il_start, il_end, files, n_layer):
        self.n_embd, self.n_layer = n_embd, n_layer
        self.data = data            # array('f'): n_embd floats a layer, from layer 1 on
        self.il_start, self.il_end = il_start, il_end
        self.files = files          # [(path, scale)] as given
        # what a state computed under it depends on: the numbers added, and where
        h = hashlib.sha256(json.dumps([n_embd, il_start, il_end]).encode())
        h.update(data.tobytes())
        self.identity = h.hexdigest()

    @classmethod
    def load(cls, model, specs, layer_range=None):
        """The ControlVector of ``specs`` ([path, scale] pairs) for the Model ``model``,
        or None where there are none; ``layer_range``: [START, END] as the flag gives
        them (None: every layer).  ModelLoadError naming the flag and the file where
        one cannot be used with this model."""
        if not specs:
            return None
        arch = model.meta.get("general.architecture", "")
        n_layer = model.handle.n_layer()
        start, end = layer_range or (-1, -1)
        start = start if start > 0 else 1
        end = end if end > 0 else n_layer
        summed, used = {}, 0
        for path, scale in specs:
            n_embd, layers = read_file(path, scale, arch)
            if n_embd != model.n_embd:
                raise ModelLoadError(
                    "--control-vector %s: its vectors have %d values, the model's layers %d "
                    "(a control vector for another model)" % (path, n_embd, model.n_embd))
            for layer, values in layers.items():
                if layer in summed:
                    summed[layer] = array.array("f", map(sum, zip(summed[layer], values)))
                else:
                    summed[layer] = values
            used = max(used, max(layers))
        if used >= n_layer:
            # llama.cpp leaves them unused: the model has no such layer
            logging.getLogger("offgrid.worker").warning(
                "--control-vector: directions for layers up to %d, the model's last is %d: "
                "those past it are unused", used, n_layer - 1)
        data = array.array("f", bytes(4 * model.n_embd * min(used, n_layer - 1)))
        for layer, values in summed.items():
            if layer < n_layer:
                data[(layer - 1) * model.n_embd:layer * model.n_embd] = values
        return cls(model.n_embd, data, start, end, [(p, float(s)) for p, s in specs], n_layer)

    def apply(self, ctx):
        """Make ``ctx`` (a ContextHandle of the model) add the vector in its decodes."""
        ctx.set_control_vector(self.data, self.n_embd, self.il_start, self.il_end)

    def describe(self):
        """The load line's words for it: its files and the layers it reaches (the
        default END, the layer count, is one past the last layer)."""
        return "control vector %s, layers %d-%d" % (
            " + ".join("%s x %g" % (os.path.basename(p), s) for p, s in self.files),
            self.il_start, min(self.il_end, self.n_layer - 1))
