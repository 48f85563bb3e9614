"""Draft-model speculation (-md/--model-draft): a smaller model of the same
vocabulary drafts the next tokens, the target checks them in one decode.

llama-server's draft-simple, on offgrid's terms:
- The draft model has one context of its own, one sequence per session, and
  keeps what each sequence holds (``_cached``), so a draft only decodes what
  the history gained since the last one: the tokens the target kept, less
  the drafted ones it did not (their cells are cut first).  The first draft
  of a request evaluates its prompt on the draft model, from what the
  sequence shares with the previous request's.
- Each draft token is the draft model's most likely one (of its top 10, as
  llama-server's draft sampler), drafting stops at the first whose
  probability among those 10 is under ``p_min``, and a draft shorter than
  ``n_min`` is dropped.  The target samples each position as it would
  without a draft and keeps a drafted token only where it sampled that very
  token (engine/session.py), so the output is the target's, greedy or not.
- A drafter has PromptLookup's interface (``append``, ``draft``), so the
  session's loop, its verify decode and its probation (a request stops
  drafting where too few drafts come true) are the same for both.
- Its decodes take the process's decode turn and run on the shared thread
  pools of the target's current thread counts (engine/session.py), as every
  other context's.

Whether it pays is the machine's and the pair's business: a draft token costs
a decode of the draft model, and a drafted run the target rejects costs its
verify.  ``offgrid`` leaves it off unless ``-md`` is given.
"""

import threading

from .. import libllama
from ..errors import ModelLoadError
from . import cachereuse
from .memory import KV_TYPES
from .model import Model
from .session import check_cache_types, decode_turn

OUT_NONE, OUT_LAST = libllama.ContextHandle.OUT_NONE, libllama.ContextHandle.OUT_LAST

# llama-server's draft sampler: the most likely of the draft model's top 10,
# its probability taken among those 10
TOP_K = 10
# llama.cpp's common_speculative_are_compatible: vocabularies whose sizes
# differ by more than this, or whose token texts differ from this id on, are
# not one vocabulary
VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START = 5


def vocab_mismatch(target, draft):
    """Why ``draft`` (a Model) cannot draft for ``target``, or None when it can."""
    kind = "tokenizer.ggml.model"
    if target.meta.get(kind) != draft.meta.get(kind):
        return "its tokenizer is %s, the model's %s" % (draft.meta.get(kind), target.meta.get(kind))
    for name in ("bos", "eos"):
        adds = getattr(target, "add_" + name), getattr(draft, "add_" + name)
        if adds[0] != adds[1] or (adds[0] and getattr(target, name) != getattr(draft, name)):
            return "its %s token differs from the model's" % name.upper()
    if abs(target.n_vocab - draft.n_vocab) > VOCAB_MAX_SIZE_DIFFERENCE:
        return "it has %d tokens, the model %d" % (draft.n_vocab, target.n_vocab)
    for i in range(VOCAB_CHECK_START, min(target.n_vocab, draft.n_vocab)):
        if target.token_text(i) != draft.token_text(i):
            return "its token %d is %r, the model's %r" % (i, draft.token_text(i),
                                                           target.token_text(i))
    return None


