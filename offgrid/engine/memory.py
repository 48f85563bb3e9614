"""MemoryClass: what a model's memory can do, read once at load.

A model remembers a prompt in one of four ways, or (an encoder) not at all,
and every cache feature (prefix reuse, chunk reuse, drafts, kept states,
context shift) depends on which:

    dense       a KV cell per position: cut anywhere, move (re-rotate) keys
    swa         the same, plus a window cache that keeps only the last window
                of positions (full-size with swa_full, as offgrid makes it)
    hybrid      attention's KV cells beside a recurrent state per sequence
                (Qwen3.5/3.6, LFM2, Granite-4.0-H, Nemotron-H, Qwen3-Next)
    recurrent   a recurrent state per sequence only (Mamba, RWKV)
    none        no memory at all: an encoder (BERT, nomic-bert) reads each
                input whole into embeddings and cannot generate text

A recurrent state is that of the sequence's last token: it cannot be cut
back to an earlier position, unless the context keeps snapshots of its last
``rollback`` tokens (``n_rs_seq``, on the architectures that support them),
and libllama's own answers are no guide (``llama_memory_can_shift`` is true
for most hybrids; a cut in the middle returns true and leaves the state as it
was).  So the session asks this one description rather than libllama, and
what it cannot cut it restores from a checkpoint of the recurrent part
(``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``), as llama-server does.

An --mmproj that places images by M-RoPE positions (Qwen2-VL and its kin:
engine/positions.py) makes the positions of the cache no longer its token
indices: keys are then never moved (no chunk reuse, no context shift, as
llama-server has it), which ``with_media`` records.

Made by ``MemoryClass.of(handle, meta)`` from the model, then ``with_context``
once a context says how many tokens it can take back.
"""

from .. import libllama
from .ggufheader import read_header

_ROPE_NAMES = {
    libllama.LLAMA_ROPE_TYPE_NONE: "none",
    libllama.LLAMA_ROPE_TYPE_NORM: "norm",
    libllama.LLAMA_ROPE_TYPE_NEOX: "neox",
    libllama.LLAMA_ROPE_TYPE_MROPE: "mrope",
    libllama.LLAMA_ROPE_TYPE_VISION: "vision",
    libllama.LLAMA_ROPE_TYPE_IMROPE: "imrope",
}

# rope types whose tokens have several positions each (llama_hparams::n_pos_per_embd)
_MULTI_POSITION = (libllama.LLAMA_ROPE_TYPE_MROPE, libllama.LLAMA_ROPE_TYPE_IMROPE)


