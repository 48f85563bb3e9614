"""Starting a model's worker from the command line's flags, and the shelf of a command line.

``__main__`` parses the flags; ``build_shelf`` turns them into the shelf
(``-m``, ``--fim-model``, the folders and the preset) with ``start_worker``
as its loader; ``worker_args`` is the engine's share of the flags, handed to
each worker process on its command line.
"""

import argparse
import json
import os
import sys

from ... import protocol
from ...errors import ModelLoadError
from . import overrides, presetkeys, sampling
from .entry import ModelEntry
from .folders import PresetError, default_memory_budget, parse_size, read_preset
from .shelf import Shelf
from .worker_client import WorkerClient


def worker_settings(path, args, chat_template=None, decode_lock=None):
    """The engine's share of our flags for one model (``protocol.WorkerSettings``)."""
    # -md drafts for -m's model alone: the shelf's others need not share its vocabulary
    draft = getattr(args, "model_draft", None)
    model = getattr(args, "model", None)
    if draft and not (model and os.path.realpath(model) == os.path.realpath(path)):
        draft = None
    spec_type = args.spec_type if draft or args.spec_type != "draft-simple" else "none"
    # --mmproj is -m's projector, as -md is its draft model
    mmproj = getattr(args, "mmproj", None)
    if mmproj and not (model and os.path.realpath(model) == os.path.realpath(path)):
        mmproj = None
    return protocol.WorkerSettings(
        model=path, ctx_size=args.ctx_size, batch_size=args.batch_size,
        ubatch_size=args.ubatch_size, parallel=max(1, args.parallel), threads=args.threads,
        threads_batch=args.threads_batch, spec_type=spec_type,
        spec_draft_n_max=args.spec_draft_n_max, model_draft=draft,
        spec_draft_n_min=getattr(args, "spec_draft_n_min", 0),
        spec_draft_p_min=getattr(args, "spec_draft_p_min", 0.0),
        stream_interval_ms=args.stream_interval_ms,
        chat_template=chat_template, pooling="rank" if args.reranking else args.pooling,
        no_swa_full=args.no_swa_full, no_repack=args.no_repack,
        kv_unified=getattr(args, "kv_unified", True),
        stream_pace=getattr(args, "stream_pace", protocol.WorkerSettings.stream_pace),
        context_shift=args.context_shift, spm_infill=args.spm_infill,
        tool_call_rescue=not args.no_tool_call_rescue, reasoning=args.reasoning,
        template_kwargs=getattr(args, "template_kwargs", None) or {},
        reasoning_budget=getattr(args, "reasoning_budget", -1),
        reasoning_budget_message=getattr(args, "reasoning_budget_message", ""),
        cache_type_k=getattr(args, "cache_type_k", "f16"),
        override_kv=getattr(args, "override_kv", None) or [],
        load_mode=getattr(args, "load_mode", "auto"),
        lazy_mode=getattr(args, "lazy_mode", "auto"),
        check_tensors=getattr(args, "check_tensors", False),
        rope=getattr(args, "rope", None) or {},
        override_tensor=getattr(args, "override_tensor", None) or [],
        cache_type_v=getattr(args, "cache_type_v", "f16"),
        cache_type_k_draft=getattr(args, "cache_type_k_draft", "f16"),
        cache_type_v_draft=getattr(args, "cache_type_v_draft", "f16"),
        output_default=getattr(args, "output_default", None),
        ctx_checkpoints=getattr(args, "ctx_checkpoints", 8),
        checkpoint_min_step=getattr(args, "checkpoint_min_step", 256),
        cpu_placement=getattr(args, "cpu_placement", None) or {},
        cpu_placement_batch=getattr(args, "cpu_placement_batch", None) or {},
        numa=getattr(args, "numa", None),
        reasoning_format=args.reasoning_format, lib=args.lib, decode_lock=decode_lock,
        rpc=args.rpc or None, n_gpu_layers=args.n_gpu_layers,
        tensor_split=list(args.tensor_split) if args.tensor_split else None,
        device=getattr(args, "device", None), split_mode=getattr(args, "split_mode", None),
        main_gpu=getattr(args, "main_gpu", 0) or 0,
        kv_offload=not getattr(args, "no_kv_offload", False),
        verbose=args.verbose, flash_attn=args.flash_attn, cache_ram=cache_ram_mib(args),
        cache_dir=None if getattr(args, "no_cache_disk", False) else cache_dir(args),
        cache_disk_max=getattr(args, "cache_disk_max", 4096),
        slot_save_path=getattr(args, "slot_save_path", None),
        mmproj=os.path.abspath(mmproj) if mmproj else None,
        mmproj_offload=not getattr(args, "no_mmproj_offload", False),
        image_min_tokens=getattr(args, "image_min_tokens", None) or -1,
        image_max_tokens=getattr(args, "image_max_tokens", None) or -1,
        # --lora adapters are -m's model's alone (server/api/lora.py)
        lora=[[os.path.abspath(p), s] for p, s in getattr(args, "lora_specs", ())]
        if model and os.path.realpath(model) == os.path.realpath(path) else None,
        # model_args has chosen this model's: the command line's (-m's) or its preset's
        control_vectors=[[os.path.abspath(p), s]
                         for p, s in getattr(args, "control_vectors", None) or ()],
        control_vector_layers=getattr(args, "control_vector_layers", None))


