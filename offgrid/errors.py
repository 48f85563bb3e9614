"""The exceptions offgrid raises, as one small tree.

Errors from libllama are turned into these at the binding boundary
(``libllama.py``) or in the engine; the HTTP server maps them to status codes
in exactly one place (``server/errors.py``).  Nothing here imports ctypes, so
every layer may import this module.

    OffgridError
    ├── LibraryError            libllama missing, of the wrong version, lacking a symbol
    ├── ModelLoadError          a GGUF file that libllama refused
    ├── ContextError            a llama_context could not be created
    ├── DecodeError             llama_decode failed mid-request (a bug or out of memory)
    ├── WorkerDied              a model's worker process ended while serving the request
    ├── RpcUnavailable          an rpc-server holding the model's layers cannot be reached (503)
    └── InvalidRequest          the caller asked for something impossible (4xx)
        ├── ContextFull         the prompt (plus generation) cannot fit the context
        ├── InvalidToken        a token id outside the vocabulary
        └── NotSupported        the model lacks what the request needs (FIM tokens)
            └── EncoderOnly     text generation asked of an encoder (embeddings only)
"""


class OffgridError(Exception):
    """Base of every error offgrid raises on purpose."""


class LibraryError(OffgridError):
    """libllama could not be found, is of another version, or lacks a symbol."""


class ModelLoadError(OffgridError):
    """libllama could not load a model file."""


class ContextError(OffgridError):
    """libllama could not create a context (usually: not enough memory)."""


class DecodeError(OffgridError):
    """llama_decode returned a fatal status; ``status`` is its return value."""

    def __init__(self, message, status=None):
        super().__init__(message)
        self.status = status


class WorkerDied(OffgridError):
    """A model's worker process ended (a signal, an abort, out of memory) mid-request.

    ``how`` says how, in words ("SIGABRT", "killed: out of memory ...").
    """

    def __init__(self, message, how=None):
        super().__init__(message)
        self.how = how


class RpcUnavailable(OffgridError):
    """An rpc-server endpoint (``--rpc``) that holds some of the model's layers is down:
    refused at load, or gone mid-request.  The message names the endpoint; the
    worker is reloaded once it answers again.
    """


class InvalidRequest(OffgridError):
    """The request cannot be served as asked; the client should change it."""


class ContextFull(InvalidRequest):
    """The prompt, with room to generate, does not fit the session's context."""


class PromptTooLong(InvalidRequest):
    """The prompt alone fills the context: llama-server's exceed_context_size_error.

    Raised by a worker that prepared the prompt itself (the front checks
    prompts it was given as tokens); ``fields`` travel with it.
    """

    def __init__(self, message="", n_prompt_tokens=0, n_ctx=0):
        super().__init__(message or "the prompt has %d tokens and the context holds %d"
                         % (n_prompt_tokens, n_ctx))
        self.n_prompt_tokens, self.n_ctx = n_prompt_tokens, n_ctx

    def fields(self):
        return {"n_prompt_tokens": self.n_prompt_tokens, "n_ctx": self.n_ctx}


class InvalidToken(InvalidRequest):
    """A token id outside ``[0, n_vocab)`` was given."""


class NotSupported(InvalidRequest):
    """The model cannot do what was asked (e.g. fill-in-the-middle without FIM tokens)."""


class EncoderOnly(NotSupported):
    """Text generation asked of an encoder (BERT and its kin): it has no memory
    to generate from, and libllama computes no logits for it."""

    @classmethod
    def of(cls, arch):
        return cls("this model is an encoder (%s): it makes embeddings (/v1/embeddings, "
                   "/embedding, /api/embed) and generates no text" % arch)
