"""The header of a GGUF file, read in Python with bounds: its metadata's scalar and
string values, and its tensors' types and shapes, never their data.  What is
checked before libllama sees a file (engine/adapters.py: a LoRA adapter's pairs;
engine/model.py: --override-kv's types) reads it here, and so do the arrays of a value
per layer libllama's metadata leaves out (engine/memory.py: the KV cache's size)."""

import struct

from ..errors import ModelLoadError

# bounds of a header we read: more is not an adapter or a model file
MAX_KV = 1 << 20
MAX_TENSORS = 1 << 20
MAX_STRING = 1 << 24
MAX_DIMS = 4
# arrays of numbers up to this long are read (a value per layer: Jamba's head counts);
# longer ones (the vocabulary's token types and scores) are skipped
MAX_LAYER_ARRAY = 4096

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
            10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Reader:
    def __init__(self, f, path):
        self.f, self.path = f, path

    def take(self, n):
        data = self.f.read(n)
        if len(data) != n:
            raise ModelLoadError("%s: the GGUF file ends inside its header" % self.path)
        return data

    def scalar(self, fmt):
        fmt = "<" + fmt
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self):
        n = self.scalar("Q")
        if n > MAX_STRING:
            raise ModelLoadError("%s: a string of %d bytes in the GGUF header" % (self.path, n))
        return self.take(n).decode("utf-8", "replace")

    def value(self, vtype, keep=True):
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item, n = self.scalar("I"), self.scalar("Q")
            if item == _STRING:
                for _ in range(n):
                    self.f.seek(self.scalar("Q"), 1)
            elif item in _SCALARS and n <= MAX_LAYER_ARRAY:
                size = struct.calcsize(_SCALARS[item])
                return list(struct.unpack("<%d%s" % (n, _SCALARS[item]), self.take(n * size)))
            elif item in _SCALARS:
                self.f.seek(n * struct.calcsize(_SCALARS[item]), 1)
            else:
                raise ModelLoadError("%s: a GGUF array of type %d" % (self.path, item))
            return None         # the vocabulary's arrays are not needed here
        if vtype not in _SCALARS:
            raise ModelLoadError("%s: a GGUF value of type %d" % (self.path, vtype))
        return self.scalar(_SCALARS[vtype])


def read_header(path):
    """(metadata, tensors) of a GGUF file: scalar and string values by key (arrays of
    numbers up to MAX_LAYER_ARRAY long as lists, other arrays as None), and name ->
    (ggml type, shape in ggml order).  ModelLoadError
    where it is not a GGUF file or its header is cut short or out of bounds."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ModelLoadError("cannot open %s: %s" % (path, e.strerror or e))
    with f:
        r = _Reader(f, path)
        if f.read(4) != b"GGUF":
            raise ModelLoadError("%s is not a GGUF file" % path)
        version = r.scalar("I")
        if version not in (2, 3):
            raise ModelLoadError("%s: GGUF version %d" % (path, version))
        n_tensors, n_kv = r.scalar("Q"), r.scalar("Q")
        if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
            raise ModelLoadError("%s: a GGUF header of %d tensors and %d keys"
                                 % (path, n_tensors, n_kv))
        meta = {}
        for _ in range(n_kv):
            key = r.string()
            meta[key] = r.value(r.scalar("I"))
        tensors = {}
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.scalar("I")
            if not 1 <= n_dims <= MAX_DIMS:
                raise ModelLoadError("%s: tensor %s has %d dimensions" % (path, name, n_dims))
            shape = struct.unpack("<%dQ" % n_dims, r.take(8 * n_dims))
            ttype = r.scalar("I")
            r.scalar("Q")       # its offset: libllama checks it against the file
            tensors[name] = (ttype, shape)
    return meta, tensors
