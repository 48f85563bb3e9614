"""The one place where exceptions become HTTP errors, and errors become bodies.

Handlers raise ``HTTPError`` (``httpd/httperrors.py``) or let engine errors
(``offgrid.errors``) through; the HTTP layer hands every exception, and its
own refusals (a bad request line, a full server), to ``respond``, which maps
it with ``to_http_error`` and writes its body in the shape of the path's
dialect (``error_body``): OpenAI's
``{"error": {"code": 400, "message": "...", "type": "invalid_request_error"}}``
by default (and on the Responses routes), Ollama's ``{"error": "..."}`` on
/api/*, Anthropic's ``{"type": "error", "error": {"type": ..., "message": ...}}``
on /v1/messages.
"""

import logging
import traceback

from ... import errors
from ..httpd.httperrors import (BadRequest, ContextExceeded, HTTPError, NotImplementedByModel,
                                Unavailable)

log = logging.getLogger("offgrid.http")


def to_http_error(exc):
    """Map any exception to the HTTPError the client should see."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, errors.NotSupported):
        return NotImplementedByModel(str(exc))
    if isinstance(exc, errors.PromptTooLong):
        return ContextExceeded(exc.n_prompt_tokens, exc.n_ctx)
    if isinstance(exc, errors.ContextFull):
        return BadRequest(str(exc), type="exceed_context_size_error")
    if isinstance(exc, errors.InvalidRequest):
        return BadRequest(str(exc))
    if isinstance(exc, errors.RpcUnavailable):
        return Unavailable(str(exc))
    if isinstance(exc, errors.DecodeError):
        return HTTPError("inference failed: %s; the session was reset" % exc)
    if isinstance(exc, errors.OffgridError):
        return HTTPError(str(exc))
    return HTTPError("internal error: %s: %s" % (type(exc).__name__, exc))


# -- dialects ---------------------------------------------------------------------------

# Anthropic's error types, by status (its API reference's "Errors" table).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error"}


def _anthropic_body(err):
    kind = _ANTHROPIC_TYPES.get(err.status)
    if kind is None:
        kind = "invalid_request_error" if err.status < 500 else "api_error"
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def error_body(err, dialect="openai"):
    """The JSON body of an HTTPError in ``dialect``'s shape (see the module docstring)."""
    if dialect == "ollama":
        return {"error": err.message}
    if dialect == "anthropic":
        return _anthropic_body(err)
    return err.body()


def error_event(dialect="openai"):
    """The SSE event name of an error inside a stream already under way, or None.

    Anthropic's clients read only named events, and raise on one named "error";
    Responses' streams name every event (a response that fails mid-stream ends
    with its own response.failed, ``ResponsesFormat.fail``; this is for the
    rest).  OpenAI's chat and completions streams name none: their SDK raises
    on a message with an "error" member.
    """
    return "error" if dialect in ("anthropic", "responses") else None


def log_internal(exc, what):
    """A bug met by one request: one line naming where (the whole traceback with -v).

    One line, because a request can make the traceback huge (a RecursionError's
    thousand frames were 217 KB of log for a 1.2 KB request), and many
    requests can make many of them.
    """
    if log.isEnabledFor(logging.INFO):      # -v
        log.error("internal error on %s", what, exc_info=exc)
        return
    where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    at = " at %s:%d in %s" % (where[0].filename, where[0].lineno, where[0].name) if where else ""
    log.error("internal error on %s: %s: %.200s%s (run with -v for the traceback)",
              what, type(exc).__name__, exc, at)


def respond(exc, what, dialect, service=None):
    """The one error exit: (HTTPError, body, stream event name) for ``exc`` in ``dialect``.

    ``what`` ("METHOD /path") names the request in the log: an exception that
    is not ours is logged (``log_internal``); a 5xx counts in /metrics.
    """
    err = to_http_error(exc)
    if err.status >= 500 and not isinstance(exc, (HTTPError, errors.OffgridError)):
        log_internal(exc, what)
    if service is not None and err.status >= 500:
        service.metrics.error()
    return err, error_body(err, dialect), error_event(dialect)
