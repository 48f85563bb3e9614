"""Hand-written ctypes bindings to the part of llama.h that offgrid calls.

This is the only module in offgrid that imports ``ctypes``.  Everything above
it (model, session, server) sees Python ints, strs and bytes, and the
exceptions of ``offgrid.errors``.

The bindings are written against llama.cpp commit 0c1e570, as vendored by
llama-cpp-python 0.3.36, whose ``llama_version()`` is ``0.5.0-dev``.  Each
binding has its C prototype above it, so comparing this file with ``llama.h``
is a reading exercise; ``tests/test_layout.py`` compiles a C file against the
pinned header and checks every struct's size and field offsets against the
classes here, and ``tests/test_prototypes.py`` compiles every prototype (as
a function pointer, from its ctypes types) against the declaration.

Below the prototypes come the handle classes, the only way the engine reaches
libllama: ModelHandle (a model, its metadata and vocabulary), ContextHandle
(a context, its batch, abort flag and ``memory``, a Memory), SamplerHandle
(one sampler or chain, a constructor per kind), Candidates (a reusable
candidates array) and ThreadPool.  Each C handle has one owner, whose
close() frees it once.  Device is a ggml backend device (an rpc-server's,
from rpc_devices()), which ggml's registry owns; on_ggml_abort() hooks
GGML_ABORT.

Functions are bound on first use: a library that lacks one symbol still loads,
and the error names the symbol when (and only when) offgrid needs it.

Finding the library: an explicit path (``--lib``) or ``$OFFGRID_LIB``, then
``lib/`` beside the package (a checkout or a bundle), then ``offgrid/lib``
(a wheel that bundles it), then the system's search path.
"""

import array
import ctypes
import ctypes.util
import math
import os
import re
import sys
import threading
from ctypes import (CFUNCTYPE, POINTER, Structure, c_bool, c_char_p, c_float,
                    c_int, c_int8, c_int32, c_size_t, c_uint32, c_uint64, c_void_p)
from pathlib import Path

from .errors import LibraryError

# The llama_version() these bindings were written for.  A library of another
# version may have other struct layouts: passing it one of ours would corrupt
# memory, so we refuse it unless the user insists.
EXPECTED_VERSION = "0.5.0-dev"
ALLOW_ANY_ENV = "OFFGRID_ALLOW_ANY_LIBLLAMA"

# ---------------------------------------------------------------------------
# Scalar types and constants (llama.h)
# ---------------------------------------------------------------------------

llama_token = c_int32
llama_pos = c_int32
llama_seq_id = c_int32


def _spelled(base, c_type):
    """``base`` as ctypes passes it, remembering the C type ``c_type`` it stands for.

    ctypes has one c_void_p for every struct pointer and no const, so the
    prototypes below use these to say which pointer each one is; binding
    strips them back to ``base`` (calls still take and return plain ints,
    bytes and None), and tests/test_prototypes.py compiles the spellings
    against llama.h.
    """
    return type(c_type.replace(" ", "_").replace("*", "p"), (base,),
                {"_c_": c_type, "_abi_": base})


def _abi(ctype):
    """The plain ctypes type a _spelled type passes as (others are returned unchanged)."""
    return vars(ctype).get("_abi_", ctype) if isinstance(ctype, type) else ctype


llama_model_p = _spelled(c_void_p, "struct llama_model *")
const_llama_model_p = _spelled(c_void_p, "const struct llama_model *")
const_llama_vocab_p = _spelled(c_void_p, "const struct llama_vocab *")
llama_context_p = _spelled(c_void_p, "struct llama_context *")
const_llama_context_p = _spelled(c_void_p, "const struct llama_context *")
llama_memory_t = _spelled(c_void_p, "llama_memory_t")
llama_sampler_p = _spelled(c_void_p, "struct llama_sampler *")
llama_adapter_lora_p = _spelled(c_void_p, "struct llama_adapter_lora *")
const_llama_adapter_lora_p = _spelled(c_void_p, "const struct llama_adapter_lora *")
char_buf = _spelled(c_char_p, "char *")             # an output buffer; c_char_p is const char *
float_p = _spelled(c_void_p, "float *")             # read with from_address, not a POINTER
const_float_p = _spelled(c_void_p, "const float *")  # a buffer's address (buffer_info)
uint8_p = _spelled(c_void_p, "uint8_t *")           # a buffer's address (ctypes.addressof)
const_uint8_p = _spelled(c_void_p, "const uint8_t *")
llama_token_p = POINTER(llama_token)
const_llama_token_p = _spelled(POINTER(llama_token), "const llama_token *")
const_char_pp = _spelled(POINTER(c_char_p), "const char **")
ggml_abort_callback_p = _spelled(c_void_p, "ggml_abort_callback")
ggml_threadpool_t = _spelled(c_void_p, "ggml_threadpool_t")
ggml_backend_dev_t = _spelled(c_void_p, "ggml_backend_dev_t")
ggml_backend_buffer_type_t = _spelled(c_void_p, "ggml_backend_buffer_type_t")
ggml_backend_reg_t = _spelled(c_void_p, "ggml_backend_reg_t")
enum_ggml_log_level = _spelled(c_int, "enum ggml_log_level")
enum_ggml_backend_dev_type = _spelled(c_int, "enum ggml_backend_dev_type")
enum_llama_pooling_type = _spelled(c_int, "enum llama_pooling_type")
enum_ggml_numa_strategy = _spelled(c_int, "enum ggml_numa_strategy")

LLAMA_DEFAULT_SEED = 0xFFFFFFFF

# enum ggml_backend_dev_type (ggml-backend.h)
GGML_BACKEND_DEVICE_TYPE_CPU = 0

# ggml.h: the size of ggml_threadpool_params.cpumask
GGML_MAX_N_THREADS = 512

# enum ggml_numa_strategy (ggml-cpu.h), by --numa's names
NUMA_STRATEGIES = {"distribute": 1, "isolate": 2, "numactl": 3}

# enum llama_pooling_type: how an embedding context pools its tokens' hidden states
LLAMA_POOLING_TYPE_UNSPECIFIED = -1
LLAMA_POOLING_TYPE_NONE = 0
LLAMA_POOLING_TYPE_MEAN = 1
LLAMA_POOLING_TYPE_CLS = 2
LLAMA_POOLING_TYPE_LAST = 3
LLAMA_POOLING_TYPE_RANK = 4

# enum llama_rope_type
LLAMA_ROPE_TYPE_NONE = -1
LLAMA_ROPE_TYPE_NORM = 0
LLAMA_ROPE_TYPE_NEOX = 2
LLAMA_ROPE_TYPE_MROPE = 8
LLAMA_ROPE_TYPE_VISION = 24
LLAMA_ROPE_TYPE_IMROPE = 40

# llama_state_seq_flags: only the parts a cut cannot restore (a recurrent
# state, a window cache), as a checkpoint keeps them
LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY = 1

# enum ggml_log_level
GGML_LOG_LEVEL_ERROR = 4
GGML_LOG_LEVEL_CONT = 5


def _callback(c_name, restype, argtypes):
    """A CFUNCTYPE for the C typedef ``c_name``, with the spelled signature kept for the test."""
    cls = CFUNCTYPE(_abi(restype), *[_abi(t) for t in argtypes])
    cls._c_ = c_name
    cls._c_signature_ = (restype, argtypes)
    return cls


# typedef bool (*llama_progress_callback)(float progress, void * user_data);
llama_progress_callback = _callback("llama_progress_callback", c_bool, [c_float, c_void_p])
# typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);
ggml_log_callback = _callback("ggml_log_callback", None, [enum_ggml_log_level, c_char_p, c_void_p])
# typedef void (*ggml_abort_callback_t)(const char * error_message);   (ggml.h: GGML_ABORT's hook)
ggml_abort_callback_t = _callback("ggml_abort_callback_t", None, [c_char_p])

# ---------------------------------------------------------------------------
# Structs, every field in C order and C type
# ---------------------------------------------------------------------------


class llama_model_params(Structure):
    """struct llama_model_params (passed by value to llama_model_load_from_file)."""
    _fields_ = [
        ("devices", c_void_p),                  # ggml_backend_dev_t *
        ("tensor_buft_overrides", c_void_p),    # const struct llama_model_tensor_buft_override *
        ("n_gpu_layers", c_int32),
        ("split_mode", c_int),                  # enum llama_split_mode
        ("load_mode", c_int),                   # enum llama_load_mode
        ("lazy_mode", c_int),                   # enum llama_lazy_mode
        ("main_gpu", c_int32),
        ("tensor_split", POINTER(c_float)),
        ("progress_callback", llama_progress_callback),
        ("progress_callback_user_data", c_void_p),
        ("kv_overrides", c_void_p),             # const struct llama_model_kv_override *
        ("vocab_only", c_bool),
        ("check_tensors", c_bool),
        ("use_extra_bufts", c_bool),
        ("no_host", c_bool),
        ("no_alloc", c_bool),
        ("load_mtp", c_bool),
    ]


class _kv_override_value(ctypes.Union):
    _fields_ = [("val_i64", ctypes.c_int64), ("val_f64", ctypes.c_double),
                ("val_bool", c_bool), ("val_str", ctypes.c_char * 128)]


class llama_model_kv_override(Structure):
    """struct llama_model_kv_override: one metadata value in place of the file's; an
    array of them ends with an empty key."""
    _anonymous_ = ("value",)
    _fields_ = [("tag", c_int),                 # enum llama_model_kv_override_type
                ("key", ctypes.c_char * 128),
                ("value", _kv_override_value)]


# enum llama_load_mode, by -lm's words
LOAD_MODES = {"auto": -1, "none": 0, "mmap": 1, "mlock": 2, "mmap+mlock": 3, "dio": 4}
# enum llama_rope_scaling_type (--rope-scaling)
ROPE_SCALING_TYPES = {"none": 0, "linear": 1, "yarn": 2}
# llama_context_params' RoPE and YaRN fields a ModelHandle's ``rope`` may set
ROPE_PARAMS = ("rope_scaling_type", "rope_freq_base", "rope_freq_scale", "yarn_ext_factor",
               "yarn_attn_factor", "yarn_beta_fast", "yarn_beta_slow", "yarn_orig_ctx")
# enum llama_lazy_mode (-lzm): tensors the architecture marks (per-layer embeddings)
# read from the file on demand
LAZY_MODES = {"off": 0, "auto": 1, "on": 2}

# enum llama_model_kv_override_type, by --override-kv's words
KV_OVERRIDE_TYPES = {"int": 0, "float": 1, "bool": 2, "str": 3}


class llama_model_tensor_buft_override(Structure):
    """struct llama_model_tensor_buft_override: the tensors whose names match a
    regex go to this buffer type; an array of them ends with a NULL pattern."""
    _fields_ = [("pattern", c_char_p), ("buft", c_void_p)]


def buffer_types(lib):
    """{name: ggml_backend_buffer_type_t} of every device's own buffer type ("CPU",
    "Vulkan0", "CUDA0", ...), as llama-server's -ot looks them up."""
    out = {}
    for i in range(lib.ggml_backend_dev_count()):
        buft = lib.ggml_backend_dev_buffer_type(lib.ggml_backend_dev_get(i))
        if buft:
            out[lib.ggml_backend_buft_name(buft).decode("utf-8", "replace")] = buft
    return out


