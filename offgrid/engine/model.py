"""A loaded GGUF model: weights, vocabulary, special tokens and metadata.

A Model is shared, read-only, by every ChatSession made from it (libllama's
model and vocab are safe to use from several contexts at once).  It owns the
``llama_model *`` and frees it once, in close().
"""

import collections
import logging
import os
import sys
import threading

from .. import libllama
from ..errors import InvalidToken, ModelLoadError
from . import devices as gpus
from . import rpc
from .ggufheader import read_header
from .memory import MemoryClass, kv_bytes_of, kv_meta

# Texts this long or longer have their tokens kept (Model.tokenize), the last
# TOKENIZED_KEPT of them: a few editors' prefixes and suffixes and their rings
# of extra chunks (16 in llama.vim and llama.vscode), a few chats.
TOKENIZED_MIN_CHARS = 512
TOKENIZED_KEPT = 64
# Shorter texts are kept too, the last TOKENIZED_SHORT_KEPT of them, apart so
# that what an editor sends once per keystroke never pushes a long one out:
# a prompt of 135 characters took 0.1-0.3 ms to tokenize on gemma's 262k
# vocabulary once libllama's tables had left the CPU's caches (75 us while
# they were in), a tenth of a quick request's time in the server; a prompt
# sent again (a warm-up, a retry, the same prompt sampled again) skips it.
TOKENIZED_SHORT_KEPT = 16