class DraftModel:
    """The draft model and its context: one sequence per session of the target."""

    def __init__(self, model, target, n_sessions, n_ctx, n_batch, n_ubatch, threads, n_min=0,
                 p_min=0.0, kv_unified=True, type_k="f16", type_v="f16"):
        """``model``: the loaded draft Model (owned from here on); ``target``:
        the target Model; ``n_ctx``: tokens per session (the target's);
        ``threads``: the target's DecodeThreads (the counts the draft's
        decodes follow); ``kv_unified``: False gives each session's sequence a
        cache stream of its own, as the target's (--no-kv-unified); ``type_k``,
        ``type_v``: its KV cache's types (-ctkd, -ctvd; memory.KV_TYPES)."""
        self.model = model
        self.n_ctx = n_ctx
        self.n_min = max(0, n_min)
        self.p_min = max(0.0, p_min)
        self.threads = threads
        self.ctx = None
        why = vocab_mismatch(target, model)
        if why is not None:
            raise ModelLoadError("the draft model %s cannot draft for %s: %s"
                                 % (model.name, target.name, why))
        check_cache_types(model, type_k, type_v, None, ("-ctkd", "-ctvd"))
        self.type_k, self.type_v = type_k, type_v
        self.ctx = libllama.ContextHandle(
            model.lib, model.handle, n_ctx * n_sessions, n_batch, n_ubatch or n_batch,
            threads.generation.max_threads, threads.batch.max_threads, n_seq_max=n_sessions,
            seq_per_stream=0 if kv_unified else 1, type_k=KV_TYPES[type_k][0],
            type_v=KV_TYPES[type_v][0])
        if not self.ctx.ptr:
            raise ModelLoadError("libllama could not make the draft model's context of %d "
                                 "tokens (not enough memory?)" % (n_ctx * n_sessions))
        self._lock = threading.Lock()       # the draft context: one draft at a time
        self._cached = [[] for _ in range(n_sessions)]
        self._candidates = libllama.Candidates(model.lib, model.n_vocab)
        self._greedy = libllama.SamplerHandle.greedy(model.lib)
        self._top = libllama.SamplerHandle.chain(model.lib)
        self._top.add(libllama.SamplerHandle.top_k(model.lib, TOP_K))
        # dist only computes the probabilities here: the pick is data[0]
        self._top.add(libllama.SamplerHandle.dist(model.lib, 0))
        self.n_drafts = 0               # drafts made (for tests and /metrics)
        self.closed = False

    @classmethod
    def load(cls, path, target, n_sessions, n_ctx, n_batch, n_ubatch, threads, n_min=0,
             p_min=0.0, lib_path=None, verbose=False, kv_unified=True, type_k="f16",
             type_v="f16"):
        model = Model.load(path, lib_path=lib_path, verbose=verbose, progress=False)
        try:
            return cls(model, target, n_sessions, n_ctx, n_batch, n_ubatch, threads, n_min,
                       p_min, kv_unified, type_k, type_v)
        except BaseException:
            model.close()
            raise

    def close(self):
        if not self.closed:
            self.closed = True
            if self.ctx is not None:
                self.ctx.close()
            for s in (getattr(self, "_greedy", None), getattr(self, "_top", None)):
                if s is not None:
                    s.close()
            self.model.close()

    def drafter(self, seq, prompt, cancel=None):
        """A drafter for one request of session ``seq`` whose prompt is ``prompt``."""
        return _Drafter(self, seq, prompt, cancel)

    # -- one draft -----------------------------------------------------------
    def draft(self, seq, history, k, cancel=None):
        """Up to ``k`` tokens the draft model expects after ``history`` (the
        prompt and every token the target kept, its last one not yet decoded
        by the target); [] where it has none it is sure enough of."""
        if k <= 0 or k < self.n_min or len(history) + k >= self.n_ctx or self.closed:
            return []
        with self._lock:
            if not self._sync(seq, history, cancel):
                return []
            out = []
            pos = len(history)
            while True:
                token = self._pick()
                if token is None:
                    break
                out.append(token)
                if len(out) >= k or (cancel is not None and cancel.cancelled):
                    break
                if not self._decode(seq, [token], pos, OUT_LAST):
                    break
                self._cached[seq].append(token)
                pos += 1
            self.n_drafts += 1
        return out if len(out) >= max(self.n_min, 1) else []

    def _sync(self, seq, history, cancel):
        """Bring sequence ``seq`` to ``history``, the last token's logits out."""
        cached = self._cached[seq]
        keep = min(cachereuse.common_prefix(cached, history), len(history) - 1)
        if keep < len(cached):
            # a recurrent state cannot be cut back (engine/memory.py): a draft
            # model that has one reads the history again; a cut is read back
            mem = self.ctx.memory
            if self.model.memory.has_state or not mem.seq_rm(seq, keep, -1) \
                    or mem.seq_pos_max(seq) != keep - 1:
                self._forget(seq)
                keep = 0
            else:
                del cached[keep:]
        n_batch = self.ctx.n_batch
        while keep < len(history):
            if cancel is not None and cancel.cancelled:
                return False
            chunk = history[keep:keep + n_batch]
            last = keep + len(chunk) == len(history)
            if not self._decode(seq, chunk, keep, OUT_LAST if last else OUT_NONE):
                return False
            cached += chunk
            keep += len(chunk)
        return True

    def _decode(self, seq, tokens, pos, outputs):
        threads = self.threads
        with decode_turn():
            threads.attach(self.ctx, len(tokens), threads.generation.current(0),
                           threads.batch.max_threads)
            status = self.ctx.decode_parts([(tokens, pos, (seq,), outputs)])
        if status != 0:
            self._forget(seq)       # what a failed decode left is not known
            return False
        return True

    def _forget(self, seq):
        self.ctx.memory.seq_rm(seq, -1, -1)
        self._cached[seq] = []

    def _pick(self):
        """The draft model's next token from its last decode, or None under p_min."""
        if self.p_min <= 0.0:
            return self._greedy.sample(self.ctx, -1)
        c = self._candidates
        c.load(self.ctx, -1)
        self._top.apply(c)
        token, p = c.head(1)[0]
        return token if p >= self.p_min else None


class _Drafter:
    """One request's drafts (PromptLookup's interface, engine/lookup.py)."""

    def __init__(self, owner, seq, prompt, cancel):
        self.owner = owner
        self.seq = seq
        self.history = list(prompt)
        self.cancel = cancel

    def append(self, token):
        self.history.append(token)

    def draft(self, k):
        return self.owner.draft(self.seq, self.history, k, self.cancel)
