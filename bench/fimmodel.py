"""A copy of a GGUF model whose metadata names fill-in-the-middle tokens.

llama-server answers ``/infill`` only for a model with FIM prefix, suffix and
middle tokens, and so does offgrid; the default gemma-3-270m has none.  Its
vocabulary does have 99 ``<unusedN>`` tokens of type CONTROL (ids 6..104), so
a copy whose metadata says ``tokenizer.ggml.fim_pre_token_id = 6`` (and so on)
is a real-sized model both servers accept for ``/infill``.  Its completions
are not trained FIM output, but the work is real: the same prompt layout,
the same number of prompt and generated tokens, the same weights and speed.

The copy is written with tests/gguf.py: its reader parses the header,
metadata and tensor table; its packing functions write them back with three
keys added.  Tensor offsets are relative to the data section, so the data
section (every tensor, padding included) is copied byte for byte after the new
header, at the same alignment.  The result is cached in
``$OFFGRID_CACHE/bench`` under a name keyed by the source file's sha256 and
this recipe, so a second run finds it.
"""

import hashlib
import os
import shutil
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import gguf  # noqa: E402  (tests/gguf.py: standard library only)

# Bump when the recipe changes.
RECIPE_VERSION = 1

# Token ids given the FIM roles, by the model's tokens' text.  The text is
# checked before use, so a vocabulary where these ids mean something else
# fails loudly instead of silently producing a broken model.
FIM_TOKENS = {
    "tokenizer.ggml.fim_pre_token_id": "<unused0>",
    "tokenizer.ggml.fim_suf_token_id": "<unused1>",
    "tokenizer.ggml.fim_mid_token_id": "<unused2>",
}

TOKEN_TYPE_CONTROL = 3      # llama_token_type LLAMA_TOKEN_TYPE_CONTROL


def cache_dir():
    base = os.environ.get("OFFGRID_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                             "offgrid")
    return Path(base) / "bench"


def sha256_of(path, chunk=1 << 20):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                return h.hexdigest()
            h.update(block)


def fim_copy(source, directory=None):
    """Path of the FIM-token copy of ``source``, building it if it is not cached."""
    source = Path(source)
    directory = Path(directory) if directory else cache_dir()
    key = hashlib.sha256(("%s|%d|%s" % (sha256_of(source), RECIPE_VERSION,
                                         sorted(FIM_TOKENS.items()))).encode()).hexdigest()[:12]
    out = directory / ("%s-fim-%s.gguf" % (source.stem, key))
    if out.is_file():
        return out
    directory.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".%d.tmp" % os.getpid())
    try:
        write_fim_copy(source, tmp)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return out


def fim_token_ids(meta):
    """{metadata key: token id} for FIM_TOKENS, checked against the vocabulary."""
    tokens = meta["tokenizer.ggml.tokens"].value
    types = meta["tokenizer.ggml.token_type"].value
    ids = {}
    for key, text in FIM_TOKENS.items():
        if text not in tokens:
            raise ValueError("the vocabulary has no %r token to use as %s" % (text, key))
        tid = tokens.index(text)
        if types[tid] != TOKEN_TYPE_CONTROL:
            raise ValueError("%r (id %d) is not a control token (type %d)"
                             % (text, tid, types[tid]))
        ids[key] = tid
    return ids


def write_fim_copy(source, dest):
    src = gguf.read(source)
    meta = dict(src.metadata)
    for key in FIM_TOKENS:
        if key in meta:
            raise ValueError("%s already names FIM tokens (%s)" % (source, key))
    for key, tid in fim_token_ids(meta).items():
        meta[key] = gguf.uint32(tid)

    alignment = src.alignment
    with open(dest, "wb") as f:
        f.write(gguf.MAGIC)
        f.write(struct.pack("<IQQ", gguf.VERSION, len(src.tensors), len(meta)))
        for key, value in meta.items():
            f.write(gguf._pack_kv(key, value))
        for t in src.tensors:
            f.write(gguf._pack_string(t.name))
            f.write(struct.pack("<I%dQ" % len(t.shape), len(t.shape), *t.shape))
            f.write(struct.pack("<IQ", t.type, t.offset))     # offsets unchanged
        f.write(b"\0" * (gguf.pad(f.tell(), alignment) - f.tell()))
        with open(source, "rb") as s:
            s.seek(src.data_offset)
            shutil.copyfileobj(s, f, 1 << 20)

    # The copy must describe the same tensors at the same places.
    dst = gguf.read(dest)
    if dst.tensors != src.tensors:
        raise ValueError("the copy's tensor table differs from the source's")
    size_src = os.path.getsize(source) - src.data_offset
    size_dst = os.path.getsize(dest) - dst.data_offset
    if size_src != size_dst:
        raise ValueError("the copy's data section is %d bytes, the source's %d"
                         % (size_dst, size_src))


if __name__ == "__main__":
    print(fim_copy(sys.argv[1]))
