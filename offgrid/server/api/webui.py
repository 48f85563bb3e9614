"""The chat page: ``offgrid/webui/`` (index.html, app.js, app.css) over HTTP.

The page is three hand-written files in the package (no build step), read
from disk on each request: they are small, the OS caches them, and an edit
shows on the next reload.  Every answer carries a Content-Security-Policy
that lets the page load and connect to this server only and run no inline
script, so "works offline" and "model text cannot run as script" are
enforced by the browser, not only by the page's care (it never assigns
``innerHTML``).

``GET /`` stays what Ollama's clients ping: their heartbeat (``HEAD /``) reads
the status only, and a client that reads the body gets the old text; only a
request that accepts ``text/html`` (a browser's navigation) gets the page.
``--no-webui`` (``Handler.webui = False``) leaves ``/`` as the text and the
page's own paths as 404s.
"""

import hashlib
import os

from ..httpd.httperrors import NotFound

# offgrid/webui/, from offgrid/server/api/
_HERE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                      "webui"))

# path -> (file in offgrid/webui/, Content-Type)
FILES = {
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/app.css": ("app.css", "text/css; charset=utf-8"),
    "/favicon.svg": (None, "image/svg+xml"),
}

# the tab's icon (a browser asks for one; a 404 would be an error in its console)
ICON = ('<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16">'
        '<rect width="16" height="16" rx="3" fill="#2f6f4f"/>'
        '<path d="M4 5h8M4 8h6M4 11h4" stroke="#fff" stroke-width="1.6"/></svg>\n')

# The browser's own guard: nothing from another origin (fonts, scripts, images,
# connections), no inline script or style, no framing of the page elsewhere;
# images also from data: URIs (the pictures a person attaches, kept in the page).
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # revalidated every time (the ETag makes that a 304), so an upgrade never
    # runs a stale app.js against a newer server
    "Cache-Control": "no-cache",
}

ROOT_TEXT = "offgrid is running\n"


def enabled(h):
    return getattr(h, "webui", True)


def wants_html(accept):
    """Whether an Accept header asks for a page (browsers' navigations do)."""
    return "text/html" in (accept or "").lower()


def root(h, _body):
    """GET /: the chat page for a browser, else the liveness text Ollama's clients expect."""
    if enabled(h) and wants_html(h.headers.get("Accept")):
        _send_file(h, "/index.html", vary="Accept")
    else:
        headers = {"Vary": "Accept"} if enabled(h) else None
        h.send_text(200, ROOT_TEXT, "text/plain; charset=utf-8", headers=headers)


def asset(h, _body):
    """GET /index.html, /app.js, /app.css, /favicon.svg."""
    path = h.path.split("?", 1)[0]
    if not enabled(h):
        raise NotFound("File Not Found: %s (the chat page is off: --no-webui)" % path)
    _send_file(h, path)


def _send_file(h, path, vary=None):
    name, ctype = FILES[path]
    if name is None:
        data = ICON.encode("utf-8")
    else:
        try:
            with open(os.path.join(_HERE, name), "rb") as fh:
                data = fh.read()
        except OSError:
            raise NotFound("File Not Found: %s (offgrid/webui/%s is missing from this "
                           "install)" % (path, name))
    etag = '"%s"' % hashlib.sha256(data).hexdigest()[:20]
    headers = dict(_HEADERS, ETag=etag)
    if vary:
        headers["Vary"] = vary
    if etag in (h.headers.get("If-None-Match") or ""):
        h.send_response(304)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_cors_headers()
        h.end_headers()
        return
    h.send_text(200, data.decode("utf-8"), ctype, headers)


__all__ = ["CSP", "FILES", "asset", "root"]