class MemoryClass:
    """The memory of one model (and, after with_context, of its contexts)."""

    def __init__(self, kind, n_swa=0, rope_type=0, n_expert=0, n_expert_used=0,
                 can_shift=True, rollback=0, copies=True, mrope_media=False):
        self.kind = kind                # "dense", "swa", "hybrid", "recurrent" or "none"
        self.n_swa = n_swa              # the attention window, 0 for none
        self.rope_type = rope_type      # enum llama_rope_type
        self.n_expert = n_expert        # MoE experts, 0 for a dense FFN
        self.n_expert_used = n_expert_used
        self.can_shift = can_shift      # libllama moves keys (llama_memory_can_shift)
        self.rollback = rollback        # tokens a recurrent state can be taken back
        # a sequence's state can be copied out (not from --rpc devices' layers:
        # llama.cpp aborts there), which checkpoints and replays need
        self.copies = copies
        # images placed by M-RoPE positions (--mmproj of Qwen2-VL and its kin)
        self.mrope_media = mrope_media

    @classmethod
    def of(cls, handle, meta=None):
        """The class of a loaded ModelHandle (``meta``: its GGUF metadata)."""
        meta = meta or {}
        arch = meta.get("general.architecture", "")
        if handle.is_recurrent():
            kind = "recurrent"
        elif handle.is_hybrid():
            kind = "hybrid"
        elif handle.n_swa() > 0:
            kind = "swa"
        else:
            kind = "dense"
        return cls(kind, n_swa=max(0, handle.n_swa()), rope_type=handle.rope_type(),
                   n_expert=_int(meta.get("%s.expert_count" % arch)),
                   n_expert_used=_int(meta.get("%s.expert_used_count" % arch)))

    def with_context(self, ctx, copies=True):
        """This class as a made context has it: whether it has a memory at all,
        whether its memory moves keys, how many tokens its recurrent state can
        be taken back, and whether a state can be copied out of it (``copies``)."""
        kind = self.kind if ctx.memory.exists else "none"
        return MemoryClass(kind, self.n_swa, self.rope_type, self.n_expert,
                           self.n_expert_used, can_shift=ctx.memory.can_shift(),
                           rollback=ctx.n_rs_seq if self.has_state else 0, copies=copies,
                           mrope_media=self.mrope_media)

    def with_media(self, mrope):
        """This class with an --mmproj; ``mrope``: it places images by M-RoPE
        positions, so keys are never moved."""
        return MemoryClass(self.kind, self.n_swa, self.rope_type, self.n_expert,
                           self.n_expert_used, can_shift=self.can_shift,
                           rollback=self.rollback, copies=self.copies, mrope_media=mrope)

    # -- what the memory can do ------------------------------------------------
    @property
    def generates(self):
        """Text can be generated: every class but an encoder's (no memory, and no
        logits either: llama-server refuses its completions too)."""
        return self.kind != "none"

    @property
    def has_state(self):
        """A recurrent state per sequence (hybrid or recurrent)."""
        return self.kind in ("hybrid", "recurrent")

    @property
    def cuts_anywhere(self):
        """Cells can be removed at any position, in the middle too."""
        return not self.has_state

    @property
    def moves_keys(self):
        """Cached runs can move to new positions (chunk reuse, context shift): not
        where an image's tokens share one position (M-RoPE media), which llama-server
        does not move either."""
        return self.cuts_anywhere and self.can_shift and not self.mrope_media

    @property
    def leaves_no_trace(self):
        """A token decoded into a sequence and cut again leaves the cache as it
        was: no window cache (one may recycle an old cell for the token), no
        recurrent state, one position a token (M-RoPE has several: a batch
        must carry them).  The decoder's stream fillers need this (batch.py)."""
        return self.kind == "dense" and self.rope_type not in _MULTI_POSITION

    def can_take_back(self, n):
        """Whether the last ``n`` tokens can be cut off without a checkpoint."""
        return self.cuts_anywhere or n <= self.rollback

    @property
    def drafts(self):
        """The longest draft a wrong guess of which can be taken back: any
        length (None) where cells are cut or the state is checkpointed before
        each check (``replays``), else the snapshots kept (0: no drafts)."""
        if not self.generates:
            return 0
        if self.rollback:
            return self.rollback
        return None if self.cuts_anywhere or self.copies else 0

    @property
    def replays(self):
        """A recurrent state with no snapshots: a draft is checked after a
        checkpoint of the state, and a wrong one restores it and decodes the
        accepted tokens again (llama-server's speculative checkpoints)."""
        return self.has_state and not self.rollback and self.copies

    @property
    def needs_checkpoints(self):
        """A prompt that diverges from the cache inside what a cut cannot give
        back restarts from a checkpoint (or from nothing)."""
        return self.has_state and self.copies

    @property
    def rope_name(self):
        return _ROPE_NAMES.get(self.rope_type, str(self.rope_type))

    def describe(self):
        """One line for the load line and /props, e.g. "hybrid: prompt reuse from
        checkpoints, drafts rolled back natively up to 16 tokens"."""
        if not self.generates:
            return "none: an encoder, embeddings only (no text generation)"
        parts = []
        if self.kind == "swa":
            parts.append("window %d" % self.n_swa)
        if self.n_expert:
            parts.append("MoE %d of %d experts" % (self.n_expert_used, self.n_expert))
        if self.has_state:
            parts.append("prompt reuse from its prefix and checkpoints" if self.copies else
                         "prompt reuse where a prompt goes on from the cache (no checkpoints: "
                         "a state cannot be copied from --rpc devices)")
            if self.rollback:
                parts.append("drafts rolled back natively up to %d tokens" % self.rollback)
            elif self.copies:
                parts.append("drafts checked from a checkpoint, the accepted part replayed")
            else:
                parts.append("no drafts")
        else:
            parts.append("prompt reuse anywhere" if self.moves_keys else "prompt reuse of a prefix")
        if self.mrope_media:
            parts.append("images by M-RoPE positions (no chunk reuse or context shift)")
        return "%s: %s" % (self.kind, ", ".join(parts))

    def as_dict(self):
        """What /props shows."""
        return {"class": self.kind, "n_swa": self.n_swa, "rope_type": self.rope_name,
                "n_expert": self.n_expert, "n_expert_used": self.n_expert_used,
                "rollback": self.rollback, "chunk_reuse": self.moves_keys,
                "mrope_media": self.mrope_media,
                "checkpoints": self.needs_checkpoints,
                "speculation": self.drafts != 0, "draft_rollback": "none" if not self.generates
                else "cut" if self.cuts_anywhere
                else "native" if self.rollback else "checkpoint and replay" if self.copies
                else "none",
                "description": self.describe()}


