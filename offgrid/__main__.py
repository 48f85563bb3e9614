"""``python -m offgrid`` / ``offgrid``: load the models and serve them over HTTP.

The flags are named like llama-server's, so habits carry over.  The HTTP
socket opens first, so ``/health`` answers 503 "loading" while the models
load; then one line ``listening on http://HOST:PORT`` says it is ready.
SIGINT/SIGTERM stop it: new requests get 503, running ones get a grace
period, the process exits 0.
"""

import argparse
import ipaddress
import logging
import os
import signal
import sys
import threading

from . import __version__
from .errors import OffgridError


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="offgrid", description="A local LLM server over libllama.")
    p.add_argument("-m", "--model", required=True, help="GGUF model for text and chat requests")
    p.add_argument("--fim-model", help="GGUF code model for /infill and suffix requests "
                   "(default: --model)")
    p.add_argument("-a", "--alias", action="append", default=[],
                   help="a name the --model answers to (repeatable; the first is its id)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks one)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096,
                   help="context size of each session, in tokens (default 4096; "
                   "0: the model's training context)")
    p.add_argument("-b", "--batch-size", type=int, default=512,
                   help="prompt tokens decoded per step (default 512)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=None,
                   help="physical batch size (default: --batch-size)")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="threads for generation (default: all cores)")
    p.add_argument("-tb", "--threads-batch", type=int, default=None,
                   help="threads for prompt evaluation (default: --threads)")
    p.add_argument("-np", "--parallel", type=int, default=1,
                   help="sessions per model, i.e. requests run at once (default 1)")
    p.add_argument("-n", "--n-predict", type=int, default=-1,
                   help="default tokens to generate when a request sets none (-1: no limit)")
    p.add_argument("--api-key", action="append", default=[],
                   help="API key (repeatable; also $OFFGRID_API_KEY)")
    p.add_argument("--api-key-file", help="file with one API key per line")
    p.add_argument("--cors-origin", action="append", default=[],
                   help="origin allowed to call the API from a browser (repeatable)")
    p.add_argument("--max-body", type=int, default=8 * 1024 * 1024,
                   help="largest request body in bytes (default 8 MiB)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds an idle connection is kept, and a client that stops "
                   "reading a response is waited for (default 30)")
    p.add_argument("--read-timeout", type=float, default=30.0,
                   help="seconds a client may take to send a whole request (default 30)")
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds running requests get to finish on shutdown (default 10)")
    p.add_argument("--cache-reuse", type=int, default=64,
                   help="FIM requests move cached runs of at least N tokens to where the new "
                   "prompt needs them instead of recomputing them (default 64; 0: off)")
    p.add_argument("--no-swa-full", action="store_true",
                   help="windowed KV cache for sliding-window models: less memory, "
                   "but no prompt-cache reuse")
    p.add_argument("--chat-template", metavar="NAME|FILE",
                   help="chat template for --model instead of its own: a Jinja file, "
                   "\"chatml\", or the name of a libllama built-in template")
    p.add_argument("--lib", help="path to libllama.so or its folder (default: lib/, "
                   "$OFFGRID_LIB, the system)")
    p.add_argument("-v", "--verbose", action="store_true", help="log requests and libllama")
    p.add_argument("--version", action="version", version="offgrid " + __version__)
    return p.parse_args(argv)


def read_api_keys(args):
    """The keys from --api-key, $OFFGRID_API_KEY and --api-key-file.

    Raises ValueError where a key was asked for but none came of it (an
    empty --api-key, an empty file): a server meant to be locked must not
    start open.
    """
    keys = list(args.api_key)
    env = os.environ.get("OFFGRID_API_KEY")
    if env is not None:
        keys.append(env)
    if any(not k.strip() for k in keys):
        raise ValueError("an empty API key was given (--api-key or $OFFGRID_API_KEY)")
    keys = [k.strip() for k in keys]
    if args.api_key_file:
        with open(args.api_key_file, encoding="utf-8") as fh:
            found = [k for k in (line.strip() for line in fh) if k and not k.startswith("#")]
        if not found:
            raise ValueError("--api-key-file %s holds no key" % args.api_key_file)
        keys += found
    return keys


