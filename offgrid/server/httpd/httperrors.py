"""The HTTP errors: an exception per status, raised instead of writing a response.

Handlers, the request reader and the serving layer raise these; engine code
raises ``offgrid.errors``.  Both reach ``api/errormap.py``, the one place that
turns an exception into a status and a body in the route's dialect.
"""


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


class NotImplementedByModel(HTTPError):
    status, type = 501, "not_supported_error"


class Unavailable(HTTPError):
    status, type = 503, "unavailable_error"


class QueueFull(Unavailable):
    """A model's queue is at --max-queue: come back in ``retry_after`` seconds, or
    elsewhere (a load balancer's redispatch takes the 503 to another replica)."""

    def __init__(self, message, retry_after=1):
        super().__init__(message, headers={"Retry-After": str(retry_after)})


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
