"""A minimal GGUF v3 reader and writer, standard library only.

The test suite uses this to build tiny models (see tinymodels.py): it reads the
tokenizer metadata out of llama.cpp's vocab-only files and writes a complete
model file around it with random tensors.  Nothing in offgrid itself imports
this module; the runtime reads GGUF through libllama.

The format, as llama.cpp's ggml/src/gguf.cpp reads it (all little-endian):

    header      magic b"GGUF", version u32, n_tensors u64, n_kv u64
    metadata    n_kv times: key (string), value type u32, value
    tensor info n_tensors times: name (string), n_dims u32, ne u64 * n_dims,
                ggml type u32, offset u64 (relative to the data section)
    padding     zeros up to a multiple of the alignment
    data        each tensor's bytes, each padded to a multiple of the alignment

A string is a u64 byte length followed by UTF-8 bytes, no terminator.  An array
value is an item type u32, a count u64, then the items.  The alignment is the
`general.alignment` key (u32) when present, else 32.

Tensor shapes are in ggml order: shape[0] is the number of elements in one
contiguous row (ggml's ne[0]), the reverse of numpy's order.  llama.cpp names
shapes the same way, e.g. token_embd.weight is {n_embd, n_vocab}.
"""

import enum
import os
import struct
import sys
from array import array
from typing import Any, BinaryIO, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, Union

MAGIC = b"GGUF"
VERSION = 3
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"

PathLike = Union[str, "os.PathLike[str]"]


class ValueType(enum.IntEnum):
    """Metadata value types (gguf_type in ggml's gguf.h)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


class TensorType(enum.IntEnum):
    """The ggml tensor types this module can size.  Quantized types have block
    layouts we have no need to write, so they are left out on purpose."""

    F32 = 0
    F16 = 1


# struct format of each fixed-size value type; strings and arrays are handled apart.
_SCALAR_FORMATS = {
    ValueType.UINT8: "B",
    ValueType.INT8: "b",
    ValueType.UINT16: "H",
    ValueType.INT16: "h",
    ValueType.UINT32: "I",
    ValueType.INT32: "i",
    ValueType.FLOAT32: "f",
    ValueType.BOOL: "?",
    ValueType.UINT64: "Q",
    ValueType.INT64: "q",
    ValueType.FLOAT64: "d",
}

_ELEMENT_SIZES = {TensorType.F32: 4, TensorType.F16: 2}


class Value(NamedTuple):
    """A typed metadata value.  GGUF keys are typed and llama.cpp checks the
    type exactly (a context length written as u64 instead of u32 fails to
    load), so values carry their type rather than having it guessed."""

    type: ValueType
    value: Any  # int, float, bool, str, or a list of those for arrays
    item_type: Optional[ValueType] = None  # arrays only


class TensorInfo(NamedTuple):
    name: str
    shape: Tuple[int, ...]  # ggml order, shape[0] is the contiguous dimension
    type: int  # ggml type id; TensorType for the types this module writes
    offset: int  # from the start of the data section

    @property
    def n_elements(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data; only known for F32 and F16."""
        return self.n_elements * _ELEMENT_SIZES[TensorType(self.type)]


def pad(n: int, alignment: int) -> int:
    """Round n up to a multiple of alignment."""
    return (n + alignment - 1) // alignment * alignment


# --------------------------------------------------------------------------
# Convenience constructors for typed values
# --------------------------------------------------------------------------

def string(s: str) -> Value:
    return Value(ValueType.STRING, s)


def uint32(n: int) -> Value:
    return Value(ValueType.UINT32, n)


def int32(n: int) -> Value:
    return Value(ValueType.INT32, n)


def float32(x: float) -> Value:
    return Value(ValueType.FLOAT32, x)


def boolean(b: bool) -> Value:
    return Value(ValueType.BOOL, b)


def array_of(item_type: ValueType, items: Sequence[Any]) -> Value:
    return Value(ValueType.ARRAY, list(items), item_type)


