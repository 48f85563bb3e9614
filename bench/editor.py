"""Editor replay: a scripted typing session sent to /infill as llama.vscode sends it.

The file being edited is bench/data/typed_file.py.txt (365 lines of Python).
A few lines in its middle are taken out; the "user" types them back a
character at a time at KEYS_PER_S, with the cursor's line, the lines above
and below it, and a ring of extra chunks from another file
(bench/data/context_files.py.txt) sent as llama.vscode / llama.vim do:

    input_prefix   the (up to) N_PREFIX lines above the cursor's line, each + "\n"
    prompt         the cursor's line up to the cursor
    input_suffix   the rest of that line, "\n", the next N_SUFFIX lines
    input_extra    N_CHUNKS chunks of CHUNK_LINES lines; every ROTATE_EVERY
                   pauses the oldest is dropped and a new one appended
    n_predict 24..32, t_max_prompt_ms, t_max_predict_ms, top_k 40, top_p 0.99,
    samplers [top_k, top_p, infill], cache_prompt, id_slot 0

Every keystroke sends a request; the previous one, if still unanswered, is
dropped first (its connection shut down, as llama.vim's jobstop kills curl).
Before typing starts, one request for the file as it is is answered and
not counted, and the user reads for FILE_OPEN_S before the first key (the
editor had the file open; a server that uses idle time, as offgrid's fill
of what t_max_prompt_ms dropped, gets that time, llama-server gains nothing
from it).  At word boundaries, once at least MIN_BURST keys have been typed, the user
pauses: the last request is waited for, and its latency (send to answer) is
one sample.  The cached fraction of that answer is cache_n / (cache_n +
prompt_n) from its timings.  "own_ms" is prompt_ms + predicted_ms of that
answer, i.e. what the same request costs with nothing abandoned before it;
latency minus own_ms is time spent on, or waiting behind, dropped requests.
"""

import http.client
import json
import socket
import threading
import time
from pathlib import Path

from servers import HOST

DATA = Path(__file__).resolve().parent / "data"

KEYS_PER_S = 10.0
N_KEYS = 100            # keystrokes, i.e. /infill requests, per replay
MIN_BURST = 6           # keys typed before the user may pause
PAUSE_S = 0.5           # idle time after an answer before typing resumes
FIRST_LINE = 257        # 0-based index of the first line taken out and typed back
N_LINES = 4             # lines taken out (more than N_KEYS characters' worth)
N_PREFIX, N_SUFFIX = 256, 64
N_CHUNKS, CHUNK_LINES, ROTATE_EVERY = 6, 16, 3
T_MAX_PROMPT_MS, T_MAX_PREDICT_MS = 500, 500
FILE_OPEN_S = 15.0      # idle after the first answer, before typing starts
ANSWER_TIMEOUT_S = 300.0    # an answer at a pause; a server this slow gets no figure
FIRST_TIMEOUT_S = 600.0     # the first request evaluates the whole ~3,000-token prompt


class Document:
    """The file with the cursor on a line being typed."""

    def __init__(self, text, first_line=FIRST_LINE, n_lines=N_LINES):
        lines = text.split("\n")
        typed = lines[first_line:first_line + n_lines]
        self.before = lines[:first_line]
        self.after = lines[first_line + n_lines:]
        # Keystrokes: each line's text after its indentation (the editor
        # auto-indents), Enter between lines.  The cursor starts on an empty
        # line already indented like the first typed line.
        self.indents = [ln[:len(ln) - len(ln.lstrip())] for ln in typed]
        self.keys = list("\n".join(ln.lstrip() for ln in typed))
        self.line = self.indents[0]
        self._line_no = 0

    def type(self, ch):
        if ch == "\n":
            self.before.append(self.line)
            self._line_no += 1
            self.line = self.indents[self._line_no]
        else:
            self.line += ch

    def fields(self):
        prefix = "".join(ln + "\n" for ln in self.before[-N_PREFIX:])
        suffix = "\n" + "\n".join(self.after[:N_SUFFIX]) + "\n"
        return prefix, self.line, suffix


class ChunkRing:
    """llama.vscode's ring of extra context: fixed-size chunks of another file."""

    def __init__(self, text, filename="context_files.py"):
        lines = text.split("\n")
        self.pool = ["\n".join(lines[i:i + CHUNK_LINES]) + "\n"
                     for i in range(0, len(lines) - CHUNK_LINES + 1, CHUNK_LINES)]
        self.filename = filename
        self.next = N_CHUNKS
        self.chunks = list(self.pool[:N_CHUNKS])

    def rotate(self):
        self.chunks = self.chunks[1:] + [self.pool[self.next % len(self.pool)]]
        self.next += 1

    def extra(self):
        return [{"filename": self.filename, "text": c} for c in self.chunks]


