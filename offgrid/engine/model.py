"""A loaded GGUF model: weights, vocabulary, special tokens and metadata.

A Model is shared, read-only, by every ChatSession made from it (libllama's
model and vocab are safe to use from several contexts at once).  It owns the
``llama_model *`` and frees it once, in close().
"""

import os
import sys
import threading

from .. import libllama
from ..chat.gbnf import VocabFacts
from ..errors import InvalidToken, ModelLoadError


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
      bos, eos, eot, nl   special token ids, None where the model has none
      fim_pre, fim_suf, fim_mid, fim_pad, fim_rep, fim_sep
                          fill-in-the-middle token ids, None where absent
      add_bos             whether tokenizing a prompt should prepend BOS
      meta                GGUF metadata, key -> value as a string
      chat_template       the model's Jinja template text, or None
      vocab_only          loaded without weights: it tokenizes but cannot generate
    """

    def __init__(self, handle, path):
        self._handle = handle
        self.lib = handle.lib
        self.path = str(path)
        self.name = os.path.basename(self.path)
        self.vocab_only = handle.vocab_only
        lib, vocab = self.lib, handle.vocab
        self._vocab = vocab
        self.n_vocab = lib.llama_vocab_n_tokens(vocab)
        self.n_ctx_train = lib.llama_model_n_ctx_train(handle.ptr)
        self.n_embd = lib.llama_model_n_embd(handle.ptr)
        self.n_params = lib.llama_model_n_params(handle.ptr)
        self.size = lib.llama_model_size(handle.ptr)
        self.n_swa = lib.llama_model_n_swa(handle.ptr)
        self.desc = libllama.read_string(lib.llama_model_desc, handle.ptr)

        def tok(fn):
            t = fn(vocab)
            return t if 0 <= t < self.n_vocab else None
        self.bos = tok(lib.llama_vocab_bos)
        self.eos = tok(lib.llama_vocab_eos)
        self.eot = tok(lib.llama_vocab_eot)
        self.nl = tok(lib.llama_vocab_nl)
        self.fim_pre = tok(lib.llama_vocab_fim_pre)
        self.fim_suf = tok(lib.llama_vocab_fim_suf)
        self.fim_mid = tok(lib.llama_vocab_fim_mid)
        self.fim_pad = tok(lib.llama_vocab_fim_pad)
        self.fim_rep = tok(lib.llama_vocab_fim_rep)
        self.fim_sep = tok(lib.llama_vocab_fim_sep)
        self.add_bos = bool(lib.llama_vocab_get_add_bos(vocab))
        self.add_eos = bool(lib.llama_vocab_get_add_eos(vocab))

        self.meta = {}
        for i in range(lib.llama_model_meta_count(handle.ptr)):
            key = libllama.read_string(lib.llama_model_meta_key_by_index, handle.ptr, i)
            val = libllama.read_string(lib.llama_model_meta_val_str_by_index, handle.ptr, i,
                                       size=1024)
            if key is not None:
                self.meta[key] = val
        tmpl = lib.llama_model_chat_template(handle.ptr, None)
        self.chat_template = tmpl.decode("utf-8", "replace") if tmpl else None

        # Per-token caches, filled lazily: generation asks for the same few
        # thousand tokens over and over, and a dict lookup beats a C call.
        self._pieces = {}
        self._eog = {}
        self._lock = threading.Lock()
        self._grammar_facts = None

    @classmethod
    def load(cls, path, lib_path=None, progress=True, verbose=False, vocab_only=False):
        """Load a GGUF file.  Raises ModelLoadError (or LibraryError).

        With ``vocab_only`` only the tokenizer and metadata are loaded (no
        weights): the model can tokenize but cannot back a ChatSession.
        """
        lib = libllama.load(lib_path, verbose=verbose)
        if not os.path.isfile(path):
            raise ModelLoadError("model file not found: %s" % path)
        show = _terminal_progress(os.path.basename(str(path))) if progress else None
        handle = libllama.ModelHandle(lib, path, show, vocab_only=vocab_only)
        if not handle.ptr:
            raise ModelLoadError("libllama could not load the model %s "
                                 "(not a GGUF file, or an unsupported architecture)" % path)
        try:
            return cls(handle, path)
        except BaseException:
            handle.close()
            raise

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
    def tokenize(self, text, add_special=True, parse_special=False):
        """Token ids of ``text``.

        ``add_special`` adds BOS (and EOS) where the model wants them;
        ``parse_special`` lets text such as ``<fim_prefix>`` become the special
        token rather than its letters, so only trusted prompt text should use it.
        """
        return libllama.tokenize(self.lib, self._vocab, text.encode("utf-8", "surrogatepass"),
                                 add_special, parse_special)

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
            piece = libllama.token_to_piece(self.lib, self._vocab, token, False)
            self._pieces[token] = piece
        return piece

    def token_text(self, token, special=True):
        """A token's text for display (``/tokenize`` with_pieces), special tokens rendered."""
        self.check_tokens((token,))
        return libllama.token_to_piece(self.lib, self._vocab, token, special)

    def is_eog(self, token):
        """Whether generating ``token`` ends generation (EOS, EOT, ...)."""
        r = self._eog.get(token)
        if r is None:
            r = self._eog[token] = bool(self.lib.llama_vocab_is_eog(self._vocab, token))
        return r

    @property
    def grammar_facts(self):
        """The vocabulary facts ``chat.gbnf.check`` needs, computed on first use.

        One pass over the vocabulary (262k tokens of gemma-3: 1.1 s of CPU),
        straight to libllama rather than through the token caches, which would
        keep every piece alive.
        """
        with self._lock:            # two first requests at once compute it once
            if self._grammar_facts is None:
                self._grammar_facts = self._vocab_facts()
            return self._grammar_facts

    def _vocab_facts(self):
        lib, vocab = self.lib, self._vocab
        eog, first = set(), set()
        for t in range(self.n_vocab):
            if lib.llama_vocab_is_eog(vocab, t):
                eog.add(t)
                continue
            piece = libllama.token_to_piece(lib, vocab, t, False)
            if piece and piece[0]:      # libllama's sampler skips empty and NUL-led pieces
                first.add(piece[0])

        def token_id(text):
            ids = self.tokenize(text, add_special=False, parse_special=True)
            return ids[0] if len(ids) == 1 else None
        return VocabFacts(self.n_vocab, eog, first, token_id)

    def detokenize(self, tokens, special=False):
        """Text of a token list; ids are checked first."""
        self.check_tokens(tokens)
        if not tokens:
            return ""
        data = libllama.detokenize(self.lib, self._vocab, list(tokens), False, special)
        return data.decode("utf-8", "replace")

    def builtin_template(self, name, messages, add_assistant=True):
        """Render (role, content) pairs with libllama's built-in template ``name``."""
        return libllama.chat_apply_template(self.lib, name, messages, add_assistant)

    def builtin_template_names(self):
        return libllama.builtin_chat_templates(self.lib)
