"""Raw HTTP over a loopback socket, and a look at a server process from outside.

For tests that must send what no client library sends (lying lengths, huge
headers, half a request, nothing at all) and read exactly what comes back,
including whether a second response follows or the connection closes.
"""

import os
import socket
import time


def connect(port, timeout=10):
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def request(method, path, body=b"", headers=None, length=True):
    """The bytes of one request; ``length`` False leaves out Content-Length."""
    lines = ["%s %s HTTP/1.1" % (method, path), "Host: 127.0.0.1"]
    if length and body:
        lines.append("Content-Length: %d" % len(body))
    for k, v in (headers or {}).items():
        lines.append("%s: %s" % (k, v))
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def read_until_closed(sock, timeout=10):
    """Everything the server sends until it closes (or ``timeout`` passes)."""
    return read_and_whether_closed(sock, timeout)[0]


def read_and_whether_closed(sock, timeout):
    """(everything received, whether the server closed) within ``timeout``."""
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            data = sock.recv(1 << 16)
        except socket.timeout:
            return out, False
        except ConnectionResetError:
            return out, True
        if not data:
            return out, True
        out += data
    return out, False


def parse_responses(data):
    """[(status, {header: value}, body)] of the responses in ``data`` (Content-Length framed)."""
    out = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            break
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        n = int(headers.get("content-length", 0))
        out.append((status, headers, rest[:n]))
        data = rest[n:]
    return out


def exchange(port, data, timeout=10, pause=None):
    """Send ``data`` (then nothing more) on a new connection; the responses until it closes.

    ``pause`` (seconds) is a wait before reading, for tests that time things.
    """
    with connect(port, timeout) as sock:
        sock.sendall(data)
        if pause:
            time.sleep(pause)
        return parse_responses(read_until_closed(sock, timeout))


# -- the server process, from /proc ----------------------------------------------

def threads_of(pid):
    """How many threads the process has now."""
    return len(os.listdir("/proc/%d/task" % pid))


def rss_of(pid):
    """Resident memory of the process, in bytes."""
    with open("/proc/%d/status" % pid) as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS for pid %d" % pid)


def open_files_of(pid):
    """The regular files the process holds open (sockets, pipes and devices left out)."""
    out = set()
    d = "/proc/%d/fd" % pid
    for fd in os.listdir(d):
        try:
            target = os.readlink(os.path.join(d, fd))
        except OSError:
            continue
        if target.startswith("/") and not target.startswith("/dev/"):
            out.add(target)
    return out


def children(pid):
    """PIDs of the live (not zombie) child processes of ``pid``: a server's model workers."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name) as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(name))
    return out


def argv_of(pid):
    """The process's command line as a list ([] once it is gone)."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            return fh.read().decode("utf-8", "replace").split("\0")[:-1]
    except OSError:
        return []


def tree_rss(pid):
    """Resident bytes of the process and all its descendants (its workers)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += rss_of(p)
        except (OSError, AssertionError):    # gone, or a zombie without VmRSS
            continue
        todo += children(p)
    return total


def wait_threads(pid, at_most, timeout=15):
    """Wait until the process has at most ``at_most`` threads; returns the count."""
    deadline = time.monotonic() + timeout
    n = threads_of(pid)
    while n > at_most and time.monotonic() < deadline:
        time.sleep(0.1)
        n = threads_of(pid)
    return n
