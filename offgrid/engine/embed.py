"""Embeddings and rerank scores: a llama_context of their own, beside the chat sessions.

An Embedder turns token lists into vectors (or, with pooling ``rank``, into
relevance scores).  Its context is made with ``embeddings=true`` (pooling
none, or rank), on the first request and then kept: a server that only chats
never pays for it, and no embedding request ever touches a chat session's
KV cache (``ChatSession.cached`` stays what it was).

Batching: several inputs go into one llama_decode, one sequence id each, up
to ``n_batch`` tokens and ``n_seq_max`` inputs; the memory is cleared
between batches.  The context outputs every token's state (libllama's
pooling none) and the pooling (mean, cls = first token, last) is done here:
libllama pools a sequence within one ubatch only, so an input longer than a
batch could not be pooled there, while here a decoder's long input is
decoded alone in chunks (its keys stay in the cache) and pooled over all of
them, up to the context.  (An encoder attends both ways: its input must fit
one batch.)  Only rank pools in libllama, where the classifier head is.
Decodes take turns with the sessions' (``decode_turn``), so an embedding
request and a stream on the same cores do not starve each other.

What it costs: an embedding context computes the output layer's logits for
every token (libllama has no switch for that), so its buffers hold
``n_vocab`` floats per token of a batch, twice (the host copy and the compute
buffer).  ``embedding_batch`` sizes the batch to keep that near 128 MiB; its
KV cache is the chat context's size (-c).

Threading: one request at a time (``_lock``); called from the worker's
request threads.
"""

import array
import math
import operator
import sys
import threading
import time

from .. import libllama
from ..errors import ContextError, ContextFull, DecodeError, InvalidRequest, NotSupported
from .session import decode_threads, decode_turn

POOLING = {"none": libllama.LLAMA_POOLING_TYPE_NONE, "mean": libllama.LLAMA_POOLING_TYPE_MEAN,
           "cls": libllama.LLAMA_POOLING_TYPE_CLS, "last": libllama.LLAMA_POOLING_TYPE_LAST,
           "rank": libllama.LLAMA_POOLING_TYPE_RANK}
POOLING_NAMES = {v: k for k, v in POOLING.items()}

# The pooling of a model whose GGUF names none (the chat models: Qwen2.5,
# SmolLM2, gemma-3), which were not trained to embed.  Mean: measured on
# Qwen2.5-Coder over four (sentence, paraphrase, unrelated) triples, mean put
# every paraphrase nearer than the unrelated sentence (cosine 0.58-0.95 vs
# 0.28-0.52); last, the pooling of models trained for it on a decoder
# (Qwen3-Embedding), got one of four backwards (-0.22 vs 0.60): an untrained
# decoder's last state is about the next token more than the text.
# llama-server's own default there is none, which its /v1/embeddings refuses.
DECODER_DEFAULT = "mean"

# Inputs decoded together at most (LLAMA_MAX_SEQ is 256).
MAX_SEQS = 64

# Bytes the logits of one embedding batch may take, host copy and compute
# buffer together (see the module docstring).
LOGITS_BUDGET = 128 << 20


def model_pooling(model):
    """The pooling type the model's GGUF names (``ARCH.pooling_type``), or None."""
    arch = model.meta.get("general.architecture", "")
    value = model.meta.get("%s.pooling_type" % arch)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def choose_pooling(model, asked=None):
    """(pooling name, where it came from): ``asked`` (--pooling), else the GGUF's, else ours."""
    if asked:
        return asked, "flag"
    own = model_pooling(model)
    if own in POOLING_NAMES:
        return POOLING_NAMES[own], "gguf"
    return DECODER_DEFAULT, "default"


def embedding_batch(n_vocab, n_batch, n_ubatch=None, dedicated=False):
    """Tokens per embedding decode: -ub if given, else -b, cut to the logits budget
    for a chat model (a multiple of 16: Qwen2.5's 152k vocabulary gets 96,
    gemma-3's 262k 64).  A ``dedicated`` embedding or reranker model (its GGUF
    names a pooling) has no output layer to speak of, and an encoder must see a
    whole input in one batch: it gets -b, as llama-server gives it."""
    if n_ubatch:
        return max(8, min(n_batch, n_ubatch))
    if dedicated:
        return max(8, n_batch)
    fits = LOGITS_BUDGET // (8 * max(1, n_vocab))
    return max(32, min(n_batch, fits - fits % 16))