class llama_context_params(Structure):
    """struct llama_context_params (passed by value to llama_init_from_model)."""
    _fields_ = [
        ("n_ctx", c_uint32),
        ("n_batch", c_uint32),
        ("n_ubatch", c_uint32),
        ("n_seq_max", c_uint32),
        ("n_rs_seq", c_uint32),
        ("n_outputs_max", c_uint32),
        ("n_outputs_max_per_seq", c_uint32),
        ("n_threads", c_int32),
        ("n_threads_batch", c_int32),
        ("ctx_type", c_int),                    # enum llama_context_type
        ("rope_scaling_type", c_int),           # enum llama_rope_scaling_type
        ("pooling_type", c_int),                # enum llama_pooling_type
        ("attention_type", c_int),              # enum llama_attention_type
        ("flash_attn_type", c_int),             # enum llama_flash_attn_type
        ("rope_freq_base", c_float),
        ("rope_freq_scale", c_float),
        ("yarn_ext_factor", c_float),
        ("yarn_attn_factor", c_float),
        ("yarn_beta_fast", c_float),
        ("yarn_beta_slow", c_float),
        ("yarn_orig_ctx", c_uint32),
        ("defrag_thold", c_float),
        ("cb_eval", c_void_p),                  # ggml_backend_sched_eval_callback
        ("cb_eval_user_data", c_void_p),
        ("type_k", c_int),                      # enum ggml_type
        ("type_v", c_int),                      # enum ggml_type
        ("abort_callback", c_void_p),           # ggml_abort_callback
        ("abort_callback_data", c_void_p),
        ("embeddings", c_bool),
        ("offload_kqv", c_bool),
        ("no_perf", c_bool),
        ("op_offload", c_bool),
        ("swa_full", c_bool),
        ("kv_unified", c_bool),
        ("samplers", c_void_p),                 # struct llama_sampler_seq_config *
        ("n_samplers", c_size_t),
        ("ctx_other", c_void_p),                # struct llama_context *
    ]


class llama_batch(Structure):
    """struct llama_batch: parallel arrays of n_tokens entries each."""
    _fields_ = [
        ("n_tokens", c_int32),
        ("token", POINTER(llama_token)),
        ("embd", POINTER(c_float)),
        ("pos", POINTER(llama_pos)),
        ("n_seq_id", POINTER(c_int32)),
        ("seq_id", POINTER(POINTER(llama_seq_id))),
        ("logits", POINTER(c_int8)),
    ]


class llama_token_data(Structure):
    """typedef struct llama_token_data { llama_token id; float logit; float p; }"""
    _fields_ = [
        ("id", llama_token),
        ("logit", c_float),
        ("p", c_float),
    ]


class llama_token_data_array(Structure):
    """typedef struct llama_token_data_array: candidates handed to llama_sampler_apply."""
    _fields_ = [
        ("data", POINTER(llama_token_data)),
        ("size", c_size_t),
        ("selected", ctypes.c_int64),
        ("sorted", c_bool),
    ]


class llama_logit_bias(Structure):
    """typedef struct llama_logit_bias { llama_token token; float bias; }"""
    _fields_ = [
        ("token", llama_token),
        ("bias", c_float),
    ]


class llama_sampler_chain_params(Structure):
    """typedef struct llama_sampler_chain_params { bool no_perf; }"""
    _fields_ = [
        ("no_perf", c_bool),
    ]


class llama_chat_message(Structure):
    """typedef struct llama_chat_message { const char * role; const char * content; }"""
    _fields_ = [
        ("role", c_char_p),
        ("content", c_char_p),
    ]


class ggml_threadpool_params(Structure):
    """struct ggml_threadpool_params (ggml.h), filled by ggml_threadpool_params_init."""
    _fields_ = [
        ("cpumask", c_bool * GGML_MAX_N_THREADS),  # all false: the default affinity
        ("n_threads", c_int),
        ("prio", c_int),                        # enum ggml_sched_priority
        ("poll", c_uint32),                     # 0: no polling .. 100: aggressive
        ("strict_cpu", c_bool),
        ("paused", c_bool),
    ]


# The struct classes the layout test checks against llama.h (and the ggml.h it includes).
STRUCTS = (llama_model_params, llama_context_params, llama_batch, llama_token_data,
           llama_token_data_array, llama_logit_bias, llama_sampler_chain_params,
           llama_chat_message, ggml_threadpool_params, llama_model_kv_override,
           llama_model_tensor_buft_override)

# ---------------------------------------------------------------------------
# Prototypes: name -> (restype, argtypes), bound on first use
# ---------------------------------------------------------------------------

