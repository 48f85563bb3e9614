"""No request can crash, hang or bloat the server (issue 12), end to end.

Each row of HOSTILE is a request that once killed the server (SIGABRT or a
stack overflow inside libllama), was answered with a 500, or held a session
for seconds.  Each goes to a real server on the real library (gemma-3-270m
for text and chat, the tiny random FIM model for /infill), and each must leave
behind:

  * an answer: a 4xx JSON error in the endpoint's shape
    (``{"error": {"code", "message", "type"}}``), or, where the request is a
    sampling dead end, a 200 that ends early with the text so far;
  * the same server process, alive, its memory (RSS summed over the process
    tree, so model workers in child processes count) under its starting value
    plus 200 MB;
  * ``/health`` answering within 1 s all along (a thread polls it while the
    row runs);
  * a normal completion succeeding right after.

The table runs twice: against ``-np 1``, and against ``-np 2``, where a second
client streams a long greedy completion while each hostile request arrives
and must get every one of its tokens.

A row that kills or hangs the server fails saying so (the signal, the last
lines of the server's output), and the next row gets a fresh server, so one
death does not fail the rows after it.
"""

import http.client
import json
import re
import resource
import signal
import socket
import subprocess
import threading
import time
from typing import Callable, List, NamedTuple

import pytest

from offgrid.engine.model import Model

try:
    from . import rawhttp
    from .serverproc import ServerProcess, TEST_THREADS
except ImportError:
    import rawhttp
    from serverproc import ServerProcess, TEST_THREADS

# two servers and fifty rows, each with its own checks: minutes, not seconds
pytestmark = pytest.mark.slow

ANSWER_TIMEOUT = 30          # seconds a hostile request may take to be answered
WARMUP_TIMEOUT = 120         # a fresh server's first completion
HEALTH_TIMEOUT = 1.0         # /health must answer within this, all along
HEALTH_EVERY = 0.2           # seconds between two /health polls
RSS_GROWTH = 200 << 20       # bytes the process tree may grow by over its start
N_PREDICT = 16               # tokens a hostile completion may run to
COMPANION_TOKENS = 1500      # the second client's stream: outlasts any row, then it is cut
COMPANION_AFTER = 8          # pieces it must still get once the row and its check are done
SILENT_SOCKETS = 600

PROMPT = "The capital of France is"

# lines of the gdb backtrace ggml prints on abort, left out when reporting a death
BACKTRACE = re.compile(r"(#\d+ |\d+\t|\[New LWP|\[Thread |\[Inferior |warning: )")


# -- what a server must answer -------------------------------------------------------

class Answer(NamedTuple):
    """One response, or why none came (``status`` None)."""
    status: object
    body: object
    seconds: float
    error: str = ""


def short(obj, n=300):
    text = obj if isinstance(obj, str) else json.dumps(obj)
    return text if len(text) <= n else text[:n] + "..."


def refused(a):
    """A 4xx with the JSON error shape every endpoint shares."""
    if not (isinstance(a.status, int) and 400 <= a.status < 500):
        return "answered %s, not a 4xx: %s" % (a.status, short(a.body))
    err = a.body.get("error") if isinstance(a.body, dict) else None
    if not (isinstance(err, dict) and err.get("code") == a.status
            and isinstance(err.get("message"), str) and err["message"]
            and isinstance(err.get("type"), str) and err["type"]):
        return "a %d without {\"error\": {\"code\", \"message\", \"type\"}}: %s" \
            % (a.status, short(a.body))
    return None


def ends_early(*texts):
    """A 200 that stopped before its token limit, with one of ``texts`` as its content."""
    def check(a):
        if a.status != 200:
            return "answered %s, not a 200 that ends early: %s" % (a.status, short(a.body))
        b = a.body if isinstance(a.body, dict) else {}
        if b.get("content") not in texts or not b.get("stop") or b.get("stop_type") == "limit":
            return "a 200 that did not end early with %r: content %r, stop_type %r" \
                % (texts, b.get("content"), b.get("stop_type"))
        return None
    return check