def is_loopback(host):
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def load_entry(path, ids, args, lib_path, chat_template=None):
    """Load one model and its --parallel sessions into a ModelEntry."""
    from .engine.model import Model
    from .engine.session import ChatSession
    from .server.pool import ChatPool
    from .server.service import ModelEntry

    model = Model.load(path, lib_path=lib_path, verbose=args.verbose)
    sessions = []
    try:
        for _ in range(max(1, args.parallel)):
            sessions.append(ChatSession(model, n_ctx=args.ctx_size, n_batch=args.batch_size,
                                        n_ubatch=args.ubatch_size, n_threads=args.threads,
                                        n_threads_batch=args.threads_batch,
                                        swa_full=not args.no_swa_full))
    except BaseException:
        for s in sessions:
            s.close()
        model.close()
        raise
    name = ids[0] if ids else os.path.basename(path)
    return ModelEntry(id=name, aliases=ids[1:], model=model, pool=ChatPool(sessions),
                      n_ctx=sessions[0].n_ctx, n_batch=sessions[0].n_batch,
                      path=os.path.abspath(path), chat_template=chat_template)


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from .server.errors import HTTPError
    from .server.http import make_server
    from .server.service import Service

    try:
        api_keys = read_api_keys(args)
    except OSError as e:
        print("offgrid: cannot read --api-key-file: %s" % e, file=sys.stderr)
        return 2
    except ValueError as e:
        print("offgrid: %s" % e, file=sys.stderr)
        return 2
    if not is_loopback(args.host) and not api_keys:
        print("offgrid: warning: listening on %s without an API key; anyone who can reach "
              "this address can use the server (set --api-key)" % args.host, file=sys.stderr)
    try:
        httpd = make_server(args.host, args.port, None, api_keys, args.cors_origin,
                            args.max_body, args.verbose, args.timeout, args.read_timeout)
    except OSError as e:
        print("offgrid: cannot listen on %s:%d: %s" % (args.host, args.port, e), file=sys.stderr)
        return 1
    serving = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                               name="http", daemon=True)
    serving.start()   # /health says "loading" meanwhile

    chat_template = args.chat_template
    if chat_template and os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as fh:
            chat_template = fh.read()
    try:
        text = load_entry(args.model, args.alias, args, args.lib, chat_template)
        from .chat.select import template_for
        template_for(text)      # a template that cannot be used stops startup here
        fim = None
        if args.fim_model and os.path.abspath(args.fim_model) != os.path.abspath(args.model):
            fim = load_entry(args.fim_model, [], args, args.lib)
    except (OffgridError, HTTPError) as e:
        print("offgrid: %s" % e, file=sys.stderr)
        httpd.shutdown()
        httpd.server_close()
        return 1
    service = Service(text, fim, n_predict_default=args.n_predict,
                      shutdown_grace=args.shutdown_grace, cache_reuse=max(0, args.cache_reuse))
    httpd.RequestHandlerClass.service = service

    stop = threading.Event()

    def on_signal(signum, _frame):
        stop.set()
        # a second Ctrl-C (or SIGTERM) ends the process at once, grace or not
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    host, port = httpd.server_address[:2]
    print("listening on http://%s:%d" % (host if ":" not in host else "[%s]" % host, port),
          flush=True)

    while not stop.wait(0.5):
        pass
    print("offgrid: shutting down", file=sys.stderr, flush=True)
    # Stop accepting first; requests on kept-alive connections still reach
    # the service and get 503 from here on, while running ones finish.
    httpd.shutdown()
    service.shutdown()
    # Let the handlers write their last bytes; only then are the models freed,
    # since a handler may still be tokenizing.  One that does not finish in
    # time (a client that stopped reading) keeps them: the process ends anyway.
    drained = httpd.drain(5.0)
    httpd.server_close()
    if drained:
        service.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
