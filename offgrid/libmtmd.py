"""Hand-written ctypes bindings to the part of libmtmd that offgrid calls.

libmtmd is llama.cpp's multimodal library (tools/mtmd: ``mtmd.h`` and
``mtmd-helper.h``): it loads an mmproj GGUF (an image or audio encoder and
its projector into the text model's embedding space), decodes image and
audio files (stb_image: JPEG, PNG, BMP, GIF; miniaudio: WAV, MP3, FLAC),
splits a prompt at its media markers into text and media chunks, encodes a
media chunk into embeddings and decodes those into a llama_context.

A sibling of ``offgrid/libllama.py`` (and, with it, the only modules that
import ``ctypes``): the same conventions, the C prototype above each
binding, bound on first use, struct layouts and prototypes checked against
the pinned headers by tests/test_mtmd_bindings.py.  The library is loaded
only when a model is served with ``--mmproj``, from the folder libllama was
loaded from (``make lib`` builds both).

Handles, each with one owner and an idempotent close(): MtmdContext (an
mmproj loaded for one text model), Bitmap (a decoded image or audio clip)
and Chunks (a tokenized prompt: text and media chunks).  Errors become
``offgrid.errors`` exceptions here: a file libmtmd cannot decode is an
InvalidRequest, an mmproj it cannot load a LibraryError.
"""

import ctypes
import threading
from ctypes import (POINTER, Structure, c_bool, c_char_p, c_float, c_int, c_int32,
                    c_int64, c_size_t, c_uint32, c_void_p)
from pathlib import Path

from . import libllama
from .errors import InvalidRequest, LibraryError
from .libllama import _abi, _spelled, llama_pos, llama_seq_id, llama_token

# ---------------------------------------------------------------------------
# Types and constants (mtmd.h)
# ---------------------------------------------------------------------------

# enum mtmd_input_chunk_type
MTMD_INPUT_CHUNK_TYPE_TEXT = 0
MTMD_INPUT_CHUNK_TYPE_IMAGE = 1
MTMD_INPUT_CHUNK_TYPE_AUDIO = 2

mtmd_context_p = _spelled(c_void_p, "mtmd_context *")
const_mtmd_context_p = _spelled(c_void_p, "const mtmd_context *")
mtmd_bitmap_p = _spelled(c_void_p, "mtmd_bitmap *")
const_mtmd_bitmap_p = _spelled(c_void_p, "const mtmd_bitmap *")
mtmd_input_chunks_p = _spelled(c_void_p, "mtmd_input_chunks *")
const_mtmd_input_chunks_p = _spelled(c_void_p, "const mtmd_input_chunks *")
mtmd_input_chunk_p = _spelled(c_void_p, "mtmd_input_chunk *")
const_mtmd_input_chunk_p = _spelled(c_void_p, "const mtmd_input_chunk *")
const_llama_model_p = _spelled(c_void_p, "const struct llama_model *")
llama_context_p = _spelled(c_void_p, "struct llama_context *")
const_uchar_p = _spelled(c_void_p, "const unsigned char *")
float_p = _spelled(c_void_p, "float *")
const_llama_token_p = _spelled(c_void_p, "const llama_token *")
const_mtmd_bitmap_pp = _spelled(c_void_p, "const mtmd_bitmap * const *")
enum_mtmd_input_chunk_type = _spelled(c_int, "enum mtmd_input_chunk_type")


class mtmd_context_params(Structure):
    """struct mtmd_context_params (passed by value to mtmd_init_from_file)."""
    _fields_ = [
        ("use_gpu", c_bool),
        ("device", c_void_p),                   # ggml_backend_dev_t
        ("print_timings", c_bool),
        ("n_threads", c_int),
        ("image_marker", c_char_p),             # deprecated: must stay NULL
        ("media_marker", c_char_p),
        ("flash_attn_type", c_int),             # enum llama_flash_attn_type
        ("warmup", c_bool),
        ("image_min_tokens", c_int),
        ("image_max_tokens", c_int),
        ("cb_eval", c_void_p),                  # ggml_backend_sched_eval_callback
        ("cb_eval_user_data", c_void_p),
        ("batch_max_tokens", c_int32),
        ("progress_callback", c_void_p),        # mtmd_progress_callback
        ("progress_callback_user_data", c_void_p),
    ]