_PROTOTYPES = {
    # const char * llama_version(void);
    "llama_version": (c_char_p, []),
    # void llama_backend_init(void);
    "llama_backend_init": (None, []),
    # void llama_numa_init(enum ggml_numa_strategy numa);
    "llama_numa_init": (None, [enum_ggml_numa_strategy]),
    # void llama_log_set(ggml_log_callback log_callback, void * user_data);
    "llama_log_set": (None, [ggml_log_callback, c_void_p]),
    # struct llama_model_params llama_model_default_params(void);
    "llama_model_default_params": (llama_model_params, []),
    # struct llama_context_params llama_context_default_params(void);
    "llama_context_default_params": (llama_context_params, []),
    # struct llama_sampler_chain_params llama_sampler_chain_default_params(void);
    "llama_sampler_chain_default_params": (llama_sampler_chain_params, []),
    # size_t llama_max_devices(void);
    "llama_max_devices": (c_size_t, []),

    # --- model ---------------------------------------------------------------
    # struct llama_model * llama_model_load_from_file(const char * path_model, struct llama_model_params params);
    "llama_model_load_from_file": (llama_model_p, [c_char_p, llama_model_params]),
    # void llama_model_free(struct llama_model * model);
    "llama_model_free": (None, [llama_model_p]),
    # const struct llama_vocab * llama_model_get_vocab(const struct llama_model * model);
    "llama_model_get_vocab": (const_llama_vocab_p, [const_llama_model_p]),
    # int32_t llama_model_n_ctx_train(const struct llama_model * model);
    "llama_model_n_ctx_train": (c_int32, [const_llama_model_p]),
    # int32_t llama_model_n_embd(const struct llama_model * model);
    "llama_model_n_embd": (c_int32, [const_llama_model_p]),
    # int32_t llama_model_n_layer(const struct llama_model * model);
    "llama_model_n_layer": (c_int32, [const_llama_model_p]),
    # int32_t llama_model_n_embd_out(const struct llama_model * model);
    "llama_model_n_embd_out": (c_int32, [const_llama_model_p]),
    # int32_t llama_model_n_embd_inp(const struct llama_model * model);
    "llama_model_n_embd_inp": (c_int32, [const_llama_model_p]),
    # int32_t llama_model_n_swa(const struct llama_model * model);
    "llama_model_n_swa": (c_int32, [const_llama_model_p]),
    # bool llama_model_is_recurrent(const struct llama_model * model);
    "llama_model_is_recurrent": (c_bool, [const_llama_model_p]),
    # bool llama_model_is_hybrid(const struct llama_model * model);
    "llama_model_is_hybrid": (c_bool, [const_llama_model_p]),
    # bool llama_model_has_encoder(const struct llama_model * model);
    "llama_model_has_encoder": (c_bool, [const_llama_model_p]),
    # enum llama_rope_type llama_model_rope_type(const struct llama_model * model);
    "llama_model_rope_type": (c_int, [const_llama_model_p]),
    # uint64_t llama_model_n_params(const struct llama_model * model);
    "llama_model_n_params": (c_uint64, [const_llama_model_p]),
    # uint64_t llama_model_size(const struct llama_model * model);
    "llama_model_size": (c_uint64, [const_llama_model_p]),
    # int32_t llama_model_desc(const struct llama_model * model, char * buf, size_t buf_size);
    "llama_model_desc": (c_int32, [const_llama_model_p, char_buf, c_size_t]),
    # int32_t llama_model_meta_count(const struct llama_model * model);
    "llama_model_meta_count": (c_int32, [const_llama_model_p]),
    # int32_t llama_model_meta_key_by_index(const struct llama_model * model, int32_t i, char * buf, size_t buf_size);
    "llama_model_meta_key_by_index": (c_int32, [const_llama_model_p, c_int32, char_buf, c_size_t]),
    # int32_t llama_model_meta_val_str_by_index(const struct llama_model * model, int32_t i, char * buf, size_t buf_size);
    "llama_model_meta_val_str_by_index": (c_int32, [const_llama_model_p, c_int32, char_buf,
                                                    c_size_t]),
    # const char * llama_model_chat_template(const struct llama_model * model, const char * name);
    "llama_model_chat_template": (c_char_p, [const_llama_model_p, c_char_p]),

    # --- LoRA adapters (engine/adapters.py) ----------------------------------
    # struct llama_adapter_lora * llama_adapter_lora_init(struct llama_model * model, const char * path_lora);
    "llama_adapter_lora_init": (llama_adapter_lora_p, [llama_model_p, c_char_p]),
    # void llama_adapter_lora_free(struct llama_adapter_lora * adapter);
    "llama_adapter_lora_free": (None, [llama_adapter_lora_p]),
    # int32_t llama_adapter_meta_val_str(const struct llama_adapter_lora * adapter, const char * key, char * buf, size_t buf_size);
    "llama_adapter_meta_val_str": (c_int32, [const_llama_adapter_lora_p, c_char_p, char_buf,
                                             c_size_t]),
    # int32_t llama_set_adapters_lora(struct llama_context * ctx, struct llama_adapter_lora ** adapters, size_t n_adapters, float * scales);
    "llama_set_adapters_lora": (c_int32, [llama_context_p,
                                          _spelled(c_void_p, "struct llama_adapter_lora **"),
                                          c_size_t, float_p]),

    # --- control vectors (engine/controlvector.py) ---------------------------
    # int32_t llama_set_adapter_cvec(struct llama_context * ctx, const float * data, size_t len, int32_t n_embd, int32_t il_start, int32_t il_end);
    "llama_set_adapter_cvec": (c_int32, [llama_context_p, const_float_p, c_size_t, c_int32,
                                         c_int32, c_int32]),

    # --- vocab ---------------------------------------------------------------
    # int32_t llama_vocab_n_tokens(const struct llama_vocab * vocab);
    "llama_vocab_n_tokens": (c_int32, [const_llama_vocab_p]),
    # bool llama_vocab_is_eog(const struct llama_vocab * vocab, llama_token token);
    "llama_vocab_is_eog": (c_bool, [const_llama_vocab_p, llama_token]),
    # llama_token llama_vocab_bos(const struct llama_vocab * vocab); (and eos, eot, nl)
    "llama_vocab_bos": (llama_token, [const_llama_vocab_p]),
    "llama_vocab_eos": (llama_token, [const_llama_vocab_p]),
    "llama_vocab_eot": (llama_token, [const_llama_vocab_p]),
    "llama_vocab_nl": (llama_token, [const_llama_vocab_p]),
    # llama_token llama_vocab_sep(const struct llama_vocab * vocab);
    "llama_vocab_sep": (llama_token, [const_llama_vocab_p]),
    # bool llama_vocab_get_add_bos(const struct llama_vocab * vocab); (and add_eos, add_sep)
    "llama_vocab_get_add_bos": (c_bool, [const_llama_vocab_p]),
    "llama_vocab_get_add_eos": (c_bool, [const_llama_vocab_p]),
    "llama_vocab_get_add_sep": (c_bool, [const_llama_vocab_p]),
    # llama_token llama_vocab_fim_pre(const struct llama_vocab * vocab); (and suf, mid, pad, rep, sep)
    "llama_vocab_fim_pre": (llama_token, [const_llama_vocab_p]),
    "llama_vocab_fim_suf": (llama_token, [const_llama_vocab_p]),
    "llama_vocab_fim_mid": (llama_token, [const_llama_vocab_p]),
    "llama_vocab_fim_pad": (llama_token, [const_llama_vocab_p]),
    "llama_vocab_fim_rep": (llama_token, [const_llama_vocab_p]),
    "llama_vocab_fim_sep": (llama_token, [const_llama_vocab_p]),

    # --- tokenization ----------------------------------------------------------
    # int32_t llama_tokenize(const struct llama_vocab * vocab, const char * text, int32_t text_len,
    #                        llama_token * tokens, int32_t n_tokens_max, bool add_special, bool parse_special);
    "llama_tokenize": (c_int32, [const_llama_vocab_p, c_char_p, c_int32, llama_token_p, c_int32,
                                 c_bool, c_bool]),
    # int32_t llama_token_to_piece(const struct llama_vocab * vocab, llama_token token, char * buf,
    #                              int32_t length, int32_t lstrip, bool special);
    "llama_token_to_piece": (c_int32, [const_llama_vocab_p, llama_token, char_buf, c_int32, c_int32,
                                       c_bool]),
    # int32_t llama_detokenize(const struct llama_vocab * vocab, const llama_token * tokens, int32_t n_tokens,
    #                          char * text, int32_t text_len_max, bool remove_special, bool unparse_special);
    "llama_detokenize": (c_int32, [const_llama_vocab_p, const_llama_token_p, c_int32, char_buf,
                                   c_int32, c_bool, c_bool]),

    # --- context ---------------------------------------------------------------
    # struct llama_context * llama_init_from_model(struct llama_model * model, struct llama_context_params params);
    "llama_init_from_model": (llama_context_p, [llama_model_p, llama_context_params]),
    # struct llama_context * llama_init_from_model_streams(struct llama_model * model,
    #         struct llama_context_params params, uint32_t n_seq_per_stream);
    # (offgrid's scripts/patches/0005: sequences s*n .. s*n+n-1 share KV stream s)
    "llama_init_from_model_streams": (llama_context_p, [llama_model_p, llama_context_params,
                                                        c_uint32]),
    # void llama_free(struct llama_context * ctx);
    "llama_free": (None, [llama_context_p]),
    # uint32_t llama_n_ctx(const struct llama_context * ctx);
    "llama_n_ctx": (c_uint32, [const_llama_context_p]),
    # uint32_t llama_n_rs_seq(const struct llama_context * ctx);
    "llama_n_rs_seq": (c_uint32, [const_llama_context_p]),
    # uint32_t llama_n_batch(const struct llama_context * ctx);
    "llama_n_batch": (c_uint32, [const_llama_context_p]),
    # uint32_t llama_n_ubatch(const struct llama_context * ctx);
    "llama_n_ubatch": (c_uint32, [const_llama_context_p]),
    # llama_memory_t llama_get_memory(const struct llama_context * ctx);
    "llama_get_memory": (llama_memory_t, [const_llama_context_p]),
    # void llama_set_abort_callback(struct llama_context * ctx, ggml_abort_callback abort_callback, void * abort_callback_data);
    "llama_set_abort_callback": (None, [llama_context_p, ggml_abort_callback_p, c_void_p]),
    # void llama_attach_threadpool(struct llama_context * ctx, ggml_threadpool_t threadpool,
    #                              ggml_threadpool_t threadpool_batch);
    "llama_attach_threadpool": (None, [llama_context_p, ggml_threadpool_t, ggml_threadpool_t]),
    # void llama_set_n_threads(struct llama_context * ctx, int32_t n_threads,
    #                          int32_t n_threads_batch);
    "llama_set_n_threads": (None, [llama_context_p, c_int32, c_int32]),
    # struct llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max);
    "llama_batch_init": (llama_batch, [c_int32, c_int32, c_int32]),
    # void llama_batch_free(struct llama_batch batch);
    "llama_batch_free": (None, [llama_batch]),
    # int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);
    "llama_decode": (c_int32, [llama_context_p, llama_batch]),
    # float * llama_get_logits_ith(struct llama_context * ctx, int32_t i);
    "llama_get_logits_ith": (float_p, [llama_context_p, c_int32]),
    # enum llama_pooling_type llama_pooling_type(const struct llama_context * ctx);
    "llama_pooling_type": (enum_llama_pooling_type, [const_llama_context_p]),
    # bool llama_get_causal_attn(const struct llama_context * ctx);
    "llama_get_causal_attn": (c_bool, [const_llama_context_p]),
    # float * llama_get_embeddings(struct llama_context * ctx);
    "llama_get_embeddings": (float_p, [llama_context_p]),
    # float * llama_get_embeddings_seq(struct llama_context * ctx, llama_seq_id seq_id);
    "llama_get_embeddings_seq": (float_p, [llama_context_p, llama_seq_id]),

    # --- memory (KV cache) -----------------------------------------------------
    # void llama_memory_clear(llama_memory_t mem, bool data);
    "llama_memory_clear": (None, [llama_memory_t, c_bool]),
    # bool llama_memory_seq_rm(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
    "llama_memory_seq_rm": (c_bool, [llama_memory_t, llama_seq_id, llama_pos, llama_pos]),
    # void llama_memory_seq_cp(llama_memory_t mem, llama_seq_id seq_id_src, llama_seq_id seq_id_dst,
    #                          llama_pos p0, llama_pos p1);
    "llama_memory_seq_cp": (None, [llama_memory_t, llama_seq_id, llama_seq_id, llama_pos, llama_pos]),
    # void llama_memory_seq_add(llama_memory_t mem, llama_seq_id seq_id, llama_pos p0, llama_pos p1, llama_pos delta);
    "llama_memory_seq_add": (None, [llama_memory_t, llama_seq_id, llama_pos, llama_pos, llama_pos]),
    # llama_pos llama_memory_seq_pos_min(llama_memory_t mem, llama_seq_id seq_id);
    "llama_memory_seq_pos_min": (llama_pos, [llama_memory_t, llama_seq_id]),
    # llama_pos llama_memory_seq_pos_max(llama_memory_t mem, llama_seq_id seq_id);
    "llama_memory_seq_pos_max": (llama_pos, [llama_memory_t, llama_seq_id]),
    # bool llama_memory_can_shift(llama_memory_t mem);
    "llama_memory_can_shift": (c_bool, [llama_memory_t]),

    # --- one sequence's state (engine/statecache.py) ---------------------------
    # size_t llama_state_seq_get_size_ext(struct llama_context * ctx, llama_seq_id seq_id,
    #                                     llama_state_seq_flags flags);
    "llama_state_seq_get_size_ext": (c_size_t, [llama_context_p, llama_seq_id, c_uint32]),
    # size_t llama_state_seq_get_data_ext(struct llama_context * ctx, uint8_t * dst, size_t size,
    #                                     llama_seq_id seq_id, llama_state_seq_flags flags);
    "llama_state_seq_get_data_ext": (c_size_t, [llama_context_p, uint8_p, c_size_t, llama_seq_id,
                                                c_uint32]),
    # size_t llama_state_seq_set_data_ext(struct llama_context * ctx, const uint8_t * src,
    #                                     size_t size, llama_seq_id dest_seq_id,
    #                                     llama_state_seq_flags flags);
    "llama_state_seq_set_data_ext": (c_size_t, [llama_context_p, const_uint8_p, c_size_t,
                                                llama_seq_id, c_uint32]),

    # --- sampling --------------------------------------------------------------
    # struct llama_sampler * llama_sampler_chain_init(struct llama_sampler_chain_params params);
    "llama_sampler_chain_init": (llama_sampler_p, [llama_sampler_chain_params]),
    # void llama_sampler_chain_add(struct llama_sampler * chain, struct llama_sampler * smpl);
    "llama_sampler_chain_add": (None, [llama_sampler_p, llama_sampler_p]),
    # void llama_sampler_free(struct llama_sampler * smpl);
    "llama_sampler_free": (None, [llama_sampler_p]),
    # void llama_sampler_accept(struct llama_sampler * smpl, llama_token token);
    "llama_sampler_accept": (None, [llama_sampler_p, llama_token]),
    # void llama_sampler_apply(struct llama_sampler * smpl, llama_token_data_array * cur_p);
    "llama_sampler_apply": (None, [llama_sampler_p, POINTER(llama_token_data_array)]),
    # llama_token llama_sampler_sample(struct llama_sampler * smpl, struct llama_context * ctx, int32_t idx);
    "llama_sampler_sample": (llama_token, [llama_sampler_p, llama_context_p, c_int32]),
    # struct llama_sampler * llama_sampler_init_greedy(void);
    "llama_sampler_init_greedy": (llama_sampler_p, []),
    # struct llama_sampler * llama_sampler_init_dist(uint32_t seed);
    "llama_sampler_init_dist": (llama_sampler_p, [c_uint32]),
    # struct llama_sampler * llama_sampler_init_top_k(int32_t k);
    "llama_sampler_init_top_k": (llama_sampler_p, [c_int32]),
    # struct llama_sampler * llama_sampler_init_top_p(float p, size_t min_keep);
    "llama_sampler_init_top_p": (llama_sampler_p, [c_float, c_size_t]),
    # struct llama_sampler * llama_sampler_init_min_p(float p, size_t min_keep);
    "llama_sampler_init_min_p": (llama_sampler_p, [c_float, c_size_t]),
    # struct llama_sampler * llama_sampler_init_typical(float p, size_t min_keep);
    "llama_sampler_init_typical": (llama_sampler_p, [c_float, c_size_t]),
    # struct llama_sampler * llama_sampler_init_temp_ext(float t, float delta, float exponent);
    "llama_sampler_init_temp_ext": (llama_sampler_p, [c_float, c_float, c_float]),
    # struct llama_sampler * llama_sampler_init_temp(float t);
    "llama_sampler_init_temp": (llama_sampler_p, [c_float]),
    # struct llama_sampler * llama_sampler_init_xtc(float p, float t, size_t min_keep, uint32_t seed);
    "llama_sampler_init_xtc": (llama_sampler_p, [c_float, c_float, c_size_t, c_uint32]),
    # struct llama_sampler * llama_sampler_init_top_n_sigma(float n);
    "llama_sampler_init_top_n_sigma": (llama_sampler_p, [c_float]),
    # struct llama_sampler * llama_sampler_init_mirostat(int32_t n_vocab, uint32_t seed,
    #                                                    float tau, float eta, int32_t m);
    "llama_sampler_init_mirostat": (llama_sampler_p, [c_int32, c_uint32, c_float, c_float,
                                                      c_int32]),
    # struct llama_sampler * llama_sampler_init_mirostat_v2(uint32_t seed, float tau, float eta);
    "llama_sampler_init_mirostat_v2": (llama_sampler_p, [c_uint32, c_float, c_float]),
    # struct llama_sampler * llama_sampler_init_penalties(int32_t n_vocab, int32_t penalty_last_n,
    #                         float penalty_repeat, float penalty_freq, float penalty_present);
    "llama_sampler_init_penalties": (llama_sampler_p, [c_int32, c_int32, c_float, c_float, c_float]),
    # struct llama_sampler * llama_sampler_init_logit_bias(int32_t n_vocab, int32_t n_logit_bias,
    #                                                      const llama_logit_bias * logit_bias);
    "llama_sampler_init_logit_bias": (llama_sampler_p, [
        c_int32, c_int32, _spelled(POINTER(llama_logit_bias), "const llama_logit_bias *")]),
    # struct llama_sampler * llama_sampler_init_infill(const struct llama_vocab * vocab);
    "llama_sampler_init_infill": (llama_sampler_p, [const_llama_vocab_p]),
    # struct llama_sampler * llama_sampler_init_grammar(const struct llama_vocab * vocab,
    #                                                   const char * grammar_str, const char * grammar_root);
    "llama_sampler_init_grammar": (llama_sampler_p, [const_llama_vocab_p, c_char_p, c_char_p]),
    # struct llama_sampler * llama_sampler_init_grammar_lazy_patterns(
    #         const struct llama_vocab * vocab, const char * grammar_str, const char * grammar_root,
    #         const char ** trigger_patterns, size_t num_trigger_patterns,
    #         const llama_token * trigger_tokens, size_t num_trigger_tokens);
    "llama_sampler_init_grammar_lazy_patterns": (
        llama_sampler_p, [const_llama_vocab_p, c_char_p, c_char_p, const_char_pp, c_size_t,
                          const_llama_token_p, c_size_t]),

    # --- chat templates --------------------------------------------------------
    # int32_t llama_chat_apply_template(const char * tmpl, const struct llama_chat_message * chat, size_t n_msg,
    #                                   bool add_ass, char * buf, int32_t length);
    "llama_chat_apply_template": (c_int32, [
        c_char_p, _spelled(POINTER(llama_chat_message), "const struct llama_chat_message *"),
        c_size_t, c_bool, char_buf, c_int32]),
    # int32_t llama_chat_builtin_templates(const char ** output, size_t len);
    "llama_chat_builtin_templates": (c_int32, [const_char_pp, c_size_t]),
}

