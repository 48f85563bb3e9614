"""``python -m offgrid`` / ``offgrid``: load the models and serve them over HTTP.

The flags are named like llama-server's, so habits carry over.  The HTTP
socket opens first, so ``/health`` answers 503 "loading" while the models
load; then one line ``listening on http://HOST:PORT`` (``https://`` with
--ssl-key-file and --ssl-cert-file) says it is ready.
SIGINT/SIGTERM stop it: new requests get 503, running ones get a grace
period, the process exits 0.
"""

import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

from .errors import OffgridError
from .flags import parse_args
from .flagvalues import is_loopback
from .request import GenerationParams


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


def main(argv=None):
    args = parse_args(argv)
    if not args.log_file:
        return serve(args)
    from .logfile import LogFile
    try:
        log = LogFile(args.log_file)
    except OSError as e:
        print("offgrid: cannot write --log-file %s: %s" % (args.log_file, e.strerror),
              file=sys.stderr)
        return 2
    try:
        return serve(args)
    finally:
        log.close()


def serve(args):
    """Serve until SIGINT or SIGTERM; the process's exit status."""
    if args.list_devices:
        # libllama is the workers' alone: a process of its own lists them
        from .server.models.worker_process import offgrid_command
        return subprocess.call(offgrid_command(
            "from offgrid.engine.devices import main; sys.exit(main())",
            ["--lib", args.lib] if args.lib else []))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from .server.api.routes import APP
    from .server.httpd.httperrors import HTTPError
    from .server.httpd.frontmem import ceiling_from_flag
    from .server.httpd.server import make_server
    from .server.models.launch import build_shelf
    from .server.serving.service import Service

    try:
        api_keys = read_api_keys(args)
    except OSError as e:
        print("offgrid: cannot read --api-key-file: %s" % e, file=sys.stderr)
        return 2
    except ValueError as e:
        print("offgrid: %s" % e, file=sys.stderr)
        return 2
    if args.slot_save_path:
        # llama-server makes the folder too; the workers write into it
        args.slot_save_path = os.path.abspath(os.path.expanduser(args.slot_save_path))
        try:
            os.makedirs(args.slot_save_path, exist_ok=True)
        except OSError as e:
            print("offgrid: cannot make --slot-save-path %s: %s" % (args.slot_save_path,
                                                                     e.strerror),
                  file=sys.stderr)
            return 2
    if not is_loopback(args.host) and not api_keys:
        print("offgrid: warning: listening on %s without an API key; anyone who can reach "
              "this address can use the server (set --api-key)" % args.host, file=sys.stderr)
    try:
        httpd = make_server(args.host, args.port, APP, None, api_keys, args.cors_origin,
                            args.max_body, args.verbose, args.timeout, args.read_timeout,
                            ceiling_from_flag(args.front_max_rss), args.instance_name,
                            args.tls, args.api_prefix, args.reuse_port)
    except OSError as e:
        print("offgrid: cannot listen on %s:%d: %s" % (args.host, args.port, e), file=sys.stderr)
        return 1
    httpd.RequestHandlerClass.webui = args.webui
    httpd.RequestHandlerClass.ping_every = args.sse_ping_interval
    serving = threading.Thread(target=httpd.serve_forever, name="http", daemon=True)
    serving.start()   # /health says "loading" meanwhile

    # Decodes take turns across the models' workers as they do across the
    # sessions of one (see engine/session.py): the workers flock this file.
    lock_fd, decode_lock = tempfile.mkstemp(prefix="offgrid-decode-", suffix=".lock")
    os.close(lock_fd)

    def fail(message, code=1):
        print("offgrid: %s" % message, file=sys.stderr)
        if shelf is not None:
            shelf.close()
        os.unlink(decode_lock)
        httpd.shutdown()
        httpd.server_close()
        return code

    shelf = None
    try:
        shelf, text, fim = build_shelf(args, decode_lock)
    except ValueError as e:
        return fail(e, 2)
    # the command line's models are loaded before "listening on"; a failure ends the server
    for entry in (text, fim):
        if entry is not None:
            try:
                shelf.load(entry)
            except (OffgridError, HTTPError) as e:
                return fail(getattr(e, "message", e))
    for entry in (text, fim):
        info = entry.info if entry is not None else None
        if info and info.pooling == "rank" and not info.rank_head:
            # llama-server goes ahead too; the scores then come from no trained head
            print("offgrid: warning: %s has no rank head (its GGUF pooling_type is not rank): "
                  "/rerank scores are the first component of its hidden state, not relevance"
                  % entry.id, file=sys.stderr)
    defaults = GenerationParams(n_predict=args.n_predict, ignore_eos=args.ignore_eos,
                                n_keep=args.keep, cache_prompt=args.cache_prompt,
                                stop=list(args.reverse_prompt), special=args.special)
    service = Service(text, fim, generation_default=defaults,
                      shutdown_grace=args.shutdown_grace, cache_reuse=max(0, args.cache_reuse),
                      endpoints_off=[
                          name for name, on in (("metrics", args.metrics),
                                                ("props", args.props),
                                                ("slots", args.slots),
                                                ("embeddings", args.embeddings)) if not on],
                      shelf=shelf, fim_given=fim is not None)
    service.slot_save_path = args.slot_save_path
    from .server.api import media
    media.allow_files_under(args.media_path)    # file:// images (refused without it)
    httpd.RequestHandlerClass.service = service
    shelf.start_reaper()
    # preset models marked load-on-startup, and --pin ones, load meanwhile
    for entry in shelf.entries:
        if entry.worker is None and entry.status == "unloaded" and (
                entry.pinned or (entry.preset or {}).get("load_on_startup")):
            shelf.load(entry, wait=False)

    stop = StopSignals()
    stop.install()
    host, port = httpd.server_address[:2]
    address = "%s://%s:%d" % ("https" if args.tls else "http",
                              host if ":" not in host else "[%s]" % host, port)
    print("listening on " + address, flush=True)
    if args.webui:
        print("offgrid: chat page at %s%s/" % (address, args.api_prefix or ""), file=sys.stderr,
              flush=True)

    stop.wait()
    print("offgrid: shutting down", file=sys.stderr, flush=True)
    # New requests get 503 from now on, those on kept-alive connections too
    # (a balancer retries them elsewhere); then stop accepting, and close the
    # listening socket, so a new connection is refused at once (server.py:
    # stop_accepting) rather than left in the kernel's queue, while the
    # running requests finish.
    service.stop_taking()
    httpd.shutdown()
    httpd.stop_accepting()
    service.shutdown()
    # Let the handlers write their last bytes (a client that stopped reading
    # gets 5 seconds), then end the workers.
    httpd.drain(5.0)
    httpd.server_close()
    # A worker is a process: ending it frees everything it held, whether or
    # not a handler still waits on it (that one gets "worker died").
    service.close()
    os.unlink(decode_lock)
    return 0


class StopSignals:
    """SIGINT and SIGTERM as a flag the main thread polls.

    The handler takes no lock.  Python runs it in the main thread between two
    bytecodes, which may be inside ``Event.wait`` with the event's own lock
    held: an ``Event.set()`` here then waits for that lock forever.  That is
    how a server once never noticed its SIGTERM (the test that stopped it
    waited 60 s, then killed it).
    """

    def __init__(self):
        self.received = []
        self._wake = None

    def install(self):
        # the C handler writes a byte here, so wait() wakes at once, not at its
        # next look: during that look a balancer would still send new work here
        self._wake, w = os.pipe()
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w)
        signal.signal(signal.SIGINT, self.handler)
        signal.signal(signal.SIGTERM, self.handler)

    def handler(self, signum, _frame):
        self.received.append(signum)
        # a second Ctrl-C (or SIGTERM) ends the process at once, grace or not
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)

    def wait(self, poll=0.5):
        """Return once a signal came: at once through the wakeup pipe, else at the
        next look (sleep is what a signal interrupts)."""
        while not self.received:
            if self._wake is None:
                time.sleep(poll)
            elif select.select([self._wake], [], [], poll)[0]:
                os.read(self._wake, 512)


if __name__ == "__main__":
    sys.exit(main())