class mtmd_input_text(Structure):
    """struct mtmd_input_text (passed by pointer to mtmd_tokenize)."""
    _fields_ = [
        ("text", c_char_p),
        ("text_len", c_size_t),
        ("add_special", c_bool),
        ("parse_special", c_bool),
    ]


class mtmd_helper_video_init_params(Structure):
    """struct mtmd_helper_video_init_params (mtmd-helper.h; part of mtmd_helper_init_opt)."""
    _fields_ = [
        ("fps_target", c_float),
        ("ffmpeg_bin_dir", c_char_p),
        ("timestamp_interval_ms", c_int64),
    ]


class mtmd_helper_init_opt(Structure):
    """struct mtmd_helper_init_opt (passed by value to mtmd_helper_bitmap_init_from_buf)."""
    _fields_ = [
        ("video_params", mtmd_helper_video_init_params),
    ]


class mtmd_helper_bitmap_wrapper(Structure):
    """struct mtmd_helper_bitmap_wrapper (returned by value): a bitmap, or a video (never
    here: libmtmd is built with MTMD_VIDEO=OFF)."""
    _fields_ = [
        ("bitmap", c_void_p),                   # mtmd_bitmap *
        ("video_ctx", c_void_p),                # mtmd_helper_video *
    ]


# The struct classes tests/test_mtmd_bindings.py checks against mtmd.h and mtmd-helper.h.
STRUCTS = (mtmd_context_params, mtmd_input_text, mtmd_helper_video_init_params,
           mtmd_helper_init_opt, mtmd_helper_bitmap_wrapper)

# ---------------------------------------------------------------------------
# Prototypes: name -> (restype, argtypes), bound on first use
# ---------------------------------------------------------------------------