# From libggml and the libggml-base it links (a portable build loads its CPU
# backend variants at run time, so the CPU backend's own functions are found
# through the backend registry rather than by symbol):
_GGML_PROTOTYPES = {
    # void ggml_backend_load_all_from_path(const char * dir_path);
    "ggml_backend_load_all_from_path": (None, [c_char_p]),
    # ggml_backend_dev_t ggml_backend_dev_by_type(enum ggml_backend_dev_type type);
    "ggml_backend_dev_by_type": (ggml_backend_dev_t, [enum_ggml_backend_dev_type]),
    # ggml_backend_reg_t ggml_backend_dev_backend_reg(ggml_backend_dev_t device);
    "ggml_backend_dev_backend_reg": (ggml_backend_reg_t, [ggml_backend_dev_t]),
    # void * ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name);
    "ggml_backend_reg_get_proc_address": (c_void_p, [ggml_backend_reg_t, c_char_p]),
    # void ggml_threadpool_params_init(struct ggml_threadpool_params * p, int n_threads);
    "ggml_threadpool_params_init": (None, [POINTER(ggml_threadpool_params), c_int]),
    # ggml_abort_callback_t ggml_set_abort_callback(ggml_abort_callback_t callback);
    "ggml_set_abort_callback": (_spelled(c_void_p, "ggml_abort_callback_t"),
                                [ggml_abort_callback_t]),
    # ggml_backend_reg_t ggml_backend_reg_by_name(const char * name);
    "ggml_backend_reg_by_name": (ggml_backend_reg_t, [c_char_p]),
    # size_t ggml_backend_reg_dev_count(ggml_backend_reg_t reg);
    "ggml_backend_reg_dev_count": (c_size_t, [ggml_backend_reg_t]),
    # ggml_backend_dev_t ggml_backend_reg_dev_get(ggml_backend_reg_t reg, size_t index);
    "ggml_backend_reg_dev_get": (ggml_backend_dev_t, [ggml_backend_reg_t, c_size_t]),
    # const char * ggml_backend_dev_name(ggml_backend_dev_t device);
    "ggml_backend_dev_name": (c_char_p, [ggml_backend_dev_t]),
    # const char * ggml_backend_dev_description(ggml_backend_dev_t device);
    "ggml_backend_dev_description": (c_char_p, [ggml_backend_dev_t]),
    # void ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);
    "ggml_backend_dev_memory": (None, [ggml_backend_dev_t, POINTER(c_size_t), POINTER(c_size_t)]),
    # the devices a build's backends registered (a GPU build's Vulkan or CUDA
    # devices), for -dev, --list-devices and the default device list:
    # size_t ggml_backend_dev_count(void);
    "ggml_backend_dev_count": (c_size_t, []),
    # ggml_backend_dev_t ggml_backend_dev_get(size_t index);
    "ggml_backend_dev_get": (ggml_backend_dev_t, [c_size_t]),
    # enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);
    "ggml_backend_dev_type": (enum_ggml_backend_dev_type, [ggml_backend_dev_t]),
    # ggml_backend_buffer_type_t ggml_backend_dev_buffer_type(ggml_backend_dev_t device);
    "ggml_backend_dev_buffer_type": (ggml_backend_buffer_type_t, [ggml_backend_dev_t]),
    # const char * ggml_backend_buft_name(ggml_backend_buffer_type_t buft);
    "ggml_backend_buft_name": (c_char_p, [ggml_backend_buffer_type_t]),
    # const char * ggml_backend_reg_name(ggml_backend_reg_t reg);
    "ggml_backend_reg_name": (c_char_p, [ggml_backend_reg_t]),
    # size_t ggml_backend_reg_count(void);
    "ggml_backend_reg_count": (c_size_t, []),
    # ggml_backend_reg_t ggml_backend_reg_get(size_t index);
    "ggml_backend_reg_get": (ggml_backend_reg_t, [c_size_t]),
}

# Found through the CPU backend's registry entry (ggml-cpu.h), so called
# through these function types rather than bound by name:
_PROC_PROTOTYPES = {
    # struct ggml_threadpool * ggml_threadpool_new(struct ggml_threadpool_params * params);
    "ggml_threadpool_new": (_spelled(c_void_p, "struct ggml_threadpool *"),
                            [POINTER(ggml_threadpool_params)]),
    # void ggml_threadpool_free(struct ggml_threadpool * threadpool);
    "ggml_threadpool_free": (None, [_spelled(c_void_p, "struct ggml_threadpool *")]),
    # void ggml_threadpool_pause(struct ggml_threadpool * threadpool);  (our patch 0003)
    "ggml_threadpool_pause": (None, [_spelled(c_void_p, "struct ggml_threadpool *")]),
    # the RPC backend's registry entry (ggml-rpc.h):
    # ggml_backend_reg_t ggml_backend_rpc_add_server(const char * endpoint);
    "ggml_backend_rpc_add_server": (ggml_backend_reg_t, [c_char_p]),
}


def _proc_type(name):
    restype, argtypes = _PROC_PROTOTYPES[name]
    return CFUNCTYPE(_abi(restype), *[_abi(t) for t in argtypes])


_ggml_threadpool_new = _proc_type("ggml_threadpool_new")
_ggml_threadpool_free = _proc_type("ggml_threadpool_free")
_ggml_threadpool_pause = _proc_type("ggml_threadpool_pause")
_ggml_backend_rpc_add_server = _proc_type("ggml_backend_rpc_add_server")


class Library:
    """A loaded libllama: its C functions as attributes, bound on first use.

    ``lib.llama_decode(ctx, batch)`` calls the C function with the prototype
    from ``_PROTOTYPES``; a symbol the library lacks raises LibraryError naming
    it, at the first call, not at load.
    """

    def __init__(self, cdll, path, ggml=None):
        self._cdll = cdll
        self._ggml = ggml
        self.path = path
        self.fallback = None    # why a GPU build was passed over for the CPU's (load())

    def __getattr__(self, name):
        table, dll = ((_PROTOTYPES, self._cdll) if name in _PROTOTYPES
                      else (_GGML_PROTOTYPES, self._ggml))
        if name not in table or dll is None:
            raise AttributeError(name)
        try:
            fn = getattr(dll, name)
        except AttributeError:
            raise LibraryError("libllama at %s lacks the symbol %s; rebuild it with `make lib`"
                               % (self.path, name)) from None
        restype, argtypes = table[name]
        fn.restype, fn.argtypes = _abi(restype), [_abi(t) for t in argtypes]
        setattr(self, name, fn)     # next lookups skip __getattr__
        return fn


# ---------------------------------------------------------------------------
# Loading the library
# ---------------------------------------------------------------------------

_lock = threading.Lock()
_loaded = None          # the Library, once loaded
_log_callback = None    # kept alive: libllama holds the C pointer
_verbose = False


def _candidates(explicit):
    """Yield the places to look for libllama, in order."""
    if explicit:
        yield Path(explicit)
        return
    env = os.environ.get("OFFGRID_LIB")
    if env:
        yield Path(env)
        return
    here = Path(__file__).resolve().parent
    yield here.parent / "lib"
    yield here / "lib"
    found = ctypes.util.find_library("llama")
    yield Path(found or "libllama.so")


def _open(path):
    """dlopen one candidate; a directory means libllama.so inside it."""
    if path.is_dir():
        path = path / "libllama.so"
    if path.is_absolute() or "/" in str(path):
        if not path.exists():
            raise OSError("no such file")
        # A prebuilt library dropped in without an rpath still finds its ggml
        # siblings if we load them first, globally, from the same folder.
        for sibling in ("libggml-base.so", "libggml.so"):
            if (path.parent / sibling).exists():
                ctypes.CDLL(str(path.parent / sibling), mode=ctypes.RTLD_GLOBAL)
    cdll = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    ggml = None
    try:
        ggml = ctypes.CDLL(str(path.parent / "libggml.so") if "/" in str(path) else "libggml.so")
    except OSError:
        pass
    return cdll, ggml, path


# A GPU build's libggml links its driver's library: where the machine has no
# such driver, dlopen fails on it, and the CPU build beside (lib/ for
# lib/cuda/, as `make lib GPU=...` installs them) serves instead.
_DRIVER_LIB = re.compile(r"lib(?:cuda|vulkan)\.so\.1")


def _cpu_build_beside(candidate, error):
    """(the CPU build's folder to load instead of ``candidate``, the driver's
    library it lacks) for a GPU build that failed to load for want of that
    library; (None, None) otherwise."""
    driver = _DRIVER_LIB.search(str(error))
    if not driver:
        return None, None
    folder = candidate if candidate.is_dir() else candidate.parent
    cpu = folder.parent
    if cpu == folder or not (cpu / "libllama.so").exists():
        return None, None
    return cpu, driver.group(0)


def load(path=None, verbose=False):
    """Load libllama once per process and return the Library.

    Raises LibraryError listing every path tried when none loads, or naming the
    found and expected versions when they differ.
    """
    global _loaded, _verbose
    with _lock:
        if _loaded is not None:
            return _loaded
        _verbose = verbose
        tried = []
        fallback = None
        for candidate in _candidates(path):
            try:
                cdll, ggml, real = _open(candidate)
                break
            except OSError as e:
                tried.append("%s (%s)" % (candidate, e))
                cpu, driver = _cpu_build_beside(candidate, e)
                if cpu is not None:
                    try:
                        cdll, ggml, real = _open(cpu)
                    except OSError as e2:
                        tried.append("%s (%s)" % (cpu, e2))
                        continue
                    fallback = ("this libllama (%s) needs %s, the driver's, which this "
                                "machine lacks; serving on the CPU with %s"
                                % (candidate, driver, real))
                    break
        else:
            raise LibraryError(
                "could not load libllama; tried:\n  " + "\n  ".join(tried)
                + "\nbuild it with `make lib`, or give its path with --lib or OFFGRID_LIB")
        lib = Library(cdll, real, ggml)
        lib.fallback = fallback
        version = lib.llama_version().decode()
        if version != EXPECTED_VERSION and os.environ.get(ALLOW_ANY_ENV) != "1":
            raise LibraryError(
                "libllama at %s is version %s, but offgrid's bindings are written for %s; "
                "its structs may differ, so it is not used. Rebuild the pinned one with "
                "`make lib`, or set %s=1 to try it anyway"
                % (real, version, EXPECTED_VERSION, ALLOW_ANY_ENV))
        _install_log_callback(lib)
        # A portable build keeps its CPU backends as separate libggml-cpu-*.so
        # variants that must be loaded (the best one for this CPU) before use.
        folder = real.parent if "/" in str(real) else None
        if folder is not None and any(folder.glob("libggml-cpu-*.so")):
            lib.ggml_backend_load_all_from_path(str(folder).encode())
        lib.llama_backend_init()
        _loaded = lib
        return lib


def loaded():
    """The Library loaded by load(), loading it from the default places if needed."""
    return _loaded if _loaded is not None else load()


# What libllama logs, as errors, when a decode stops because offgrid aborted
# it: a cancelled request, which an editor makes on nearly every keystroke.
# (GGML_STATUS_ABORTED is 1; llama_decode returns 2.)  They are dropped only
# while some context's abort flag is set, i.e. while the abort is ours.
_ABORT_LINES = frozenset((
    b"graph_compute: ggml_backend_sched_graph_compute_async failed with error 1\n",
    b"process_ubatch: failed to compute graph, compute status: 1\n",
    b"llama_decode: failed to decode, ret = 2\n",
))
_aborts_lock = threading.Lock()
_aborts_set = 0         # contexts whose abort flag is set (ContextHandle.request_abort)


