"""What the shelf reads from disk, and the units of its flags.

``scan`` finds the models of the ``--models-dir`` folders, ``gguf_problem``
tells a file that cannot be a model from its first bytes, ``read_preset``
reads llama-server's preset INI (``--models-preset``); ``parse_size``
(``--models-memory``) and ``parse_duration`` (Ollama's ``keep_alive``) read
what users write.  Pure functions: ``shelf.py`` decides what to do with them.
"""

import configparser
import math
import os
import re

from . import presetkeys, sampling

# -- sizes and durations ---------------------------------------------------------------------

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.I)


def parse_size(text):
    """Bytes from ``12G``, ``512MiB``, ``1.5g`` or a plain number of bytes (binary units)."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError("not a size: %r (say 12G, 512M or a number of bytes)" % text)
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * scale)


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|\u00b5s|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


# The longest keep_alive: Go's longest time.Duration (2**63 - 1 ns, 292 years),
# Ollama's own bound; past it Ollama refuses the duration, and the expiry
# /api/ps would show is past any calendar.  A negative value says "for good".
MAX_DURATION = (2 ** 63 - 1) / 1e9


def parse_duration(value):
    """Seconds from Ollama's ``keep_alive``: a number of seconds or a Go duration ("5m",
    "1h30m", "-1"); any negative value means never (returned as -1).  ValueError for
    anything else, and for durations past MAX_DURATION."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError("'keep_alive' must be a duration (\"5m\") or a number of seconds")
    if isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            sign = -1.0 if text.startswith("-") else 1.0
            body = text.lstrip("+-")
            parts = _DURATION_PART.findall(body)
            if not body or "".join(a + b for a, b in parts) != body:
                raise ValueError("'keep_alive' %r is not a duration (say \"5m\", \"30s\", "
                                 "\"1h\", 0 or -1)" % _clip(value))
            seconds = sign * sum(float(n) * _UNITS[u] for n, u in parts)
    else:
        try:
            seconds = float(value)
        except OverflowError:       # an integer of hundreds of digits
            seconds = math.inf if value > 0 else -math.inf
    if seconds != seconds:
        raise ValueError("'keep_alive' must be a number")
    if seconds < 0:
        return -1.0
    if seconds > MAX_DURATION:
        raise ValueError("'keep_alive' %s is out of range: at most %d seconds (292 years); "
                         "a negative value keeps the model loaded for good"
                         % (_clip(value), int(MAX_DURATION)))
    return seconds


def _clip(value, n=40):
    text = value if isinstance(value, str) else repr(value)
    if len(text) > n:
        text = text[:n] + "... (%d characters)" % len(text)
    return repr(text) if isinstance(value, str) else text


def physical_memory():
    """Bytes of RAM of this machine, or None where the system does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# The share of physical RAM the loaded models may hold when --models-memory is
# not given: three quarters leaves the rest to the system, the front and the
# page cache that mmap'd weights also live in.
DEFAULT_MEMORY_SHARE = 0.75


def default_memory_budget():
    ram = physical_memory()
    return int(ram * DEFAULT_MEMORY_SHARE) if ram else 0


# -- finding models ------------------------------------------------------------------------------

_SHARD = re.compile(r"^(.+)-(\d{5})-of-(\d{5})\.gguf$", re.I)


def _models_in(folder):
    """[(name, path)] for the model files of one folder: splits as their first part,
    companion files (mmproj) left out."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    out = []
    for n in names:
        path = os.path.join(folder, n)
        if not n.lower().endswith(".gguf") or n.lower().startswith("mmproj") \
                or not os.path.isfile(path):
            continue
        m = _SHARD.match(n)
        if m:
            if int(m.group(2)) != 1:
                continue        # later parts: libllama finds them beside the first
            out.append((m.group(1), path))
        else:
            out.append((n[:-len(".gguf")], path))
    return out


def scan(dirs):
    """[(name, path, more_names)] for every model in ``dirs`` and one level of subfolders.

    A subfolder that holds exactly one model also lends it its own name, as
    llama-server's router names such folders.
    """
    found = []
    for d in dirs:
        found += [(name, path, []) for name, path in _models_in(d)]
        try:
            subs = sorted(os.listdir(d))
        except OSError:
            continue
        for sub in subs:
            folder = os.path.join(d, sub)
            if os.path.isdir(folder):
                inner = _models_in(folder)
                for name, path in inner:
                    found.append((name, path, [sub] if len(inner) == 1 and sub != name else []))
    return found