def completes(pattern):
    """A 200 whose content (any finish) fully matches ``pattern``."""
    def check(a):
        if a.status != 200:
            return "answered %s, not a 200: %s" % (a.status, short(a.body))
        content = a.body.get("content") if isinstance(a.body, dict) else None
        if not isinstance(content, str) or not re.fullmatch(pattern, content, re.S):
            return "a 200 whose content %r does not match %r" % (content, pattern)
        return None
    return check


def embeds(a):
    """A 200 with, per input, a vector of finite numbers."""
    if a.status != 200:
        return "answered %s, not a 200: %s" % (a.status, short(a.body))
    data = a.body.get("data") if isinstance(a.body, dict) else None
    if not data or not all(isinstance(d.get("embedding"), list) and d["embedding"] and
                            all(isinstance(x, float) and x == x and abs(x) != float("inf")
                                for x in d["embedding"]) for d in data):
        return "a 200 without finite vectors: %s" % short(a.body)
    return None


def chat_answered(a):
    """A 200 chat completion with its one choice."""
    if a.status != 200:
        return "answered %s, not a 200: %s" % (a.status, short(a.body))
    choices = a.body.get("choices") if isinstance(a.body, dict) else None
    if not (isinstance(choices, list) and len(choices) == 1):
        return "a 200 without its choice: %s" % short(a.body)
    return None


def either(*checks):
    """Any one of ``checks`` passing is the right answer."""
    def check(a):
        problems = [c(a) for c in checks]
        return None if None in problems else " / ".join(problems)
    return check


# -- the rows --------------------------------------------------------------------------

class Vocab(NamedTuple):
    """What hostile bodies need to know about gemma's vocabulary."""
    eog: List[int]           # every end-of-generation token id
    hello: int               # the token of "Hello"


class Row(NamedTuple):
    id: str
    send: Callable           # (ServerProcess, Vocab) -> [problem, ...]


def post(id, path, body, answer, within=ANSWER_TIMEOUT):
    """A row that POSTs ``body`` (a dict, or a function of the Vocab) and judges the answer."""
    def send(srv, vocab):
        data = body(vocab) if callable(body) else body
        a = post_json(srv, path, data, within)
        if a.status is None:
            return [a.error]
        problem = answer(a)
        return [problem] if problem else []
    return Row(id, send)


def completion(**fields):
    return dict({"prompt": "Hello", "n_predict": N_PREDICT, "temperature": 0}, **fields)


def chat(**fields):
    return dict({"messages": [{"role": "user", "content": "Say hello."}],
                 "max_tokens": N_PREDICT, "temperature": 0}, **fields)


def ban(tokens):
    return [[t, False] for t in tokens]


M_OVER_N = {"type": "string", "minLength": 3, "maxLength": 2}
DEEP_PARENS = "root ::= " + "(" * 20000 + '"a"' + ")" * 20000
RULE_CHAIN = "root ::= r0\n" + "".join("r%d ::= r%d\n" % (i, i + 1) for i in range(99999)) \
    + 'r99999 ::= "a"\n'
INFILL_GRAMMAR = 'root ::= [A-Za-z_]+ "(" [a-z]* ")"'
# text a grammar can have produced so far: any prefix of its language
INFILL_PREFIXES = r"[A-Za-z_]*(\([a-z]*\)?)?"


def smuggled_request(srv, vocab):
    """Content-Length and Transfer-Encoding both, and a second request after the body.

    A server that frames by either header alone answers the smuggled GET too;
    the safe answers are one response (200, or a 400 error) and a closed
    connection.
    """
    body = json.dumps(completion(n_predict=2)).encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    smuggled = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    data = rawhttp.request("POST", "/completion", chunked, {
        "Content-Type": "application/json", "Transfer-Encoding": "chunked"}) + smuggled
    with rawhttp.connect(srv.port, ANSWER_TIMEOUT) as sock:
        sock.sendall(data)
        got, closed = rawhttp.read_and_whether_closed(sock, ANSWER_TIMEOUT)
    statuses = [int(s) for s in re.findall(rb"(?:^|\r\n)HTTP/1\.[01] (\d{3}) ", got)]
    problems = []
    if len(statuses) != 1:
        problems.append("%d responses to one request and a smuggled one: %r"
                        % (len(statuses), short(got.decode("latin-1"))))
    elif statuses[0] not in (200, 400):
        problems.append("answered %d, not 200 or 400: %r" % (statuses[0], short(got.decode())))
    elif statuses[0] == 400:
        status, _, payload = rawhttp.parse_responses(got)[0]
        try:
            parsed = json.loads(payload)
        except ValueError:
            parsed = payload.decode("latin-1")
        problem = refused(Answer(status, parsed, 0))
        if problem:
            problems.append(problem)
    if not closed:
        problems.append("the connection stayed open %ss after answering %s"
                        % (ANSWER_TIMEOUT, statuses))
    return problems


