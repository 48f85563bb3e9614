"""The model's remote devices: llama.cpp's rpc-server on other machines (``--rpc``).

When a model does not fit one machine, each other machine runs llama.cpp's
``ggml-rpc-server`` (``make rpc-server``), and the worker adds its devices
through ggml's RPC backend, as llama-server's ``--rpc`` does: the model's
device list is those devices, and its layers are split across them (the
first ``n_layer + 1 - n_gpu_layers`` stay on this machine's CPU).  ggml does
the rest: weights are sent at load, every decode's graph runs partly there,
over TCP.

ggml's RPC client GGML_ABORTs the process when a server cannot be reached or
a connection drops.  So the worker checks every endpoint before ggml
connects (a down one is an RpcUnavailable naming it, not an abort), and
when ggml aborts anyway, the worker's last word to the front
(``abort_error``) names the endpoint that went away: the front answers the
requests that were running with a 503 naming it and reloads the model once
the endpoint answers again (server/workers.py).

The check is a TCP connect; an endpoint that takes the connection but does
not answer ggml's handshake in HANDSHAKE_TIMEOUT (an rpc-server busy with
another client: it serves one at a time) is reported through ``on_stall``,
since ggml's wait cannot be interrupted.  A machine that vanishes without
closing its connections (a cable pulled) mid-request leaves ggml waiting on
TCP.
"""

import socket
import struct
import threading
import time

from .. import libllama
from ..errors import ModelLoadError, RpcUnavailable

# Seconds a check waits for an endpoint's TCP handshake: a loopback or LAN
# connect takes microseconds; a filtered port never answers.
CONNECT_TIMEOUT = 3.0
# Seconds an rpc-server may take to answer ggml's handshake and list its
# devices.  One busy with another client (it serves one at a time) takes the
# connection and says nothing until that client leaves; ggml would wait.
HANDSHAKE_TIMEOUT = 15.0
# When ggml is already aborting: how long each try waits, and how long the
# tries go on.  A killed rpc-server's connection to us can close before its
# listening socket does, so the first try may still get through.
ABORT_CONNECT_TIMEOUT = 0.5
ABORT_SETTLE_S = 2.0


def split_endpoints(text):
    """The endpoints of a ``--rpc`` value, "HOST:PORT[,HOST:PORT...]" (the front checked it)."""
    return [e.strip() for e in (text or "").split(",") if e.strip()]


def host_port(endpoint):
    """("host", port) of "host:port" or "[v6 address]:port"."""
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def unreachable(endpoint, timeout=CONNECT_TIMEOUT):
    """Why ``endpoint`` does not take a TCP connection (e.g. "connection refused"), or
    None when it does."""
    try:
        socket.create_connection(host_port(endpoint), timeout).close()
    except socket.timeout:
        return "no answer in %g s" % timeout
    except OSError as e:
        return (e.strerror or str(e)).lower()
    return None


def check_endpoints(endpoints, timeout=CONNECT_TIMEOUT):
    """Raise RpcUnavailable naming the first endpoint that does not answer."""
    for endpoint in endpoints:
        why = unreachable(endpoint, timeout)
        if why is not None:
            raise RpcUnavailable("rpc-server %s (--rpc) is unreachable: %s" % (endpoint, why))


def connect(lib, endpoints, on_stall=None):
    """The devices of ``endpoints``' rpc-servers, in that order (libllama.Device list).

    Raises RpcUnavailable for an endpoint that does not answer, and
    ModelLoadError for one that offers no device.  ``on_stall(error)`` is
    called, from another thread, with the RpcUnavailable of an endpoint whose
    handshake takes past HANDSHAKE_TIMEOUT (the worker ends itself there).
    """
    check_endpoints(endpoints)
    devices = []
    for endpoint in endpoints:
        timer = None
        if on_stall is not None:
            err = RpcUnavailable("rpc-server %s (--rpc) took the connection but did not answer "
                                 "in %g s; is it serving another client? (an rpc-server serves "
                                 "one at a time)" % (endpoint, HANDSHAKE_TIMEOUT))
            timer = threading.Timer(HANDSHAKE_TIMEOUT, on_stall, [err])
            timer.daemon = True
            timer.start()
        try:
            found = libllama.rpc_devices(lib, endpoint)
        finally:
            if timer is not None:
                timer.cancel()
        if not found:
            raise ModelLoadError("rpc-server %s (--rpc) offers no device" % endpoint)
        devices += found
    return devices


def abort_error(message, endpoints):
    """The RpcUnavailable a GGML_ABORT ``message`` stands for, or None when no endpoint
    is down (an abort of another kind: the front reports the signal).

    ggml names the endpoint when it cannot connect or shake hands; when a
    connection drops it says only "Remote RPC server crashed", so the
    endpoints are tried again to find which, for up to ABORT_SETTLE_S.
    """
    named = [e for e in endpoints if e in message]
    deadline = time.monotonic() + ABORT_SETTLE_S
    while True:
        down = [(e, unreachable(e, ABORT_CONNECT_TIMEOUT)) for e in named or endpoints]
        down = [(e, why) for e, why in down if why is not None]
        if down:
            break
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    return RpcUnavailable("rpc-server %s (--rpc) went away: %s; the model is reloaded when "
                          "it answers again" % (", ".join(e for e, _ in down),
                                                "; ".join(why for _, why in down)))


def layer_split(n_layer, n_devices, n_gpu_layers, proportions):
    """How many of the model's ``n_layer + 1`` layers (the output layer last) each device
    holds: [cpu, device 0, device 1, ...], by llama.cpp's rule
    (``llama_model_base::load_tensors`` in the pinned source).

    ``proportions`` is one weight per device: the tensor split, or each
    device's free memory (llama.cpp's default).
    """
    n_all = n_layer + 1
    ngl = n_all if n_gpu_layers is None or n_gpu_layers < 0 else n_gpu_layers
    start = max(n_all - ngl, 0)
    act = min(ngl, n_all) if n_devices else 0
    bounds, acc = [], 0.0
    for p in proportions:
        acc = _f32(acc + p)             # llama.cpp sums and compares floats
        bounds.append(acc)
    bounds = [_f32(b / (acc or 1.0)) for b in bounds]
    counts = [0] * (n_devices + 1)
    for il in range(n_all):
        if il < start or il - start >= act:
            counts[0] += 1
            continue
        x = _f32(float(il - start) / act)
        # std::upper_bound: the first split point above x
        i = next((k for k, b in enumerate(bounds) if b > x), n_devices - 1)
        counts[1 + i] += 1
    return counts


def _f32(x):
    """``x`` rounded to a C float."""
    return struct.unpack("f", struct.pack("f", x))[0]