_PROTOTYPES = {
    # const char * mtmd_default_marker(void);
    "mtmd_default_marker": (c_char_p, []),
    # struct mtmd_context_params mtmd_context_params_default(void);
    "mtmd_context_params_default": (mtmd_context_params, []),
    # mtmd_context * mtmd_init_from_file(const char * mmproj_fname,
    #         const struct llama_model * text_model, const struct mtmd_context_params ctx_params);
    "mtmd_init_from_file": (mtmd_context_p, [c_char_p, const_llama_model_p, mtmd_context_params]),
    # void mtmd_free(mtmd_context * ctx);
    "mtmd_free": (None, [mtmd_context_p]),
    # bool mtmd_decode_use_non_causal(const mtmd_context * ctx, const mtmd_input_chunk * chunk);
    "mtmd_decode_use_non_causal": (c_bool, [const_mtmd_context_p, const_mtmd_input_chunk_p]),
    # bool mtmd_decode_use_mrope(const mtmd_context * ctx);
    "mtmd_decode_use_mrope": (c_bool, [const_mtmd_context_p]),
    # bool mtmd_support_vision(const mtmd_context * ctx);
    "mtmd_support_vision": (c_bool, [const_mtmd_context_p]),
    # bool mtmd_support_audio(const mtmd_context * ctx);
    "mtmd_support_audio": (c_bool, [const_mtmd_context_p]),
    # uint32_t mtmd_bitmap_get_nx(const mtmd_bitmap * bitmap);
    "mtmd_bitmap_get_nx": (c_uint32, [const_mtmd_bitmap_p]),
    # uint32_t mtmd_bitmap_get_ny(const mtmd_bitmap * bitmap);
    "mtmd_bitmap_get_ny": (c_uint32, [const_mtmd_bitmap_p]),
    # bool mtmd_bitmap_is_audio(const mtmd_bitmap * bitmap);
    "mtmd_bitmap_is_audio": (c_bool, [const_mtmd_bitmap_p]),
    # void mtmd_bitmap_free(mtmd_bitmap * bitmap);
    "mtmd_bitmap_free": (None, [mtmd_bitmap_p]),
    # void mtmd_bitmap_set_id(mtmd_bitmap * bitmap, const char * id);
    "mtmd_bitmap_set_id": (None, [mtmd_bitmap_p, c_char_p]),
    # mtmd_input_chunks * mtmd_input_chunks_init(void);
    "mtmd_input_chunks_init": (mtmd_input_chunks_p, []),
    # size_t mtmd_input_chunks_size(const mtmd_input_chunks * chunks);
    "mtmd_input_chunks_size": (c_size_t, [const_mtmd_input_chunks_p]),
    # const mtmd_input_chunk * mtmd_input_chunks_get(const mtmd_input_chunks * chunks, size_t idx);
    "mtmd_input_chunks_get": (const_mtmd_input_chunk_p, [const_mtmd_input_chunks_p, c_size_t]),
    # void mtmd_input_chunks_free(mtmd_input_chunks * chunks);
    "mtmd_input_chunks_free": (None, [mtmd_input_chunks_p]),
    # enum mtmd_input_chunk_type mtmd_input_chunk_get_type(const mtmd_input_chunk * chunk);
    "mtmd_input_chunk_get_type": (enum_mtmd_input_chunk_type, [const_mtmd_input_chunk_p]),
    # const llama_token * mtmd_input_chunk_get_tokens_text(const mtmd_input_chunk * chunk,
    #                                                      size_t * n_tokens_output);
    "mtmd_input_chunk_get_tokens_text": (const_llama_token_p,
                                         [const_mtmd_input_chunk_p, POINTER(c_size_t)]),
    # size_t mtmd_input_chunk_get_n_tokens(const mtmd_input_chunk * chunk);
    "mtmd_input_chunk_get_n_tokens": (c_size_t, [const_mtmd_input_chunk_p]),
    # const char * mtmd_input_chunk_get_id(const mtmd_input_chunk * chunk);
    "mtmd_input_chunk_get_id": (c_char_p, [const_mtmd_input_chunk_p]),
    # llama_pos mtmd_input_chunk_get_n_pos(const mtmd_input_chunk * chunk);
    "mtmd_input_chunk_get_n_pos": (llama_pos, [const_mtmd_input_chunk_p]),
    # mtmd_input_chunk * mtmd_input_chunk_copy(const mtmd_input_chunk * chunk);
    "mtmd_input_chunk_copy": (mtmd_input_chunk_p, [const_mtmd_input_chunk_p]),
    # void mtmd_input_chunk_free(mtmd_input_chunk * chunk);
    "mtmd_input_chunk_free": (None, [mtmd_input_chunk_p]),
    # int32_t mtmd_tokenize(const mtmd_context * ctx, mtmd_input_chunks * output,
    #         const mtmd_input_text * text, const mtmd_bitmap * const * bitmaps, size_t n_bitmaps);
    "mtmd_tokenize": (c_int32, [const_mtmd_context_p, mtmd_input_chunks_p,
                                _spelled(POINTER(mtmd_input_text), "const mtmd_input_text *"),
                                const_mtmd_bitmap_pp, c_size_t]),
    # int32_t mtmd_encode_chunk(mtmd_context * ctx, const mtmd_input_chunk * chunk);
    "mtmd_encode_chunk": (c_int32, [mtmd_context_p, const_mtmd_input_chunk_p]),
    # float * mtmd_get_output_embd(mtmd_context * ctx);
    "mtmd_get_output_embd": (float_p, [mtmd_context_p]),
    # (mtmd-helper.h)
    # struct mtmd_helper_init_opt mtmd_helper_init_opt_default(void);
    "mtmd_helper_init_opt_default": (mtmd_helper_init_opt, []),
    # void mtmd_helper_log_set(ggml_log_callback log_callback, void * user_data);
    "mtmd_helper_log_set": (None, [libllama.ggml_log_callback, c_void_p]),
    # struct mtmd_helper_bitmap_wrapper mtmd_helper_bitmap_init_from_buf(
    #         const mtmd_context * ctx, const unsigned char * buf, size_t len,
    #         bool placeholder, struct mtmd_helper_init_opt opt);
    "mtmd_helper_bitmap_init_from_buf": (mtmd_helper_bitmap_wrapper,
                                         [const_mtmd_context_p, const_uchar_p, c_size_t, c_bool,
                                          mtmd_helper_init_opt]),
    # int32_t mtmd_helper_decode_image_chunk(mtmd_context * ctx, struct llama_context * lctx,
    #         const mtmd_input_chunk * chunk, float * encoded_embd, llama_pos n_past,
    #         llama_seq_id seq_id, int32_t n_batch, llama_pos * new_n_past,
    #         mtmd_helper_post_decode_callback callback, void * user_data);
    "mtmd_helper_decode_image_chunk": (c_int32, [
        mtmd_context_p, llama_context_p, const_mtmd_input_chunk_p, float_p, llama_pos,
        llama_seq_id, c_int32, POINTER(llama_pos),
        _spelled(c_void_p, "mtmd_helper_post_decode_callback"), c_void_p]),
}


