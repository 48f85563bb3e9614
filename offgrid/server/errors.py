"""HTTP errors, and the one place where engine errors become HTTP statuses.

Handlers raise HTTPError (or one of its subclasses) instead of writing error
responses by hand; engine code raises offgrid.errors exceptions.  Both end in
``to_http_error`` and are sent by ``Handler._send_exception`` in the shape of
the route's dialect (``error_body``): OpenAI's
``{"error": {"code": 400, "message": "...", "type": "invalid_request_error"}}``
by default, Ollama's ``{"error": "..."}``, Anthropic's
``{"type": "error", "error": {"type": ..., "message": ...}}``.
"""

from .. import errors


class HTTPError(Exception):
    """An error response: status, message, and OpenAI's error ``type``."""
    status = 500
    type = "server_error"

    def __init__(self, message, status=None, type=None, headers=None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        self.headers = headers or {}

    def body(self):
        return {"error": {"code": self.status, "message": self.message, "type": self.type}}


class BadRequest(HTTPError):
    status, type = 400, "invalid_request_error"


class Unauthorized(HTTPError):
    status, type = 401, "authentication_error"


class NotFound(HTTPError):
    status, type = 404, "not_found_error"


class MethodNotAllowed(HTTPError):
    status, type = 405, "invalid_request_error"


class RequestTimeout(HTTPError):
    status, type = 408, "invalid_request_error"


class LengthRequired(HTTPError):
    status, type = 411, "invalid_request_error"


class PayloadTooLarge(HTTPError):
    status, type = 413, "invalid_request_error"


class HeadersTooLarge(HTTPError):
    status, type = 431, "invalid_request_error"


class NotImplementedByModel(HTTPError):
    status, type = 501, "not_supported_error"


class Unavailable(HTTPError):
    status, type = 503, "unavailable_error"


class ContextExceeded(BadRequest):
    """llama-server's exceed_context_size_error, with the two sizes its body reports."""
    type = "exceed_context_size_error"

    def __init__(self, n_prompt_tokens, n_ctx):
        super().__init__("the request exceeds the available context size: the prompt has "
                         "%d tokens and the context holds %d" % (n_prompt_tokens, n_ctx))
        self.n_prompt_tokens, self.n_ctx = n_prompt_tokens, n_ctx

    def body(self):
        out = super().body()
        out["error"].update(n_prompt_tokens=self.n_prompt_tokens, n_ctx=self.n_ctx)
        return out


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


# The error shapes of the dialects, by the name a Route carries.
DIALECTS = ("openai", "ollama", "anthropic")


def error_body(err, dialect="openai"):
    """The JSON body of an HTTPError in ``dialect``'s shape (see the module docstring)."""
    if dialect == "ollama":
        return {"error": err.message}
    if dialect == "anthropic":
        return _anthropic_body(err)
    return err.body()


def error_event(dialect="openai"):
    """The SSE event name of an error inside a stream already under way, or None.

    Anthropic's clients read only named events, and raise on one named "error".
    """
    return "error" if dialect == "anthropic" else None
