"""The route table: path -> the function that answers it, and the error shape of its dialect.

Each function gets the Handler and the parsed JSON body (None for GET).
The HTTP layer (``httpd/``) is handed this table (``APP``) and knows no
route itself.
"""

from collections import namedtuple

from ..httpd.httperrors import Unavailable
from .errormap import respond
from . import anthropic, embeddings, ollama, ollama_admin, openai_chat, responses, router_models
from . import lora, slot_actions, status, transcriptions, webui
from .status import health, metrics, models, props, slots
from .native import completion, detokenize, infill, tokenize
from .openai_completions import v1_completions

# dialect: the shape of the route's error bodies (errormap.error_body) and stream
# error events (errormap.error_event)
# body_optional: a POST that may come without a body (the handler gets None)
# body_array: a JSON array is a body too (POST /lora-adapters), not only an object
Route = namedtuple("Route", "handler methods auth needs_service dialect body_optional "
                   "body_array body_form", defaults=("openai", False, False, False))


# -- the table ------------------------------------------------------------------------

_GET, _POST = ("GET",), ("POST",)

ROUTES = {
    "/health": Route(health, _GET, False, False),
    "/v1/health": Route(health, _GET, False, False),
    "/props": Route(props, ("GET", "POST"), True, True, body_optional=True),
    "/models": Route(models, _GET, True, True),
    "/v1/models": Route(models, _GET, True, True),
    "/models/load": Route(router_models.load, _POST, True, True),
    "/models/unload": Route(router_models.unload, _POST, True, True),
    "/slots": Route(slots, _GET, True, True),
    # LoRA adapters (api/lora.py): GET lists them, POST sets their global scales
    "/lora-adapters": Route(lora.adapters, ("GET", "POST"), True, True, body_array=True),
    "/metrics": Route(metrics, _GET, True, True),
    "/tokenize": Route(tokenize, _POST, True, True),
    "/detokenize": Route(detokenize, _POST, True, True),
    "/apply-template": Route(openai_chat.apply_template, _POST, True, True),
    "/completion": Route(completion, _POST, True, True),
    "/completions": Route(completion, _POST, True, True),
    "/infill": Route(infill, _POST, True, True),
    "/v1/completions": Route(v1_completions, _POST, True, True),
    "/v1/chat/completions": Route(openai_chat.chat_completions, _POST, True, True),
    "/chat/completions": Route(openai_chat.chat_completions, _POST, True, True),
    "/v1/chat/completions/control": Route(openai_chat.control, _POST, True, True),
    # embeddings and rerank (server/embeddings.py)
    "/v1/embeddings": Route(embeddings.v1_embeddings, _POST, True, True),
    "/embedding": Route(embeddings.embedding, _POST, True, True),
    "/embeddings": Route(embeddings.embedding, _POST, True, True),
    "/rerank": Route(embeddings.rerank, _POST, True, True),
    "/reranking": Route(embeddings.rerank, _POST, True, True),
    "/v1/rerank": Route(embeddings.rerank, _POST, True, True),
    "/v1/reranking": Route(embeddings.rerank, _POST, True, True),
    "/v1/chat/completions/input_tokens": Route(openai_chat.input_tokens, _POST, True, True),
    "/chat/completions/input_tokens": Route(openai_chat.input_tokens, _POST, True, True),
    # the chat page (api/webui.py) for browsers; "/" answers Ollama's clients' heartbeat
    "/": Route(webui.root, _GET, False, False),
    **{path: Route(webui.asset, _GET, False, False) for path in webui.FILES},
    # Ollama's API (api/ollama.py)
    "/api/version": Route(ollama_admin.version, _GET, False, False, "ollama"),
    "/api/tags": Route(ollama_admin.tags, _GET, True, True, "ollama"),
    "/api/ps": Route(ollama_admin.ps, _GET, True, True, "ollama"),
    "/api/show": Route(ollama_admin.show, _POST, True, True, "ollama"),
    "/api/generate": Route(ollama.generate, _POST, True, True, "ollama"),
    "/api/chat": Route(ollama.chat_, _POST, True, True, "ollama"),
    "/api/embed": Route(ollama.embed, _POST, True, True, "ollama"),
    "/api/embeddings": Route(ollama.embeddings_, _POST, True, True, "ollama"),
    "/api/pull": Route(ollama_admin.pull, _POST, True, True, "ollama"),
    "/api/push": Route(ollama.manage, _POST, True, False, "ollama"),
    "/api/create": Route(ollama.manage, _POST, True, False, "ollama"),
    "/api/copy": Route(ollama.manage, _POST, True, False, "ollama"),
    "/api/delete": Route(ollama.manage, ("DELETE",), True, False, "ollama"),
    "/v1/messages": Route(anthropic.messages, _POST, True, True, "anthropic"),
    "/v1/messages/count_tokens": Route(anthropic.count_tokens, _POST, True, True, "anthropic"),
    "/v1/audio/transcriptions": Route(transcriptions.transcriptions, _POST, True, True,
                                      body_form=True),
    "/audio/transcriptions": Route(transcriptions.transcriptions, _POST, True, True,
                                   body_form=True),
    "/v1/responses": Route(responses.responses, _POST, True, True, "responses"),
    "/responses": Route(responses.responses, _POST, True, True, "responses"),
    "/v1/responses/input_tokens": Route(responses.input_tokens, _POST, True, True),
    "/responses/input_tokens": Route(responses.input_tokens, _POST, True, True),
}


# Routes whose path ends in a value (the handler reads it from h.path), tried
# after ROUTES' exact paths: (prefix, route).
PREFIX_ROUTES = ((status.MODEL_PREFIX, Route(status.model_retrieve, _GET, True, True)),
                 (slot_actions.PREFIX, Route(slot_actions.slot_action, _POST, True, True,
                                             body_optional=True)))


def route_of(path):
    """The route of a path (no query string): an exact one, else a prefix's, else None."""
    route = ROUTES.get(path)
    if route is None:
        for prefix, r in PREFIX_ROUTES:
            if path.startswith(prefix) and len(path) > len(prefix):
                return r
    return route


def dialect_of(path):
    """The error shape for a path: its route's dialect; Ollama's for any other /api/ path."""
    route = route_of(path)
    if route is not None:
        return route.dialect
    return "ollama" if path.startswith("/api/") else "openai"


class App:
    """What the HTTP layer (``httpd/``) is handed: the table, the call into a route,
    and the one error exit."""

    @staticmethod
    def route(path):
        return route_of(path)

    @staticmethod
    def dispatch(h, route, body):
        """Run ``route`` for one request; the models it uses are held until it is answered
        (``Service.request_scope``)."""
        svc = h.service
        if not route.needs_service:
            route.handler(h, body)
            return
        if svc is None:
            raise Unavailable("Loading model")
        with svc.request_scope(body):
            route.handler(h, body)

    @staticmethod
    def error_response(exc, what, service=None):
        """(HTTPError, body, stream event) for ``exc`` on ``what`` ("METHOD /path")."""
        return respond(exc, what, dialect_of(what.split(" ", 1)[-1]), service)


APP = App()