def file_key(path):
    """What says a file changed: its size and modification time (None if gone)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_size, st.st_mtime)


def gguf_problem(path):
    """Why ``path`` cannot be a GGUF model, read from its first bytes; None if it may be."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(24)
    except OSError as e:
        return "cannot read the file: %s" % e.strerror
    if head[:4] != b"GGUF":
        return "not a GGUF file (it starts with %r, not b'GGUF')" % head[:4]
    if len(head) < 24:
        return "truncated GGUF file (%d bytes)" % len(head)
    return None


def name_is_safe(name):
    """Whether a requested name may be looked for at all: no path, nothing hidden."""
    return bool(name) and "/" not in name and "\\" not in name and ".." not in name \
        and "\0" not in name


# -- presets ---------------------------------------------------------------------------------

# the sampling keys (temp, top-k, ...: models/sampling.py) beside presetkeys.SETTINGS
_SAMPLING_KEYS = sampling.preset_keys()
_BOOLS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}


class PresetError(ValueError):
    """A preset file that cannot be read, or a value in it that is not of its kind."""


def _setting(section, key, raw):
    key_l = key.strip().lower()
    s = presetkeys.BY_KEY.get(key_l)
    if s is not None:
        name, kind, low = s.name, s.kind, s.low
    elif key_l in _SAMPLING_KEYS:
        (name, kind), low = _SAMPLING_KEYS[key_l], None
    else:
        return None, None
    value = raw.strip()
    try:
        if isinstance(kind, tuple):
            if value not in kind:
                raise ValueError(value)
        elif kind == "bool":
            value = _BOOLS[value.lower()]
        elif kind == "duration":
            value = parse_duration(value)
        elif kind == "list":
            value = [a.strip() for a in value.split(",") if a.strip()]
        elif kind is str:
            pass
        elif kind in (int, float):
            value = kind(value)
        else:
            try:
                value = kind(value)
            except ValueError as e:         # a reader of overrides.py says what is wrong
                raise PresetError("[%s] %s = %s: %s" % (section, key, raw, e))
        if low is not None and value < low:
            raise ValueError(value)
    except PresetError:
        raise
    except (KeyError, ValueError):
        raise PresetError("[%s] %s = %s: not a valid value" % (section, key, raw))
    return name, value


def read_preset(path):
    """(defaults, {section: settings}, ignored) from a llama-server preset INI file.

    ``[*]`` holds the defaults of every model; other sections name a model
    (one on the shelf, or a new one with ``model = PATH``).  Keys offgrid has
    no use for (``n-gpu-layers``, ``hf-repo``, ...) are returned in
    ``ignored`` as "[section] key" for a warning, not an error: a preset
    written for llama-server still serves.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as e:
        raise PresetError("cannot read %s: %s" % (path, e))
    ini = configparser.ConfigParser(interpolation=None, strict=False, default_section="\0",
                                    comment_prefixes=("#", ";"), inline_comment_prefixes=None)
    ini.optionxform = str
    # keys before the first section (llama-server's "version = 1") are dropped; the
    # lines stay, blank, so errors name the right line
    lines = text.splitlines()
    first = next((i for i, line in enumerate(lines) if line.strip().startswith("[")), None)
    if first is None:
        raise PresetError("%s has no [section]: a preset names its models in [name] "
                          "sections, and [*] for all of them" % path)
    lines[:first] = [""] * first
    try:
        ini.read_string("\n".join(lines), source=path)
    except configparser.Error as e:
        raise PresetError("%s: %s" % (path, e))
    defaults, models, ignored = {}, {}, []
    for section in ini.sections():
        settings = {}
        for key, raw in ini.items(section):
            name, value = _setting(section, key, raw)
            if name is None:
                ignored.append("[%s] %s" % (section, key))
            else:
                settings[name] = value
        if section == "*":
            defaults.update(settings)
        else:
            models[section] = settings
    return defaults, models, ignored
