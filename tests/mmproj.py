"""An mmproj made by the tests: plain colours become chosen tokens' embeddings, exactly.

No registry ships a vision model or an mmproj, so the tests write one with
hand-set weights, for llama.cpp's ``gemma3`` projector (tools/mtmd/models/
siglip.cpp, read for this): a patch embedding (a convolution with patch
size P), the vision transformer's layers (none here: block_count 0), an
average pool of n_merge x n_merge patches, an RMS norm times
``mm.soft_emb_norm.weight``, and a projection ``mm.input_projection.weight``
into the text model's embeddings.

The vision width is 4.  A pixel, normalised by mean 0.5 and std 0.5, is
x in [-1, 1] per channel; the convolution gives

    v = (r', g', b', 1 - r' - g' - b')      where c' = (x_c + 1) / 2

for a patch of one colour (weights 0.5 / P^2 per pixel, bias 0.5; the
fourth channel's weights -0.5 / P^2, bias -0.5; every product and sum exact
in float32).  Pure red, green, blue and black give the one-hot vectors
e0..e3; their RMS is 1/2 (eps 0), the norm's weight 0.5 undoes the 2, and
the projection's row k is the embedding of ``tokens[k]``: the image becomes
that token's embedding, bit for bit, and a prompt with it gives the greedy
text of the same prompt with that token.  Other images (a photo) give some
mix of the four rows: real tokens' worth of numbers, never all zero.

Each image becomes ``(image_size / P / n_merge)^2`` tokens; libmtmd resizes
any image to image_size x image_size first.  The gemma3 projector wraps an
image in ``<start_of_image>`` ... ``<end_of_image>`` text and decodes its
tokens with non-causal attention, as gemma-3 does.
"""

import hashlib
import json
import os
import struct
from pathlib import Path

try:
    from . import gguf
except ImportError:  # tests/ on sys.path
    import gguf

FORMAT_VERSION = 1
COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "black": (0, 0, 0)}
ORDER = ("red", "green", "blue", "black")
PATCH = 2
N_MERGE = 2
WIDTH = 4


def token_embeddings(model_path, token_ids):
    """The rows of ``token_embd.weight`` (F16 or F32) of a GGUF for ``token_ids``, as floats."""
    f = gguf.read(model_path)
    info = f.tensor("token_embd.weight")
    n_embd = info.shape[0]
    size = {gguf.TensorType.F32: 4, gguf.TensorType.F16: 2}[gguf.TensorType(info.type)]
    fmt = "<%d%s" % (n_embd, "f" if size == 4 else "e")
    rows = []
    with open(f.path, "rb") as fh:
        for t in token_ids:
            fh.seek(f.data_offset + info.offset + t * n_embd * size)
            rows.append(list(struct.unpack(fmt, fh.read(n_embd * size))))
    return n_embd, rows


def write(directory, model_path, tokens, tokens_per_side=1):
    """An mmproj for the text model at ``model_path`` in which red, green, blue and
    black images become ``tokens`` (four ids, in that order); cached by recipe."""
    assert len(tokens) == 4
    model_path = Path(model_path)
    recipe = {"format": FORMAT_VERSION, "tokens": list(tokens), "side": tokens_per_side,
              "model": hashlib.sha256(model_path.read_bytes()).hexdigest()}
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(directory) / ("mmproj-%s.gguf" % key)
    if path.exists():
        return path
    n_embd, rows = token_embeddings(model_path, tokens)
    image_size = PATCH * N_MERGE * tokens_per_side

    w = gguf.Writer()
    w.add("general.architecture", gguf.string("clip"))
    w.add("general.name", gguf.string("offgrid-test-mmproj"))
    w.add("clip.projector_type", gguf.string("gemma3"))
    w.add("clip.has_vision_encoder", gguf.boolean(True))
    w.add("clip.vision.embedding_length", gguf.uint32(WIDTH))
    w.add("clip.vision.attention.head_count", gguf.uint32(1))
    w.add("clip.vision.feed_forward_length", gguf.uint32(WIDTH))
    w.add("clip.vision.block_count", gguf.uint32(0))
    w.add("clip.vision.projection_dim", gguf.uint32(n_embd))
    w.add("clip.vision.attention.layer_norm_epsilon", gguf.float32(0.0))
    w.add("clip.vision.image_size", gguf.uint32(image_size))
    w.add("clip.vision.patch_size", gguf.uint32(PATCH))
    w.add("clip.vision.projector.scale_factor", gguf.uint32(N_MERGE))
    w.add("clip.vision.image_mean", gguf.array_of(gguf.ValueType.FLOAT32, [0.5] * 3))
    w.add("clip.vision.image_std", gguf.array_of(gguf.ValueType.FLOAT32, [0.5] * 3))

    F32 = gguf.TensorType.F32
    k = 0.5 / (PATCH * PATCH)
    kernel = []                          # ggml order [P, P, 3, WIDTH]: out, in, y, x
    for out in range(WIDTH):
        for c in range(3):
            weight = (k if c == out else 0.0) if out < 3 else -k
            kernel += [weight] * (PATCH * PATCH)
    w.add_tensor("v.patch_embd.weight", (PATCH, PATCH, 3, WIDTH), F32, gguf.f32_bytes(kernel))
    w.add_tensor("v.patch_embd.bias", (WIDTH,), F32, gguf.f32_bytes([0.5, 0.5, 0.5, -0.5]))
    w.add_tensor("mm.soft_emb_norm.weight", (WIDTH,), F32, gguf.f32_bytes([0.5] * WIDTH))
    # ne[0] = the text model's n_embd: row k is what e_k becomes
    w.add_tensor("mm.input_projection.weight", (n_embd, WIDTH), F32,
                 gguf.f32_bytes([x for row in rows for x in row]))

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("%s.tmp-%d" % (path.name, os.getpid()))
    try:
        w.write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def png(rgb, width=8, height=8):
    """A PNG of one colour, written with the standard library."""
    import zlib
    raw = b"".join(b"\x00" + bytes(rgb) * width for _ in range(height))

    def chunk(kind, data):
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def bmp(rgb, width=8, height=8):
    """A 24-bit BMP of one colour (rows bottom up, each padded to 4 bytes)."""
    row = bytes(rgb[::-1]) * width
    row += b"\0" * (-len(row) % 4)
    pixels = row * height
    return (b"BM" + struct.pack("<IHHI", 54 + len(pixels), 0, 0, 54)
            + struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, len(pixels), 2835, 2835,
                          0, 0) + pixels)


