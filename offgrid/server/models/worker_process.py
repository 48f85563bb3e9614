"""A worker's process as the operating system sees it: its command line, its memory
limit and RSS, how it ended.  ``worker_client.WorkerClient`` starts and watches it.
"""

import os
import signal
import subprocess
import sys

_MIB = 1 << 20


def package_root():
    """The folder that holds the ``offgrid`` package the front runs from."""
    # offgrid/server/models/worker_client.py: four levels up
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))


def offgrid_command(code, args=()):
    """argv that runs ``code`` on this interpreter with this offgrid first on
    sys.path and nothing from the environment's path: under ``python3 -I``
    (how a bundle runs, isolated mode, kept for the child) the folder that
    holds the package is on no path of the child's otherwise."""
    code = "import sys; sys.path.insert(0, %r); %s" % (package_root(), code)
    flags = ["-I"] if sys.flags.isolated else []
    return [sys.executable] + flags + ["-c", code] + list(args)


def worker_command(worker_args, max_data=None):
    """argv of a worker: this interpreter, this offgrid (offgrid_command).

    Its first instruction is ``engine/lifeline.start``: the process ends with
    its front, and keeps within ``max_data`` bytes (RLIMIT_DATA), before
    anything else is imported or loaded.
    """
    return offgrid_command("from offgrid.engine import lifeline; lifeline.start(%r); "
                           "from offgrid.engine.worker import main; sys.exit(main())"
                           % (int(max_data) if max_data else None), worker_args)


def data_limit(max_rss):
    """The RLIMIT_DATA of a worker whose RSS ceiling is ``max_rss`` bytes: a little
    above it, since the limit counts memory reserved (thread stacks, buffers not
    yet touched) and RSS only what is touched; the watchdog holds the ceiling
    itself, this stops an allocation that would leap past it between two of the
    watchdog's looks."""
    return max_rss + max(128 * _MIB, max_rss // 4)


def set_data_limit(pid, max_rss):
    """Move a running worker's RLIMIT_DATA to match ``max_rss`` (Linux's prlimit)."""
    try:
        import resource
        _, hard = resource.prlimit(pid, resource.RLIMIT_DATA)
        resource.prlimit(pid, resource.RLIMIT_DATA, (data_limit(max_rss), hard))
    except (ImportError, AttributeError, ValueError, OSError):
        pass        # gone, or no prlimit here: the watchdog still holds the ceiling


def rss_of(pid):
    """Resident bytes of a process, or None once it is gone."""
    try:
        with open("/proc/%d/statm" % pid) as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def describe_exit(returncode, killed_for=None):
    """How a worker ended, in words for a log line and an error message."""
    if killed_for:
        return killed_for
    if returncode is None:
        return "its pipe closed"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "signal %d" % -returncode
        if -returncode == signal.SIGKILL:
            return name + " (killed: out of memory, or by hand)"
        return name
    return "exit status %d" % returncode


def _reap(proc):
    """Wait for a worker that ended: (its return code, its peak RSS in bytes, 0 unknown)."""
    if getattr(proc, "returncode", 0) is None and isinstance(getattr(proc, "pid", None), int):
        try:
            # wait4 also says how much memory the process ever held
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage.ru_maxrss * 1024
        except (ChildProcessError, AttributeError, OSError):
            pass        # reaped already (proc.wait below knows its code), or no wait4
    return proc.wait(), 0


def _popen(argv):
    # glibc gives each thread that allocates at once an arena of its own, and
    # keeps what it freed: libllama's grammar sampling peaks near 165 MB on a
    # 262k vocabulary per arena, so two requests' threads held twice that
    # for good.  Two arenas (unless the user chose) bound it.
    env = dict(os.environ)
    env.setdefault("MALLOC_ARENA_MAX", "2")
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
                            close_fds=True, env=env)