def silent_sockets(srv, vocab):
    """Sockets that connect and never send a byte hold no session and starve nobody."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = SILENT_SOCKETS + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    socks = []
    try:
        for _ in range(SILENT_SOCKETS):
            socks.append(rawhttp.connect(srv.port, ANSWER_TIMEOUT))
        time.sleep(1)       # let the server take them all in
        problem = normal_completion(srv)
        return ["with %d silent sockets open, %s" % (SILENT_SOCKETS, problem)] if problem else []
    finally:
        for s in socks:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


HOSTILE = [
    # -- grammars that abort inside libllama ----------------------------------------
    post("grammar-nul-char", "/completion", completion(grammar="root ::= [\\x00]"),
         either(refused, ends_early("", "\x00"))),
    post("grammar-token-999999", "/completion", completion(grammar="root ::= <[999999]>"),
         refused),
    post("grammar-token-4294967295", "/completion",
         completion(grammar="root ::= <[4294967295]>"), refused),
    post("grammar-eog-token", "/completion",
         lambda v: completion(grammar="root ::= <[%d]>" % v.eog[0]),
         either(refused, ends_early(""))),
    post("grammar-only-token-banned", "/completion",
         lambda v: completion(grammar="root ::= <[%d]>" % v.hello, logit_bias=ban([v.hello])),
         ends_early("")),
    post("grammar-finished-eog-banned", "/completion",
         lambda v: completion(grammar='root ::= "a"', logit_bias=ban(v.eog)),
         ends_early("a")),
    post("grammar-finished-eog-banned-ignore-eos", "/completion",
         lambda v: completion(grammar='root ::= "a"', logit_bias=ban(v.eog), ignore_eos=True),
         ends_early("a")),
    post("infill-sampler-with-grammar", "/infill",
         {"input_prefix": "def ", "input_suffix": "\n", "n_predict": N_PREDICT,
          "temperature": 0, "samplers": ["top_k", "top_p", "infill"],
          "grammar": INFILL_GRAMMAR},
         either(refused, completes(INFILL_PREFIXES))),
    # -- grammars deep enough to overflow a stack --------------------------------------
    post("grammar-20000-nested-parens", "/completion", completion(grammar=DEEP_PARENS),
         either(refused, completes("a?"))),
    post("grammar-100000-rule-chain", "/completion", completion(grammar=RULE_CHAIN),
         either(refused, completes("a?"))),
    # -- x{m,n} with m > n, by every route ---------------------------------------------
    post("repeat-m-over-n-grammar", "/completion", completion(grammar='root ::= "a"{3,2}'),
         refused),
    post("repeat-m-over-n-json-schema", "/completion", completion(json_schema=M_OVER_N),
         refused),
    post("repeat-m-over-n-response-format", "/v1/chat/completions",
         chat(response_format={"type": "json_schema",
                                "json_schema": {"name": "x", "schema": M_OVER_N}}),
         refused),
    # a tool's schema never fails a request (issue 36): the constraint it cannot hold
    # is dropped, and the call goes on under the rest of the schema
    post("repeat-m-over-n-tool-parameters", "/v1/chat/completions",
         chat(tools=[{"type": "function", "function": {
             "name": "f", "description": "f",
             "parameters": {"type": "object", "properties": {"s": M_OVER_N},
                            "required": ["s"]}}}],
              tool_choice="required"),
         either(refused, chat_answered)),
    # -- a schema too big to build quickly --------------------------------------------
    post("json-schema-enum-20000", "/completion",
         completion(json_schema={"enum": ["value-%05d" % i for i in range(20000)]}),
         either(refused, completes(r'("value-\d{0,5}"?)?')), within=5),
    # -- malformed schemas ------------------------------------------------------------------
    post("json-schema-minlength-string", "/completion",
         completion(json_schema={"type": "string", "minLength": "5"}), refused),
    post("json-schema-exclusiveminimum-string", "/completion",
         completion(json_schema={"type": "number", "exclusiveMinimum": "5"}), refused),
    post("json-schema-required-object", "/completion",
         completion(json_schema={"type": "object", "properties": {"x": {"type": "string"}},
                                 "required": [{"x": 1}]}), refused),
    post("json-schema-maximum-1500-digits", "/completion",
         completion(json_schema={"type": "integer", "maximum": int("9" * 1500)}),
         either(refused, completes(r"-?\d*"))),
    post("json-schema-5000-char-property", "/completion",
         completion(json_schema={"type": "object", "properties": {"p" * 5000: {"type": "string"}},
                                 "additionalProperties": True}),
         either(refused, completes(r"\{.*"))),
    post("json-schema-prefixitems-number", "/completion",
         completion(json_schema={"type": "array", "prefixItems": 5}), refused),
    post("json-schema-maxlength-10-to-the-12", "/completion",
         completion(json_schema={"type": "string", "maxLength": 10 ** 12}),
         either(refused, completes(r'("[^"]*"?)?'))),
    # -- sampling parameters -------------------------------------------------------------
    post("repeat-penalty-zero", "/completion", completion(repeat_penalty=0),
         either(refused, completes(r".*"))),
    # -- embeddings (a context of their own, made on first use) ----------------------------
    post("embedding-token-id-2**31-1", "/v1/embeddings", {"input": [[1], [2 ** 31 - 1]]},
         refused),
    post("embedding-2048-empty-inputs", "/v1/embeddings", {"input": [[]] * 2048}, refused),
    post("embedding-p-norm-1000", "/v1/embeddings", {"input": "Hello", "embd_normalize": 1000},
         embeds),
    # -- the connection itself ------------------------------------------------------------
    Row("content-length-and-chunked-smuggle", smuggled_request),
    Row("600-silent-sockets", silent_sockets),
]


# -- the server, watched ----------------------------------------------------------------

def post_json(srv, path, body, timeout):
    """POST on a new connection; an Answer, with status None if none came in time."""
    t0 = time.monotonic()
    c = http.client.HTTPConnection(srv.host, srv.port, timeout=timeout)
    try:
        c.request("POST", path, body=json.dumps(body).encode(),
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        payload = r.read()
        try:
            parsed = json.loads(payload)
        except ValueError:
            parsed = payload.decode("utf-8", "replace")
        return Answer(r.status, parsed, time.monotonic() - t0)
    except socket.timeout:
        return Answer(None, None, time.monotonic() - t0, "no answer within %ss (hang)" % timeout)
    except (OSError, http.client.HTTPException) as e:
        return Answer(None, None, time.monotonic() - t0,
                      "no answer: %s: %s" % (type(e).__name__, e))
    finally:
        c.close()


def normal_completion(srv, timeout=ANSWER_TIMEOUT):
    """None if a plain greedy completion succeeds now, else what went wrong."""
    a = post_json(srv, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0},
                  timeout)
    if a.status is None:
        return "a normal completion got %s" % a.error
    if a.status != 200 or not a.body.get("tokens_predicted"):
        return "a normal completion answered %s: %s" % (a.status, short(a.body))
    return None


class Watch:
    """While a row runs: /health polled with a 1 s timeout, and the tree's peak RSS."""

    def __init__(self, srv):
        self.srv = srv
        self.failures = []
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._t0 = time.monotonic()

    def _poll(self):
        while not self._stop.is_set():
            t = time.monotonic() - self._t0
            c = http.client.HTTPConnection(self.srv.host, self.srv.port, timeout=HEALTH_TIMEOUT)
            try:
                c.request("GET", "/health")
                r = c.getresponse()
                r.read()
                if r.status != 200:
                    self.failures.append("%.1fs: /health answered %d" % (t, r.status))
            except (OSError, http.client.HTTPException) as e:
                self.failures.append("%.1fs: /health: %s" % (t, type(e).__name__))
            finally:
                c.close()
            if self.srv.proc.poll() is None:
                self.peak_rss = max(self.peak_rss, rawhttp.tree_rss(self.srv.proc.pid))
            self._stop.wait(HEALTH_EVERY)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(HEALTH_TIMEOUT + 5)


