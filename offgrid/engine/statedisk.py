"""StateDisk: prompt states written to disk when a worker goes, read back when one is wanted.

A model put to sleep (--sleep-idle-seconds), unloaded, or a server stopped
and started again begins with empty caches: the next request pays its whole
prompt.  So before the worker goes (the front asks it: WorkerClient.close),
the most recently used states (engine/statecache.py) and the sessions' own
caches are written here, up to a bound in bytes; the next worker of the same
model lists them at start (their tokens only) and reads one back the first
time a request would restore it.

A state is only good for the exact model file (its whole content's hash:
two fine-tunes of one base can share size and header), the libllama build
that wrote it and the same context settings, so each file says which (``Identity``),
and a file that names another, or does not match its own checksum, is a
miss with one log line, never restored.  So is a file that cannot be read,
and a write that fails (full disk, unwritable folder) leaves no half file
and logs once: the cache is an optimisation, never an error.

    <dir>/<model key>/<n>.state:
        b"OFFGRID-STATE\\n"   u32 length   header (JSON: identity, n_tokens,
        state_bytes, sha256 of what follows)   n_tokens x i32   the state
"""

import array
import fcntl
import hashlib
import json
import logging
import os
import struct
import sys

log = logging.getLogger("offgrid.statedisk")

MAGIC = b"OFFGRID-STATE\n"
FORMAT = 1
HEAD_BYTES = 1 << 20        # of the model file, hashed: its header (metadata, tensor index)


def file_identity(path, head=HEAD_BYTES):
    """A file's size and the SHA-256 of its first ``head`` bytes (a GGUF's header
    and metadata: another model, or another quantisation, differs there)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(head))
        size = os.fstat(f.fileno()).st_size
    return {"size": size, "head_sha256": h.hexdigest()}


def hash_book():
    """Where file hashes are kept: offgrid's cache ($OFFGRID_CACHE, else
    ~/.cache/offgrid), the same for every --cache-dir, so a model is hashed
    once per machine, not once per folder of states."""
    root = os.environ.get("OFFGRID_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                           "offgrid")
    return os.path.join(root, "file-hashes.json")


def content_sha256(path, book=None):
    """The SHA-256 of a whole file, computed once and kept in ``book`` (hash_book())
    by the file's device, inode, size and modification time.

    Two fine-tunes of one base, converted alike, have the same size and often
    the same header; only their tensor data differs, so a state is matched to
    its model by all of it.  Hashing reads the file once (about a second a
    GB here); a file replaced or touched is hashed again."""
    st = os.stat(path)
    key = "%d:%d:%d:%d" % (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    book = book or hash_book()
    known = _read_json(book)
    if isinstance(known.get(key), str):
        return known[key]
    if st.st_size > 1 << 30:
        log.info("hashing %s (%.1f GB) once, so that its kept states are its own",
                 os.path.basename(path), st.st_size / 1e9)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()
    try:
        os.makedirs(os.path.dirname(book), exist_ok=True)
        known = _read_json(book)
        known[key] = digest
        tmp = "%s.tmp-%d" % (book, os.getpid())
        with open(tmp, "w") as f:
            json.dump(known, f)
        os.replace(tmp, book)
    except OSError as e:
        log.warning("could not keep the hash of %s: %s", path, e)
    return digest


def _read_json(path):
    try:
        with open(path) as f:
            d = json.load(f)
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def identity(model_path, lib_path, context, content=True):
    """What a state depends on: the model file (with ``content``, its whole
    content's hash too), the libllama build (its file's identity), and the
    context's settings (``context``: a dict of them)."""
    model = file_identity(model_path)
    if content:
        model["sha256"] = content_sha256(model_path)
    return {"format": FORMAT, "model": model,
            "build": file_identity(lib_path) if lib_path else None, "context": context}


def default_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "offgrid", "states")