# --------------------------------------------------------------------------
# Tensor data encoding
# --------------------------------------------------------------------------

def f32_bytes(values: Iterable[float]) -> bytes:
    """Little-endian float32 bytes for a flat sequence of numbers."""
    data = array("f", values)
    if sys.byteorder != "little":
        data.byteswap()
    return data.tobytes()


def f16_bytes(values: Sequence[float]) -> bytes:
    """Little-endian IEEE half-precision bytes; values must fit in float16."""
    return struct.pack("<%de" % len(values), *values)


# --------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------

class GGUFFile(NamedTuple):
    """What read() found: the metadata in file order and the tensor table."""

    path: str
    version: int
    metadata: Dict[str, Value]
    tensors: List[TensorInfo]
    alignment: int
    data_offset: int  # absolute file position of the data section

    def tensor(self, name: str) -> TensorInfo:
        for info in self.tensors:
            if info.name == name:
                return info
        raise KeyError(name)

    def tensor_bytes(self, info: TensorInfo) -> bytes:
        """The raw data of one F32 or F16 tensor, read from the file."""
        with open(self.path, "rb") as f:
            f.seek(self.data_offset + info.offset)
            return _read_exact(f, info.nbytes)


def _read_exact(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError("truncated GGUF file: wanted %d bytes, got %d" % (n, len(data)))
    return data


def _read_scalar(f: BinaryIO, fmt: str) -> Any:
    fmt = "<" + fmt
    return struct.unpack(fmt, _read_exact(f, struct.calcsize(fmt)))[0]


def _read_string(f: BinaryIO) -> str:
    n = _read_scalar(f, "Q")
    # surrogateescape: some vocabularies hold byte sequences that are not
    # valid UTF-8 on their own; they must survive a read/write round trip.
    return _read_exact(f, n).decode("utf-8", "surrogateescape")


def _read_value(f: BinaryIO, vtype: ValueType) -> Any:
    if vtype == ValueType.STRING:
        return _read_string(f)
    fmt = _SCALAR_FORMATS.get(vtype)
    if fmt is None:
        raise ValueError("unsupported GGUF value type %d" % vtype)
    return _read_scalar(f, fmt)


def _read_array(f: BinaryIO) -> Value:
    item_type = ValueType(_read_scalar(f, "I"))
    n = _read_scalar(f, "Q")
    if item_type == ValueType.STRING:
        items = [_read_string(f) for _ in range(n)]
    elif item_type == ValueType.ARRAY:
        # Nested arrays are legal in the spec but ggml refuses them; so do we.
        raise ValueError("nested GGUF arrays are not supported")
    else:
        # Fixed-size items: one bulk unpack instead of n small reads.
        fmt = "<%d%s" % (n, _SCALAR_FORMATS[item_type])
        items = list(struct.unpack(fmt, _read_exact(f, struct.calcsize(fmt))))
    return Value(ValueType.ARRAY, items, item_type)


def read(path: PathLike) -> GGUFFile:
    """Read the header, metadata and tensor table of a GGUF file (not the
    tensor data; see GGUFFile.tensor_bytes)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        if _read_exact(f, 4) != MAGIC:
            raise ValueError("%s: not a GGUF file" % path)
        version = _read_scalar(f, "I")
        if version != VERSION:
            raise ValueError("%s: GGUF version %d, only %d is supported" % (path, version, VERSION))
        n_tensors = _read_scalar(f, "Q")
        n_kv = _read_scalar(f, "Q")

        metadata: Dict[str, Value] = {}
        for _ in range(n_kv):
            key = _read_string(f)
            vtype = ValueType(_read_scalar(f, "I"))
            if vtype == ValueType.ARRAY:
                metadata[key] = _read_array(f)
            else:
                metadata[key] = Value(vtype, _read_value(f, vtype))

        tensors = []
        for _ in range(n_tensors):
            name = _read_string(f)
            n_dims = _read_scalar(f, "I")
            shape = struct.unpack("<%dQ" % n_dims, _read_exact(f, 8 * n_dims))
            ggml_type = _read_scalar(f, "I")
            offset = _read_scalar(f, "Q")
            tensors.append(TensorInfo(name, tuple(shape), ggml_type, offset))

        alignment = DEFAULT_ALIGNMENT
        if ALIGNMENT_KEY in metadata:
            alignment = metadata[ALIGNMENT_KEY].value
        data_offset = pad(f.tell(), alignment)

    return GGUFFile(path, version, metadata, tensors, alignment, data_offset)


# --------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------

def _pack_string(s: str) -> bytes:
    data = s.encode("utf-8", "surrogateescape")
    return struct.pack("<Q", len(data)) + data


def _pack_value(vtype: ValueType, value: Any) -> bytes:
    if vtype == ValueType.STRING:
        return _pack_string(value)
    return struct.pack("<" + _SCALAR_FORMATS[vtype], value)


def _pack_kv(key: str, value: Value) -> bytes:
    out = [_pack_string(key), struct.pack("<I", value.type)]
    if value.type == ValueType.ARRAY:
        items = value.value
        if value.item_type is None or value.item_type == ValueType.ARRAY:
            raise ValueError("%s: an array needs a scalar or string item_type" % key)
        out.append(struct.pack("<IQ", value.item_type, len(items)))
        if value.item_type == ValueType.STRING:
            out.extend(_pack_string(s) for s in items)
        else:
            out.append(struct.pack("<%d%s" % (len(items), _SCALAR_FORMATS[value.item_type]), *items))
    else:
        out.append(_pack_value(value.type, value.value))
    return b"".join(out)


class Writer:
    """Collects metadata and tensors, then writes one GGUF file.

    Metadata keeps insertion order; adding a key again replaces its value in
    place (ggml rejects files with duplicate keys).  Tensors are written in the
    order added, each at the next aligned offset, which is the only layout
    ggml accepts.
    """

    def __init__(self) -> None:
        self.metadata: Dict[str, Value] = {}
        self._tensors: List[Tuple[str, Tuple[int, ...], TensorType, bytes]] = []

    def add(self, key: str, value: Value) -> None:
        if not isinstance(value, Value):
            raise TypeError("%s: metadata values must be gguf.Value, got %r" % (key, value))
        self.metadata[key] = value

    def add_tensor(self, name: str, shape: Sequence[int], ttype: TensorType, data: bytes) -> None:
        """Add a tensor; shape is in ggml order and data already encoded (see
        f32_bytes / f16_bytes)."""
        if any(t[0] == name for t in self._tensors):
            raise ValueError("duplicate tensor name %r" % name)
        ttype = TensorType(ttype)
        expected = TensorInfo(name, tuple(shape), ttype, 0).nbytes
        if len(data) != expected:
            raise ValueError("%s: shape %s as %s needs %d bytes, got %d"
                             % (name, tuple(shape), ttype.name, expected, len(data)))
        self._tensors.append((name, tuple(shape), ttype, bytes(data)))

    @property
    def alignment(self) -> int:
        value = self.metadata.get(ALIGNMENT_KEY)
        if value is None:
            return DEFAULT_ALIGNMENT
        if value.type != ValueType.UINT32 or value.value <= 0 or value.value & (value.value - 1):
            raise ValueError("%s must be a u32 power of two" % ALIGNMENT_KEY)
        return value.value

    def write(self, path: PathLike) -> None:
        alignment = self.alignment
        with open(os.fspath(path), "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<IQQ", VERSION, len(self._tensors), len(self.metadata)))
            for key, value in self.metadata.items():
                f.write(_pack_kv(key, value))

            offset = 0
            for name, shape, ttype, data in self._tensors:
                f.write(_pack_string(name))
                f.write(struct.pack("<I%dQ" % len(shape), len(shape), *shape))
                f.write(struct.pack("<IQ", ttype, offset))
                offset += pad(len(data), alignment)

            # The data section starts aligned relative to the start of the
            # file; ggml only looks for it when there are tensors, and
            # vocab-only files end right after their metadata.
            if self._tensors:
                f.write(b"\0" * (pad(f.tell(), alignment) - f.tell()))
            for _, _, _, data in self._tensors:
                f.write(data)
                f.write(b"\0" * (pad(len(data), alignment) - len(data)))


# --------------------------------------------------------------------------
# LoRA adapters, and a model with an adapter merged in
# --------------------------------------------------------------------------

def f32_values(data: bytes) -> List[float]:
    """The float32s of little-endian bytes (f32_bytes' inverse)."""
    return list(struct.unpack("<%df" % (len(data) // 4), data))


def adapter_writer(arch: str, alpha: Optional[float] = None) -> Writer:
    """A Writer with the keys libllama's llama_adapter_lora_init asks of an
    adapter (src/llama-adapter.cpp): general.type "adapter", the base model's
    general.architecture, adapter.type "lora" and, if given, its alpha.  Add
    each adapted weight W as a pair (add_lora_pair)."""
    w = Writer()
    w.add("general.type", string("adapter"))
    w.add("general.architecture", string(arch))
    w.add("adapter.type", string("lora"))
    if alpha is not None:
        w.add("adapter.lora.alpha", float32(alpha))
    return w


def add_lora_pair(w: Writer, name: str, a: Sequence[float], b: Sequence[float],
                  n_in: int, n_out: int, rank: int) -> None:
    """The pair of weight ``name`` (ggml shape (n_in, n_out)): ``a`` is rank rows
    of n_in (ggml shape (n_in, rank)), ``b`` n_out rows of rank (ggml shape
    (rank, n_out)), so that libllama adds scale * B (A x) to W x."""
    w.add_tensor(name + ".lora_a", (n_in, rank), TensorType.F32, f32_bytes(a))
    w.add_tensor(name + ".lora_b", (rank, n_out), TensorType.F32, f32_bytes(b))


def merged_weight(weight: Sequence[float], a: Sequence[float], b: Sequence[float],
                  n_in: int, n_out: int, rank: int, scale: float) -> List[float]:
    """W + scale * B A, row by row in ggml's layout (row o of W holds the n_in
    weights of output o): what the model with the adapter computes."""
    out = list(weight)
    for o in range(n_out):
        row = b[o * rank:(o + 1) * rank]
        for i in range(n_in):
            out[o * n_in + i] += scale * sum(row[k] * a[k * n_in + i] for k in range(rank))
    return out


def with_metadata(src: PathLike, dst: PathLike, metadata: Dict[str, Value]) -> PathLike:
    """Write a copy of the F32/F16 GGUF file ``src`` to ``dst`` with ``metadata`` added
    to (or in place of) its own; returns ``dst``."""
    f = read(src)
    w = Writer()
    for key, value in {**f.metadata, **metadata}.items():
        w.add(key, value)
    for info in f.tensors:
        w.add_tensor(info.name, info.shape, TensorType(info.type), f.tensor_bytes(info))
    w.write(dst)
    return dst


def rewrite(src: PathLike, dst: PathLike, tensors: Dict[str, bytes]) -> None:
    """Write a copy of the F32/F16 GGUF file ``src`` to ``dst`` with the data of
    the tensors named in ``tensors`` replaced (same shape and type)."""
    f = read(src)
    w = Writer()
    for key, value in f.metadata.items():
        w.add(key, value)
    for info in f.tensors:
        data = tensors.get(info.name)
        w.add_tensor(info.name, info.shape, TensorType(info.type),
                     data if data is not None else f.tensor_bytes(info))
    w.write(dst)