class Companion(threading.Thread):
    """A second client's long greedy stream, under way before a hostile request arrives.

    It must go on through the row: once the row and the completion after it
    are answered, it must still get COMPANION_AFTER pieces, then the test
    hangs up (waiting for all its tokens cost seconds a row).
    """

    def __init__(self, srv):
        super().__init__(daemon=True)
        self.srv = srv
        self.status = None
        self.final = None
        self.error = ""
        self.pieces = 0
        self.started = threading.Event()
        self._cond = threading.Condition()
        self._conn = None
        self._cut = False

    def run(self):
        c = self._conn = http.client.HTTPConnection(self.srv.host, self.srv.port, timeout=120)
        try:
            c.request("POST", "/completion", body=json.dumps({
                "prompt": "Once upon a time", "n_predict": COMPANION_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}).encode(),
                headers={"Content-Type": "application/json"})
            r = c.getresponse()
            self.status = r.status
            for line in r:
                if line.startswith(b"data: "):
                    event = json.loads(line[len(b"data: "):])
                    with self._cond:
                        self.pieces += 1
                        if event.get("stop"):
                            self.final = event
                        self._cond.notify_all()
                    self.started.set()
        except (OSError, http.client.HTTPException, ValueError) as e:
            if not self._cut:
                self.error = "%s: %s" % (type(e).__name__, e)
        finally:
            c.close()
            with self._cond:
                self._cond.notify_all()
            self.started.set()

    def problem(self):
        """None if the stream went on after the row; then it is cut."""
        with self._cond:
            seen = self.pieces
            self._cond.wait_for(lambda: self.pieces >= seen + COMPANION_AFTER
                                or not self.is_alive(), 60)
            # (a row that outlasts the whole stream: its end, checked below, is enough)
            went_on = self.pieces >= seen + COMPANION_AFTER or self.final is not None
            self._cut = True
        try:
            self._conn.sock.shutdown(socket.SHUT_RDWR)
        except (OSError, AttributeError):
            pass
        self.join(30)
        if self.status != 200 or self.error:
            return "the second client's stream broke: status %s, %s" % (self.status, self.error)
        if self.final is not None and (self.final.get("stop_type") != "limit"
                                       or self.final.get("tokens_predicted") != COMPANION_TOKENS):
            return "the second client's stream ended early: stop_type %r after %r tokens" \
                % (self.final.get("stop_type"), self.final.get("tokens_predicted"))
        if not went_on:
            return "the second client's stream stalled: %d pieces in 60 s after the row" \
                % (self.pieces - seen)
        return None