def write_audio(directory, model_path):
    """An mmproj with an audio encoder only (llama.cpp's ``qwen2a``: whisper's encoder,
    one layer 8 wide, then a projection into the text model's embeddings), seeded
    weights: not a chosen answer, but a real encoder libmtmd runs on a real clip
    (whisper's log-mel of 30 s chunks: 750 tokens each)."""
    import random
    model_path = Path(model_path)
    recipe = {"format": FORMAT_VERSION, "audio": "qwen2a",
              "model": hashlib.sha256(model_path.read_bytes()).hexdigest()}
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(directory) / ("mmproj-audio-%s.gguf" % key)
    if path.exists():
        return path
    n_embd = gguf.read(model_path).tensor("token_embd.weight").shape[0]
    rng = random.Random(7)
    width, n_mel, n_pos = 8, 8, 1500

    def rand(*shape):
        n = 1
        for d in shape:
            n *= d
        return gguf.f32_bytes([rng.uniform(-0.3, 0.3) for _ in range(n)])

    w = gguf.Writer()
    w.add("general.architecture", gguf.string("clip"))
    w.add("general.name", gguf.string("offgrid-test-mmproj-audio"))
    w.add("clip.projector_type", gguf.string("qwen2a"))
    w.add("clip.has_audio_encoder", gguf.boolean(True))
    w.add("clip.audio.embedding_length", gguf.uint32(width))
    w.add("clip.audio.attention.head_count", gguf.uint32(1))
    w.add("clip.audio.feed_forward_length", gguf.uint32(width))
    w.add("clip.audio.block_count", gguf.uint32(1))
    w.add("clip.audio.projection_dim", gguf.uint32(n_embd))
    w.add("clip.audio.attention.layer_norm_epsilon", gguf.float32(1e-5))
    w.add("clip.audio.num_mel_bins", gguf.uint32(n_mel))
    F32 = gguf.TensorType.F32
    w.add_tensor("a.conv1d.1.weight", (3, n_mel, width), F32, rand(3, n_mel, width))
    w.add_tensor("a.conv1d.1.bias", (1, width), F32, rand(width))
    w.add_tensor("a.conv1d.2.weight", (3, width, width), F32, rand(3, width, width))
    w.add_tensor("a.conv1d.2.bias", (1, width), F32, rand(width))
    w.add_tensor("a.position_embd.weight", (width, n_pos), F32, rand(width, n_pos))
    blk = "a.blk.0."
    for norm in ("ln1", "ln2"):
        w.add_tensor(blk + norm + ".weight", (width,), F32, gguf.f32_bytes([1.0] * width))
        w.add_tensor(blk + norm + ".bias", (width,), F32, gguf.f32_bytes([0.0] * width))
    for name, bias in (("attn_q", True), ("attn_k", False), ("attn_v", True),
                       ("attn_out", True), ("ffn_up", True), ("ffn_down", True)):
        w.add_tensor(blk + name + ".weight", (width, width), F32, rand(width, width))
        if bias:
            w.add_tensor(blk + name + ".bias", (width,), F32, rand(width))
    w.add_tensor("mm.a.fc.weight", (width, n_embd), F32, rand(width, n_embd))
    w.add_tensor("mm.a.fc.bias", (n_embd,), F32, rand(n_embd))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("%s.tmp-%d" % (path.name, os.getpid()))
    try:
        w.write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def wav(seconds=1.0, rate=16000):
    """A WAV of a 440 Hz tone, written with the standard library."""
    import io
    import math
    import wave
    buf = io.BytesIO()
    with wave.open(buf, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(rate)
        f.writeframes(b"".join(struct.pack("<h", int(8000 * math.sin(2 * math.pi * 440 * i / rate)))
                               for i in range(int(seconds * rate))))
    return buf.getvalue()


# -- Qwen2-VL: images placed by M-RoPE positions --------------------------------------
QWEN_PATCH = 2          # pixels of a patch's side; a token is 2 x 2 patches (merge 2)
QWEN_WIDTH = 8          # the vision transformer's width
QWEN_GAIN = 16.0        # GELU(16) == 16 in float32 (ggml's gelu passes x >= 10 through)


def write_qwen2vl(directory, model_path, tokens, projector="qwen2vl_merger", deepstack=True):
    """A ``qwen2vl_merger`` mmproj (llama.cpp's tools/mtmd/models/qwen2vl.cpp, read for
    this) for the text model at ``model_path``, in which every token of a plain red,
    green, blue or black image is the embedding of ``tokens`` (four ids, in that
    order), exactly; cached by recipe.

    A patch of P x P pixels (normalised by mean 0, std 1: x in [0, 1]) goes through
    two convolutions (Qwen's two frames; the second all zeros) into (r, g, b, 0, ...);
    one vision layer whose attention and FFN outputs are zero weights (the layer is
    then the identity, but libmtmd still feeds it the patches' M-RoPE positions,
    which a graph with no layer would not take); then the merger: 2 x 2 patches
    side by side, ``mm.0`` (16 r, 16 g, 16 b, 16 - 16 (r + g + b)), GELU (which
    keeps 16 and 0 as they are), ``mm.2`` whose column k is tokens[k]'s embedding
    over 16.  Every product and sum is exact in float32.

    Each image becomes (rows x columns) tokens of 2P x 2P pixels, its size aligned
    and bounded by libmtmd (at least 8 tokens unless --image-min-tokens says
    otherwise); libmtmd wraps it in ``<|vision_start|>`` ... ``<|vision_end|>``
    text and, for a text model with M-RoPE (Qwen2-VL), places its tokens by row and
    column: an image of r x c tokens takes max(r, c) positions.

    ``projector="qwen2.5vl_merger"``: Qwen2.5-VL's, the same with RMS norms (weights
    only) and two such layers, the first with window attention, the second full
    (n_wa_pattern 2: libmtmd aborts on a tower whose layers are all full, its
    window mask then in no graph).  ``projector="qwen3vl_merger"``: Qwen3-VL's,
    with a patch bias and learned position embeddings (zeros), a fused qkv, and a
    deepstack branch on its layer (zero weights) whose features go to the text
    model's first layer: each token's embedding is then 2 n_embd wide, the
    second half zeros (a text model of n_deepstack_layers 1); without ``deepstack``,
    n_embd wide (Qwen3.5's text models take no deepstack)."""
    assert projector in ("qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger")
    qwen25 = projector == "qwen2.5vl_merger"
    qwen3 = projector == "qwen3vl_merger"
    assert len(tokens) == 4
    model_path = Path(model_path)
    n_layer = 2 if qwen25 else 1
    recipe = {"format": FORMAT_VERSION, "projector": projector, "tokens": list(tokens),
              "layers": n_layer, "deepstack": bool(deepstack and qwen3),
              "model": hashlib.sha256(model_path.read_bytes()).hexdigest()}
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(directory) / ("mmproj-qwen2vl-%s.gguf" % key)
    if path.exists():
        return path
    n_embd, rows = token_embeddings(model_path, tokens)
    P, W, G = QWEN_PATCH, QWEN_WIDTH, QWEN_GAIN
    n_ff, hidden = 2 * W, 4

    w = gguf.Writer()
    w.add("general.architecture", gguf.string("clip"))
    w.add("general.name", gguf.string("offgrid-test-mmproj-qwen2vl"))
    w.add("clip.projector_type", gguf.string(projector))
    if qwen25:
        w.add("clip.vision.n_wa_pattern", gguf.uint32(2))
    w.add("clip.has_vision_encoder", gguf.boolean(True))
    w.add("clip.use_gelu", gguf.boolean(True))
    w.add("clip.vision.embedding_length", gguf.uint32(W))
    w.add("clip.vision.attention.head_count", gguf.uint32(1))
    w.add("clip.vision.feed_forward_length", gguf.uint32(n_ff))
    w.add("clip.vision.block_count", gguf.uint32(n_layer))
    w.add("clip.vision.projection_dim", gguf.uint32(n_embd))
    w.add("clip.vision.attention.layer_norm_epsilon", gguf.float32(1e-6))
    w.add("clip.vision.image_size", gguf.uint32(4 * P * 8))
    w.add("clip.vision.patch_size", gguf.uint32(P))
    w.add("clip.vision.image_mean", gguf.array_of(gguf.ValueType.FLOAT32, [0.0] * 3))
    w.add("clip.vision.image_std", gguf.array_of(gguf.ValueType.FLOAT32, [1.0] * 3))

    F32 = gguf.TensorType.F32

    def zeros(*shape):
        n = 1
        for d in shape:
            n *= d
        return gguf.f32_bytes([0.0] * n)

    kernel = []                          # ggml order [P, P, 3, W]: out, in, y, x
    for out in range(W):
        for c in range(3):
            kernel += [1.0 / (P * P) if c == out else 0.0] * (P * P)
    w.add_tensor("v.patch_embd.weight", (P, P, 3, W), F32, gguf.f32_bytes(kernel))
    w.add_tensor("v.patch_embd.weight.1", (P, P, 3, W), F32, zeros(P, P, 3, W))
    if qwen3:
        w.add_tensor("v.patch_embd.bias", (W,), F32, zeros(W))
        w.add_tensor("v.position_embd.weight", (W, 16), F32, zeros(W, 16))
    if qwen3 and deepstack:
        d = "v.deepstack.0."
        w.add_tensor(d + "norm.weight", (4 * W,), F32, gguf.f32_bytes([1.0] * (4 * W)))
        w.add_tensor(d + "norm.bias", (4 * W,), F32, zeros(4 * W))
        w.add_tensor(d + "fc1.weight", (4 * W, 4 * W), F32, zeros(4 * W, 4 * W))
        w.add_tensor(d + "fc1.bias", (4 * W,), F32, zeros(4 * W))
        w.add_tensor(d + "fc2.weight", (4 * W, n_embd), F32, zeros(4 * W, n_embd))
        w.add_tensor(d + "fc2.bias", (n_embd,), F32, zeros(n_embd))
    for il in range(n_layer):
        blk = "v.blk.%d." % il
        for norm in ("ln1", "ln2"):
            w.add_tensor(blk + norm + ".weight", (W,), F32, gguf.f32_bytes([1.0] * W))
            if not qwen25:
                w.add_tensor(blk + norm + ".bias", (W,), F32, zeros(W))
        if qwen3:
            w.add_tensor(blk + "attn_qkv.weight", (W, 3 * W), F32, zeros(W, 3 * W))
            w.add_tensor(blk + "attn_qkv.bias", (3 * W,), F32, zeros(3 * W))
        for name in ("attn_out",) if qwen3 else ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(blk + name + ".weight", (W, W), F32, zeros(W, W))
            w.add_tensor(blk + name + ".bias", (W,), F32, zeros(W))
        w.add_tensor(blk + "ffn_up.weight", (W, n_ff), F32, zeros(W, n_ff))
        w.add_tensor(blk + "ffn_up.bias", (n_ff,), F32, zeros(n_ff))
        w.add_tensor(blk + "ffn_down.weight", (n_ff, W), F32, zeros(n_ff, W))
        w.add_tensor(blk + "ffn_down.bias", (W,), F32, zeros(W))
    # the merger: ne[0] = 4 W (four patches' channels, the first patch's r, g, b first)
    mm0 = []
    for k in range(hidden):
        row = [0.0] * (4 * W)
        for c in range(3):
            row[c] = G if k == c else (-G if k == 3 else 0.0)
        mm0 += row
    w.add_tensor("mm.0.weight", (4 * W, hidden), F32, gguf.f32_bytes(mm0))
    w.add_tensor("mm.0.bias", (hidden,), F32, gguf.f32_bytes([0.0, 0.0, 0.0, G]))
    w.add_tensor("mm.2.weight", (hidden, n_embd), F32,
                 gguf.f32_bytes([rows[k][j] / G for j in range(n_embd) for k in range(hidden)]))
    w.add_tensor("mm.2.bias", (n_embd,), F32, zeros(n_embd))

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("%s.tmp-%d" % (path.name, os.getpid()))
    try:
        w.write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path
