"""Images and audio in a prompt: the worker's side of --mmproj.

A prompt with media is a token list like any other, in which each media
chunk (an image, or a slice of one, or an audio clip, as libmtmd splits it)
stands as ``n_tokens`` copies of one negative id, its *media id*: derived
from the SHA-256 of the file's bytes and the chunk's place among that
file's chunks.  Everything that compares prompts (the session's prefix, the
front's choice of session, kept states, slot and state files) compares
these ids as tokens, so a second turn about the same image reuses its
cache, and a different image at the same place does not.  Media ids fit in
int32 (state files store tokens so) and never reach libllama as tokens:
the session decodes a run of one as its chunk's embeddings (``decode``),
a step of its own in the BatchDecoder.  Where the projector places an
image by M-RoPE positions (Qwen2-VL and its kin), its tokens take fewer
positions than tokens: ``positions`` gives the session the map
(engine/positions.py).

MediaStore (one per worker, owner of the MtmdContext) turns a prompt's text
and files into those tokens (``tokenize``), keeps the chunks of the last
prompts (their media ids' meaning) and the embeddings of the last encoded
chunks, both bounded, and checks a token list that comes back from the
front (``layout``).

Caps: MAX_MEDIA files a request, MAX_MEDIA_BYTES each (the front checks
these first, server/api/media.py), MAX_IMAGE_PIXELS an image (read from its
header before it is decoded); an image is scaled by libmtmd to its
projector's size, so its tokens are bounded by the mmproj (and
--image-max-tokens).
"""

import hashlib
import os
import struct
import threading
from collections import OrderedDict

from ..errors import InvalidRequest, InvalidToken
from ..request import MAX_MEDIA, MAX_MEDIA_BYTES
from .positions import IDENTITY, Positions

# pixels of one image: stb_image holds them all, 3 bytes each, before libmtmd
# scales the image to its projector's size (16 of 16.7 megapixels: 800 MB)
MAX_IMAGE_PIXELS = 4096 * 4096


def media_id(key):
    """The negative token id of a media chunk's ``key`` (a str): in [-2^31, -2],
    -1 being libllama's LLAMA_TOKEN_NULL."""
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    return -2 - h % (2 ** 31 - 2)


class Span:
    """One media chunk of a prompt: its owned mtmd_input_chunk copy and what it costs."""

    __slots__ = ("id", "kind", "n_tokens", "n_pos", "chunk", "non_causal", "users",
                 "retired")

    def __init__(self, id, kind, n_tokens, chunk, non_causal, n_pos=None):
        self.id, self.kind, self.n_tokens = id, kind, n_tokens
        self.n_pos = n_tokens if n_pos is None else n_pos    # positions it takes
        self.chunk, self.non_causal = chunk, non_causal
        self.users = 0              # evaluations using its chunk now (layout's hold)
        self.retired = False        # dropped from the store: freed when the last is done


