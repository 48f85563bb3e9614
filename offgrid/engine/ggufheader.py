"""The header of a GGUF file, read in Python with bounds: its metadata's scalar and
string values, and its tensors' types and shapes, not their data.  What is
checked before libllama sees a file (engine/adapters.py: a LoRA adapter's pairs;
engine/model.py: --override-kv's types) reads it here, and so do the arrays of a value
per layer libllama's metadata leaves out (engine/memory.py: the KV cache's size).  The
one file whose data is read here is a control vector's (``read_f32``:
engine/controlvector.py), a few small F32 vectors that offgrid hands libllama itself."""

import array
import os
import struct
import sys

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
    meta, tensors, _ = _read(path)
    return meta, {name: (ttype, shape) for name, (ttype, shape, _) in tensors.items()}


GGML_F32 = 0
DEFAULT_ALIGNMENT = 32      # GGUF_DEFAULT_ALIGNMENT, where general.alignment is absent


def read_f32(path, names):
    """{name: array('f') of its values} of the F32 tensors ``names`` of a GGUF file
    (every element, in ggml order); ModelLoadError where one is not F32 or its data
    lies outside the file."""
    meta, tensors, header_end = _read(path)
    align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ModelLoadError("%s: general.alignment %r is not a power of two" % (path, align))
    start = -(-header_end // align) * align         # the data section, aligned
    size = os.path.getsize(path)
    out = {}
    with open(path, "rb") as f:
        for name in names:
            ttype, shape, offset = tensors[name]
            if ttype != GGML_F32:
                raise ModelLoadError("%s: tensor %s is not F32" % (path, name))
            n = 1
            for d in shape:
                n *= d
            begin = start + offset
            if offset % align or begin + 4 * n > size:
                raise ModelLoadError("%s: tensor %s's data lies outside the file"
                                     % (path, name))
            f.seek(begin)
            values = array.array("f")
            values.frombytes(f.read(4 * n))
            if sys.byteorder != "little":
                values.byteswap()
            out[name] = values
    return out


def _read(path):
    """(metadata, name -> (type, shape, offset), where the header ends) of a GGUF file."""
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
            # its offset in the data section: libllama checks it against the file
            # (read_f32 does, for the data it reads)
            tensors[name] = (ttype, shape, r.scalar("Q"))
        header_end = f.tell()
    return meta, tensors, header_end
