"""Embeddings and reranking, in OpenAI's and llama.cpp's shapes.

    POST /v1/embeddings               OpenAI's: ``input`` a string, a list of strings, a
                                      token-id list or a list of them; ``encoding_format``
                                      float or base64; ``dimensions`` only if it is the model's
    POST /embedding, /embeddings      llama.cpp's: ``content`` (or ``input``), an array of
                                      {index, embedding: [vector]} (a vector per token with
                                      --pooling none)
    POST /rerank, /reranking, /v1/rerank, /v1/reranking
                                      ``query`` and ``documents`` (Jina's shape) or ``texts``
                                      (TEI's), with a model that pools ``rank``

Ollama's /api/embed and /api/embeddings are in ``ollama.py``, over the same
worker call.  The work happens in the model's worker (``engine/embed.py``)
in a context of its own, so no chat session's cache is touched; it does not
queue for a session.  A worker call runs to its end, so a request goes as
calls of about CALL_SIZE characters each: a client that hangs up (the
disconnect watcher) or a shutdown stops it between two.  Inputs are read here, as llama-server reads them
(``tokenize_input_prompts``): a list that holds no number is several inputs,
anything else is one; an input is a string, token ids, a mix of both,
``{"prompt_string": ...}`` or ``{"content": [text parts]}``.  The worker checks
token ids, empty inputs and lengths.
"""

import math

from ... import protocol
from ...request import RequestCancel
from ..httpd.httperrors import BadRequest, HTTPError, Unavailable
from . import lora
from .fields import Fields

# Inputs one request may carry: OpenAI's own limit.
MAX_INPUTS = 2048

# Characters (and token ids) of input per worker call: a few hundred tokens,
# a batch or three, seconds at most on 2 cores.
CALL_SIZE = 1024


# -- the shared pieces (ollama.py uses them too) -------------------------------------

def check_served(svc, entry, rerank=False):
    """llama-server's 501s: embeddings switched off, or a pooling that cannot answer."""
    if "embeddings" in svc.endpoints_off:
        raise HTTPError("This server does not support embeddings. Start it with `--embeddings`",
                        status=501, type="not_supported_error")
    pooling = entry.info.pooling
    if rerank and pooling != "rank":
        raise HTTPError("This server does not support reranking. Start it with `--reranking` "
                        "and a reranker model (%s pools %s; its GGUF has no rank head)"
                        % (entry.id, pooling), status=501, type="not_supported_error")
    if not rerank and pooling == "rank":
        raise HTTPError("This server pools for reranking (--reranking): it serves /rerank, "
                        "not embeddings", status=501, type="not_supported_error")
    if svc.state != "ready":
        raise Unavailable("server is shutting down")


def embed(h, entry, inputs, what, normalize=2, truncate=False):
    """Run the worker's embed calls: (vectors, token counts, the vectors as the
    worker sent them); a vector is an array('f'), or with pooling none a list
    of them.  Stops between calls if the client hangs up or the server shuts
    down."""
    svc = h.service
    cancel = RequestCancel()
    sock = h.connection
    svc.watcher.watch(sock, cancel)
    vectors, counts, sent = [], [], []
    try:
        for group in _calls(inputs):
            if cancel.cancelled:
                raise HTTPError("the client closed the connection", status=499,
                                type="invalid_request_error")
            if svc.state != "ready":
                raise Unavailable("server is shutting down")
            out = entry.call("embed", what, inputs=group, normalize=normalize,
                             truncate=truncate, first=len(counts), **global_lora(entry))
            sent += out["vectors"]
            counts += out["n_tokens"]
            count_work(svc, out)
    finally:
        svc.watcher.unwatch(sock, cancel)
    if entry.info.pooling == "none":
        vectors = [[protocol.decode_vector(r) for r in rows] for rows in sent]
    else:
        vectors = [protocol.decode_vector(v) for v in sent]
    return vectors, counts, sent


def global_lora(entry):
    """The LoRA scales an embedding or rerank call runs with: the global ones
    (llama-server's embedding task takes no "lora" of its own, and its slot runs
    with the server's adapters); nothing where the model has none."""
    return {"lora": lora.resolve(entry, None)} if entry.lora else {}


