"""POST /slots/{id}?action=save|restore|erase: llama-server's slot API.

``save`` writes the session's cache (its tokens and keys and values) to a
file in ``--slot-save-path``, ``restore`` reads one back into a session (any
session of the model: a file saved from slot 1 restores into slot 0), and
``erase`` empties a session's cache.  The files are llama-server's own
format (engine/slotfile.py).  A file name is a plain name in that folder:
no path separator, no "..", as llama.cpp's fs_validate_filename allows.

The action waits for its session to be free (llama-server defers it the
same way) and holds it while the worker works, so no request runs on it
meanwhile.  Without ``--slot-save-path`` every action is refused with
llama-server's 501.  ``?model=NAME`` picks the model on a server of several.
"""

from urllib.parse import parse_qs, unquote

from ... import protocol
from ...protocol import valid_filename
from ...request import RequestCancel
from ..httpd.httperrors import BadRequest, HTTPError

PREFIX = "/slots/"
ACTIONS = ("save", "restore", "erase")


def slot_action(h, body):
    svc = h.service
    if not getattr(svc, "slot_save_path", None):
        raise HTTPError("This server does not support slots action. Start it with "
                        "`--slot-save-path`", status=501, type="not_supported_error")
    path, _, query = h.path.partition("?")
    try:
        id_slot = int(unquote(path[len(PREFIX):]), 10)
    except ValueError:
        raise BadRequest("Invalid slot ID")
    params = parse_qs(query)
    action = (params.get("action") or [""])[0]
    if action not in ACTIONS:
        raise BadRequest("Invalid action")
    filename = ""
    if action != "erase":
        filename = body.get("filename") if isinstance(body, dict) else None
        if not isinstance(filename, str):
            raise BadRequest("'filename' is required: a file name in --slot-save-path")
        if not valid_filename(filename):
            raise BadRequest("Invalid filename")
    entry = svc.entry_for((params.get("model") or [None])[0])
    pool = entry.pool
    if pool is None or not 0 <= id_slot < len(pool.sessions):
        raise BadRequest("Invalid slot ID")
    session = pool.sessions[id_slot]
    if not pool.hold(session, RequestCancel()):
        raise BadRequest("Invalid slot ID")
    try:
        out = entry.call("slot_action", "POST /slots",
                         action=protocol.encode_slot_action(
                             protocol.SlotAction(action, id_slot, filename)))
        cached = out.pop("cached", None)
        if action == "restore":
            session.cached = list(cached) if len(pool.sessions) > 1 else []
            session.n_cached = len(cached)
        elif action == "erase":
            session.cached, session.n_cached = [], 0
    except BaseException:
        if action != "save":
            # a failed restore leaves the session empty (the worker resets it)
            session.cached, session.n_cached = [], 0
        raise
    finally:
        pool.release(session)
    h.send_json(200, out)