class InFlight:
    """One /infill request on its own connection, answered or dropped."""

    def __init__(self, port, body, timeout=ANSWER_TIMEOUT_S):
        self.port = port
        self.timeout = timeout
        self.data = json.dumps(body).encode()
        self.t_sent = time.perf_counter()
        self.t_answer = None
        self.answer = None
        self.error = None
        self._conn = None
        self._dropped = False
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        conn = http.client.HTTPConnection(HOST, self.port, timeout=self.timeout)
        with self._lock:
            if self._dropped:
                return
            self._conn = conn
        try:
            conn.request("POST", "/infill", body=self.data,
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            payload = r.read()
            self.t_answer = time.perf_counter()
            if r.status != 200:
                raise RuntimeError("HTTP %d: %s" % (r.status, payload[:300]))
            self.answer = json.loads(payload)
        except Exception as e:      # a dropped request ends here too
            self.error = e
        finally:
            conn.close()

    def drop(self):
        """Hang up, as an editor that kills the previous request does."""
        with self._lock:
            self._dropped = True
            conn = self._conn
        if conn is not None and conn.sock is not None and self.t_answer is None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    @property
    def latency_s(self):
        return self.t_answer - self.t_sent


def body_for(doc, ring, i):
    prefix, line, suffix = doc.fields()
    return {
        "input_prefix": prefix, "input_suffix": suffix, "prompt": line,
        "input_extra": ring.extra(),
        "n_predict": 24 + (i * 5) % 9,          # 24..32, varied
        "t_max_prompt_ms": T_MAX_PROMPT_MS, "t_max_predict_ms": T_MAX_PREDICT_MS,
        "top_k": 40, "top_p": 0.99, "samplers": ["top_k", "top_p", "infill"],
        "stream": False, "cache_prompt": True, "id_slot": 0,
    }


def warm(port):
    """The replay's first request alone (the file as it was opened), so that a
    replay on a busy machine starts from a cache filled while it was idle."""
    doc = Document((DATA / "typed_file.py.txt").read_text("utf-8"))
    ring = ChunkRing((DATA / "context_files.py.txt").read_text("utf-8"))
    _first(port, doc, ring)


def _first(port, doc, ring):
    """The request for the file as it is, answered before typing starts."""
    first = InFlight(port, body_for(doc, ring, 0), FIRST_TIMEOUT_S)
    first.thread.join(FIRST_TIMEOUT_S)
    if first.answer is None:
        raise RuntimeError("editor: the first /infill request failed: %s"
                           % (repr(first.error) if first.error else
                              "no answer within %.0f s" % FIRST_TIMEOUT_S))


def pauses_after(ch, since_pause, last):
    """Whether the user pauses after typing ``ch``: after the last key, or at a
    word boundary once MIN_BURST keys have been typed since the last pause."""
    return last or (since_pause >= MIN_BURST and ch in " (\n,.")


def replay(port, n_keys=N_KEYS):
    """Type n_keys keys; returns samples at each pause and counts of the whole run."""
    doc = Document((DATA / "typed_file.py.txt").read_text("utf-8"))
    ring = ChunkRing((DATA / "context_files.py.txt").read_text("utf-8"))
    keys = doc.keys[:n_keys]
    if len(keys) < n_keys:
        raise ValueError("only %d keys to type; take out more lines" % len(keys))
    out = {"latency_ms": [], "own_ms": [], "cached_fraction": [], "prompt_tokens": [],
           "evaluated": [], "predicted_n": [], "requests": 0, "pauses": 0}
    # The file was open before typing started: its first request has been
    # answered, so the cache holds the file as it was (not counted).
    _first(port, doc, ring)
    time.sleep(FILE_OPEN_S)
    all_requests = []
    current = None
    since_pause = 0
    interval = 1.0 / KEYS_PER_S
    t_next = time.perf_counter()
    for i, ch in enumerate(keys):
        delay = t_next - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t_next += interval
        doc.type(ch)
        since_pause += 1
        if current is not None and current.t_answer is None:
            current.drop()
        current = InFlight(port, body_for(doc, ring, i))
        all_requests.append(current)
        out["requests"] += 1
        if pauses_after(ch, since_pause, i == len(keys) - 1):
            current.thread.join(ANSWER_TIMEOUT_S)
            if current.answer is None:
                raise RuntimeError("editor: no answer at a pause: %s"
                                   % (repr(current.error) if current.error else
                                      "none within %.0f s" % ANSWER_TIMEOUT_S))
            t = current.answer["timings"]
            out["latency_ms"].append(current.latency_s * 1000.0)
            out["own_ms"].append(t["prompt_ms"] + t["predicted_ms"])
            total = t["cache_n"] + t["prompt_n"]
            out["cached_fraction"].append(t["cache_n"] / total if total else 0.0)
            out["prompt_tokens"].append(total)
            out["evaluated"].append(t["prompt_n"])
            out["predicted_n"].append(t["predicted_n"])
            out["pauses"] += 1
            current = None
            since_pause = 0
            if out["pauses"] % ROTATE_EVERY == 0:
                ring.rotate()
            time.sleep(PAUSE_S)
            t_next = time.perf_counter()
    for r in all_requests:
        r.thread.join(ANSWER_TIMEOUT_S)
    out["dropped"] = sum(1 for r in all_requests if r.answer is None)
    return out