class Library:
    """A loaded libmtmd: its C functions as attributes, bound on first use (a
    symbol the library lacks raises LibraryError naming it, at its first call)."""

    def __init__(self, cdll, path):
        self._cdll = cdll
        self.path = path

    def __getattr__(self, name):
        if name not in _PROTOTYPES:
            raise AttributeError(name)
        try:
            fn = getattr(self._cdll, name)
        except AttributeError:
            raise LibraryError("libmtmd at %s lacks the symbol %s; rebuild it with `make lib`"
                               % (self.path, name)) from None
        restype, argtypes = _PROTOTYPES[name]
        fn.restype, fn.argtypes = _abi(restype), [_abi(t) for t in argtypes]
        setattr(self, name, fn)
        return fn


_lock = threading.Lock()
_loaded = None


def load():
    """Load libmtmd once per process, from the folder libllama came from."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        llama = libllama.loaded()
        folder = Path(llama.path).parent if "/" in str(llama.path) else None
        path = folder / "libmtmd.so" if folder is not None else Path("libmtmd.so")
        try:
            cdll = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        except OSError as e:
            raise LibraryError("could not load libmtmd (%s), which --mmproj needs; "
                               "rebuild lib/ with `make lib`" % e) from None
        lib = Library(cdll, path)
        # its log lines (and clip's) go where libllama's go, filtered the same way
        if libllama._log_callback is not None:
            lib.mtmd_helper_log_set(libllama._log_callback, None)
        _loaded = lib
        return lib


# ---------------------------------------------------------------------------
# Handles
# ---------------------------------------------------------------------------

class MtmdContext:
    """An mmproj loaded for one text model (mtmd_context *); close() frees it."""

    def __init__(self, lib, path, model_ptr, n_threads=4, use_gpu=True, image_min_tokens=-1,
                 image_max_tokens=-1, warmup=True):
        self.lib = lib
        params = lib.mtmd_context_params_default()
        params.use_gpu = use_gpu
        params.print_timings = False
        params.n_threads = n_threads
        params.warmup = warmup
        params.image_min_tokens = image_min_tokens
        params.image_max_tokens = image_max_tokens
        self.ptr = lib.mtmd_init_from_file(str(path).encode(), model_ptr, params)
        if not self.ptr:
            raise LibraryError("libmtmd could not load the mmproj %s for this model (not an "
                               "mmproj, a projector this build does not know, or one made for "
                               "a model of another embedding size: see the log above)" % path)
        self.marker = lib.mtmd_default_marker().decode()
        self.vision = bool(lib.mtmd_support_vision(self.ptr))
        self.audio = bool(lib.mtmd_support_audio(self.ptr))
        self.mrope = bool(lib.mtmd_decode_use_mrope(self.ptr))
        self._opt = lib.mtmd_helper_init_opt_default()

    def bitmap(self, data, key):
        """A Bitmap of an image or audio file's bytes, identified by ``key`` (its
        hash); InvalidRequest where libmtmd cannot decode it."""
        buf = (ctypes.c_ubyte * len(data)).from_buffer_copy(data)
        wrapped = self.lib.mtmd_helper_bitmap_init_from_buf(self.ptr, ctypes.addressof(buf),
                                                             len(data), False, self._opt)
        if not wrapped.bitmap:
            raise InvalidRequest("the image or audio could not be decoded (JPEG, PNG, BMP "
                                 "and GIF images, WAV, MP3 and FLAC audio are)")
        bm = Bitmap(self.lib, wrapped.bitmap)
        self.lib.mtmd_bitmap_set_id(bm.ptr, key.encode())
        return bm

    def tokenize(self, text, bitmaps, add_special, parse_special):
        """Chunks of ``text`` whose media markers stand for ``bitmaps`` in order."""
        if text.count(self.marker) != len(bitmaps):
            # (libmtmd throws, and says only "2")
            raise InvalidRequest("the prompt has %d media markers (%s) for %d images and audio "
                                 "clips" % (text.count(self.marker), self.marker, len(bitmaps)))
        chunks = Chunks(self.lib)
        data = text.encode("utf-8", "surrogatepass")
        inp = mtmd_input_text(data, len(data), add_special, parse_special)
        arr = (c_void_p * max(1, len(bitmaps)))(*[b.ptr for b in bitmaps])
        status = self.lib.mtmd_tokenize(self.ptr, chunks.ptr, ctypes.byref(inp),
                                        ctypes.addressof(arr), len(bitmaps))
        if status != 0:
            chunks.close()
            raise InvalidRequest("an image or audio clip could not be preprocessed "
                                 "(mtmd_tokenize: %d)" % status)
        return chunks

    def chunk_id(self, chunk_ptr):
        """The id of the bitmap a media chunk came from (what bitmap() set), or None."""
        cid = self.lib.mtmd_input_chunk_get_id(chunk_ptr)
        return cid.decode() if cid else None

    def copy_chunk(self, chunk_ptr):
        """An owned copy of one chunk of a Chunks, outliving it (free_chunk frees it)."""
        return self.lib.mtmd_input_chunk_copy(chunk_ptr)

    def free_chunk(self, chunk_ptr):
        self.lib.mtmd_input_chunk_free(chunk_ptr)

    def non_causal(self, chunk_ptr):
        return bool(self.lib.mtmd_decode_use_non_causal(self.ptr, chunk_ptr))

    def encode(self, chunk_ptr, n_tokens, n_embd):
        """The embeddings of a media chunk: (n_tokens, n_embd) float32 as bytes."""
        if self.lib.mtmd_encode_chunk(self.ptr, chunk_ptr) != 0:
            return None
        addr = self.lib.mtmd_get_output_embd(self.ptr)
        return ctypes.string_at(addr, 4 * n_tokens * n_embd) if addr else None

    def decode(self, ctx_ptr, chunk_ptr, embd, pos, seq, n_batch):
        """Decode a media chunk's embeddings (bytes from encode) into sequence ``seq``
        of a llama_context at positions from ``pos``; returns the helper's status."""
        buf = ctypes.create_string_buffer(embd, len(embd))
        new_pos = llama_pos(0)
        return self.lib.mtmd_helper_decode_image_chunk(
            self.ptr, ctx_ptr, chunk_ptr, ctypes.addressof(buf), pos, seq, n_batch,
            ctypes.byref(new_pos), None, None)

    def close(self):
        if self.ptr:
            self.lib.mtmd_free(self.ptr)
            self.ptr = None