def _install_log_callback(lib):
    """Route libllama's log lines to stderr, dropping chatter unless verbose."""
    global _log_callback
    state = {"keep": True}

    def on_log(level, text, _user_data):
        # CONT continues the previous line at the previous line's level.
        if level != GGML_LOG_LEVEL_CONT:
            state["keep"] = _verbose or (level >= GGML_LOG_LEVEL_ERROR and not (
                _aborts_set and text in _ABORT_LINES))
        if state["keep"] and text:
            sys.stderr.write(text.decode("utf-8", "replace"))

    _log_callback = ggml_log_callback(on_log)
    lib.llama_log_set(_log_callback, None)


# ---------------------------------------------------------------------------
# Helpers that hide C buffers from the layers above
# ---------------------------------------------------------------------------

def read_string(fn, *args, size=256):
    """Call a ``fn(..., char * buf, size_t size) -> length`` function and return a str.

    Returns None when the function reports failure (-1).  Grows the buffer when
    the value is longer than it.
    """
    while True:
        buf = ctypes.create_string_buffer(size)
        n = fn(*args, buf, size)
        if n < 0:
            return None
        if n < size:
            return buf.raw[:n].decode("utf-8", "replace")
        size = n + 1


def init_grammar_sampler(lib, vocab, grammar, trigger_patterns=()):
    """A grammar sampler (NULL when libllama rejects the GBNF); lazy with triggers.

    A lazy grammar lets everything through until the output so far matches
    one of ``trigger_patterns`` (ECMAScript regexes, searched from the start
    of the output), then constrains the rest, from the match on.  libllama
    compiles the patterns with std::regex and an invalid one throws through
    the C API, so only offgrid's own fixed patterns may reach here.
    """
    g = grammar.encode("utf-8")
    if not trigger_patterns:
        return lib.llama_sampler_init_grammar(vocab, g, b"root")
    patterns = [p.encode("utf-8") for p in trigger_patterns]
    arr = (c_char_p * len(patterns))(*patterns)
    return lib.llama_sampler_init_grammar_lazy_patterns(vocab, g, b"root", arr, len(patterns),
                                                        None, 0)


def chat_apply_template(lib, template, messages, add_assistant):
    """libllama's built-in (non-Jinja) template by name or text.

    ``messages`` is a list of (role, content) str pairs.  Returns the prompt, or
    None when libllama does not know the template.
    """
    arr = (llama_chat_message * len(messages))()
    keep = []   # the encoded strings must outlive the call
    for i, (role, content) in enumerate(messages):
        r, c = role.encode(), content.encode()
        keep += [r, c]
        arr[i].role, arr[i].content = r, c
    tmpl = template.encode() if template is not None else None
    size = 2 * sum(len(c) for c in keep) + 256
    while True:
        buf = ctypes.create_string_buffer(size)
        n = lib.llama_chat_apply_template(tmpl, arr, len(messages), add_assistant, buf, size)
        if n < 0:
            return None
        if n <= size:
            return buf.raw[:n].decode("utf-8", "replace")
        size = n


def builtin_chat_templates(lib):
    """Names of the templates llama_chat_apply_template knows."""
    n = lib.llama_chat_builtin_templates(None, 0)
    arr = (c_char_p * n)()
    lib.llama_chat_builtin_templates(arr, n)
    return [name.decode() for name in arr]


class ModelHandle:
    """Owns one ``struct llama_model *``; close() frees it exactly once.

    Its vocabulary (``const struct llama_vocab *``) belongs to the model and
    lives as long as it; ``vocab`` is that pointer, opaque, for the sampler
    constructors that take it.  Every query the engine makes of the model or
    its vocabulary is a method here.
    """

    def __init__(self, lib, path, progress=None, vocab_only=False, devices=(), n_gpu_layers=None,
                 tensor_split=None, repack=True, split_mode=None, main_gpu=0, kv_offload=True,
                 kv_overrides=(), load_mode="auto", tensor_overrides=(), lazy_mode="auto",
                 check_tensors=False, rope=None):
        """Load ``path``; ``progress(fraction)`` is called while loading.

        ``vocab_only`` loads the tokenizer and metadata but no weights: enough
        to tokenize, not to create a context.

        ``devices`` (Device objects: local_devices(), rpc_devices()) are the
        model's device list, passed to libllama as it is (never its own default
        pick); without any the model is on the CPU alone.  ``n_gpu_layers`` of
        its layers go to them (None or negative: all, the output layer
        counting as one, as llama.h says), the last ones: the first stay on
        the CPU.  ``tensor_split`` gives each device's proportion of them, in
        ``devices`` order (None: by the memory each reports free).

        ``repack`` False keeps the CPU's weights as the file has them rather
        than repacked for its faster kernels (llama-server's --no-repack):
        those sum in another order, and an rpc-server never repacks.

        ``split_mode`` is enum llama_split_mode (None: libllama's default,
        by layer); with 0 (none) the whole offloaded part goes to
        ``devices[main_gpu]``.  ``kv_offload`` False keeps the KV cache of
        every context made from this model in host memory, whatever device
        holds a layer (llama-server's --no-kv-offload): ContextHandle reads it.

        ``kv_overrides``: (key, type, value) metadata in place of the file's
        (llama-server's --override-kv; type a word of KV_OVERRIDE_TYPES, the
        key and a str value under 128 bytes).  ``load_mode``: a word of
        LOAD_MODES (llama-server's -lm: mmap, mlock, dio, ...).
        ``tensor_overrides``: (regex, buffer type) pairs, buffer_types()'s values
        (llama-server's -ot): the tensors whose names match go there.
        """
        self.lib = lib
        params = lib.llama_model_default_params()
        params.vocab_only = vocab_only
        params.use_extra_bufts = repack
        params.load_mode = LOAD_MODES[load_mode]
        params.lazy_mode = LAZY_MODES[lazy_mode]
        params.check_tensors = bool(check_tensors)      # --check-tensors: NaN, inf refused
        self.vocab_only = vocab_only
        self.kv_offload = kv_offload
        # --rope-*, --yarn-*: {ROPE_PARAMS field: value} for every context of this model
        self.rope = {k: ROPE_SCALING_TYPES[v] if k == "rope_scaling_type" else v
                     for k, v in (rope or {}).items() if k in ROPE_PARAMS}
        # the arrays libllama reads while loading (it copies the device list)
        keep = []
        if not vocab_only:
            # an explicit list, empty too: libllama's own pick (devices NULL)
            # would take a GPU build's devices where the caller gave none
            arr = (c_void_p * (len(devices) + 1))(*[d.ptr for d in devices], None)
            keep.append(arr)
            params.devices = ctypes.cast(arr, c_void_p)
        if devices and not vocab_only:
            params.n_gpu_layers = -1 if n_gpu_layers is None or n_gpu_layers < 0 else n_gpu_layers
            if split_mode is not None:
                params.split_mode = split_mode
            params.main_gpu = main_gpu
            if tensor_split:
                n_max = lib.llama_max_devices()
                if len(tensor_split) > n_max:
                    raise ValueError("--tensor-split has %d proportions; libllama takes at most %d"
                                     % (len(tensor_split), n_max))
                split = (c_float * n_max)(*tensor_split)
                keep.append(split)
                params.tensor_split = ctypes.cast(split, POINTER(c_float))
        else:
            params.n_gpu_layers = 0      # no devices: the CPU holds every layer
        if kv_overrides:
            arr = (llama_model_kv_override * (len(kv_overrides) + 1))()
            for o, (key, kind, value) in zip(arr, kv_overrides):
                o.tag, o.key = KV_OVERRIDE_TYPES[kind], key.encode()
                if kind == "int":
                    o.val_i64 = value
                elif kind == "float":
                    o.val_f64 = value
                elif kind == "bool":
                    o.val_bool = value
                else:
                    o.val_str = value.encode()
            keep.append(arr)
            params.kv_overrides = ctypes.cast(arr, c_void_p)
        if tensor_overrides and not vocab_only:
            arr = (llama_model_tensor_buft_override * (len(tensor_overrides) + 1))(
                *[(pattern.encode(), buft) for pattern, buft in tensor_overrides], (None, None))
            keep.append(arr)
            params.tensor_buft_overrides = ctypes.cast(arr, c_void_p)
        if progress is not None:
            def on_progress(fraction, _user_data):
                progress(fraction)
                return True
            # Keep the C callback alive for as long as loading runs.
            self._progress_cb = llama_progress_callback(on_progress)
            params.progress_callback = self._progress_cb
        self.ptr = lib.llama_model_load_from_file(os.fsencode(path), params)
        self._progress_cb = None
        self.vocab = lib.llama_model_get_vocab(self.ptr) if self.ptr else None

    def close(self):
        ptr, self.ptr = self.ptr, None
        self.vocab = None
        if ptr:
            self.lib.llama_model_free(ptr)

    # -- the model -----------------------------------------------------------
    def n_ctx_train(self):
        return self.lib.llama_model_n_ctx_train(self.ptr)

    def n_embd(self):
        return self.lib.llama_model_n_embd(self.ptr)

    def n_layer(self):
        return self.lib.llama_model_n_layer(self.ptr)

    def n_embd_out(self):
        """The size of the model's output embeddings (n_embd, save for a few architectures)."""
        return self.lib.llama_model_n_embd_out(self.ptr)

    def n_embd_inp(self):
        """The width of an embedding the model takes as input (an image's: n_embd, or
        more where a projector feeds later layers too, as Qwen3-VL's deepstack)."""
        return self.lib.llama_model_n_embd_inp(self.ptr)

    def n_swa(self):
        """The sliding attention window, 0 where the model has none."""
        return self.lib.llama_model_n_swa(self.ptr)

    def is_recurrent(self):
        """Whether the model's whole memory is recurrent state (Mamba, RWKV)."""
        return bool(self.lib.llama_model_is_recurrent(self.ptr))

    def has_encoder(self):
        """An encoder whose output the decoder reads (T5, and llama.cpp's EAGLE3 and
        DFlash drafters): each generation needs llama_encode first."""
        return bool(self.lib.llama_model_has_encoder(self.ptr))

    def is_hybrid(self):
        """Whether the model keeps recurrent state beside its attention's cache."""
        return bool(self.lib.llama_model_is_hybrid(self.ptr))

    def rope_type(self):
        """enum llama_rope_type: -1 none, 0 norm, 2 neox, 8 mrope, 24 vision, 40 imrope."""
        return self.lib.llama_model_rope_type(self.ptr)

    def n_params(self):
        return self.lib.llama_model_n_params(self.ptr)

    def size(self):
        """Bytes of the weights."""
        return self.lib.llama_model_size(self.ptr)

    def desc(self):
        return read_string(self.lib.llama_model_desc, self.ptr)

    def meta(self):
        """The GGUF metadata, key -> value rendered as a string."""
        lib, out = self.lib, {}
        for i in range(lib.llama_model_meta_count(self.ptr)):
            key = read_string(lib.llama_model_meta_key_by_index, self.ptr, i)
            val = read_string(lib.llama_model_meta_val_str_by_index, self.ptr, i, size=1024)
            if key is not None:
                out[key] = val
        return out

    def chat_template(self, name=None):
        """The model's (default or named) chat template text, or None."""
        tmpl = self.lib.llama_model_chat_template(self.ptr, name.encode() if name else None)
        return tmpl.decode("utf-8", "replace") if tmpl else None

    # -- the vocabulary ------------------------------------------------------
    def n_vocab(self):
        return self.lib.llama_vocab_n_tokens(self.vocab)

    # the special tokens special_tokens() reads, by the suffix of their getter
    SPECIAL_TOKENS = ("bos", "eos", "eot", "sep", "nl", "fim_pre", "fim_suf", "fim_mid", "fim_pad",
                      "fim_rep", "fim_sep")

    def special_tokens(self):
        """{name: id} for SPECIAL_TOKENS, as libllama reports them (-1 where absent)."""
        lib = self.lib
        return {name: getattr(lib, "llama_vocab_" + name)(self.vocab)
                for name in self.SPECIAL_TOKENS}

    def add_bos(self):
        return bool(self.lib.llama_vocab_get_add_bos(self.vocab))

    def add_eos(self):
        return bool(self.lib.llama_vocab_get_add_eos(self.vocab))

    def add_sep(self):
        return bool(self.lib.llama_vocab_get_add_sep(self.vocab))

    def is_eog(self, token):
        return bool(self.lib.llama_vocab_is_eog(self.vocab, token))

    def tokenize(self, data, add_special, parse_special):
        """Tokenize UTF-8 bytes; returns a list of token ids."""
        capacity = len(data) + 8
        while True:
            out = (llama_token * capacity)()
            n = self.lib.llama_tokenize(self.vocab, data, len(data), out, capacity, add_special,
                                        parse_special)
            if n >= 0:
                return out[:n]
            if n == -(2 ** 31):
                raise ValueError("text too long to tokenize")
            capacity = -n

    def token_to_piece(self, token, special):
        """The bytes of one token (not necessarily a whole UTF-8 character)."""
        buf = ctypes.create_string_buffer(64)
        n = self.lib.llama_token_to_piece(self.vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self.lib.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens, remove_special, unparse_special):
        """Bytes of a token list; the caller guarantees every id is in range."""
        arr = (llama_token * len(tokens))(*tokens)
        size = max(16, len(tokens) * 8)
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self.lib.llama_detokenize(self.vocab, arr, len(tokens), buf, size, remove_special,
                                          unparse_special)
            if n >= 0:
                return buf.raw[:n]
            size = -n


