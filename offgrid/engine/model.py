"""A loaded GGUF model: weights, vocabulary, special tokens and metadata.

A Model is shared, read-only, by every ChatSession made from it (libllama's
model and vocab are safe to use from several contexts at once).  It owns the
``llama_model *`` and frees it once, in close().
"""

import collections
import os
import sys
import threading

from .. import libllama
from ..errors import InvalidToken, ModelLoadError
from . import rpc
from .memory import MemoryClass

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
        # dense, SWA, hybrid or recurrent: what its contexts' caches may do
        # (a session's decoder refines it with the context's rollback depth)
        self.memory = MemoryClass.of(handle, self.meta)
        self.chat_template = handle.chat_template()
        self.devices = self._placement(devices, n_gpu_layers, tensor_split)

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
             on_rpc_stall=None):
        """Load a GGUF file.  Raises ModelLoadError (or LibraryError, RpcUnavailable).

        With ``vocab_only`` only the tokenizer and metadata are loaded (no
        weights): the model can tokenize but cannot back a ChatSession.

        ``rpc_endpoints`` ("host:port" of rpc-servers) put its layers on their
        devices (engine/rpc.py): ``n_gpu_layers`` of them (None: all), split
        by ``tensor_split`` (one proportion per device; None: by free memory).
        ``repack`` False: no repacked CPU weights (libllama.ModelHandle).
        ``on_rpc_stall``: rpc.connect's ``on_stall``.
        """
        lib = libllama.load(lib_path, verbose=verbose)
        if not os.path.isfile(path):
            raise ModelLoadError("model file not found: %s" % path)
        devices = (rpc.connect(lib, list(rpc_endpoints), on_rpc_stall)
                   if rpc_endpoints and not vocab_only else [])
        if tensor_split and len(tensor_split) > len(devices):
            raise ModelLoadError("--tensor-split gives %d proportions for %d devices"
                                 % (len(tensor_split), len(devices)))
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
                                      repack=repack)
        if not handle.ptr:
            raise ModelLoadError("libllama could not load the model %s "
                                 "(not a GGUF file, or an unsupported architecture)" % path)
        try:
            return cls(handle, path, devices, n_gpu_layers, tensor_split)
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
        return None, "libllama's choice per device (-fa auto, layers on --rpc devices)"

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