def _int(value):
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


# -ctk/-ctv's types (request.KV_CACHE_TYPES): ggml's type id, and bytes per block of
# so many values (ggml.c's type_traits)
KV_TYPES = {"f32": (0, 4, 1), "f16": (1, 2, 1), "bf16": (30, 2, 1), "q8_0": (8, 34, 32),
            "q4_0": (2, 18, 32), "q4_1": (3, 20, 32), "iq4_nl": (20, 18, 32),
            "q5_0": (6, 22, 32), "q5_1": (7, 24, 32)}


def kv_meta(meta, path):
    """``meta`` (libllama's metadata as strings, which leaves arrays out) with the head
    counts read from the file's header where it keeps one per layer (Jamba's,
    Nemotron-H's: none in a recurrent layer): what the KV cache's size is read from."""
    arch = meta.get("general.architecture", "")
    keys = ("%s.attention.head_count" % arch, "%s.attention.head_count_kv" % arch)
    if all(k in meta for k in keys):
        return meta
    header, _ = read_header(path)
    return dict(meta, **{k: header[k] for k in keys if isinstance(header.get(k), list)})


def per_layer(meta, key, n_layer):
    """A metadata value that is one number, or a list of one per layer (kv_meta), as a
    list of ``n_layer`` ints; None where the key is absent or does not read."""
    value = meta.get(key)
    try:
        if isinstance(value, list):
            values = [int(v) for v in value]
            return values if len(values) == n_layer else None
        return [int(value)] * n_layer if value is not None else None
    except (TypeError, ValueError):
        return None


def kv_bytes_of(meta, n_cells, type_k="f16", type_v="f16"):
    """Bytes of a KV cache of ``n_cells`` tokens for a model of this metadata, its keys
    and values of these types (-ctk, -ctv): each layer's KV heads (none in a
    recurrent layer) times the head sizes."""
    arch = meta.get("general.architecture", "")
    n_layer = _int(meta.get("%s.block_count" % arch))
    n_kv = (per_layer(meta, "%s.attention.head_count_kv" % arch, n_layer)
            or per_layer(meta, "%s.attention.head_count" % arch, n_layer) or [1] * n_layer)
    k_len, v_len = kv_head_size_set(meta)[0]
    _, k_bytes, k_block = KV_TYPES[type_k]
    _, v_bytes, v_block = KV_TYPES[type_v]
    per_token = sum(n_kv) * (k_len * k_bytes / k_block + v_len * v_bytes / v_block)
    return int(per_token * n_cells)


def kv_head_size_set(meta):
    """Each (key, value) head size of the model's attention layers, from its metadata
    (llama.cpp's n_embd_head_k and n_embd_head_v: the embedding over the first layer's
    head count unless the file says), the full layers' first: sliding-window layers
    may have sizes of their own (key_length_swa, value_length_swa: Gemma 4's)."""
    arch = meta.get("general.architecture", "")
    heads = meta.get("%s.attention.head_count" % arch)
    first = _int(heads[0] if isinstance(heads, list) and heads else heads)
    head = _int(meta.get("%s.embedding_length" % arch)) // (first or 1)
    full = (_int(meta.get("%s.attention.key_length" % arch)) or head,
            _int(meta.get("%s.attention.value_length" % arch)) or head)
    swa = (_int(meta.get("%s.attention.key_length_swa" % arch)) or full[0],
           _int(meta.get("%s.attention.value_length_swa" % arch)) or full[1])
    return [full] if swa == full else [full, swa]