def count_work(svc, out):
    """/metrics' prompt counters for an embed or rerank call's answer (``n_tokens``,
    ``n_decode``, ``decode_ms``): llama-server counts these tokens as processed prompt."""
    n = out["n_tokens"]
    svc.metrics.prompt_work(sum(n), out.get("decode_ms", 0.0) / 1000.0, out.get("n_decode", 0),
                            max(n, default=0))


def _calls(inputs):
    """The inputs in groups of about CALL_SIZE characters and token ids (a longer
    input alone), in order."""
    group, size = [], 0
    for parts in inputs:
        n = sum(len(p) for p in parts)
        if group and size + n > CALL_SIZE:
            yield group
            group, size = [], 0
        group.append(parts)
        size += n
    if group:
        yield group


def input_from(p, where):
    """One input as parts (strings and token-id lists), as the worker tokenizes them."""
    if isinstance(p, dict):
        if "content" in p:
            return [_content_text(p["content"], where)]
        if p.get("multimodal_data"):
            raise BadRequest("%s has multimodal_data, but this server has no multimodal model"
                             % where)
        p = p.get("prompt_string")
        if not isinstance(p, str):
            raise BadRequest("%s as an object needs a string 'prompt_string' or a 'content' "
                             "array of text parts" % where)
    if isinstance(p, str):
        return [p]
    if isinstance(p, list):
        parts = []
        for x in p:
            if isinstance(x, str):
                parts.append(x)
            elif isinstance(x, int) and not isinstance(x, bool):
                if parts and isinstance(parts[-1], list):
                    parts[-1].append(x)
                else:
                    parts.append([x])
            else:
                raise BadRequest("%s must be a string, token ids, or a list of both" % where)
        return parts
    raise BadRequest("%s must be a string, a list of token ids, or an object with "
                     "'prompt_string' or 'content'" % where)


def _content_text(content, where):
    """OpenAI's content parts, text only: their texts joined (llama-server's
    tokenize_oai_content_array)."""
    if not isinstance(content, list):
        raise BadRequest("%s.content must be an array of content parts" % where)
    text = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            if kind in ("image_url", "input_audio", "input_video", "file"):
                raise BadRequest("%s.content[%d] is %s, but this server has no multimodal "
                                 "model" % (where, i, kind))
            raise BadRequest("%s.content[%d] must be {\"type\": \"text\", \"text\": ...}"
                             % (where, i))
        text.append(part["text"])
    return "".join(text)


def inputs_from(v, where="input"):
    """Every input of a request (llama-server's rule: a list with no number in it
    is several inputs; anything else is one)."""
    if isinstance(v, list) and not any(isinstance(x, int) and not isinstance(x, bool)
                                       for x in v):
        if not v:
            raise BadRequest("'%s' must not be empty" % where)
        if len(v) > MAX_INPUTS:
            raise BadRequest("'%s' has %d inputs; at most %d are allowed in one request"
                             % (where, len(v), MAX_INPUTS))
        return [input_from(p, "%s[%d]" % (where, i)) for i, p in enumerate(v)]
    return [input_from(v, "'%s'" % where)]


def normalize_from(f):
    """llama-server's ``embd_normalize``: -1 none, 0 int16 range, 2 unit length, p>0 p-norm."""
    return f.int("embd_normalize", 2, lo=-1, hi=1000)


def encoding_from(f):
    fmt = f.str("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise BadRequest("'encoding_format' must be \"float\" or \"base64\"")
    return fmt


def floats(vec):
    """A vector as JSON numbers (the float32 values, as Python floats)."""
    return vec.tolist()


# -- OpenAI and llama.cpp ------------------------------------------------------------