class AdapterHandle:
    """Owns one ``struct llama_adapter_lora *`` of a model; close() frees it once
    (before its model: libllama frees what is left with the model, and a
    pointer freed twice would crash)."""

    def __init__(self, lib, model_ptr, path):
        """Load the adapter file ``path`` for the model (``ptr`` None where
        libllama refuses it: its reason goes to the log)."""
        self.lib = lib
        self.ptr = lib.llama_adapter_lora_init(model_ptr, os.fsencode(path))

    def meta(self, key):
        """A scalar GGUF metadata value of the adapter as a string, or None."""
        return read_string(self.lib.llama_adapter_meta_val_str, self.ptr, key.encode(),
                           size=1024)

    def close(self):
        ptr, self.ptr = self.ptr, None
        if ptr:
            self.lib.llama_adapter_lora_free(ptr)


class ThreadPool:
    """Owns one ``struct ggml_threadpool *``: n worker threads that persist.

    Without one attached, every llama_decode makes a pool of threads and
    joins it at the end: tens of microseconds per token, and with several
    contexts, threads of one decode still winding down while the next one
    spins up.  A persistent pool's workers wait between graphs (polling
    briefly, then sleeping), as llama-server's do, though briefer (POLL).

    ``ptr`` is None where the CPU backend offers no pools (a library built
    otherwise); contexts then keep ggml's per-decode pools.  A pool may be
    attached to several contexts as long as they never decode at the same
    time, and must outlive them all.
    """

    # ggml_threadpool_params.poll: how long a worker polls for its next graph
    # before it sleeps, in units of 128 Ki pause instructions.  ggml's and
    # llama-server's 50 measured ~200 ms of a whole core after every decode
    # here: the tail of each request, taken from whatever runs next (the
    # front's reply, another model's worker waiting for its turn, the editor
    # and the user's build on a 2-core laptop; the server next door in a
    # paired bench).  1 is ~4 ms: still far longer than the gap between two
    # tokens' decodes (~0.3 ms of Python), so generation never waits for a
    # wake-up.  gemma-3-270m, 2 threads, three pools taking turns on one
    # context (30 x 64 tokens each): 12.76 ms/token at 1, 12.75 at 50, and
    # 13.36 at 0 (a sleeping worker is slow to wake on this VM).  Two models
    # streaming at once on one server (their decodes take turns): 3 x 96
    # tokens each took 11.5 and 15.1 s at 50, 9.8 and 9.3 s at 1, 7.3 at 0;
    # a worker now also pauses its pool when the other waits for the turn
    # (engine/worker.FileTurns), and at 1 that took 6.3 s.
    POLL = 1

    def __init__(self, lib, n_threads, poll=None, cpus=(), strict=False, prio=0):
        """``cpus``: the CPUs its threads may run on (ggml's cpumask; empty: any), each
        thread on one of them in turn with ``strict``; ``prio``: enum
        ggml_sched_priority (engine/placement.py says what ggml does with them)."""
        self.n_threads = n_threads
        self.poll = self.POLL if poll is None else poll
        self.cpus, self.strict, self.prio = tuple(cpus), bool(strict), prio
        self.ptr = None
        self._free = self._pause = None
        try:
            dev = lib.ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU)
            reg = lib.ggml_backend_dev_backend_reg(dev) if dev else None
            new, free, pause = [lib.ggml_backend_reg_get_proc_address(reg, name) if reg else None
                                for name in (b"ggml_threadpool_new", b"ggml_threadpool_free",
                                             b"ggml_threadpool_pause")]
        except (AttributeError, LibraryError):
            return      # no libggml handle, or it lacks the registry functions
        if not (new and free):
            return
        params = ggml_threadpool_params()
        lib.ggml_threadpool_params_init(ctypes.byref(params), n_threads)
        params.poll = self.poll
        for cpu in self.cpus:
            params.cpumask[cpu] = True
        params.strict_cpu = self.strict
        params.prio = prio
        # made paused, ggml places nobody but its own threads now: made running, it
        # would pin and reschedule the thread that happens to create it, as the
        # pool's thread 0 (the caller of each decode places itself: placement.lead)
        params.paused = bool(self.cpus) or prio != 0
        self.ptr = _ggml_threadpool_new(new)(ctypes.byref(params)) or None
        self._free = _ggml_threadpool_free(free)
        # a library built without patch 0003 hands out no pause: pause() does nothing
        self._pause = _ggml_threadpool_pause(pause) if pause else None

    def pause(self):
        """Put the workers to sleep now instead of polling for the next graph
        (the next decode wakes them: ggml's kickoff resumes a paused pool).
        Only while no decode runs on the pool: a worker that saw the pause
        before a graph just kicked off would sleep through it."""
        if self.ptr and self._pause is not None:
            self._pause(self.ptr)

    def close(self):
        ptr, self.ptr = self.ptr, None
        if ptr:
            self._free(ptr)


# enum ggml_backend_dev_type (ggml-backend.h), as names
DEV_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel", 4: "meta"}


