"""The command line's values that need reading: each a function that takes what
argparse gives and returns what the flags module keeps, or raises
(argparse.ArgumentTypeError where argparse calls it, ValueError where
parse_args does), naming the flag and what it takes."""

import argparse
import ipaddress
import json
import os
import re
import ssl

from .server.models import overrides


def thread_count(value):
    """-t / -tb: "auto", or a count (0 and below mean auto, as llama-server's -1)."""
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError("a number of threads or auto, not %r" % value)
    return n if n > 0 else "auto"


def tensor_overrides(args):
    """-ot's REGEX=BUFT items, then --cpu-moe's and --n-cpu-moe's, as [regex, buffer type
    name] (llama-server's order); ValueError for one that does not read."""
    out = [o for value in args.override_tensor for o in overrides.tensor_overrides(value)]
    return out + overrides.moe_overrides(args.cpu_moe, args.n_cpu_moe)


def template_kwargs(args):
    """--chat-template-kwargs and --reasoning-effort as one dict (llama-server's flags);
    ValueError for a value they, or --reasoning-budget, do not take."""
    kwargs = {}
    if args.chat_template_kwargs is not None:
        kwargs = overrides.template_kwargs(args.chat_template_kwargs)
    if args.reasoning_effort not in (None, "default"):
        kwargs["reasoning_effort"] = args.reasoning_effort
    if args.reasoning_budget < -1:
        raise ValueError("--reasoning-budget %d: give -1 (no bound), 0 or more"
                         % args.reasoning_budget)
    return kwargs


def gpu_layers(value):
    """-ngl: a count of layers, or auto (-1: as many as the devices' memory holds) or
    all (-2), as llama-server's common/arg.cpp keeps them (engine/devices.py)."""
    if value == "auto":
        return -1
    if value == "all":
        return -2
    try:
        n = int(value)
    except ValueError:
        n = None
    if n is None or n < -2:
        raise argparse.ArgumentTypeError("a number of layers, auto or all, not %r" % value)
    return n


def device_list(value):
    """-dev: "Vulkan0,Vulkan1" as a list; "none": the CPU alone."""
    names = [x.strip() for x in value.split(",") if x.strip()]
    if not names or ("none" in names and len(names) > 1):
        raise argparse.ArgumentTypeError("device names such as Vulkan0,Vulkan1 (or none), "
                                         "not %r" % value)
    return names


def tensor_split(value):
    """-ts: proportions, "3,1" (llama-server also takes "3/1")."""
    try:
        parts = [float(x) for x in value.replace("/", ",").split(",") if x.strip()]
    except ValueError:
        parts = []
    if not parts or any(not (x >= 0) or x == float("inf") for x in parts) or not any(parts):
        raise argparse.ArgumentTypeError("proportions such as 3,1, not %r" % value)
    return parts


def rpc_endpoints(value, allow_remote):
    """--rpc's "HOST:PORT[,HOST:PORT...]" as a list; raises ValueError for a malformed one,
    and for a host that is not this machine's unless ``allow_remote``: rpc-server has no
    authentication, so nobody should point a model at one on a network by accident."""
    out = []
    for endpoint in (e.strip() for e in value.split(",")):
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("--rpc %s: give HOST:PORT, e.g. 127.0.0.1:50052" % endpoint)
        if not allow_remote and not is_loopback(host):
            raise ValueError("--rpc %s is not on this machine; rpc-server has no "
                             "authentication, so offgrid only reaches one elsewhere with "
                             "--rpc-allow-remote, over a private network or a tunnel "
                             "(docs/rpc.md)" % endpoint)
        out.append(endpoint)
    return out


def is_loopback(host):
    """Whether ``host`` (one address, or a comma list) only accepts connections from this
    machine."""
    if "," in host:
        return all(is_loopback(h.strip()) for h in host.split(",") if h.strip())
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def logit_bias(value):
    """-l: TOKEN_ID(+/-)BIAS, e.g. 15043+1 or 15043-inf, as (id, bias) (llama.cpp's
    common/arg.cpp reads it alike); a bias of -inf bans the token."""
    m = re.fullmatch(r"\s*(\d+)\s*([+-])\s*(\S+)\s*", value)
    try:
        bias = float(m.group(3)) * (-1 if m.group(2) == "-" else 1) if m else None
    except ValueError:
        bias = None
    if bias is None or bias != bias or bias == float("inf"):
        raise argparse.ArgumentTypeError("TOKEN_ID(+/-)BIAS such as 15043+1 or 15043-inf, "
                                         "not %r" % value)
    return (int(m.group(1)), bias)