def normalize(vec, mode):
    """``vec`` scaled as llama-server's ``embd_normalize`` says: -1 none, 0 to the
    int16 range by its largest component, 2 to unit length (the default), p > 0
    the p-norm."""
    if mode < 0 or not vec:
        return vec
    top = max(abs(x) for x in vec)
    if mode == 0:
        size = top / 32760.0
    elif top == 0.0:
        size = 0.0
    elif mode == 2:
        size = math.sqrt(math.fsum(x * x for x in vec))
    else:   # scaled by the largest first: no overflow for any p
        size = top * math.fsum((abs(x) / top) ** mode for x in vec) ** (1.0 / mode)
    k = 1.0 / size if size > 0 else 0.0
    return array.array("f", [x * k for x in vec])


class Embedder:
    """The embedding context of one model, made on first use; close() frees it."""

    def __init__(self, model, pooling="mean", n_ctx=4096, n_batch=512, n_threads=None,
                 n_threads_batch=None, threads=None):
        """``threads``: a DecodeThreads (engine/threads.py) of its own; without it,
        one from n_threads / n_threads_batch (None or "auto": adaptive)."""
        self.model = model
        self.pooling = pooling
        self.pooling_type = POOLING[pooling]
        self.rank = self.pooling_type == libllama.LLAMA_POOLING_TYPE_RANK
        self.n_ctx = max(16, n_ctx)
        self.n_batch = min(n_batch, self.n_ctx)
        # libllama reserves its graphs with the batch split evenly among
        # n_seq_max sequences; pooled outputs only agree with that reserve
        # when it splits exactly (else it aborts the process in ggml_mul_mat)
        self.n_seqs = max(k for k in range(1, min(MAX_SEQS, self.n_batch) + 1)
                          if self.n_batch % k == 0)
        if self.rank and model_pooling(model) != self.pooling_type:
            # no classifier head: libllama's rank output is then the whole hidden
            # state, and it reads sequence j's score at float j of the first
            # sequence's; one sequence a batch gets each its own (llama-server's
            # slots decode one each too)
            self.n_seqs = 1
        self.threads = threads or decode_threads(model, n_threads, n_threads_batch)
        self.n_out = model.n_embd_out
        self.pooling_from = "flag"
        self._ctx = None
        self._lock = threading.Lock()
        # its model's LoRA adapters (engine/adapters.py; Loaded sets them): an
        # embedding runs with the global scales, as llama-server's does
        self.adapters = None
        # its model's control vector (engine/controlvector.py; Loaded sets it), as
        # llama-server's one context embeds with it too
        self.control_vector = None
        self.closed = False
        # whether an input may span several batches: set with the context
        # (a decoder's keys stay in its cache; an encoder sees one batch)
        self.splits = None
        # its decodes so far and their time (the prompt counters of /metrics)
        self.n_decodes = 0
        self.decode_seconds = 0.0

    @classmethod
    def for_model(cls, model, pooling=None, n_ctx=4096, n_batch=512, n_ubatch=None,
                  threads=None):
        """The Embedder a worker keeps: pooling as asked (--pooling), else the GGUF's,
        else DECODER_DEFAULT; the batch as embedding_batch() sizes it."""
        name, source = choose_pooling(model, pooling)
        dedicated = model_pooling(model) is not None
        e = cls(model, name, n_ctx, embedding_batch(model.n_vocab, n_batch, n_ubatch, dedicated),
                threads=threads)
        e.pooling_from = source
        return e

    @property
    def max_tokens(self):
        """The longest input (tokens) this context takes (before the context is
        made, what it would be for a decoder)."""
        return self.n_ctx if self.splits is not False else self.n_batch

    # -- lifetime ------------------------------------------------------------
    def _context(self):
        if self.closed:
            raise ContextError("the embedding context is closed")
        if self._ctx is None:
            # Pooling happens here, in Python, from every token's state
            # (libllama's pooling none), but for rank, whose classifier head
            # is in the graph.  libllama pools a sequence within one ubatch
            # only; pooled here, a decoder's long input is pooled over all
            # of its chunks, mean included.
            ctx = libllama.ContextHandle(
                self.model.lib, self.model.handle, self.n_ctx, self.n_batch, self.n_batch,
                self.threads.generation.max_threads, self.threads.batch.max_threads,
                swa_full=False, n_seq_max=self.n_seqs,
                embeddings=True, pooling=(libllama.LLAMA_POOLING_TYPE_RANK if self.rank
                                          else libllama.LLAMA_POOLING_TYPE_NONE))
            if not ctx.ptr:
                raise ContextError("libllama could not create an embedding context of %d "
                                   "tokens (not enough memory?)" % self.n_ctx)
            if self.control_vector is not None:
                try:
                    self.control_vector.apply(ctx)
                except BaseException:
                    ctx.close()
                    raise
            self.splits = ctx.causal_attn()
            self.n_batch = min(self.n_batch, ctx.n_batch)
            self._ctx = ctx
        return self._ctx

    def close(self):
        with self._lock:
            self.closed = True
            ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.close()

    # -- requests --------------------------------------------------------------
    def check(self, tokens, index=0):
        """Raise InvalidRequest/ContextFull unless ``tokens`` is an input this context takes."""
        if not tokens:
            raise InvalidRequest("input %d is empty: it has no tokens (send some text)" % index)
        self.model.check_tokens(tokens)
        if len(tokens) > self.max_tokens:
            how = ("the embedding context holds %d tokens; start the server with a larger -c"
                   % self.n_ctx if self.splits is not False else
                   "this model reads a whole input in one batch of %d tokens; start the "
                   "server with a larger -ub (and -b)" % self.n_batch)
            raise ContextFull("input %d (%d tokens) is too large to process: %s"
                              % (index, len(tokens), how))

    def embed(self, inputs, norm=2, truncate=False, first=0, adapters=()):
        """One embedding per token list: an array('f') of n_embd_out, normalized
        as ``norm`` says (see normalize); with pooling none, a list of them, one
        per token, as they are.  ``truncate`` cuts each input to what the
        context takes rather than refusing it.  Errors name an input by its
        index plus ``first``.  Returns (embeddings, the token count of each
        input).  ``adapters``: the LoRA adapter key to run with."""
        if self.rank:
            raise NotSupported("the server pools for reranking (--reranking or --pooling "
                               "rank): its outputs are scores, not embeddings")
        out, counts = self._run(inputs, truncate, first, adapters)
        if self.pooling_type == libllama.LLAMA_POOLING_TYPE_NONE:
            return out, counts
        return [normalize(v, norm) for v in out], counts

    def scores(self, inputs, adapters=()):
        """(The relevance score of each token list (pooling rank): its first output,
        the token count of each)."""
        if not self.rank:
            raise NotSupported("the server does not rerank: start it with --reranking")
        out, counts = self._run(inputs, adapters=adapters)
        return [v[0] if len(v) else 0.0 for v in out], counts

    def _run(self, inputs, truncate=False, first=0, adapters=()):
        for i, tokens in enumerate(inputs):
            if not tokens:
                self.check(tokens, first + i)
            self.model.check_tokens(tokens)
        with self._lock:
            ctx = self._context()
            if self.adapters is not None:
                self.adapters.apply(ctx, adapters)
            if truncate:
                inputs = [t[:self.max_tokens] for t in inputs]
            for i, tokens in enumerate(inputs):
                self.check(tokens, first + i)
            out = [None] * len(inputs)
            for group in self._groups([len(t) for t in inputs]):
                try:
                    self._batch(ctx, inputs, group, out)
                finally:
                    ctx.memory.clear(False)     # cells only: the next batch starts empty
            return out, [len(t) for t in inputs]

    def _groups(self, lengths):
        """Lists of input indices decoded together, in order: at most n_batch tokens
        and n_seqs inputs each; an input longer than a batch goes alone."""
        group, used = [], 0
        for i, n in enumerate(lengths):
            if group and (used + n > self.n_batch or len(group) == self.n_seqs):
                yield group
                group, used = [], 0
            group.append(i)
            used += n
            if used >= self.n_batch:
                yield group
                group, used = [], 0
        if group:
            yield group

    def _batch(self, ctx, inputs, group, out):
        if self.rank:
            if len(group) == 1 and len(inputs[group[0]]) > self.n_batch:
                # a causal reranker (Qwen3-Reranker's kind) scores its last token,
                # which attends to the earlier chunks' cells: the input in chunks,
                # the score after the last (an encoder's input is refused longer
                # than a batch: check)
                tokens = inputs[group[0]]
                for start in range(0, len(tokens), self.n_batch):
                    self._decode(ctx, [(0, tokens[start:start + self.n_batch], start)])
            else:
                self._decode(ctx, [(j, inputs[i], 0) for j, i in enumerate(group)])
            for j, i in enumerate(group):
                data = ctx.embedding_seq(j, 1)
                if data is None:
                    raise DecodeError("libllama returned no score for input %d" % i, -1)
                out[i] = _floats(data)
            return
        if len(group) == 1 and len(inputs[group[0]]) > self.n_batch:
            (i,) = group
            tokens, pool = inputs[i], _Pool(self.pooling, self.n_out, len(inputs[i]))
            for start in range(0, len(tokens), self.n_batch):
                chunk = tokens[start:start + self.n_batch]
                self._decode(ctx, [(0, chunk, start)])
                pool.add(self._rows(ctx, len(chunk)), 0, len(chunk))
            out[i] = pool.result()
            return
        self._decode(ctx, [(j, inputs[i], 0) for j, i in enumerate(group)])
        rows = self._rows(ctx, sum(len(inputs[i]) for i in group))
        at = 0
        for i in group:
            n = len(inputs[i])
            pool = _Pool(self.pooling, self.n_out, n)
            pool.add(rows, at, n)
            out[i] = pool.result()
            at += n

    def _rows(self, ctx, n_rows):
        data = ctx.embedding_rows(n_rows, self.n_out)
        if data is None:
            raise DecodeError("libllama returned no embeddings for the batch", -1)
        return _floats(data)

    def _decode(self, ctx, parts):
        n = sum(len(tokens) for _, tokens, _ in parts)
        with decode_turn():
            started = self.threads.before(ctx, n)      # attaches the pools it picks
            t0 = time.perf_counter()
            status = ctx.decode_sequences(parts)
            self.n_decodes += 1
            self.decode_seconds += time.perf_counter() - t0
            if status == 0:
                self.threads.after(n, started)
        if status != 0:
            raise DecodeError("llama_decode of an embedding batch failed with status %d"
                              % status, status)