class StateDisk:
    """One model's folder of states in ``root``, at most ``max_bytes`` of them."""

    def __init__(self, root, ident, max_bytes):
        self.ident = ident
        key = hashlib.sha256(json.dumps(ident["model"], sort_keys=True).encode()).hexdigest()
        self.dir = os.path.join(root, key[:24])
        self.max_bytes = max_bytes
        self.reads = self.read_failures = self.writes = 0
        self._warned = False
        self._files = {}            # name -> bytes, as last listed or written

    # -- listing and reading ----------------------------------------------------------
    def index(self):
        """(file name, tokens, state bytes) of each state here that this worker may use.
        The files it may not are logged a line for each reason, not each file: after
        an upgrade of libllama every file of the folder is another build's."""
        out, misses = [], {}

        def miss(name, why):
            misses.setdefault(why, []).append(name)
        try:
            names = sorted(n for n in os.listdir(self.dir) if n.endswith(".state"))
        except OSError:
            return out
        for name in names:
            try:
                with open(os.path.join(self.dir, name), "rb") as f:
                    head = self._head(f, name, miss)
                    if head is None:
                        continue
                    tokens = _tokens(f.read(4 * head["n_tokens"]), head["n_tokens"])
            except (OSError, ValueError) as e:
                miss(name, "unreadable (%s)" % e)
                continue
            if tokens is None:
                miss(name, "truncated")
                continue
            self._files[name] = head["state_bytes"]
            out.append((name, tokens, head["state_bytes"]))
        for why, missed in misses.items():
            if len(missed) == 1:
                self._miss(missed[0], why)
            else:
                log.warning("prompt states %s (%d files) in %s: %s; not used",
                            ", ".join(missed[:3]) + (", ..." if len(missed) > 3 else ""),
                            len(missed), self.dir, why)
        return out

    def _head(self, f, name, miss=None):
        miss = miss or self._miss
        if f.read(len(MAGIC)) != MAGIC:
            miss(name, "not a state file")
            return None
        (n,) = struct.unpack("<I", f.read(4))
        if n > 1 << 20:
            miss(name, "not a state file")
            return None
        head = json.loads(f.read(n).decode("utf-8"))
        if not isinstance(head, dict) or not isinstance(head.get("n_tokens"), int) \
                or not isinstance(head.get("state_bytes"), int):
            miss(name, "not a state file")
            return None
        for what in ("format", "model", "build", "context"):
            if head.get("ident", {}).get(what) != self.ident[what]:
                miss(name, "written for another %s" % {
                    "format": "format", "model": "model file", "build": "libllama build",
                    "context": "context (-c, -np, cache settings)"}[what])
                return None
        return head

    def read(self, name, tokens):
        """The state in file ``name`` (bytearray), checked whole; None (and one log
        line) if it cannot be used."""
        path = os.path.join(self.dir, name)
        try:
            with open(path, "rb") as f:
                head = self._head(f, name)
                if head is None:
                    self.read_failures += 1
                    return None
                body = f.read(4 * head["n_tokens"] + head["state_bytes"] + 1)
        except (OSError, ValueError) as e:
            self.read_failures += 1
            self._miss(name, "unreadable (%s)" % e)
            return None
        n_tok = 4 * head["n_tokens"]
        if len(body) != n_tok + head["state_bytes"] \
                or hashlib.sha256(body).hexdigest() != head.get("sha256") \
                or _tokens(body[:n_tok], head["n_tokens"]) != list(tokens):
            self.read_failures += 1
            self._miss(name, "corrupted or truncated")
            return None
        self.reads += 1
        return bytearray(body[n_tok:])

    def _miss(self, name, why):
        log.warning("prompt state %s: %s; not used", os.path.join(self.dir, name), why)

    # -- writing ------------------------------------------------------------------------
    def write_all(self, states):
        """Make the folder hold ``states`` ((tokens, data, name): most recently used
        first; ``name`` the file a state came from, kept as it is), as many as fit
        in max_bytes, none contained in one before it; returns how many files it
        wrote.  Files of states not among them go, but for those this worker
        never listed (another's, sharing the folder), which stay while the
        bound has room.  A failure logs one line and stops writing."""
        keep, total, seen = [], 0, []
        for tokens, data, name in states:
            n = len(data) if data is not None else self._files.get(name)
            if not tokens or n is None or any(
                    len(s) >= len(tokens) and s[:len(tokens)] == list(tokens) for s in seen):
                continue
            if total + n > self.max_bytes:
                continue
            total += n
            seen.append(list(tokens))
            keep.append((list(tokens), data, name if name in self._files else None, n))
        try:
            os.makedirs(self.dir, exist_ok=True)
            lock = os.open(self.dir, os.O_RDONLY)     # flock on the folder itself
        except OSError as e:
            self._warn("cannot use %s: %s" % (self.dir, e.strerror or e))
            return 0
        try:
            # Another server (or another worker of this model) may share the
            # folder: one writer at a time, so that two never pick one name
            fcntl.flock(lock, fcntl.LOCK_EX)
            return self._write_locked(keep, total)
        except OSError as e:
            self._warn("cannot use %s: %s" % (self.dir, e.strerror or e))
            return 0
        finally:
            os.close(lock)

    def _write_locked(self, keep, total):
        old = [f for f in os.listdir(self.dir) if f.endswith(".state")]
        kept = {name: n for _, _, name, n in keep if name is not None}
        # ...and the files it wrote since this worker listed the folder are
        # not this worker's to prune: they stay while the bound has room,
        # the newest first
        theirs = []
        for name in old:
            if name not in self._files:
                try:
                    st = os.stat(os.path.join(self.dir, name))
                except OSError:
                    continue
                theirs.append((st.st_mtime, st.st_size, name))
        for _, size, name in sorted(theirs, reverse=True):
            if total + size <= self.max_bytes:
                total += size
                kept[name] = size
        files, fresh = dict(kept), 0
        taken = set(old)
        i = 0
        for tokens, data, name, n in keep:
            if name is not None:
                continue
            while "%d.state" % i in taken:
                i += 1
            new = "%d.state" % i
            taken.add(new)
            if not self._write(new, tokens, data):
                break
            files[new] = n
            fresh += 1
        for name in old:
            if name not in files:
                try:
                    os.unlink(os.path.join(self.dir, name))
                except OSError:
                    pass
        self.writes += fresh
        self._files = files
        return fresh

    def _write(self, name, tokens, data):
        body_tokens = _i32(tokens)
        h = hashlib.sha256(body_tokens)
        h.update(data)
        head = json.dumps({"ident": self.ident, "n_tokens": len(tokens),
                           "state_bytes": len(data), "sha256": h.hexdigest()}).encode()
        path = os.path.join(self.dir, name)
        tmp = path + ".tmp%d" % os.getpid()
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<I", len(head)) + head)
                f.write(body_tokens)
                f.write(data)
            os.replace(tmp, path)
            return True
        except OSError as e:
            self._warn("cannot write %s: %s" % (path, e.strerror or e))
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False

    def _warn(self, message):
        if not self._warned:
            self._warned = True
            log.warning("prompt states not saved: %s", message)

    def stats(self):
        return {"states": len(self._files), "bytes": sum(self._files.values()),
                "reads": self.reads, "read_failures": self.read_failures,
                "writes": self.writes}


def _i32(values):
    a = array.array("i", values)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def _tokens(data, n):
    if len(data) != 4 * n:
        return None
    a = array.array("i")
    a.frombytes(data)
    if sys.byteorder != "little":
        a.byteswap()
    return list(a)
