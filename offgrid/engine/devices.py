"""Which devices hold a model's layers: a GPU build's local devices (``make lib
GPU=vulkan`` or ``GPU=cuda``, docs/gpu.md) and the ``--rpc`` servers' (engine/rpc.py).

The worker hands libllama an explicit device list, never libllama's own pick,
so that what ``/props``, ``/metrics`` and the load line say each device holds
is what it does hold.  The list is made as llama.cpp makes its default one
(``llama_prepare_model_devices`` in src/llama.cpp of the pinned source): the
rpc-servers' devices first (fewer bytes over the network), then every
discrete GPU, or, where there is none, the integrated ones (a laptop's iGPU,
Mesa's lavapipe); ``-dev`` names them instead (``none``: the CPU alone), and
``-sm none`` keeps only ``-mg``'s.

``-ngl`` counts the layers that go to those devices (the last ones; the
output layer counts as one): a number, ``all``, or ``auto`` (the default),
which is all of them where the devices' free memory holds them with
llama-server's margin (``--fit-target``'s 1024 MiB a device) and as many as it
holds where not: llama-server's ``--fit`` does more (it shrinks the context
too), offgrid keeps the context it was given.
"""

import logging

from .. import libllama
from ..errors import LibraryError, ModelLoadError

log = logging.getLogger("offgrid.devices")

# -ngl's words, as llama-server's common/arg.cpp keeps them
NGL_AUTO = -1
NGL_ALL = -2
# enum llama_split_mode
SPLIT_MODES = {"none": 0, "layer": 1, "row": 2}
# llama-server's --fit-target default: what auto leaves free on each device
FIT_MARGIN = 1 << 30


def pick(lib, rpc_devices=(), names=None, split_mode=None, main_gpu=0):
    """The model's device list (libllama.Device): ``rpc_devices`` first, then this
    machine's, as llama.cpp orders them; ``names`` (``-dev``, a list) instead
    where given, ``["none"]`` for no device.  Raises ModelLoadError for a name
    no device has, or a ``main_gpu`` past the list's end."""
    local = libllama.local_devices(lib)
    if names is not None:
        if names == ["none"]:
            return []
        known = {d.name: d for d in list(rpc_devices) + local}
        out = []
        for name in names:
            if name not in known:
                raise ModelLoadError(
                    "-dev %s: no such device; this build has %s (--list-devices)"
                    % (name, ", ".join(sorted(known)) or "none"))
            out.append(known[name])
        devices = out
    else:
        gpus = [d for d in local if d.type == "gpu"]
        igpus = [d for d in local if d.type == "igpu"]
        # integrated GPUs of one backend only: one chip may be seen by several
        igpus = [d for d in igpus if d.backend == igpus[0].backend] if igpus else []
        devices = list(rpc_devices) + (gpus or igpus)
    if split_mode == SPLIT_MODES["none"] and devices:
        if not 0 <= main_gpu < len(devices):
            raise ModelLoadError("-mg %d: the model has %d device%s (0 to %d)"
                                 % (main_gpu, len(devices), "" if len(devices) == 1 else "s",
                                    len(devices) - 1))
        devices = [devices[main_gpu]]
    return devices


def no_device_reason(lib):
    """Why a GPU build has no device to give layers to, or None where it has one
    (or is a CPU build, which needs none)."""
    if lib.fallback:
        return lib.fallback
    backends = libllama.gpu_backends(lib)
    if not backends or libllama.local_devices(lib):
        return None
    return ("this libllama (%s) has the %s backend but it found no usable device (no "
            "driver, or none it can use: see its log with --verbose); serving on the CPU"
            % (lib.path, "/".join(backends)))


def layer_count(n_gpu_layers, n_layer, devices, layer_bytes, kv_layer_bytes):
    """libllama's n_gpu_layers for -ngl's ``n_gpu_layers`` (None: auto): a count, or -1
    for all.  ``layer_bytes``: a layer's weights; ``kv_layer_bytes``: a layer's KV
    caches (those go with the layer unless --no-kv-offload)."""
    if n_gpu_layers is None:
        n_gpu_layers = NGL_AUTO
    if not devices:
        return 0
    if n_gpu_layers >= 0:
        return n_gpu_layers
    if n_gpu_layers != NGL_AUTO:
        return -1
    # auto: what the free memory of the devices holds (an rpc-server's too)
    free = sum(max(0, d.memory()[0] - FIT_MARGIN) for d in devices)
    per_layer = max(1, layer_bytes + kv_layer_bytes)
    fits = free // per_layer
    if fits >= n_layer + 1:
        return -1
    log.warning("-ngl auto: %d of %d layers fit the devices' free memory (%d MiB, less "
                "%d MiB a device); the others stay on the CPU",
                fits, n_layer + 1, free >> 20, FIT_MARGIN >> 20)
    return int(fits)


def describe(devices_info):
    """The load line's words for where the layers are, e.g. "CPU 0 layers, Vulkan0
    (llvmpipe) 31 layers, 121 MiB of 23987 MiB"."""
    parts = []
    for d in devices_info:
        if d["name"] == "CPU":
            parts.append("CPU %d layers" % d["layers"])
            continue
        held = (", holds %d MiB" % (d["held"] >> 20)) if d.get("held") is not None else ""
        parts.append("%s (%s%s) %d layers%s, %d MiB free of %d"
                     % (d["name"], d.get("description") or "?",
                        " at " + d["endpoint"] if d.get("endpoint") else "", d["layers"],
                        held, d.get("free", 0) >> 20, d.get("total", 0) >> 20))
    return "; ".join(parts)


def list_text(lib):
    """--list-devices: llama-server's lines, "  Vulkan0: desc (total MiB, free MiB free)"."""
    lines = ["Available devices:"]
    local = libllama.local_devices(lib)
    if not local:
        lines.append("  (none)")
    for d in local:
        lines.append("  %s: %s (%d MiB, %d MiB free)" % (d.name, d.description, d.total >> 20,
                                                          d.free >> 20))
    return "\n".join(lines)


def main(argv=None):
    """``python -m offgrid.engine.devices [--lib PATH]``: --list-devices (the front
    does not load libllama, so it runs this)."""
    import argparse
    import sys
    p = argparse.ArgumentParser(prog="offgrid --list-devices")
    p.add_argument("--lib")
    args = p.parse_args(argv)
    try:
        lib = libllama.load(args.lib)
    except LibraryError as e:
        print("offgrid: %s" % e, file=sys.stderr)
        return 1
    print(list_text(lib))
    why = no_device_reason(lib)
    if why:
        print(why, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