class Device:
    """One ggml backend device the model may put layers on (a ``ggml_backend_dev_t``).

    Devices belong to ggml's backend registry for the life of the process:
    nothing to free.  ``endpoint`` is the rpc-server it stands for;
    ``free``/``total`` are the bytes it reported when listed (memory() asks
    again).  ``type`` is "gpu" (memory of its own), "igpu" (the host's
    memory, as an integrated GPU's or Mesa's lavapipe's), "cpu" or "accel";
    ``backend`` the name of the backend that registered it ("Vulkan",
    "CUDA", "RPC").
    """

    def __init__(self, lib, ptr, endpoint=None):
        self.lib = lib
        self.ptr = ptr
        self.endpoint = endpoint
        self.name = (lib.ggml_backend_dev_name(ptr) or b"").decode("utf-8", "replace")
        self.description = (lib.ggml_backend_dev_description(ptr) or b"").decode("utf-8",
                                                                                 "replace")
        self.type = DEV_TYPES.get(lib.ggml_backend_dev_type(ptr), "gpu")
        reg = lib.ggml_backend_dev_backend_reg(ptr)
        self.backend = ((lib.ggml_backend_reg_name(reg) if reg else None) or b"").decode(
            "utf-8", "replace")
        self.free, self.total = self.memory()

    def memory(self):
        """(free, total) bytes, as the device reports them now."""
        free, total = c_size_t(0), c_size_t(0)
        self.lib.ggml_backend_dev_memory(self.ptr, ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value


# ggml's device backends, by their library's name in a build's folder
_GPU_LIBS = {"libggml-vulkan.so": "Vulkan", "libggml-cuda.so": "CUDA", "libggml-hip.so": "ROCm",
             "libggml-sycl.so": "SYCL", "libggml-metal.so": "Metal", "libggml-opencl.so": "OpenCL"}


def gpu_backends(lib):
    """The names of the build's device backends ("Vulkan", "CUDA"), whether or
    not they found a device: those registered (not the CPU's, RPC's or an
    accelerator library's such as BLAS) and those whose library is beside
    libllama (a backend that found no driver at all may not register)."""
    folder = lib.path.parent if "/" in str(lib.path) else None
    names = [name for so, name in _GPU_LIBS.items()
             if folder is not None and (folder / so).exists()]
    for i in range(lib.ggml_backend_reg_count()):
        reg = lib.ggml_backend_reg_get(i)
        name = ((lib.ggml_backend_reg_name(reg) if reg else None) or b"").decode("utf-8",
                                                                                 "replace")
        if name and name not in ("CPU", "RPC", "BLAS") and name not in names:
            names.append(name)
    return names


def local_devices(lib):
    """The devices of this machine's GPU backends (a Vulkan or CUDA build's), in
    registry order: not the CPU's, not an accelerator's (which works beside the
    CPU backend), not an rpc-server's.  Empty with a CPU-only build, or where
    the backend found no usable device (no driver: it says so in the log)."""
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        ptr = lib.ggml_backend_dev_get(i)
        if not ptr or lib.ggml_backend_dev_type(ptr) not in (1, 2):     # GPU, IGPU
            continue
        reg = lib.ggml_backend_dev_backend_reg(ptr)
        if reg and lib.ggml_backend_reg_name(reg) == b"RPC":
            continue
        out.append(Device(lib, ptr))
    return out


def rpc_devices(lib, endpoint):
    """The devices an rpc-server at ``endpoint`` ("host:port") offers, through ggml's RPC
    backend (found in the registry by name, as llama-server's --rpc does).

    ggml connects to the server here and GGML_ABORTs when it cannot, so the
    caller checks first that the endpoint answers (engine/rpc.py).  Raises
    LibraryError when the library was built without the RPC backend.
    """
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    add = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server") if reg else None
    if not add:
        raise LibraryError("libllama at %s was built without ggml's RPC backend; rebuild it "
                           "with `make lib`" % lib.path)
    server = _ggml_backend_rpc_add_server(add)(endpoint.encode())
    if not server:
        return []       # the server offers no device
    return [Device(lib, lib.ggml_backend_reg_dev_get(server, i), endpoint)
            for i in range(lib.ggml_backend_reg_dev_count(server))]


_abort_hook = None      # kept alive: ggml holds the C pointer


def on_ggml_abort(lib, hook):
    """Call ``hook(message)`` when ggml aborts the process (GGML_ABORT, a failed
    GGML_ASSERT), just before abort(): the last word a worker gets.

    ggml then prints nothing itself, so the message goes to stderr here
    first.  The hook runs on whichever thread aborts (a C++ thread of the RPC
    backend too) and must not wait on anything another thread may hold.
    """
    global _abort_hook

    def on_abort(message):
        text = (message or b"").decode("utf-8", "replace")
        sys.stderr.write("ggml: %s\n" % text.rstrip())
        sys.stderr.flush()
        try:
            hook(text)
        except BaseException:   # an exception cannot cross into C; abort() follows anyway
            pass

    _abort_hook = ggml_abort_callback_t(on_abort)
    lib.ggml_set_abort_callback(_abort_hook)


class ContextHandle:
    """Owns one ``struct llama_context *`` and its decode batch; close() frees both once.

    Cancellation: libllama calls the abort callback after every graph node,
    from the compute thread, with the other threads waiting at a barrier.  A
    Python callback there would take the GIL hundreds of times per token and
    stall on whatever Python thread holds it.  So the callback is C's own
    ``strlen`` over a two-byte buffer ``[flag, 0]``: it returns 1 (abort) once
    ``flag`` is set and 0 otherwise, with no Python involved.  ``strlen``'s
    size_t result in the return register reads as the C bool the callback must
    return (its low byte) on the System V ABIs offgrid runs on.
    """

    def __init__(self, lib, model, n_ctx, n_batch, n_ubatch, n_threads, n_threads_batch,
                 swa_full=True, n_seq_max=1, embeddings=False,
                 pooling=LLAMA_POOLING_TYPE_UNSPECIFIED, seq_width=1, flash_attn=None,
                 seq_per_stream=0, n_rs_seq=0, type_k=1, type_v=1):
        """``n_seq_max`` sequences share one unified cache (so extra ones cost
        no memory), or with ``seq_per_stream`` (a divisor of n_seq_max), each
        run of that many consecutive sequences has a cache stream of its own,
        n_ctx / (n_seq_max / seq_per_stream) cells that only they see (1: one
        per sequence, llama-server's -np without -kvu; 0: unified).
        ``embeddings`` makes a context whose decodes
        output hidden states (every token of a batch), pooled per sequence as
        ``pooling`` says (a LLAMA_POOLING_TYPE_*; UNSPECIFIED: the model's).
        ``seq_width``: how many sequences one token of a batch may go into.
        ``flash_attn``: True, False or None (libllama's auto: on where the
        device supports it, which the CPU's does).  ``n_rs_seq``: snapshots
        of each sequence's recurrent state, so that its last n_rs_seq tokens
        can be taken back (libllama keeps it 0 for an architecture that
        cannot; ``n_rs_seq`` reads what it kept).  ``type_k``, ``type_v``: the
        KV cache's ggml types (1: f16)."""
        self.lib = lib
        if seq_per_stream > 0 and n_seq_max % seq_per_stream:
            # libllama would refuse it with a null context and a log line
            raise ValueError("n_seq_max %d is not a multiple of seq_per_stream %d"
                             % (n_seq_max, seq_per_stream))
        params = lib.llama_context_default_params()
        params.embeddings = embeddings
        params.pooling_type = pooling
        # libllama asserts (aborting the process) unless a batch can hold one
        # output per sequence
        n_batch = max(n_batch, n_seq_max, 2)
        n_ctx = max(n_ctx, 16)          # libllama clamps the batch to the context
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = max(min(n_ubatch, n_batch), n_seq_max, 2)
        params.n_seq_max = n_seq_max
        params.kv_unified = seq_per_stream <= 0 or seq_per_stream >= n_seq_max
        params.n_threads = n_threads
        params.n_threads_batch = n_threads_batch
        params.swa_full = swa_full
        params.n_rs_seq = max(0, n_rs_seq)
        params.type_k, params.type_v = type_k, type_v
        if flash_attn is not None:
            params.flash_attn_type = 1 if flash_attn else 0
        params.no_perf = True
        # --no-kv-offload is the model's, for all its contexts (ModelHandle)
        params.offload_kqv = getattr(model, "kv_offload", True)
        # --rope-scaling and the others are the model's too: every context positions alike
        for field, value in getattr(model, "rope", {}).items():
            setattr(params, field, value)
        if params.kv_unified or seq_per_stream == 1:
            self.ptr = lib.llama_init_from_model(model.ptr, params)
        else:
            self.ptr = lib.llama_init_from_model_streams(model.ptr, params, seq_per_stream)
        self.batch = None
        self.pools = None       # the ThreadPools attached: (single token, batch)
        # Taken around each call that reads the last decode's outputs: each
        # calls llama_synchronize, which on a GPU backend is not safe from two
        # threads at once (ggml-vulkan submits, waits on and resets one fence
        # per context, and clears its graph state): two members sampling the
        # same step at once left one spinning on a fence the other had reset
        # (Khronos validation: VUID-vkQueueSubmit-fence-00064).  On the CPU
        # too each read first runs output_reorder (llama-context.cpp), which
        # two threads must not run at once.  It serializes the sampling of a
        # step's members: measured with 8 clients, offgrid's gaps between
        # steps stay shorter than llama-server's (docs/performance.md).
        self.reads = threading.Lock()
        if not self.ptr:
            return
        self.memory = Memory(self)
        self.n_ctx = lib.llama_n_ctx(self.ptr)
        self.n_batch = lib.llama_n_batch(self.ptr)
        self.n_ubatch = lib.llama_n_ubatch(self.ptr)
        self.n_rs_seq = lib.llama_n_rs_seq(self.ptr)
        self._abort_flag = ctypes.create_string_buffer(2)      # [flag, NUL]
        libc = ctypes.CDLL(None)
        self._strlen_addr = ctypes.cast(libc.strlen, c_void_p).value
        lib.llama_set_abort_callback(self.ptr, self._strlen_addr,
                                     ctypes.addressof(self._abort_flag))
        # One batch of n_batch tokens for the context's whole life; the arrays
        # below are typed views over its C buffers, so filling a chunk is a
        # slice assignment rather than one ctypes call per token.
        cap = self.n_batch
        self.batch = lib.llama_batch_init(cap, 0, max(seq_width, 1))
        self._row_seqs = [None] * cap   # the sequences each batch row holds (decode_parts)
        b = self.batch
        self._tokens = (llama_token * cap).from_address(ctypes.cast(b.token, c_void_p).value)
        self._pos = (llama_pos * cap).from_address(ctypes.cast(b.pos, c_void_p).value)
        self._logits = (c_int8 * cap).from_address(ctypes.cast(b.logits, c_void_p).value)
        self._n_seq = (c_int32 * cap).from_address(ctypes.cast(b.n_seq_id, c_void_p).value)

    # -- abort flag --------------------------------------------------------
    def request_abort(self):
        """Make the running (or next) llama_decode stop after its current graph node."""
        global _aborts_set
        with _aborts_lock:
            if self.ptr and self._abort_flag[0] == b"\x00":
                self._abort_flag[0] = b"\x01"
                _aborts_set += 1

    def clear_abort(self):
        global _aborts_set
        with _aborts_lock:
            if self._abort_flag[0] != b"\x00":
                self._abort_flag[0] = b"\x00"
                _aborts_set -= 1

    def set_abortable(self, abortable):
        """Install or remove the abort callback for the decodes that follow.

        Used around the first decode after keys were moved: libllama rotates
        the moved keys in place at the start of that decode and, if aborted
        part way, applies the whole rotation again next time, rotating some
        layers twice.
        """
        if abortable:
            self.lib.llama_set_abort_callback(self.ptr, self._strlen_addr,
                                              ctypes.addressof(self._abort_flag))
        else:
            self.lib.llama_set_abort_callback(self.ptr, None, None)

    # -- LoRA adapters (engine/adapters.py) --------------------------------
    def set_adapters(self, ptrs, scales):
        """Apply the adapters ``ptrs`` (AdapterHandle.ptr) at ``scales`` to the
        decodes from now on, none where both are empty; libllama rebuilds its
        graph only when the set differs.  Under the lock of every decode."""
        n = len(ptrs)
        arr = (c_void_p * max(n, 1))(*ptrs)
        sc = (c_float * max(n, 1))(*scales)
        status = self.lib.llama_set_adapters_lora(self.ptr, ctypes.addressof(arr), n,
                                                  ctypes.addressof(sc))
        if status != 0:
            raise LibraryError("libllama refused the LoRA adapters (status %d)" % status)

    # -- a control vector (engine/controlvector.py) ------------------------
    def set_control_vector(self, data, n_embd, il_start, il_end):
        """Add ``data`` (an array('f') of n_embd floats per layer from layer 1 on)
        to each layer's output from ``il_start`` to ``il_end`` (inclusive), in every
        decode from now on.  libllama checks only n_embd against the model: the
        caller has checked the rest (engine/controlvector.py)."""
        address, n = data.buffer_info()
        status = self.lib.llama_set_adapter_cvec(self.ptr, address, n, n_embd, il_start,
                                                 il_end)
        if status != 0:
            raise LibraryError("libllama refused the control vector (status %d)" % status)

    # -- one sequence's state (engine/statecache.py) -----------------------
    def seq_state(self, seq, buf=None, partial=False):
        """A copy of sequence ``seq``'s cells (positions and keys and values,
        libllama's own format), as a bytearray (``buf``, resized, where one is
        given); None where libllama fails.  Its size grows with the sequence's
        tokens.  ``partial``: only what a cut cannot give back (the recurrent
        state, a window cache): a checkpoint.  The caller holds the lock of
        every other memory operation and decode of this context."""
        flags = LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else 0
        n = self.lib.llama_state_seq_get_size_ext(self.ptr, seq, flags)
        if n <= 0:
            return None
        if buf is None:
            buf = bytearray(n)
        elif len(buf) > n:
            del buf[n:]
        else:
            buf.extend(bytes(n - len(buf)))
        addr = ctypes.addressof((ctypes.c_char * n).from_buffer(buf))
        got = self.lib.llama_state_seq_get_data_ext(self.ptr, addr, n, seq, flags)
        return buf if got == n else None

    def set_seq_state(self, seq, data, partial=False):
        """Put ``data`` (a seq_state() of a context of this model and these
        settings, taken with the same ``partial``) into sequence ``seq``, which
        loses what it held (with ``partial``, only its recurrent or window
        part); False where libllama refuses it (that part is then empty)."""
        if not data:
            return False
        n = len(data)
        view = (ctypes.c_char * n).from_buffer(data) if isinstance(data, bytearray) \
            else ctypes.create_string_buffer(bytes(data), n)
        flags = LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else 0
        return self.lib.llama_state_seq_set_data_ext(self.ptr, ctypes.addressof(view), n, seq,
                                                     flags) == n

    def attach_threadpool(self, pool, pool_batch):
        """Run this context's decodes on ThreadPools that outlive it.

        ``pool`` runs single-token decodes (n_threads), ``pool_batch`` the
        prompt batches (n_threads_batch); each must have exactly its count.
        """
        if pool.ptr and pool_batch.ptr:
            self.lib.llama_attach_threadpool(self.ptr, pool.ptr, pool_batch.ptr)
            self.lib.llama_set_n_threads(self.ptr, pool.n_threads, pool_batch.n_threads)
            self.pools = (pool, pool_batch)

    def use_pools(self, pool, pool_batch):
        """attach_threadpool, unless these are the pools attached already (the
        per-token path asks before every decode)."""
        if self.pools != (pool, pool_batch):
            self.attach_threadpool(pool, pool_batch)

    # -- decoding ----------------------------------------------------------
    def decode_sequences(self, parts):
        """Decode several sequences in one batch, every token an output: an
        embedding context's step.

        ``parts`` are (seq_id, tokens, start_pos), at most n_batch tokens in
        all, each token in its one sequence.  Returns llama_decode's status.
        """
        return self.decode_parts([(tokens, start, (seq,), self.OUT_ALL)
                                  for seq, tokens, start in parts])

    # what decode_parts keeps of each part's tokens
    OUT_NONE, OUT_LAST, OUT_ALL = 0, 1, 2

    def decode_parts(self, parts):
        """Decode several sequences' tokens in one batch: a shared context's step.

        ``parts`` are (tokens, start_pos, seqs, outputs), at most n_batch
        tokens in all, laid out in order (part i's first token at the batch
        index the sum of the earlier parts' lengths): each token goes into the
        sequences ``seqs`` (at most as many as the batch was made for), and
        ``outputs`` (OUT_NONE, OUT_LAST, OUT_ALL) says which tokens' logits
        are kept.  Returns llama_decode's status.
        """
        seq_id = self.batch.seq_id
        rows = self._row_seqs
        n = 0
        for tokens, start, seqs, outputs in parts:
            k = len(tokens)
            self._tokens[n:n + k] = tokens
            self._pos[n:n + k] = range(start, start + k)
            self._logits[n:n + k] = (b"\x01" if outputs == self.OUT_ALL else b"\x00") * k
            if outputs == self.OUT_LAST:
                self._logits[n + k - 1] = 1
            for i in range(n, n + k):
                if rows[i] != seqs:     # rows keep their sequences between steps
                    rows[i] = seqs
                    self._n_seq[i] = len(seqs)
                    row = seq_id[i]
                    for j, s in enumerate(seqs):
                        row[j] = s
            n += k
        self.batch.n_tokens = n
        return self.lib.llama_decode(self.ptr, self.batch)

    def embedding_seq(self, seq, n):
        """The pooled output of sequence ``seq`` in the last decode: (n,) float32
        as bytes; None if it has none (pooling none, or no such sequence)."""
        with self.reads:
            addr = self.lib.llama_get_embeddings_seq(self.ptr, seq)
        return ctypes.string_at(addr, 4 * n) if addr else None

    def embedding_rows(self, n_rows, n):
        """The hidden states of the last decode's ``n_rows`` outputs (pooling none),
        in batch order: (n_rows, n) float32 as bytes, or None."""
        with self.reads:
            addr = self.lib.llama_get_embeddings(self.ptr)
        return ctypes.string_at(addr, 4 * n * n_rows) if addr else None

    def pooling_type(self):
        """The LLAMA_POOLING_TYPE_* this context pools with (the model's, if it chose)."""
        return self.lib.llama_pooling_type(self.ptr)

    def causal_attn(self):
        """Whether tokens attend only to earlier ones (a decoder), so a sequence
        may be decoded in several batches."""
        return bool(self.lib.llama_get_causal_attn(self.ptr))

    def logits(self, idx=-1):
        """Address of the (n_vocab,) float32 logits of output ``idx`` of the last decode."""
        with self.reads:
            addr = self.lib.llama_get_logits_ith(self.ptr, idx)
        if not addr:
            raise ValueError("the last decode has no logits for output %d" % idx)
        return addr

    def close(self):
        if self.ptr:
            self.clear_abort()
        ptr, self.ptr = self.ptr, None
        batch, self.batch = self.batch, None
        if batch is not None:
            self.lib.llama_batch_free(batch)
        if ptr:
            self.lib.llama_free(ptr)


class Memory:
    """The KV cache of one ContextHandle (``llama_memory_t``), owned by the context.

    Positions are half-open ranges [p0, p1); p1 < 0 means "to the end" and a
    sequence id < 0 means every sequence, as in llama.h.  Calls after the
    context is closed raise ValueError rather than reach freed memory.
    """

    def __init__(self, ctx):
        self._ctx = ctx
        self._lib = ctx.lib
        self._ptr = ctx.lib.llama_get_memory(ctx.ptr)

    def _mem(self):
        if not self._ctx.ptr:
            raise ValueError("the context is closed")
        return self._ptr

    @property
    def exists(self):
        """Whether the context has a memory at all: an encoder (BERT and its kin)
        has none, and libllama answers every call on it with a default."""
        return bool(self._ptr)

    def clear(self, data):
        """Drop every cell; ``data`` also zeroes the buffers (slow, rarely needed)."""
        self._lib.llama_memory_clear(self._mem(), data)

    def seq_rm(self, seq, p0, p1):
        """Remove ``seq``'s cells in [p0, p1); False where the memory cannot cut there."""
        return bool(self._lib.llama_memory_seq_rm(self._mem(), seq, p0, p1))

    def seq_cp(self, src, dst, p0, p1):
        """Add the cells of ``src`` in [p0, p1) to ``dst`` too (shared, not copied)."""
        self._lib.llama_memory_seq_cp(self._mem(), src, dst, p0, p1)

    def seq_add(self, seq, p0, p1, delta):
        """Move ``seq``'s cells in [p0, p1) by ``delta`` positions (keys re-rotated at the next decode)."""
        self._lib.llama_memory_seq_add(self._mem(), seq, p0, p1, delta)

    def seq_pos_min(self, seq):
        """The smallest position ``seq`` holds, -1 if none."""
        return self._lib.llama_memory_seq_pos_min(self._mem(), seq)

    def seq_pos_max(self, seq):
        """The largest position ``seq`` holds, -1 if none."""
        return self._lib.llama_memory_seq_pos_max(self._mem(), seq)

    def can_shift(self):
        """Whether seq_add works here (not, for one, on recurrent state)."""
        return bool(self._lib.llama_memory_can_shift(self._mem()))


class Candidates:
    """A reusable ``llama_token_data_array`` over the whole vocabulary.

    ``_data`` is (n_vocab, 3) 32-bit words: {id int32, logit float, p float}
    per token, which the samplers sort and cut in place.  load() puts it
    back to vocabulary order and copies in one output's logits: one memmove
    of a prepared (id, 0, 0) image, then one strided copy of the logits (an
    array slice assignment, in C); no Python loop over the vocabulary.
    """

    def __init__(self, lib, n_vocab):
        self.lib = lib
        self.n_vocab = n_vocab
        ids = array.array("i", range(n_vocab)).tobytes()
        image = bytearray(12 * n_vocab)
        image[0::12], image[1::12], image[2::12], image[3::12] = (
            ids[0::4], ids[1::4], ids[2::4], ids[3::4])
        self._image = bytes(image)                          # (n_vocab,) of {id, 0.0, 0.0}
        self._data = array.array("f", self._image)          # (n_vocab * 3,) float32 words
        self._logits = array.array("f", bytes(4 * n_vocab))  # (n_vocab,) float32 staging
        self._ids = memoryview(self._data).cast("B").cast("i")   # the same words as int32
        self._data_addr = self._data.buffer_info()[0]
        self._logits_addr = self._logits.buffer_info()[0]
        self.array = llama_token_data_array(
            ctypes.cast(self._data_addr, POINTER(llama_token_data)), n_vocab, -1, False)
        self.ref = ctypes.byref(self.array)

    def load(self, ctx, idx=-1):
        """Fill from the logits of output ``idx`` of ``ctx``'s last decode."""
        ctypes.memmove(self._data_addr, self._image, len(self._image))
        ctypes.memmove(self._logits_addr, ctx.logits(idx), 4 * self.n_vocab)
        self._data[1::3] = self._logits
        a = self.array
        a.size, a.selected, a.sorted = self.n_vocab, -1, False

    def p_at(self, i):
        """The ``p`` of entry ``i`` (after load(), entry i is token i until a sampler sorts)."""
        return self._data[3 * i + 2]

    def head(self, n):
        """[(token, p), ...] of the first ``n`` entries still in the array."""
        ids, data = self._ids, self._data
        return [(ids[3 * i], data[3 * i + 2]) for i in range(min(n, self.array.size))]

    def selected(self):
        """(token, logit) the samplers picked, or None if none was."""
        a = self.array
        if not 0 <= a.selected < a.size:
            return None
        entry = a.data[a.selected]
        return entry.id, entry.logit


class SamplerHandle:
    """Owns one ``struct llama_sampler *``; close() frees it once.

    Made by one constructor per sampler kind (``SamplerHandle.chain(lib)``,
    ``.top_k(lib, k)``, ...).  ``chain.add(s)`` hands ``s``'s sampler to the
    chain, which frees it with itself: ``s`` is empty afterwards, and its
    close() does nothing.
    """

    def __init__(self, lib, ptr, kind):
        if not ptr:
            raise ValueError("libllama could not create a %s sampler" % kind)
        self.lib = lib
        self.ptr = ptr
        self.kind = kind
        self._one = None

    # -- constructors, one per llama_sampler_init_* ---------------------------
    @classmethod
    def chain(cls, lib):
        return cls(lib, lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params()),
                   "chain")

    @classmethod
    def greedy(cls, lib):
        return cls(lib, lib.llama_sampler_init_greedy(), "greedy")

    @classmethod
    def dist(cls, lib, seed):
        """The random pick; ``seed`` LLAMA_DEFAULT_SEED means a random seed."""
        return cls(lib, lib.llama_sampler_init_dist(seed & 0xFFFFFFFF), "dist")

    @classmethod
    def top_k(cls, lib, k):
        return cls(lib, lib.llama_sampler_init_top_k(k), "top_k")

    @classmethod
    def top_p(cls, lib, p, min_keep=1):
        return cls(lib, lib.llama_sampler_init_top_p(p, min_keep), "top_p")

    @classmethod
    def min_p(cls, lib, p, min_keep=1):
        return cls(lib, lib.llama_sampler_init_min_p(p, min_keep), "min_p")

    @classmethod
    def typical(cls, lib, p, min_keep=1):
        return cls(lib, lib.llama_sampler_init_typical(p, min_keep), "typical")

    @classmethod
    def temp_ext(cls, lib, t, delta, exponent):
        return cls(lib, lib.llama_sampler_init_temp_ext(t, delta, exponent), "temp_ext")

    @classmethod
    def temp(cls, lib, t):
        return cls(lib, lib.llama_sampler_init_temp(t), "temp")

    @classmethod
    def xtc(cls, lib, p, t, min_keep, seed):
        return cls(lib, lib.llama_sampler_init_xtc(p, t, min_keep, seed & 0xFFFFFFFF), "xtc")

    @classmethod
    def top_n_sigma(cls, lib, n):
        return cls(lib, lib.llama_sampler_init_top_n_sigma(n), "top_n_sigma")

    @classmethod
    def mirostat(cls, lib, n_vocab, seed, tau, eta, m=100):
        return cls(lib, lib.llama_sampler_init_mirostat(n_vocab, seed & 0xFFFFFFFF, tau, eta, m),
                   "mirostat")

    @classmethod
    def mirostat_v2(cls, lib, seed, tau, eta):
        return cls(lib, lib.llama_sampler_init_mirostat_v2(seed & 0xFFFFFFFF, tau, eta),
                   "mirostat_v2")

    @classmethod
    def penalties(cls, lib, n_vocab, last_n, repeat, freq, present):
        return cls(lib, lib.llama_sampler_init_penalties(n_vocab, last_n, repeat, freq, present),
                   "penalties")

    @classmethod
    def logit_bias(cls, lib, n_vocab, biases):
        """From (token, bias) pairs; libllama copies them."""
        arr = (llama_logit_bias * len(biases))(*[llama_logit_bias(t, b) for t, b in biases])
        return cls(lib, lib.llama_sampler_init_logit_bias(n_vocab, len(biases), arr),
                   "logit_bias")

    @classmethod
    def infill(cls, lib, vocab):
        """llama.h's FIM sampler for a vocabulary (ModelHandle.vocab)."""
        return cls(lib, lib.llama_sampler_init_infill(vocab), "infill")

    @classmethod
    def adopt(cls, lib, ptr, kind):
        """Own a sampler made elsewhere in this module (init_grammar_sampler)."""
        return cls(lib, ptr, kind)

    # -- use ------------------------------------------------------------------
    def add(self, sampler):
        """Append ``sampler`` (a SamplerHandle) to this chain, which takes it over."""
        ptr, sampler.ptr = sampler.ptr, None
        self.lib.llama_sampler_chain_add(self.ptr, ptr)

    def sample(self, ctx, idx=-1):
        """Sample and accept a token from output ``idx`` of ``ctx``'s last decode.

        libllama throws or aborts inside this when a grammar in the chain
        rejects every candidate: only for chains without one.
        """
        with ctx.reads:
            return self.lib.llama_sampler_sample(self.ptr, ctx.ptr, idx)

    def apply(self, candidates):
        """Run the sampler over a Candidates (in place; a chain's last pick sets selected)."""
        self.lib.llama_sampler_apply(self.ptr, candidates.ref)

    def allows(self, token):
        """Whether this sampler leaves ``token`` a finite logit (a grammar: whether it may come next)."""
        if self._one is None:
            self._one = (llama_token_data(), llama_token_data_array())
            self._one[1].data = ctypes.pointer(self._one[0])
            self._one_ref = ctypes.byref(self._one[1])
        entry, arr = self._one
        entry.id, entry.logit, entry.p = token, 1.0, 0.0
        arr.size, arr.selected, arr.sorted = 1, -1, False
        self.lib.llama_sampler_apply(self.ptr, self._one_ref)
        return entry.logit != -math.inf

    def accept(self, token):
        self.lib.llama_sampler_accept(self.ptr, token)

    def close(self):
        ptr, self.ptr = self.ptr, None
        if ptr:
            self.lib.llama_sampler_free(ptr)
