"""Loaded: one model in a worker process, its sessions, their shared context,
embedder and state cache, as the worker's settings (protocol.WorkerSettings)
ask; what the worker reports of it (protocol.ModelInfo) and how big it is.

Runs in the worker process (engine/worker.py holds one and serves its frames).
"""

import logging
import os

from .. import libllama, protocol
from ..chat.adjust import asr_prompt
from ..chat.gbnf import check_grammar
from ..chat.jsonschema import schema_to_grammar
from ..chat.select import template_for
from ..errors import ModelLoadError, OffgridError
from . import devices as gpus
from . import rpc, statedisk
from .adapters import Adapters
from .controlvector import ControlVector
from .draftmodel import DraftModel
from .embed import POOLING, Embedder, model_pooling
from .memory import kv_bytes_of
from .model import Model
from .session import ChatSession, context_size, decode_threads, shared_decoder
from .statecache import StateCache


def default_grammar(model, given):
    """The server's output format (WorkerSettings.output_default: ["grammar", GBNF] or
    ["schema", a JSON schema]) as GBNF checked against ``model``, or None; a
    ModelLoadError naming the flag where it cannot be one."""
    if not given:
        return None
    kind, value = given
    try:
        grammar = schema_to_grammar(value) if kind == "schema" else value
        check_grammar(model, grammar)
    except (OffgridError, RecursionError) as e:
        raise ModelLoadError("%s: %s" % ("-j/--json-schema(-file)" if kind == "schema"
                                         else "--grammar(-file)", e))
    return grammar