class Served:
    """The module's server; a fresh one replaces it after a row that harmed it."""

    def __init__(self, parallel, *args, **kwargs):
        self.parallel = parallel
        self.args = args + ("-np", parallel)     # (model, flags...) for ServerProcess
        self.kwargs = kwargs
        self.srv = None
        self.start_rss = 0
        self.harmed = False

    def live(self):
        if self.srv is None or self.harmed or self.srv.proc.poll() is not None:
            self.close()
            self.srv = ServerProcess(*self.args, **self.kwargs).start()
            # warm up, so first-decode buffers do not count as growth; the first decode
            # can take many seconds on a busy machine
            problem = normal_completion(self.srv, timeout=WARMUP_TIMEOUT)
            assert problem is None, "a fresh server: %s; its output:\n%s" \
                % (problem, "".join(self.srv.output[-8:]))
            # and grammars: libllama's first grammar sampling over a 262k
            # vocabulary raises the worker's RSS by about 165 MB once (the
            # decoded pieces of every candidate), and the first grammar that
            # lets most candidates through (a JSON string) by 114 MB more
            # (measured: a later one, of any maxLength, adds 2 MB); those are
            # fixed costs of the model, not growth from hostile input (on
            # every session at once: each request's thread may allocate in an
            # arena of its own).  Twice: a second round still added 72-95 MB
            # on np2 (and nothing after it), which rows then counted as growth
            # (one failed at 202 MB of the 200 allowed)
            statuses = []

            def warm():
                statuses.append(self.srv.post("/completion", {
                    "prompt": "warm", "n_predict": 2, "temperature": 0,
                    "grammar": 'root ::= [a-z]+'}, timeout=WARMUP_TIMEOUT)[0])
                statuses.append(self.srv.post("/completion", {
                    "prompt": "warm", "n_predict": 2, "temperature": 0,
                    "json_schema": {"type": "string"}}, timeout=WARMUP_TIMEOUT)[0])
            for _ in range(2):
                warmers = [threading.Thread(target=warm) for _ in range(self.parallel)]
                for t in warmers:
                    t.start()
                for t in warmers:
                    t.join()
            assert statuses == [200] * 4 * self.parallel, "grammar warm-up: %s" % statuses
            # and one embedding: the worker's embedding context is made on the
            # first (about 200 MB on gemma-3, the logits of a batch), once
            status = self.srv.post("/v1/embeddings", {"input": "warm"},
                                   timeout=WARMUP_TIMEOUT)[0]
            assert status == 200, "embedding warm-up: %s" % status
            self.start_rss = rawhttp.tree_rss(self.srv.proc.pid)
            self.harmed = False
        return self.srv

    def death(self, wait=0):
        """None while the server runs (after ``wait`` s), else how it died and what it said last."""
        try:
            rc = self.srv.proc.wait(wait)
        except subprocess.TimeoutExpired:
            return None
        how = "killed by %s" % signal.Signals(-rc).name if rc < 0 else "exited with %d" % rc
        self.srv._reader.join(2)        # the last lines, up to the pipe's end
        said = [line for line in self.srv.output if not BACKTRACE.match(line)]
        return "the server died (%s); its last output:\n%s" % (how, "".join(said[-8:]))

    def close(self):
        if self.srv is not None and self.srv.proc.poll() is None:
            try:
                self.srv.stop(timeout=15)
            except AssertionError:
                pass        # it was killed after the grace; a fresh one follows
        self.srv = None