def _read_text(path, flag):
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError("%s %s: %s" % (flag, path, getattr(e, "strerror", None)
                                                         or e))


def _schema(text, where):
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError("%s: not JSON (%s)" % (where, e))
    if not isinstance(schema, (dict, bool)):
        raise argparse.ArgumentTypeError("%s: a JSON schema is an object" % where)
    return ["schema", schema if schema != {} else {"type": "object"}]


# --grammar, --grammar-file, -j and -jf: the output format of a request that sets none,
# as ["grammar", GBNF] or ["schema", a JSON schema] (the worker turns it into a checked
# grammar at load: engine/loaded.py); the last given wins, as llama-server's
def grammar_text(value):
    return ["grammar", value]


def grammar_file(path):
    return ["grammar", _read_text(path, "--grammar-file")]


def json_schema_text(value):
    return _schema(value, "--json-schema")


def json_schema_file(path):
    return _schema(_read_text(path, "--json-schema-file"), "--json-schema-file %s" % path)


def api_prefix(value):
    """--api-prefix: the path every route is served under, as "/llama" or "/a/b": it
    starts with "/", has no trailing "/" and no empty part, and only printable ASCII
    that a path takes as it is (no space, "?", "#" or "%")."""
    if not re.fullmatch(r"(/[\x21-\x2e\x30-\x7e]+)+", value) or any(c in value for c in "?#%"):
        raise argparse.ArgumentTypeError(
            "a path such as /llama: starting with /, without a trailing /, of printable "
            "characters without spaces, ?, # or %%, not %r" % value)
    return value


class _EncryptedKey(Exception):
    """The key file asks for a passphrase, which nothing gives (llama-server takes none)."""


def _no_passphrase():
    raise _EncryptedKey()


def tls_context(key_file, cert_file):
    """--ssl-key-file and --ssl-cert-file as the server's ssl.SSLContext, None without
    them; ValueError, naming the flag and the file, for one given without the other, a
    file that cannot be read, a certificate or key that does not load, or a key that is
    not the certificate's.  (llama-server serves plain HTTP with one of them alone, and
    fails to bind, saying only that, with files that do not load.)"""
    if key_file is None and cert_file is None:
        return None
    if key_file is None or cert_file is None:
        given, missing = (("--ssl-cert-file", "--ssl-key-file") if key_file is None
                          else ("--ssl-key-file", "--ssl-cert-file"))
        raise ValueError("%s needs %s too: HTTPS takes the private key and its certificate"
                         % (given, missing))
    for flag, path in (("--ssl-key-file", key_file), ("--ssl-cert-file", cert_file)):
        try:
            with open(path, "rb"):
                pass
        except OSError as e:
            raise ValueError("%s %s: %s" % (flag, path, e.strerror or e))
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=cert_file)
    except ssl.SSLError:
        raise ValueError("--ssl-cert-file %s: no PEM certificate in it" % cert_file)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2        # llama-server's (cpp-httplib's)
    try:
        context.load_cert_chain(cert_file, key_file, password=_no_passphrase)
    except _EncryptedKey:
        raise ValueError("--ssl-key-file %s is encrypted: give the key without a passphrase "
                         "(openssl pkey -in %s -out key.pem)" % (key_file, key_file))
    except ssl.SSLError as e:
        if e.reason == "KEY_VALUES_MISMATCH":
            raise ValueError("--ssl-key-file %s is not the private key of the certificate in "
                             "--ssl-cert-file %s" % (key_file, cert_file))
        if e.reason is None:            # OpenSSL's "PEM lib": the key did not parse
            raise ValueError("--ssl-key-file %s: no PEM private key in it" % key_file)
        raise ValueError("--ssl-cert-file %s with --ssl-key-file %s: %s"
                         % (cert_file, key_file, e.reason.lower().replace("_", " ")))
    return context


# -- where the decode threads run: -C/-Cr, --cpu-strict, --prio, --poll, and -batch's --

# ggml.h's GGML_MAX_N_THREADS: the CPUs a ggml_threadpool_params' mask can name
MAX_CPUS = 512