class Loaded:
    """The model, its sessions, its chat template (what chat.select keeps on it) and
    its Embedder (whose context is made on the first embedding request)."""

    def __init__(self, model, sessions, chat_template=None, embedder=None, decoder=None,
                 draft_model=None):
        self.model = model
        self.sessions = sessions
        self.decoder = decoder      # the sessions' shared context (engine/batch.py)
        self.draft_model = draft_model      # -md (engine/draftmodel.py), or None
        self.chat_template = chat_template
        self.template = None
        template_for(self)      # a template that cannot be used fails the load
        self.embedder = embedder or Embedder.for_model(model, n_ctx=sessions[0].n_ctx)
        self.states = None          # the sessions' StateCache (engine/statecache.py)
        self.media = None           # --mmproj's MediaStore (engine/media.py), or None
        self.adapters = Adapters()  # its LoRA adapters (--lora: engine/adapters.py)
        self.control_vector = None  # --control-vector's (engine/controlvector.py), or None
        self.flash_attn = "libllama's choice (-fa auto)"    # Loaded.load says which
        # --grammar(-file), -j/-jf as checked GBNF: what a request that sets no output
        # format of its own is held to (worker.py), or None
        self.output_grammar = None

    @classmethod
    def load(cls, args, progress=True, on_rpc_stall=None, on_sized=None):
        """The model and its sessions; ``on_sized(kv_bytes)`` is called once the
        model's shape is known and before its KV caches are made (the front's
        memory ceiling depends on them)."""
        if getattr(args, "numa", None):
            # --numa: ggml reads the machine's nodes once, before the model's
            # file is mapped (with several nodes libllama then maps it without
            # prefetching, and the pools' threads keep to their nodes)
            lib = libllama.load(args.lib, verbose=args.verbose)
            lib.llama_numa_init(libllama.NUMA_STRATEGIES[args.numa])
        model = Model.load(args.model, lib_path=args.lib, verbose=args.verbose,
                           progress=progress, rpc_endpoints=rpc.split_endpoints(args.rpc),
                           n_gpu_layers=args.n_gpu_layers, tensor_split=args.tensor_split,
                           repack=not args.no_repack, on_rpc_stall=on_rpc_stall,
                           device_names=args.device,
                           split_mode=gpus.SPLIT_MODES.get(args.split_mode),
                           main_gpu=args.main_gpu, kv_offload=args.kv_offload,
                           n_ctx_hint=(args.ctx_size or 4096) * max(1, args.parallel),
                           kv_overrides=args.override_kv, load_mode=args.load_mode,
                           lazy_mode=args.lazy_mode, check_tensors=args.check_tensors,
                           rope=args.rope,
                           tensor_overrides=args.override_tensor)
        n_sessions = max(1, args.parallel)
        if on_sized is not None:
            on_sized(kv_bytes_of(model.kv_meta, context_size(model, args.ctx_size) * n_sessions,
                                 args.cache_type_k, args.cache_type_v))
        sessions = []
        decoder = draft_model = media = None
        try:
            output_grammar = default_grammar(model, getattr(args, "output_default", None))
            # checked here, before any context: one that does not fit fails the load
            control_vector = ControlVector.load(model, getattr(args, "control_vectors", ()),
                                                getattr(args, "control_vector_layers", None))
            adapters = Adapters.load(model, getattr(args, "lora", None) or ())
        except BaseException:
            model.close()
            raise
        threads = decode_threads(model, args.threads, args.threads_batch)
        flash_attn, flash_attn_words = model.flash_attn(args.flash_attn)
        draft_max = 0 if args.spec_type == "none" else args.spec_draft_n_max or 8
        kv_unified = args.kv_unified
        if not kv_unified and model.memory.has_state and n_sessions > 1:
            # libllama's streams of several sequences (scripts/patches/0005)
            # take a plain or windowed attention cache only
            logging.getLogger("offgrid.worker").warning(
                "--no-kv-unified: %s keeps a recurrent state, which a KV stream per "
                "session cannot hold; its sessions share one cache", model.name)
            kv_unified = True
        try:
            # one context for every session, whose decodes are batched together
            decoder = shared_decoder(model, max(1, args.parallel), n_ctx=args.ctx_size,
                                     n_batch=args.batch_size, n_ubatch=args.ubatch_size,
                                     swa_full=not args.no_swa_full, threads=threads,
                                     flash_attn=flash_attn, kv_unified=kv_unified,
                                     # a recurrent state's snapshots, to take a draft
                                     # back: with one session only, since with several
                                     # decoding in one step they gave wrong tokens (1-2
                                     # of 32 batched requests, lfm2 and qwen35); several
                                     # sessions take a draft back by checkpoint and replay
                                     n_rs_seq=draft_max if n_sessions == 1 else 0,
                                     state_copies=not on_rpc(model),
                                     type_k=args.cache_type_k, type_v=args.cache_type_v,
                                     control_vector=control_vector)
            decoder.stream_pace = args.stream_pace
            media = make_media(args, model, decoder)
            if media is not None:
                if media.mrope and args.context_shift:
                    logging.getLogger("offgrid.worker").warning(
                        "--context-shift off: %s places images by M-RoPE positions, "
                        "whose keys cannot be moved", os.path.basename(args.mmproj))
            if args.spec_type == "draft-simple" and args.model_draft:
                draft_model = DraftModel.load(
                    args.model_draft, model, n_sessions, decoder.n_ctx_session,
                    args.batch_size, args.ubatch_size, threads, args.spec_draft_n_min,
                    args.spec_draft_p_min, lib_path=args.lib, verbose=args.verbose,
                    kv_unified=kv_unified, type_k=args.cache_type_k_draft,
                    type_v=args.cache_type_v_draft)
            for _ in range(n_sessions):
                sessions.append(ChatSession(
                    model, decoder=decoder, context_shift=args.context_shift,
                    draft_max=draft_max,
                    copy_draft_max=args.spec_draft_n_max or 63, draft_model=draft_model,
                    ctx_checkpoints=args.ctx_checkpoints,
                    checkpoint_step=args.checkpoint_min_step))
            # the embedding context learns its thread counts on its own: its
            # decodes (every token an output) run at another speed than a prompt's
            embedder = Embedder.for_model(
                model, args.pooling, n_ctx=sessions[0].n_ctx, n_batch=args.batch_size,
                n_ubatch=args.ubatch_size,
                threads=decode_threads(model, args.threads, args.threads_batch))
            loaded = cls(model, sessions, args.chat_template, embedder, decoder, draft_model)
            loaded.flash_attn = flash_attn_words
            loaded.output_grammar = output_grammar
            loaded.adapters = decoder.adapters = embedder.adapters = adapters
            loaded.control_vector = embedder.control_vector = control_vector
            # the media first: an M-RoPE projector changes what the sessions' memory
            # may do, which use_states asks
            loaded.media = media
            for s in sessions:
                s.use_media(media)
            loaded.states = make_states(args, model, sessions[0], control_vector)
            for s in sessions:
                s.use_states(loaded.states)
            return loaded
        except BaseException:
            if media is not None:
                media.close()
            for s in sessions:
                s.close()
            if draft_model is not None:
                draft_model.close()
            if decoder is not None:
                decoder.close()
            adapters.close()
            model.close()
            raise

    def close(self):
        if self.media is not None:
            self.media.close()          # before the model its projector was made for
        self.embedder.close()
        for s in self.sessions:
            s.close()
        if self.draft_model is not None:
            self.draft_model.close()
        if self.decoder is not None:
            self.decoder.close()
        self.adapters.close()       # after the context that applies them, before the model
        self.model.close()

    def info(self):
        m, s = self.model, self.sessions[0]
        devices = m.device_use()
        on_devices = [d for d in devices if d["name"] != "CPU" and d["layers"]]
        return protocol.ModelInfo(
            placement=gpus.describe(devices) if on_devices else "",
            # a discrete GPU's own memory (not an rpc-server's: another machine's)
            device_bytes=sum(d.get("held") or 0 for d in on_devices
                             if d.get("type") == "gpu" and not d.get("endpoint")),
            path=os.path.abspath(m.path), name=m.name, n_vocab=m.n_vocab,
            n_ctx_train=m.n_ctx_train, n_embd=m.n_embd, n_params=m.n_params, size=m.size,
            file_size=os.path.getsize(m.path), n_ctx=s.n_ctx, n_sessions=len(self.sessions),
            has_fim=m.has_fim, chat_template=m.chat_template or "",
            caps=self.template.caps.as_dict(), meta=m.meta, kv_bytes=self.kv_bytes(),
            n_embd_out=m.n_embd_out, pooling=self.embedder.pooling,
            rank_head=model_pooling(m) == POOLING["rank"], devices=devices,
            speculative=any(s.draft_max > 0 for s in self.sessions)
            and self.sessions[0].memory.drafts != 0,
            draft=self.draft_model.model.name if self.draft_model is not None else "",
            draft_bytes=self.draft_bytes(), flash_attn=self.flash_attn,
            memory=self.sessions[0].memory.as_dict(), lora=self.adapters.info(),
            modalities=[k for k in ("vision", "audio")
                        if self.media is not None and getattr(self.media, k)],
            grammar=self.output_grammar or "",
            control_vector=self.control_vector.describe() if self.control_vector else "",
            asr_prompt=list(asr_prompt(self.template.source or "")))

    def draft_bytes(self):
        """The draft model's file and KV cache (-md), 0 without one."""
        d = self.draft_model
        if d is None:
            return 0
        return os.path.getsize(d.model.path) + kv_bytes_of(d.model.kv_meta, d.ctx.n_ctx,
                                                           d.type_k, d.type_v)

    def kv_bytes(self):
        """The KV caches' size, from the model's shape and the caches' types."""
        types = (getattr(self.decoder, "type_k", "f16"), getattr(self.decoder, "type_v", "f16"))
        return kv_bytes_of(self.model.kv_meta, self.sessions[0].n_ctx * len(self.sessions), *types)