@pytest.fixture(scope="module")
def vocab(lib, gemma_path):
    model = Model.load(str(gemma_path), progress=False, vocab_only=True)
    try:
        return Vocab(eog=[t for t in range(model.n_vocab) if model.is_eog(t)],
                     hello=model.tokenize("Hello", add_special=False)[0])
    finally:
        model.close()


@pytest.fixture(scope="module", params=[1, 2], ids=["np1", "np2"])
def served(request, gemma_path, fim_model_path):
    s = Served(request.param, gemma_path, "--fim-model", fim_model_path, threads=TEST_THREADS,
               ctx=2048)
    try:
        yield s
    finally:
        s.close()


# -- the test ----------------------------------------------------------------------------

@pytest.mark.parametrize("row", HOSTILE, ids=[r.id for r in HOSTILE])
def test_hostile_request_is_answered_and_the_server_stays_well(served, vocab, row):
    srv = served.live()
    pid = srv.proc.pid
    companion = None
    if served.parallel > 1:
        companion = Companion(srv)
        companion.start()
        assert companion.started.wait(60), "the second client's stream never started"
    with Watch(srv) as watch:
        problems = row.send(srv, vocab)
        died = served.death(wait=1 if problems else 0)
        if died is None:
            problem = normal_completion(srv)
            if problem:
                problems.append(problem + " right after")
    if died is None:
        died = served.death()
    if died is not None:
        served.harmed = True
        pytest.fail("\n".join([died] + problems))
    grown = max(watch.peak_rss, rawhttp.tree_rss(pid)) - served.start_rss
    if grown >= RSS_GROWTH:
        problems.append("RSS grew by %d MB over its start" % (grown >> 20))
    if watch.failures:
        problems.append("/health did not answer within %ss %d times: %s"
                        % (HEALTH_TIMEOUT, len(watch.failures), "; ".join(watch.failures[:5])))
    if companion is not None:
        problem = companion.problem()
        if problem:
            problems.append(problem)
    if problems:
        served.harmed = True
        pytest.fail("\n".join(problems))
