"""HTTPS (--ssl-key-file, --ssl-cert-file): where a TLS connection differs from a plain one.

The listening socket stays plain, and so does a new connection while it
waits in the lobby: its first byte (the ClientHello) is seen there as a
request's would be, so a client that connects and sends nothing holds no
thread, as over HTTP.  The connection's own thread then wraps it and does
the handshake (``handshake``) within the read timeout, a deadline for the
whole handshake: a client that starts one and stalls holds only its own
thread, for that long, and can be dropped for a newcomer meanwhile (the
seats count it as waiting for its head).  Nothing else changes for the
handler: its rfile and wfile read and write through the SSLSocket.

Two things do not carry over from a plain socket, and each use is here:

* poll() sees the TCP bytes, not the TLS layer: a client's bytes may lie
  decrypted in the SSL object (``SSLSocket.pending()``) while poll() says
  nothing is there (a pipelined request, read in the same record as the one
  before it).  So a connection's next request is always waited for by
  reading it (the handler's rfile), never by poll() alone, and
  ``reader.unread_bytes`` asks ``pending()`` first.
* SSLSocket refuses ``recv(MSG_PEEK)``, and its ``shutdown()`` drops the TLS
  state: a look at the socket under it goes through ``raw_peek``, and a
  connection dropped from another thread (``seats``) through ``raw_shutdown``,
  which leaves the TLS layer to the thread that owns it.

``close_notify`` says goodbye as TLS asks before a connection closes
(llama-server's cpp-httplib does too), never waiting for the client's.
"""

import select
import socket
import ssl


def wrap(context, sock):
    """An accepted connection as the server side of a TLS connection, its handshake not
    begun (OSError where the socket is gone already)."""
    return context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)


def handshake(tls_sock, timeout):
    """Do ``wrap``'s handshake, within ``timeout`` seconds in all.  Raises OSError
    (ssl.SSLError, a timeout) where it fails: a client that speaks plain HTTP, stalls,
    or hangs up."""
    # the socket's timeout bounds the whole handshake, not each read (CPython's _ssl
    # turns it into a deadline): a ClientHello dripped a byte at a time cannot stretch it
    tls_sock.settimeout(timeout)
    tls_sock.do_handshake()


def is_tls(sock):
    return isinstance(sock, ssl.SSLSocket)


def raw_peek(sock, n=1):
    """Up to ``n`` bytes waiting on the TCP connection under ``sock``, left there, without
    waiting (BlockingIOError: none yet; b"": the client closed its side).  Under TLS
    they are TLS records, not request bytes: what they say is only whether bytes came."""
    # first: a socket with a timeout waits that long in recv() before the flags count
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    if not poller.poll(0):
        raise BlockingIOError("nothing to read yet")
    return socket.socket.recv(sock, n, socket.MSG_PEEK | socket.MSG_DONTWAIT)


def raw_shutdown(sock, how=socket.SHUT_RDWR):
    """Shut the TCP connection under ``sock`` down, from any thread: the thread reading
    it gets EOF, and under TLS its SSL object stays in place for it to end with."""
    socket.socket.shutdown(sock, how)


def close_notify(sock):
    """Send TLS's close_notify alert, if ``sock`` is a TLS connection still in one, without
    waiting for the client's; never raises."""
    if not is_tls(sock):
        return
    try:
        sock.settimeout(0)
        sock.unwrap()       # sends ours, then would wait for the client's: no waiting
    except (OSError, ValueError):
        pass                # SSLWantReadError after ours went out, or no TLS state left