def cache_ram_mib(args):
    """--cache-ram, or its default: a quarter of the memory free now, at most
    llama-server's 8192 MiB (engine/statecache.py keeps prompt states within it)."""
    value = getattr(args, "cache_ram", None)
    if value is not None:
        return value
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return max(0, min(8192, int(line.split()[1]) // 1024 // 4))
    except (OSError, ValueError, IndexError):
        pass
    return 1024


def cache_dir(args):
    """--cache-dir, or offgrid/states under $XDG_CACHE_HOME (else ~/.cache)."""
    value = getattr(args, "cache_dir", None)
    if value:
        return os.path.abspath(os.path.expanduser(value))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "offgrid", "states")


def worker_args(path, args, chat_template=None, decode_lock=None):
    """The worker's command line for one model: its settings, as JSON."""
    settings = worker_settings(path, args, chat_template, decode_lock)
    return ["--settings", json.dumps(protocol.encode_settings(settings))]


# What a worker whose layers are on a discrete GPU holds in host memory for the GPU
# itself: the driver's and runtime's state, the math libraries' handles (CUDA's
# context, cuBLAS).  Not yet measured on an NVIDIA GPU (bench/gpu.py records the
# peak RSS when it runs there); a gigabyte, so that a small model's 1 GiB margin
# is not all the runtime's.
GPU_RUNTIME_HOST = 1 << 30


def default_max_rss(info, cache_bytes=0):
    """A worker's memory ceiling: its model file, its KV caches, its kept prompt states
    (``cache_bytes``: --cache-ram) and a margin for the rest (compute buffers, the
    logits of a batch, Python): half the model, 1 GiB at least; GPU_RUNTIME_HOST
    more where a discrete GPU holds some of it."""
    # what a discrete GPU holds of its weights and caches is not in the worker's RSS
    device_bytes = getattr(info, "device_bytes", 0)
    on_host = max(0, info.file_size + info.kv_bytes - device_bytes)
    return (on_host + cache_bytes + max(1 << 30, info.file_size // 2)
            + (GPU_RUNTIME_HOST if device_bytes else 0) + draft_ceiling(info.draft_bytes))


def media_ceiling(path, args):
    """What --mmproj adds to a worker's memory: the projector's weights, as much again
    for its encoder's buffers, and what its MediaStore keeps (engine/media.py): 256 MiB
    of embeddings and 32 preprocessed images (~10 MB each at gemma-3's 896 pixels);
    0 without one."""
    mmproj = worker_settings(path, args).mmproj
    return 2 * os.path.getsize(mmproj) + (576 << 20) if mmproj else 0


def ceiling_of(file_size, kv_bytes):
    """default_max_rss of a model file of ``file_size`` bytes and KV caches of ``kv_bytes``."""
    return file_size + kv_bytes + max(1 << 30, file_size // 2)


def draft_ceiling(draft_bytes):
    """What a draft model (-md) of ``draft_bytes`` (its file and KV cache) adds to the
    ceiling: a second model's share, compute buffers and margin included."""
    return ceiling_of(draft_bytes, 0) if draft_bytes else 0


# a preset's settings that are our flags, by their argparse names, and the groups
# read together (presetkeys.py)
PRESET_FLAGS = presetkeys.names("flag")
MOE_KEYS = presetkeys.names("moe")
ROPE_KEYS = presetkeys.names("rope")


def preset_rope(settings):
    """A preset's RoPE and YaRN keys as WorkerSettings.rope; ValueError where one does
    not read."""
    return overrides.rope_settings(argparse.Namespace(**{k: settings.get(k)
                                                         for k in ROPE_KEYS}))


def control_vectors_for(path, args, preset):
    """(files, layer range) of the control vectors of the model at ``path``: the
    command line's for -m's model (as its --lora), else its preset's keys."""
    model = getattr(args, "model", None)
    if model and os.path.realpath(model) == os.path.realpath(path) and (
            getattr(args, "control_vectors", None)):
        return args.control_vectors, args.control_vector_layers
    files = preset.get("control_vector", []) + preset.get("control_vector_scaled", [])
    return files, preset.get("control_vector_layer_range") if files else None


def model_args(entry, args):
    """Our flags as they apply to one model: the preset's settings under the command line's."""
    out = argparse.Namespace(**vars(args))
    preset = entry.preset or {}
    explicit = getattr(args, "explicit", set())
    for key in PRESET_FLAGS:
        if key in preset and key not in explicit:
            setattr(out, key, preset[key])
    # -ot, --cpu-moe and --n-cpu-moe make one list: the command line's, else the preset's
    if any(k in preset for k in MOE_KEYS) and not any(k in explicit for k in MOE_KEYS):
        out.override_tensor = preset.get("override_tensor", []) + overrides.moe_overrides(
            preset.get("cpu_moe", False), preset.get("n_cpu_moe", 0))
    # RoPE and YaRN: the preset's keys where the command line gives none of them
    if any(k in preset for k in ROPE_KEYS) and not any(k in explicit for k in ROPE_KEYS):
        out.rope = preset_rope(preset)
    out.control_vectors, out.control_vector_layers = control_vectors_for(entry.path, args,
                                                                         preset)
    # --chat-template-kwargs: the preset's under a --reasoning-effort given
    if "template_kwargs" in preset and "chat_template_kwargs" not in explicit:
        out.template_kwargs = dict(preset["template_kwargs"], **{
            k: v for k, v in (args.template_kwargs or {}).items() if k == "reasoning_effort"})
    return out


def read_template(value):
    """--chat-template's value: a Jinja file's text, else the name as it is."""
    if value and os.path.isfile(value):
        with open(value, encoding="utf-8") as fh:
            return fh.read()
    return value


def start_worker(entry, args, decode_lock=None):
    """Start the worker of one shelf model and wait for it to load; the WorkerClient.

    Raises ModelLoadError when the model does not load.
    """
    path = entry.path
    if not os.path.isfile(path):
        raise ModelLoadError("model file not found: %s" % path)
    a = model_args(entry, args)
    template = entry.settings.get("chat_template") or (entry.preset or {}).get("chat_template")
    try:
        template = read_template(template)
    except OSError as e:
        raise ModelLoadError("cannot read the chat template of %s: %s" % (entry.id, e))
    # The memory ceiling holds from the worker's first instruction (engine/lifeline.py,
    # worker_client.py): --worker-max-rss as given; by default, until the worker says
    # what its KV caches take (its sizing frame, before it makes them), its file and
    # margin alone.
    sized = None
    # kept prompt states count too (engine/statecache.py), bounded by --cache-ram
    cache_mib = cache_ram_mib(a)
    cache_bytes = max(0, cache_mib) << 20 if cache_mib >= 0 else 0
    a.cache_ram = cache_mib
    cache_bytes += media_ceiling(path, a)
    if args.worker_max_rss is None:
        file_size = os.path.getsize(path)
        max_rss = ceiling_of(file_size, cache_bytes)

        def sized(frame):
            return (ceiling_of(frame.get("file_size", file_size),
                               frame.get("kv_bytes", 0) + cache_bytes)
                    + draft_ceiling(frame.get("draft_bytes", 0)))
    elif args.worker_max_rss > 0:
        max_rss = int(args.worker_max_rss * (1 << 20))
    else:
        max_rss = None
    worker = WorkerClient(entry.id, worker_args(path, a, template, decode_lock),
                          max_rss=max_rss, verbose=args.verbose, sized_rss=sized)
    worker.on_progress = lambda fraction: setattr(entry, "progress", fraction)
    # its prompt states go to disk before it goes (engine/statedisk.py)
    worker.persist_states = not getattr(a, "no_cache_disk", False)
    worker.timeout = max(1.0, args.worker_timeout)
    entry.loading = worker          # POST /models/unload and shutdown stop the load
    try:
        worker.start()
    except BaseException:
        worker.close()
        raise
    finally:
        entry.loading = None
    if args.worker_max_rss is None:
        worker.max_rss = default_max_rss(worker.info, cache_bytes)
    return worker


def comma_list(values):
    """A repeated flag's values, each a comma list (llama-server's -a and --tags), as one
    list in order, blanks and repeats dropped."""
    out = []
    for value in values or ():
        for item in value.split(","):
            item = item.strip()
            if item and item not in out:
                out.append(item)
    return out


def build_shelf(args, decode_lock):
    """The shelf of this command line: -m and --fim-model first, then the folders and the
    preset.  Returns (shelf, text entry or None, fim entry or None); raises ValueError
    for a flag that cannot be used."""
    preset = None
    if args.models_preset:
        try:
            defaults, sections, ignored = read_preset(args.models_preset)
        except PresetError as e:
            raise ValueError("--models-preset: %s" % e)
        for what in ignored:
            print("offgrid: --models-preset: ignoring %s (not an offgrid setting)" % what,
                  file=sys.stderr)
        preset = (defaults, sections)
        for name, settings in [("*", defaults)] + sorted(sections.items()):
            try:
                sampling.from_preset(dict(defaults, **settings), "[%s]" % name)
                preset_rope(dict(defaults, **settings))
            except ValueError as e:
                raise ValueError("--models-preset: [%s] %s" % (name, e) if "[" not in str(e)
                                 else "--models-preset: %s" % e)
    for d in args.models_dir:
        if not os.path.isdir(d):
            raise ValueError("--models-dir %s is not a folder" % d)
    if args.models_memory is None:
        memory = default_memory_budget()
    else:
        try:
            memory = parse_size(args.models_memory)
        except ValueError as e:
            raise ValueError("--models-memory: %s" % e)
    shelf = Shelf(lambda entry: start_worker(entry, args, decode_lock), dirs=args.models_dir,
                  preset=preset, models_max=args.models_max, memory=memory,
                  autoload=args.models_autoload, sleep_idle=args.sleep_idle_seconds,
                  fallback=not (args.models_dir or args.models_preset),
                  max_queue=getattr(args, "max_queue", None),
                  sampling_flags=getattr(args, "sampling", None))
    text = fim = None
    if args.model:
        stem = os.path.basename(args.model)
        given = comma_list(args.alias)
        names = list(given) or [stem]
        if stem.lower().endswith(".gguf"):
            names.append(stem[:-len(".gguf")])
        text = shelf.add(ModelEntry(id=names[0], aliases=names[1:],
                                    path=os.path.abspath(args.model),
                                    settings={"chat_template": args.chat_template}))
        # /models lists them as llama-server's sets do: sorted, once each
        text.listed_aliases = sorted(set(given))
        text.tags = sorted(set(comma_list(getattr(args, "tags", []))))
        specs = getattr(args, "lora_specs", ())
        text.lora_paths = [p for p, _ in specs]
        text.lora = [0.0 if args.lora_init_without_apply else s for _, s in specs]
    if args.fim_model and not (args.model and os.path.abspath(args.fim_model)
                               == os.path.abspath(args.model)):
        stem = os.path.basename(args.fim_model)
        names = [stem] + ([stem[:-len(".gguf")]] if stem.lower().endswith(".gguf") else [])
        fim = shelf.add(ModelEntry(id=names[0], aliases=names[1:], pinned=True,
                                   path=os.path.abspath(args.fim_model)))
    elif args.fim_model:
        text.pinned = True
    shelf.rescan()
    for name in args.pin:
        e = shelf.find(name)
        if e is None:
            raise ValueError("--pin %s: no such model on the shelf" % name)
        e.pinned = True
    return shelf, text, fim