class Bitmap:
    """A decoded image or audio clip (mtmd_bitmap *); close() frees it."""

    def __init__(self, lib, ptr):
        self.lib, self.ptr = lib, ptr

    @property
    def size(self):
        return self.lib.mtmd_bitmap_get_nx(self.ptr), self.lib.mtmd_bitmap_get_ny(self.ptr)

    @property
    def is_audio(self):
        return bool(self.lib.mtmd_bitmap_is_audio(self.ptr))

    def close(self):
        if self.ptr:
            self.lib.mtmd_bitmap_free(self.ptr)
            self.ptr = None


class Chunks:
    """A tokenized prompt (mtmd_input_chunks *): its text and media chunks, in order."""

    def __init__(self, lib):
        self.lib = lib
        self.ptr = lib.mtmd_input_chunks_init()

    def __len__(self):
        return self.lib.mtmd_input_chunks_size(self.ptr)

    def items(self):
        """(kind, tokens or None, n_tokens, n_pos, chunk pointer) of each chunk: kind
        is "text", "image" or "audio"; tokens only for text; n_pos the positions the
        chunk takes (fewer than its tokens for an image placed by M-RoPE)."""
        lib = self.lib
        out = []
        for i in range(len(self)):
            c = lib.mtmd_input_chunks_get(self.ptr, i)
            kind = lib.mtmd_input_chunk_get_type(c)
            if kind == MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = c_size_t(0)
                addr = lib.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
                tokens = list((llama_token * n.value).from_address(addr)) if n.value else []
                out.append(("text", tokens, n.value, n.value, c))
            else:
                out.append(("image" if kind == MTMD_INPUT_CHUNK_TYPE_IMAGE else "audio", None,
                            lib.mtmd_input_chunk_get_n_tokens(c),
                            lib.mtmd_input_chunk_get_n_pos(c), c))
        return out

    def close(self):
        if self.ptr:
            self.lib.mtmd_input_chunks_free(self.ptr)
            self.ptr = None