def v1_embeddings(h, body):
    """POST /v1/embeddings (OpenAI's shape; with ``content`` instead of ``input``,
    llama.cpp's, as llama-server answers it)."""
    f = Fields(body)
    if f.has("content") and not f.has("input"):
        return embedding(h, body)
    svc = h.service
    entry = svc.entry_for(f.raw("model"))
    check_served(svc, entry)
    if entry.info.pooling == "none":
        # llama-server's answer: OpenAI's shape has one vector per input
        raise BadRequest("Pooling type 'none' is not OAI compatible. Please use a different "
                         "pooling type (start the server with --pooling last, mean or cls; "
                         "/embedding gives a vector per token)")
    if "input" not in body:
        raise BadRequest("'input' is required (\"input\" or \"content\" must be provided)")
    inputs = inputs_from(body["input"])
    fmt = encoding_from(f)
    dims = f.int("dimensions", None, lo=1)
    n_out = entry.info.n_embd_out
    if dims is not None and dims != n_out:
        raise BadRequest("'dimensions' %d is not supported: %s's embeddings have %d dimensions "
                         "(leave it out, or send %d)" % (dims, entry.id, n_out, n_out))
    f.str("user")           # OpenAI's end-user id: read for its type, not kept
    svc.metrics.request("v1/embeddings")
    vectors, counts, encoded = embed(h, entry, inputs, "POST /v1/embeddings",
                                     normalize_from(f))
    data = []
    for i, vec in enumerate(vectors):
        item = {"object": "embedding", "index": i}
        item["embedding"] = encoded[i] if fmt == "base64" else floats(vec)
        data.append(item)
    n = sum(counts)
    h.send_json(200, {"object": "list", "data": data, "model": entry.id,
                      "usage": {"prompt_tokens": n, "total_tokens": n}})


def embedding(h, body):
    """POST /embedding, /embeddings: llama.cpp's shape, [{index, embedding: [vectors]}]."""
    f = Fields(body)
    svc = h.service
    entry = svc.entry_for(f.raw("model"))
    check_served(svc, entry)
    if "input" in body and body["input"] is not None:
        v = body["input"]
    elif "content" in body and body["content"] is not None:
        v = body["content"]
    else:
        raise BadRequest('"input" or "content" must be provided')
    inputs = inputs_from(v, "input" if "input" in body else "content")
    encoding_from(f)        # read for its type; llama-server's own shape is floats
    svc.metrics.request("embedding")
    vectors, _, _ = embed(h, entry, inputs, "POST " + h.path.split("?", 1)[0],
                          normalize_from(f))
    out = []
    for i, vec in enumerate(vectors):
        rows = vec if isinstance(vec, list) else [vec]
        out.append({"index": i, "embedding": [floats(r) for r in rows]})
    h.send_json(200, out)


# -- rerank --------------------------------------------------------------------------

def rerank(h, body):
    """POST /rerank (and /reranking, /v1/rerank, /v1/reranking): llama-server's answer,
    Jina's shape for ``documents``, TEI's for ``texts``."""
    f = Fields(body)
    svc = h.service
    entry = svc.entry_for(f.raw("model"))
    check_served(svc, entry, rerank=True)
    query = body.get("query")
    if query is None:
        raise BadRequest('"query" must be provided')
    if not isinstance(query, str):
        raise BadRequest('"query" must be a string')
    tei = "texts" in body
    docs = body.get("documents") if "documents" in body else body.get("texts")
    if not isinstance(docs, list) or not docs or not all(isinstance(d, str) for d in docs):
        raise BadRequest('"documents" must be a non-empty string array')
    if len(docs) > MAX_INPUTS:
        raise BadRequest('"documents" has %d entries; at most %d are allowed'
                         % (len(docs), MAX_INPUTS))
    top_n = f.int("top_n", len(docs), lo=0)
    return_text = tei and f.bool("return_text", False)
    svc.metrics.request("rerank")
    out = entry.call("rerank", "POST /rerank", query=query, documents=docs,
                     **global_lora(entry))
    count_work(svc, out)
    label = "score" if tei else "relevance_score"
    results = []
    for i, score in enumerate(out["scores"]):
        item = {"index": i, label: score if math.isfinite(score) else -1e6}
        if return_text:
            item["text"] = docs[i]
        results.append(item)
    results.sort(key=lambda r: -r[label])
    results = results[:top_n]
    if tei:
        h.send_json(200, results)
        return
    n = sum(out["n_tokens"])
    h.send_json(200, {"model": entry.id, "object": "list",
                      "usage": {"prompt_tokens": n, "total_tokens": n}, "results": results})