class MediaStore:
    """The media of a worker's recent prompts, by media id, and their embeddings."""

    max_spans = 32                        # chunks whose meaning is kept (each holds its
                                          # preprocessed image: ~10 MB for gemma-3's 896 px;
                                          # two requests' worth of MAX_MEDIA)
    max_embd_bytes = 256 * 1024 * 1024    # embeddings kept for the next turn's prefix miss
    max_placed = 65536                    # M-RoPE images whose positions are known (ints
                                          # only: kept states and slot files outlive spans)

    def __init__(self, mtmd, n_embd, n_ubatch, turn, identity=None):
        """``mtmd``: the MtmdContext (owned from here on); ``n_embd``: the text
        model's input width; ``n_ubatch``: the context's, which a non-causal chunk
        must fit; ``turn()``: the decode turn an encode takes (session.decode_turn);
        ``identity``: what tells its mmproj from another (projector_identity)."""
        self.identity = identity
        self.mtmd = mtmd
        self.n_embd = n_embd
        self.n_ubatch = n_ubatch
        self._turn = turn
        self._spans = OrderedDict()       # media id -> Span
        self._embd = OrderedDict()        # media id -> bytes
        self._embd_bytes = 0
        self._lock = threading.Lock()
        self.vision, self.audio = mtmd.vision, mtmd.audio
        # an image's tokens all at one position, the text after it n_pos further
        # (libmtmd's mtmd_decode_use_mrope: Qwen2-VL, Qwen2.5-VL, Qwen3-VL)
        self.mrope = bool(getattr(mtmd, "mrope", False))
        self._placed = OrderedDict()      # media id -> (n_tokens, n_pos), of M-RoPE images
        self.n_encoded = 0                # chunks encoded (for tests and /metrics)

    # -- a prompt's tokens -----------------------------------------------------
    def tokenize(self, text, files, add_special=True, parse_special=True):
        """Token ids of ``text``, whose media markers stand for ``files`` (bytes) in order."""
        if len(files) > MAX_MEDIA:
            raise InvalidRequest("a request may hold at most %d images and audio clips, "
                                 "not %d" % (MAX_MEDIA, len(files)))
        bitmaps, keys = [], []
        try:
            for data in files:
                if len(data) > MAX_MEDIA_BYTES:
                    raise InvalidRequest("an image or audio clip may be at most %d MiB"
                                         % (MAX_MEDIA_BYTES >> 20))
                # (libmtmd would only fail to decode it, and say why in its log)
                if is_audio(data) and not self.audio:
                    raise InvalidRequest("this model's mmproj has no audio encoder: it takes "
                                         "images only")
                if not is_audio(data) and not self.vision:
                    raise InvalidRequest("this model's mmproj has no image encoder: it takes "
                                         "audio only")
                if not is_audio(data):
                    check_image(data)
                key = hashlib.sha256(data).hexdigest()
                bitmaps.append(self.mtmd.bitmap(data, key))
                keys.append(key)
            chunks = self.mtmd.tokenize(text, bitmaps, add_special, parse_special)
        finally:
            for bm in bitmaps:
                bm.close()
        try:
            return self._tokens_of(chunks, keys)
        finally:
            chunks.close()

    def _tokens_of(self, chunks, keys):
        tokens, k, seen = [], 0, {}
        for kind, text_tokens, n, n_pos, ptr in chunks.items():
            if kind == "text":
                tokens += text_tokens
                continue
            # which file: chunks come in the order of their markers; a file cut
            # into several chunks (slices) has them one after another
            key = self.mtmd.chunk_id(ptr) or (keys[k] if k < len(keys) else "?")
            part = seen.get(key, 0)
            seen[key] = part + 1
            if part == 0:
                k += 1
            mid = media_id("%s:%d:%d" % (key, part, n))
            non_causal = self.mtmd.non_causal(ptr)
            if non_causal and n > self.n_ubatch:
                raise InvalidRequest("an image here takes %d tokens, decoded together, but a "
                                     "batch holds %d: start the server with -ub %d or more"
                                     % (n, self.n_ubatch, n))
            with self._lock:
                span = self._spans.get(mid)
                if span is None:
                    span = Span(mid, kind, n, self.mtmd.copy_chunk(ptr), non_causal, n_pos)
                    self._spans[mid] = span
                    self._trim_spans()
                else:
                    self._spans.move_to_end(mid)
                if self.mrope and kind == "image":
                    self._placed[mid] = (n, n_pos)
                    self._placed.move_to_end(mid)
                    if len(self._placed) > self.max_placed:
                        self._placed.popitem(last=False)
            tokens += [mid] * n
        return tokens

    def _trim_spans(self):
        while len(self._spans) > self.max_spans:
            mid, old = self._spans.popitem(last=False)
            self._drop_embd(mid)
            if old.users:
                old.retired = True          # a session is encoding or decoding it
            else:
                self._free(old)

    def _free(self, span):
        if span.chunk:
            self.mtmd.free_chunk(span.chunk)
            span.chunk = None

    def release(self, spans):
        """Done with the chunks of ``spans`` (a layout(..., hold=True)): a chunk a trim
        dropped meanwhile is freed now."""
        with self._lock:
            for _, _, span in spans:
                span.users -= 1
                if span.users == 0 and span.retired:
                    self._free(span)

    def layout(self, tokens, hold=False):
        """[(start, end, Span)] of the media runs of ``tokens``; InvalidToken where a
        negative id is no media this worker knows, or a run is not whole.  ``hold``:
        the spans' chunks stay alive (a trim while other prompts come in does not
        free them) until release(spans): a session's evaluation."""
        if not tokens or min(tokens) >= 0:
            return []
        out, i, n = [], 0, len(tokens)
        with self._lock:
            while i < n:
                t = tokens[i]
                if t >= 0:
                    i += 1
                    continue
                span = self._spans.get(t)
                if span is None:
                    raise InvalidToken("token id %d is no image or audio this worker holds "
                                       "(send the request with its media again)" % t)
                end = i + span.n_tokens
                if end > n or any(x != t for x in tokens[i:end]):
                    raise InvalidToken("an image's tokens (%d) are not whole in the prompt" % t)
                out.append((i, end, span))
                i = end
            if hold:
                for _, _, span in out:
                    span.users += 1
        return out

    def positions(self, tokens):
        """The Positions of ``tokens`` (engine/positions.py): IDENTITY unless the
        projector places images by M-RoPE; None where a negative id in them is an
        image whose positions this worker does not know (a state kept from a
        request long gone)."""
        if not self.mrope or not tokens or min(tokens) >= 0:
            return IDENTITY
        runs, i, n = [], 0, len(tokens)
        with self._lock:
            while i < n:
                t = tokens[i]
                if t is None or t >= 0:
                    i += 1
                    continue
                end = i + 1
                while end < n and tokens[end] == t:
                    end += 1
                placed = self._placed.get(t)
                if placed is None:
                    span = self._spans.get(t)
                    if span is None or span.kind == "image":
                        return None
                    i = end             # audio: a position per token, as text
                    continue
                size, n_pos = placed
                # the same image twice in a row: a run of its size each
                for s in range(i, end, size):
                    runs.append((s, min(s + size, end), n_pos))
                i = end
        return Positions(runs)

    def placed(self, tokens):
        """[media id, n_tokens, n_pos] of the M-RoPE images among ``tokens`` that this
        store knows (what a slot file keeps beside its tokens)."""
        if not self.mrope:
            return []
        with self._lock:
            return [[t, *self._placed[t]] for t in sorted(set(x for x in tokens if x < 0))
                    if t in self._placed]

    def learn(self, placed):
        """Know the positions of images from a slot file (``placed``: as placed())."""
        if not self.mrope:
            return
        with self._lock:
            for t, n, n_pos in placed:
                self._placed[t] = (n, n_pos)
                self._placed.move_to_end(t)
            while len(self._placed) > self.max_placed:
                self._placed.popitem(last=False)

    # -- evaluation ---------------------------------------------------------------
    def embeddings(self, span):
        """The chunk's embeddings, (n_tokens, n_embd) float32 as bytes: kept ones, or
        encoded now (taking the decode turn: the encoder computes on the same cores)."""
        with self._lock:
            data = self._embd.get(span.id)
            if data is not None:
                self._embd.move_to_end(span.id)
                return data
        with self._turn():
            data = self.mtmd.encode(span.chunk, span.n_tokens, self.n_embd)
        if data is None:
            raise InvalidRequest("the image or audio could not be encoded")
        with self._lock:
            self.n_encoded += 1
            if span.id not in self._embd:
                self._embd[span.id] = data
                self._embd_bytes += len(data)
                while self._embd_bytes > self.max_embd_bytes and len(self._embd) > 1:
                    self._drop_embd(next(iter(self._embd)))
        return data

    def _drop_embd(self, mid):
        data = self._embd.pop(mid, None)
        if data is not None:
            self._embd_bytes -= len(data)

    def decode(self, ctx_ptr, span, embd, pos, seq):
        """Decode a chunk's embeddings into ``seq`` at ``pos``: libmtmd's helper,
        which sets non-causal attention around it where the projector asks, and
        places an M-RoPE image's tokens (all at ``pos``, by row and column)."""
        return self.mtmd.decode(ctx_ptr, span.chunk, embd, pos, seq, self.n_ubatch)

    def close(self):
        with self._lock:
            for span in self._spans.values():
                self._free(span)
            self._spans.clear()
            self._embd.clear()
        self.mtmd.close()