def _machine_cpus():
    """The CPUs this process may run on (a worker inherits them)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _cpu_list(cpus):
    """{0, 1, 2, 5} as "0-2,5", as /proc and taskset write CPU lists."""
    out, run = [], []
    for cpu in sorted(cpus):
        if run and cpu != run[-1] + 1:
            out.append(run)
            run = []
        run.append(cpu)
    if run:
        out.append(run)
    return ",".join("%d" % r[0] if len(r) == 1 else "%d-%d" % (r[0], r[-1]) for r in out)


def _on_this_machine(cpus, what):
    """``cpus``, or ArgumentTypeError where they name none, or one this process may not
    run on: ggml would only warn for each thread it cannot place, and run it anywhere."""
    if not cpus:
        raise argparse.ArgumentTypeError("%s names no CPU" % what)
    here = _machine_cpus()
    missing = sorted(set(cpus) - here)
    if missing:
        raise argparse.ArgumentTypeError(
            "%s names CPU %s, which this machine does not let offgrid run on (it may: %s)"
            % (what, _cpu_list(missing), _cpu_list(here)))
    return frozenset(cpus)


def cpu_mask(value):
    """-C / -Cb: a hexadecimal mask, bit i for CPU i ("0x6", "6": CPUs 1 and 2), at most
    GGML_MAX_N_THREADS bits; as a frozenset of CPUs."""
    digits = value[2:] if value[:2].lower() == "0x" else value
    if not re.fullmatch(r"[0-9a-fA-F]+", digits):
        raise argparse.ArgumentTypeError("a hexadecimal CPU mask such as 0x3, not %r" % value)
    bits = int(digits, 16)
    if bits >> MAX_CPUS:
        raise argparse.ArgumentTypeError("mask %s names CPUs past %d, the most ggml can "
                                         "place" % (value, MAX_CPUS - 1))
    return _on_this_machine({i for i in range(bits.bit_length()) if bits >> i & 1},
                            "mask %s" % value)


def cpu_range(value):
    """-Cr / -Crb: "LO-HI" (CPUs LO to HI), "-HI" (from 0) or "LO-" (to the last this
    process may run on; llama-server's runs to 511); as a frozenset of CPUs."""
    m = re.fullmatch(r"(\d*)-(\d*)", value.strip())
    if not m:
        raise argparse.ArgumentTypeError("a range of CPUs such as 0-3 (LO-HI, -HI or LO-), "
                                         "not %r" % value)
    lo = int(m.group(1)) if m.group(1) else 0
    hi = int(m.group(2)) if m.group(2) else max(_machine_cpus())
    if max(lo, hi) >= MAX_CPUS:
        raise argparse.ArgumentTypeError("range %s goes past CPU %d, the last ggml can place"
                                         % (value, MAX_CPUS - 1))
    return _on_this_machine(set(range(lo, hi + 1)), "range %s" % value)


def _bounded(low, high, what):
    def read(value):
        try:
            n = int(value)
        except ValueError:
            n = None
        if n is None or not low <= n <= high:
            raise argparse.ArgumentTypeError("%s, %d to %d, not %r" % (what, low, high, value))
        return n
    read.__name__ = what
    return read


# --cpu-strict(-batch) 0|1; --prio(-batch): enum ggml_sched_priority, low (-1) to realtime
# (3; llama-server's --prio-batch stops at 0); --poll(-batch): ggml's polling level
cpu_strict = _bounded(0, 1, "0 or 1")
priority = _bounded(-1, 3, "a priority: -1 low, 0 normal, 1 medium, 2 high, 3 realtime")
poll_level = _bounded(0, 100, "a polling level")


def numa_strategy(value):
    """--numa: distribute (also for ""), isolate or numactl, as llama-server reads it."""
    if value in ("", "distribute"):
        return "distribute"
    if value in ("isolate", "numactl"):
        return value
    raise argparse.ArgumentTypeError("distribute, isolate or numactl, not %r" % value)


def cpu_placements(args):
    """The generation's and the batch's placement (protocol.WorkerSettings'
    cpu_placement, cpu_placement_batch): a mask and a range add up, as llama-server's,
    and each batch setting not given is the generation's.  (llama-server takes the
    generation's settings whole for the batch unless -tb is given, and then its own
    given settings or ggml's defaults.)"""
    gen = {"cpus": sorted((args.cpu_mask or set()) | (args.cpu_range or set())),
           "strict": bool(args.cpu_strict), "prio": args.prio, "poll": args.poll}
    batch_cpus = (args.cpu_mask_batch or set()) | (args.cpu_range_batch or set())
    batch = {"cpus": sorted(batch_cpus) if batch_cpus else gen["cpus"],
             "strict": gen["strict"] if args.cpu_strict_batch is None
             else bool(args.cpu_strict_batch),
             "prio": gen["prio"] if args.prio_batch is None else args.prio_batch,
             "poll": gen["poll"] if args.poll_batch is None else args.poll_batch}
    return gen, batch