def make_states(args, model, session, control_vector=None):
    """The StateCache of --cache-ram (MiB; -1: no bound) and --cache-dir, or None where
    both are off; the states on disk are listed (read when one is wanted).  Off for a
    model with layers on --rpc devices, with a line saying so: llama.cpp aborts while
    copying a sequence's state out of RPC layers (llama.cpp #26128, #26529), and an
    abort here would end the worker in the middle of a request."""
    mib = getattr(args, "cache_ram", 0) or 0
    if on_rpc(model):
        if mib or args.cache_dir:
            logging.getLogger("offgrid.statecache").warning(
                "prompt states kept off for %s (--cache-ram, --cache-dir): its layers are "
                "on --rpc devices, from which llama.cpp cannot copy a sequence's state "
                "safely", os.path.basename(model.path))
        return None
    disk = None
    if args.cache_dir and args.cache_disk_max > 0:
        try:
            ident = statedisk.identity(model.path, model.lib.path, {
                "n_ctx": session.n_ctx, "n_batch": session.n_batch,
                "swa_full": not args.no_swa_full, "n_seq": session.decoder.ctx.n_ctx,
                # -ctk/-ctv: "f16" alone for the default, as before they were flags
                "cache_type": "f16" if (args.cache_type_k, args.cache_type_v) == (
                    "f16", "f16") else "%s/%s" % (args.cache_type_k, args.cache_type_v),
                # a stream per session lays states out by stream (only named where
                # on, so that the default's states keep their identity)
                **({} if session.decoder.kv_unified else {"kv_unified": False}),
                # the model's metadata as --override-kv made it
                **({"override_kv": args.override_kv} if args.override_kv else {}),
                # positions as --rope-scaling and the others place them
                **({"rope": args.rope} if getattr(args, "rope", None) else {}),
                # what --control-vector adds to each layer's output
                **({"control_vector": control_vector.identity}
                   if control_vector is not None else {}),
                # images' cells are the projector's: another mmproj, other states
                **({"mmproj": [args.mmproj, os.path.getsize(args.mmproj)]}
                   if getattr(args, "mmproj", None) else {})})
            disk = statedisk.StateDisk(args.cache_dir, ident, args.cache_disk_max << 20)
        except OSError as e:
            logging.getLogger("offgrid.statedisk").warning(
                "prompt states on disk off: %s", e)
    if mib == 0 and disk is None:
        return None
    states = StateCache(-1 if mib < 0 else mib << 20, disk)
    states.adopt_disk()
    return states


def make_media(args, model, decoder):
    """--mmproj's MediaStore: libmtmd loaded (only here) and the projector made for
    ``model``; None without --mmproj."""
    if not getattr(args, "mmproj", None):
        return None
    from .. import libmtmd
    from .media import MediaStore, projector_identity
    from .session import decode_turn
    mtmd = libmtmd.MtmdContext(
        libmtmd.load(), args.mmproj, model.handle.ptr,
        n_threads=decoder.threads.batch.max_threads, use_gpu=args.mmproj_offload,
        image_min_tokens=args.image_min_tokens, image_max_tokens=args.image_max_tokens)
    # (libmtmd's helper reads n_embd_inp floats a token: wider than n_embd where
    # a projector feeds later layers too, as Qwen3-VL's deepstack)
    return MediaStore(mtmd, model.handle.n_embd_inp(), decoder.ctx.n_ubatch, decode_turn,
                      identity=projector_identity(args.mmproj))


def on_rpc(model):
    """Whether some of the model's layers are on --rpc devices, from whose memory
    llama.cpp cannot copy a sequence's state (llama.cpp #26128, #26529)."""
    return any(d.get("endpoint") and d.get("layers") for d in model.devices or ())