def projector_identity(path):
    """What tells an mmproj file from another, cheaply (a projector can be a GB): its
    name, size, and a hash of its first and last MiB."""
    size = os.path.getsize(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if size > 2 << 20:
            f.seek(size - (1 << 20))
            h.update(f.read(1 << 20))
    return {"name": os.path.basename(path), "size": size, "sha256": h.hexdigest()}


def check_image(data):
    """Refuse, before libmtmd decodes it, an image it would spend too much memory on (its
    header's size past MAX_IMAGE_PIXELS: stb_image holds every pixel) or of a format
    offgrid does not take."""
    size = image_size(data)
    if size is None:
        raise InvalidRequest("not an image offgrid takes (JPEG, PNG, BMP or GIF), nor audio "
                             "(WAV, MP3 or FLAC)")
    w, h = size
    if w <= 0 or h <= 0 or w * h > MAX_IMAGE_PIXELS:
        raise InvalidRequest("an image of %d x %d pixels: at most %d megapixels are taken"
                             % (w, h, MAX_IMAGE_PIXELS // 1000000))


def image_size(data):
    """(width, height) from a JPEG, PNG, BMP or GIF header; None for anything else."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24:
        return struct.unpack(">II", data[16:24])
    if data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        return struct.unpack("<HH", data[6:10])
    if data[:2] == b"BM" and len(data) >= 26:
        w, h = struct.unpack("<ii", data[18:26])
        return w, abs(h)            # a negative height is a top-down bitmap
    if data[:2] == b"\xff\xd8":
        i = 2
        while i + 9 <= len(data):
            if data[i] != 0xFF:
                return None
            marker = data[i + 1]
            if marker == 0xFF:              # fill byte
                i += 1
                continue
            if marker in (0x01,) or 0xD0 <= marker <= 0xD9:
                i += 2                      # no length
                continue
            if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
                h, w = struct.unpack(">HH", data[i + 5:i + 9])
                return w, h
            i += 2 + struct.unpack(">H", data[i + 2:i + 4])[0]
    return None


def is_audio(data):
    """Whether a file's first bytes are WAV, FLAC or MP3 (as libmtmd's helper tells audio
    from images)."""
    return len(data) >= 12 and (
        (data[:4] == b"RIFF" and data[8:12] == b"WAVE") or data[:4] == b"fLaC"
        or data[:3] == b"ID3" or (data[0] == 0xFF and data[1] & 0xE0 == 0xE0))


def floor_to_media(spans, k):
    """``k``, or the start of the media run it falls inside (a run is decoded whole)."""
    for start, end, _ in spans:
        if start < k < end:
            return start
    return k