def _terminal_progress(name):
    """A progress callback that draws a bar on stderr when it is a terminal."""
    if not sys.stderr.isatty():
        return None
    state = {"shown": -1}

    def show(fraction):
        pct = int(fraction * 100)
        if pct != state["shown"]:
            state["shown"] = pct
            bar = "#" * (pct // 4)
            sys.stderr.write("\rloading %s [%-25s] %3d%%" % (name, bar, pct))
            if pct >= 100:
                sys.stderr.write("\n")
            sys.stderr.flush()
    return show


class Model:
    """A GGUF model loaded by libllama.

    Attributes a caller may read:
      path, name          the file and its base name (the default model id)
      n_vocab             number of tokens; valid ids are 0..n_vocab-1
      n_ctx_train         context length the model was trained with
      n_embd, n_embd_out  hidden size; size of its output embeddings (engine/embed.py)
      bos, eos, eot, sep, nl
                          special token ids, None where the model has none
      fim_pre, fim_suf, fim_mid, fim_pad, fim_rep, fim_sep
                          fill-in-the-middle token ids, None where absent
      add_bos             whether tokenizing a prompt should prepend BOS
      add_eos, add_sep    whether it appends EOS, and puts SEP between a rerank pair
      meta                GGUF metadata, key -> value as a string
      chat_template       the model's Jinja template text, or None
      memory              its MemoryClass (engine/memory.py): dense, swa, hybrid, recurrent
      vocab_only          loaded without weights: it tokenizes but cannot generate
      devices             where its layers are: [{"name", "layers", ...}], the CPU first,
                          then each --rpc device ("endpoint", "free" and "total" bytes)
    """

    def __init__(self, handle, path, devices=(), n_gpu_layers=None, tensor_split=None):
        self._handle = handle
        self.lib = handle.lib
        self.path = str(path)
        self.name = os.path.basename(self.path)
        self.vocab_only = handle.vocab_only
        self.n_vocab = handle.n_vocab()
        self.n_ctx_train = handle.n_ctx_train()
        self.rope = dict(getattr(handle, "rope", {}))
        self.n_embd = handle.n_embd()
        self.n_embd_out = handle.n_embd_out()
        self.n_params = handle.n_params()
        self.size = handle.size()
        self.n_swa = handle.n_swa()
        self.desc = handle.desc()

        for name, t in handle.special_tokens().items():
            setattr(self, name, t if 0 <= t < self.n_vocab else None)
        self.add_bos = handle.add_bos()
        self.add_eos = handle.add_eos()
        self.add_sep = handle.add_sep()

        self.meta = handle.meta()
        self.kv_meta = kv_meta(self.meta, path)     # with its per-layer head counts
        # dense, SWA, hybrid or recurrent: what its contexts' caches may do
        # (a session's decoder refines it with the context's rollback depth)
        self.memory = MemoryClass.of(handle, self.meta)
        # the longest context its positions are meant for: the trained one, stretched by
        # RoPE scaling (--rope-scale, --rope-freq-scale, or the file's rope.scaling)
        self.n_ctx_max = stretched_context(self.n_ctx_train, self.meta, self.rope)
        self.chat_template = handle.chat_template()
        self.devices = self._placement(devices, n_gpu_layers, tensor_split)
        self._device_objs = [(d, d.free) for d in devices]    # load() sets the true "before"
        self.kv_offload = True

        # Per-token caches, filled lazily: generation asks for the same few
        # thousand tokens over and over, and a dict lookup beats a C call.
        self._pieces = {}
        self._eog = {}
        self._eog_all = None
        self._lock = threading.Lock()
        self._grammar_facts = None
        # Token ids of recent texts, long and short apart (see tokenize)
        self._tokenized = collections.OrderedDict()
        self._tokenized_short = collections.OrderedDict()
        self._tokenized_lock = threading.Lock()

    @classmethod
    def load(cls, path, lib_path=None, progress=True, verbose=False, vocab_only=False,
             rpc_endpoints=(), n_gpu_layers=None, tensor_split=None, repack=True,
             on_rpc_stall=None, device_names=None, split_mode=None, main_gpu=0,
             kv_offload=True, n_ctx_hint=0, kv_overrides=(), load_mode="auto",
             tensor_overrides=(), lazy_mode="auto", check_tensors=False, rope=None):
        """Load a GGUF file.  Raises ModelLoadError (or LibraryError, RpcUnavailable).

        With ``vocab_only`` only the tokenizer and metadata are loaded (no
        weights): the model can tokenize but cannot back a ChatSession.

        ``rpc_endpoints`` ("host:port" of rpc-servers) put its layers on their
        devices (engine/rpc.py): ``n_gpu_layers`` of them (None: all), split
        by ``tensor_split`` (one proportion per device; None: by free memory).
        ``repack`` False: no repacked CPU weights (libllama.ModelHandle).
        ``on_rpc_stall``: rpc.connect's ``on_stall``.

        A GPU build's devices hold layers too (engine/devices.py):
        ``device_names`` (-dev; None: every GPU, as llama.cpp picks),
        ``split_mode`` (devices.SPLIT_MODES; None: by layer) and ``main_gpu``
        (-mg) choose them; ``n_gpu_layers`` None or devices.NGL_AUTO is as
        many as their free memory holds beside ``n_ctx_hint`` tokens of KV
        cache, NGL_ALL all.  ``kv_offload`` False keeps the KV caches in host
        memory (--no-kv-offload).
        """
        lib = libllama.load(lib_path, verbose=verbose)
        if not os.path.isfile(path):
            raise ModelLoadError("model file not found: %s" % path)
        remote = (rpc.connect(lib, list(rpc_endpoints), on_rpc_stall)
                  if rpc_endpoints and not vocab_only else [])
        devices = [] if vocab_only else gpus.pick(lib, remote, device_names, split_mode,
                                                  main_gpu)
        if not vocab_only and device_names is None:
            why = gpus.no_device_reason(lib)
            if why:
                logging.getLogger("offgrid.devices").warning(why)
        if tensor_split and len(tensor_split) > len(devices):
            raise ModelLoadError("--tensor-split gives %d proportions for %d devices"
                                 % (len(tensor_split), len(devices)))
        if devices:
            n_gpu_layers = _layers_for(lib, path, devices, n_gpu_layers, n_ctx_hint,
                                       kv_offload)
        overrides = _tensor_overrides(lib, tensor_overrides) if not vocab_only else []
        _check_kv_overrides(path, kv_overrides)
        before = [d.memory()[0] for d in devices]
        # progress: True draws a bar on a terminal; a callable gets each fraction too
        bar = _terminal_progress(os.path.basename(str(path))) if progress else None
        show = bar
        if callable(progress):
            def show(fraction):
                progress(fraction)
                if bar is not None:
                    bar(fraction)
        handle = libllama.ModelHandle(lib, path, show, vocab_only=vocab_only, devices=devices,
                                      n_gpu_layers=n_gpu_layers, tensor_split=tensor_split,
                                      repack=repack, split_mode=split_mode,
                                      # pick() kept -sm none's device alone: index 0
                                      main_gpu=0, kv_offload=kv_offload,
                                      kv_overrides=[tuple(o) for o in kv_overrides or ()],
                                      load_mode=load_mode, tensor_overrides=overrides,
                                      lazy_mode=lazy_mode, check_tensors=check_tensors,
                                      rope=rope)
        if not handle.ptr:
            if any(d.endpoint is None for d in devices):
                # libllama logs "unable to allocate <device> buffer" and returns
                # no model when a device's memory cannot take its part
                raise ModelLoadError(
                    "libllama could not load the model %s on %s: not a GGUF file, an "
                    "unsupported architecture, or more than the device's memory holds "
                    "(fewer layers with -ngl N, or -dev none for the CPU alone)"
                    % (path, ", ".join(d.name for d in devices)))
            raise ModelLoadError("libllama could not load the model %s (not a GGUF file, or "
                                 "an unsupported architecture%s%s%s)" % (path, (
                                     ", or an --override-kv value it does not take"
                                     if kv_overrides else ""), (
                                     ", or an -ot pattern C++'s std::regex does not take"
                                     if overrides else ""), (
                                     ", or a tensor of NaN or infinity (--check-tensors)"
                                     if check_tensors else "")))
        if not vocab_only and handle.has_encoder():
            # libllama aborts the first decode without a llama_encode before it
            arch = handle.meta().get("general.architecture", "?")
            handle.close()
            raise ModelLoadError(
                "%s is an encoder-decoder model (%s): each generation needs its encoder "
                "run first (llama_encode), which offgrid does not do (nor llama-server); "
                "it is not served" % (os.path.basename(str(path)), arch))
        try:
            model = cls(handle, path, devices, n_gpu_layers, tensor_split)
            model._device_objs = list(zip(devices, before))
            model.kv_offload = kv_offload
            return model
        except BaseException:
            handle.close()
            raise

    def flash_attn(self, setting):
        """``-fa on|off|auto`` as (True, False or None for libllama's own
        probe, the words the load line says).  With every layer on the CPU,
        auto is on: measured on the three bench models on this project's
        2-core EPYC (docs/performance.md), prompt 1.13-1.15x faster with it
        on two and level on the third, generation level; which is also what
        libllama's probe picks for the CPU backend."""
        if setting in ("on", "off"):
            return setting == "on", "%s (-fa %s)" % (setting, setting)
        if all(d["name"] == "CPU" or not d["layers"] for d in self.devices):
            return True, "on (-fa auto: every layer on the CPU, where it is as fast or faster)"
        return None, "libllama's choice per device (-fa auto, layers on devices)"

    def device_use(self):
        """``devices`` with each device's bytes held now: the drop in its free memory
        since just before the load (weights, KV caches and compute buffers; on a
        device other processes use too, theirs as well), or None where the driver
        reports no change."""
        out = []
        objs = iter(self._device_objs)
        for d in self.devices:
            d = dict(d)
            if d["name"] != "CPU":
                dev, before = next(objs)
                free, total = dev.memory()
                d["free"], d["total"] = free, total
                d["held"] = before - free if before > free else None
            out.append(d)
        return out

    def _placement(self, devices, n_gpu_layers, tensor_split):
        """The ``devices`` attribute: how many layers each device got (engine/rpc.py)."""
        try:
            n_layer = int(self.meta.get("%s.block_count" % self.meta.get("general.architecture")))
        except (TypeError, ValueError):
            n_layer = 0
        weights = list(tensor_split or ()) + [0.0] * (len(devices) - len(tensor_split or ()))
        if not any(weights):
            weights = [d.free for d in devices]
        counts = rpc.layer_split(n_layer, len(devices), n_gpu_layers, weights)
        out = [{"name": "CPU", "layers": counts[0]}]
        for d, n in zip(devices, counts[1:]):
            out.append({"name": d.name, "endpoint": d.endpoint, "description": d.description,
                        "type": d.type, "backend": d.backend,
                        "free": d.free, "total": d.total, "layers": n})
        return out

    # -- lifetime ------------------------------------------------------------
    def close(self):
        """Free the model.  Sessions made from it must be closed first."""
        self._handle.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def handle(self):
        return self._handle

    @property
    def has_fim(self):
        """Whether the model can fill in the middle (has PRE, SUF and MID tokens)."""
        return None not in (self.fim_pre, self.fim_suf, self.fim_mid)

    # -- tokens --------------------------------------------------------------
    def tokenize(self, text, add_special=True, parse_special=False, keep=None):
        """Token ids of ``text``.

        ``add_special`` adds BOS (and EOS) where the model wants them;
        ``parse_special`` lets text such as ``<fim_prefix>`` become the special
        token rather than its letters, so only trusted prompt text should use it.
        ``keep``: True keeps the tokens with the long texts' for the same
        text's next time, False not at all; by default a text is kept with
        the long ones (TOKENIZED_MIN_CHARS or more) or the short ones.
        """
        if keep is False:
            return self._handle.tokenize(text.encode("utf-8", "surrogatepass"), add_special,
                                         parse_special)
        # An editor sends the same long prefix and suffix with every keystroke
        # while the cursor stays on a line (what is typed goes in "prompt"):
        # 256 lines took about 20 ms to tokenize here, each time.  Kept whole, by
        # text, so a hit is exactly what libllama would give.
        if keep or len(text) >= TOKENIZED_MIN_CHARS:
            kept, limit = self._tokenized, TOKENIZED_KEPT
        else:
            kept, limit = self._tokenized_short, TOKENIZED_SHORT_KEPT
        key = (text, add_special, parse_special)
        with self._tokenized_lock:
            hit = kept.get(key)
            if hit is not None:
                kept.move_to_end(key)
                return list(hit)
        tokens = self._handle.tokenize(text.encode("utf-8", "surrogatepass"), add_special,
                                       parse_special)
        with self._tokenized_lock:
            kept[key] = tuple(tokens)
            while len(kept) > limit:
                kept.popitem(last=False)      # the least recently used
        return tokens

    def check_tokens(self, tokens):
        """Raise InvalidToken unless every id is a valid token of this model.

        Called on every token list that comes from a client before any of it
        reaches libllama, which does not check ids and would read out of bounds.
        """
        n = self.n_vocab
        for t in tokens:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < n:
                raise InvalidToken("token id %r is out of range [0, %d)" % (t, n))

    def token_bytes(self, token):
        """The bytes a token stands for when generated (special tokens render empty)."""
        piece = self._pieces.get(token)
        if piece is None:
            self.check_tokens((token,))     # libllama throws through C for a bad id: abort
            piece = self._handle.token_to_piece(token, False)
            self._pieces[token] = piece
        return piece

    def token_text(self, token, special=True):
        """A token's text for display (``/tokenize`` with_pieces), special tokens rendered."""
        self.check_tokens((token,))
        return self._handle.token_to_piece(token, special)

    def is_eog(self, token):
        """Whether generating ``token`` ends generation (EOS, EOT, ...)."""
        r = self._eog.get(token)
        if r is None:
            r = self._eog[token] = self._handle.is_eog(token)
        return r

    @property
    def grammar_facts(self):
        """(n_vocab, end-of-generation ids, first bytes of the other tokens, and
        ``token_id(text)``: the one token a text is, or None): what ``chat.gbnf``
        checks grammars against, computed on first use.

        One pass over the vocabulary, until every first byte has been seen,
        straight to libllama rather than through the token caches, which would
        keep every piece alive.
        """
        with self._lock:            # two first requests at once compute it once
            if self._grammar_facts is None:
                self._grammar_facts = self._vocab_facts()
            return self._grammar_facts

    def _vocab_facts(self):
        eog = set(self.eog_tokens())
        first = set()
        for t in range(self.n_vocab):
            if t in eog:
                continue
            piece = self._handle.token_to_piece(t, False)
            if piece and piece[0]:      # libllama's sampler skips empty and NUL-led pieces
                first.add(piece[0])
                if len(first) == 255:
                    # every byte but NUL: the set is whole.  Byte-level and
                    # byte-fallback vocabularies get there in their first few
                    # hundred ids (Qwen2.5 at 255, gemma-3 at 493), which cuts
                    # this scan from 0.4-0.7 s to nothing on every (re)load
                    break

        def token_id(text):
            ids = self.tokenize(text, add_special=False, parse_special=True)
            return ids[0] if len(ids) == 1 else None
        return self.n_vocab, eog, first, token_id

    def eog_tokens(self):
        """Every token that ends generation (EOS, EOT, and the others a vocabulary
        marks so, e.g. FIM pad/sep); computed once, a C call per vocabulary entry."""
        if self._eog_all is None:
            self._eog_all = tuple(t for t in range(self.n_vocab) if self._handle.is_eog(t))
        return self._eog_all

    def detokenize(self, tokens, special=False):
        """Text of a token list; ids are checked first."""
        self.check_tokens(tokens)
        if not tokens:
            return ""
        data = self._handle.detokenize(list(tokens), False, special)
        return data.decode("utf-8", "replace")

    def builtin_template(self, name, messages, add_assistant=True):
        """Render (role, content) pairs with libllama's built-in template ``name``."""
        return libllama.chat_apply_template(self.lib, name, messages, add_assistant)

    def builtin_template_names(self):
        return libllama.builtin_chat_templates(self.lib)


def stretched_context(n_ctx_train, meta, rope):
    """The longest context a model's positions are meant for: ``n_ctx_train`` stretched
    by the RoPE scaling in force.  The flags' (--rope-scale N, --rope-freq-scale 1/N:
    the original context, --yarn-orig-ctx or the trained one, times N), else the
    file's rope.scaling (linear or yarn: its original_context_length times its
    factor; a file whose context_length holds that already stays as it is), which
    --rope-scaling none turns off."""
    if n_ctx_train <= 0:
        return n_ctx_train
    scale = rope.get("rope_freq_scale")
    if scale:
        return max(n_ctx_train, int((rope.get("yarn_orig_ctx") or n_ctx_train) / scale))
    arch = meta.get("general.architecture", "")
    if rope.get("rope_scaling_type") == libllama.ROPE_SCALING_TYPES["none"] or \
            meta.get("%s.rope.scaling.type" % arch) not in ("linear", "yarn"):
        return n_ctx_train
    try:
        factor = float(meta.get("%s.rope.scaling.factor" % arch) or 0)
        orig = int(meta.get("%s.rope.scaling.original_context_length" % arch) or n_ctx_train)
    except ValueError:
        return n_ctx_train
    return max(n_ctx_train, int(orig * factor)) if factor > 1 else n_ctx_train


def _check_kv_overrides(path, kv_overrides):
    """Raise ModelLoadError for an --override-kv of another type than the file's key:
    libllama would read the file's value instead, with a warning few see (a key the
    file lacks is libllama's to take or leave)."""
    if not kv_overrides:
        return
    meta, _ = read_header(path)
    for key, kind, _value in kv_overrides:
        have = meta.get(key)
        if have is None:
            continue
        if isinstance(have, list):
            raise ModelLoadError("--override-kv %s=%s:...: the file's %s is an array (a value "
                                 "per layer), which an override cannot give" % (key, kind, key))
        # a GGUF bool reads as bool, its ints (any width) as int, its floats as float
        file_kind = {bool: "bool", int: "int", float: "float", str: "str"}[type(have)]
        if file_kind != kind:
            raise ModelLoadError("--override-kv %s=%s:...: the file's %s is a %s, give "
                                 "%s=%s:VALUE" % (key, kind, key, file_kind, key, file_kind))


def _tensor_overrides(lib, overrides):
    """-ot's [regex, buffer type name] pairs with the buffer types' handles; ModelLoadError
    for a name no device of this library has (llama-server lists the ones there are)."""
    if not overrides:
        return []
    known = libllama.buffer_types(lib)
    out = []
    for pattern, name in overrides:
        if name not in known:
            raise ModelLoadError("-ot %s=%s: no such buffer type in this library; it has %s"
                                 % (pattern, name, ", ".join(sorted(known))))
        out.append((pattern, known[name]))
    return out


def _layers_for(lib, path, devices, n_gpu_layers, n_ctx, kv_offload):
    """libllama's n_gpu_layers for -ngl's value (engine/devices.py): auto reads the
    model's shape first (its metadata, without weights) to size a layer."""
    if n_gpu_layers is not None and n_gpu_layers != gpus.NGL_AUTO:
        return gpus.layer_count(n_gpu_layers, 0, devices, 0, 0)
    probe = libllama.ModelHandle(lib, path, vocab_only=True)
    if not probe.ptr:
        raise ModelLoadError("libllama could not load the model %s "
                             "(not a GGUF file, or an unsupported architecture)" % path)
    try:
        meta = probe.meta()
    finally:
        probe.close()
    try:
        n_layer = int(meta.get("%s.block_count" % meta.get("general.architecture")))
    except (TypeError, ValueError):
        return -1
    layer = os.path.getsize(path) // (n_layer + 1)
    kv = kv_bytes_of(kv_meta(meta, path), n_ctx) // n_layer if kv_offload and n_layer else 0
    return gpus.layer_count(n_gpu_layers, n_layer, devices, layer, kv)