class _Pool:
    """One input's pooling, fed its tokens' states a batch at a time.

    ``rows`` is a batch's (n_rows, n) float32 states as one flat array('f');
    add(rows, at, k) takes rows at..at+k-1, the input's next k tokens.
    """

    def __init__(self, pooling, n, n_tokens):
        self.pooling, self.n, self.n_tokens = pooling, n, n_tokens
        self.seen = 0
        self.acc = None
        self.rows = []

    def add(self, rows, at, k):
        n = self.n
        if self.pooling == "mean":
            acc = self.acc or [0.0] * n
            for r in range(at, at + k):
                acc = list(map(operator.add, acc, rows[r * n:(r + 1) * n]))
            self.acc = acc
        elif self.pooling == "cls":
            if self.seen == 0:
                self.acc = rows[at * n:(at + 1) * n]
        elif self.pooling == "last":
            if self.seen + k == self.n_tokens:
                self.acc = rows[(at + k - 1) * n:(at + k) * n]
        else:   # none: every token's state
            self.rows += [rows[r * n:(r + 1) * n] for r in range(at, at + k)]
        self.seen += k

    def result(self):
        if self.pooling == "none":
            return self.rows
        if self.pooling == "mean":
            return array.array("f", [x / self.n_tokens for x in self.acc])
        return array.array("f", self.acc)


def _floats(data):
    """array('f') of native float32 bytes."""
    a = array.array("f")
    if data:
        a.frombytes(data)
    return a


def to_le(vec):
    """A float32 array's bytes, little-endian (base64 embeddings are, whatever the host)."""
    if sys.byteorder != "little":
        vec = array.array("f", vec)
        vec.byteswap()
    return vec.tobytes()
