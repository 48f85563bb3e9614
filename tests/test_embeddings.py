"""Embeddings and rerank, end to end: the real client libraries against a real server.

One server on SmolLM2-135M (a chat model: the default pooling, ``mean``;
the smallest model, and embedding computes logits for every token) answers
the OpenAI SDK's ``embeddings.create``, the ``ollama`` package's ``embed``,
LangChain's ``OllamaEmbeddings`` and llama.cpp's ``/embedding``; two more
show ``--pooling none`` (a vector per token) and ``--reranking`` (scores;
SmolLM2 has no rank head, so what is checked is the shape, not the
ranking).  The engine's own tests load SmolLM2 in-process: a long input
decoded in chunks equals the same input in one batch.  (docs/dialects.md's
example runs on Qwen2.5-Coder, in test_docs.py.)
"""

import base64
import json
import math
import os
import socket
import struct
import time

import ollama
import pytest
from langchain_ollama import OllamaEmbeddings
from openai import OpenAI

from offgrid.engine.embed import Embedder

try:
    from . import rawhttp
    from .serverproc import ServerProcess
except ImportError:
    import rawhttp
    from serverproc import ServerProcess

CAT = "The cat sat on the mat."
CAT2 = "A cat was sitting on the rug."
STOCKS = "Stock markets fell sharply after the central bank raised interest rates."
CTX = 512
DIMS = 576      # SmolLM2-135M's hidden size
N_VOCAB = 49152
TOL = 1e-4      # one input alone vs in a batch: the same math, other matmul blocking


def cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def norm(v):
    return math.sqrt(sum(x * x for x in v))


def close(a, b, tol=TOL):
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


@pytest.fixture(scope="module")
def srv(smollm_path):
    with ServerProcess(smollm_path, threads=1, ctx=CTX) as s:
        yield s


@pytest.fixture(scope="module")
def oai(srv):
    return OpenAI(base_url=srv.base + "/v1", api_key="none")


def vectors(srv, inputs, **fields):
    status, _, body = srv.post("/v1/embeddings", dict(fields, input=inputs))
    assert status == 200, body
    return [d["embedding"] for d in body["data"]]


# -- OpenAI ------------------------------------------------------------------------

def test_openai_paraphrases_are_closer_than_unrelated_sentences(oai):
    res = oai.embeddings.create(model="text-embedding-3-small", input=[CAT, CAT2, STOCKS])
    a, b, c = (d.embedding for d in res.data)
    assert [d.index for d in res.data] == [0, 1, 2]
    assert cosine(a, b) > cosine(a, c) + 0.05, (cosine(a, b), cosine(a, c))
    assert cosine(a, b) > cosine(b, c) + 0.05, (cosine(a, b), cosine(b, c))


def test_openai_vectors_are_unit_length_with_the_models_dimensions(oai, srv):
    res = oai.embeddings.create(model="any", input=CAT, encoding_format="float")
    (d,) = res.data
    assert len(d.embedding) == DIMS
    assert abs(norm(d.embedding) - 1) < 1e-5
    assert res.usage.prompt_tokens == res.usage.total_tokens > 0


def test_base64_is_the_float_vector_as_little_endian_float32(srv):
    (floats,) = vectors(srv, CAT)
    (b64,) = vectors(srv, CAT, encoding_format="base64")
    raw = base64.b64decode(b64)
    assert list(struct.unpack("<%df" % (len(raw) // 4), raw)) == floats


def test_the_sdks_default_base64_decodes_to_the_float_vector(oai, srv):
    # the SDK asks for base64 unless told otherwise, and decodes it itself
    sdk = oai.embeddings.create(model="any", input=CAT).data[0].embedding
    (floats,) = vectors(srv, CAT)
    assert close(sdk, floats, 1e-7)


def test_a_batch_equals_each_input_alone(srv):
    texts = [CAT, CAT2, STOCKS, "def add(a, b):\n    return a + b", "x"]
    together = vectors(srv, texts)
    for text, vec in zip(texts, together):
        (alone,) = vectors(srv, text)
        assert close(vec, alone), text


def test_token_ids_embed_as_their_text(srv):
    _, _, tok = srv.post("/tokenize", {"content": CAT2, "add_special": True})
    (by_text,) = vectors(srv, CAT2)
    (by_ids,) = vectors(srv, tok["tokens"])
    assert close(by_text, by_ids, 1e-6)
    # a list of token-id lists is several inputs
    two = vectors(srv, [tok["tokens"], tok["tokens"][:3]])
    assert len(two) == 2 and close(two[0], by_text)


def test_usage_counts_every_inputs_tokens(srv):
    counts = [len(srv.post("/tokenize", {"content": t, "add_special": True})[2]["tokens"])
              for t in (CAT, STOCKS)]
    _, _, body = srv.post("/v1/embeddings", {"input": [CAT, STOCKS]})
    assert body["usage"] == {"prompt_tokens": sum(counts), "total_tokens": sum(counts)}
    assert body["object"] == "list" and body["model"]


def test_embedding_tokens_count_as_prompt_work_in_metrics(srv):
    # llama-server: an embedding task never samples, but its prompt costs decodes
    before = srv.metrics()
    _, _, body = srv.post("/v1/embeddings", {"input": [CAT, STOCKS]})
    srv.post("/embedding", {"content": CAT})
    after = srv.metrics()
    n = body["usage"]["prompt_tokens"] + len(
        srv.post("/tokenize", {"content": CAT, "add_special": True})[2]["tokens"])
    grew = {k: after[k] - before[k] for k in ("llamacpp:prompt_tokens_total",
                                              "llamacpp:n_decode_total",
                                              "llamacpp:tokens_predicted_total",
                                              "llamacpp:prompt_seconds_total")}
    assert grew["llamacpp:prompt_tokens_total"] == n
    assert grew["llamacpp:n_decode_total"] >= 2 and grew["llamacpp:prompt_seconds_total"] > 0
    assert grew["llamacpp:tokens_predicted_total"] == 0
    assert after["llamacpp:n_tokens_max"] >= max(before["llamacpp:n_tokens_max"], 5)


def test_dimensions_equal_to_the_models_is_accepted_and_others_refused(srv):
    status, _, _ = srv.post("/v1/embeddings", {"input": CAT, "dimensions": DIMS})
    assert status == 200
    status, _, body = srv.post("/v1/embeddings", {"input": CAT, "dimensions": 256})
    assert status == 400 and str(DIMS) in body["error"]["message"]


def test_embd_normalize_minus_one_gives_the_raw_pooled_state(srv):
    (unit,) = vectors(srv, CAT)
    (raw,) = vectors(srv, CAT, embd_normalize=-1)
    assert norm(raw) > 2
    assert close([x / norm(raw) for x in raw], unit, 1e-5)


def test_a_long_input_is_decoded_in_chunks_and_still_embeds(srv):
    # longer than one embedding batch (336 tokens for SmolLM2's vocabulary)
    long_text = "The quick brown fox jumps over the lazy dog. " * 40
    status, _, body = srv.post("/v1/embeddings", {"input": long_text})
    assert status == 200 and body["usage"]["prompt_tokens"] > 300
    assert abs(norm(body["data"][0]["embedding"]) - 1) < 1e-5


# -- llama.cpp's shape --------------------------------------------------------------

def test_llama_cpp_embedding_shape(srv):
    status, _, body = srv.post("/embedding", {"content": CAT})
    assert status == 200
    (item,) = body
    assert item["index"] == 0 and len(item["embedding"]) == 1      # one pooled vector
    (oai_vec,) = vectors(srv, CAT)
    assert close(item["embedding"][0], oai_vec, 1e-7)


def test_llama_cpp_embeddings_takes_several_and_mixed_inputs(srv):
    _, _, tok = srv.post("/tokenize", {"content": " sat on the mat."})
    status, _, body = srv.post("/embeddings", {"input": [CAT, ["The cat"] + tok["tokens"]]})
    assert status == 200 and [x["index"] for x in body] == [0, 1]
    # text parts and token ids in one input, the same tokens as the text
    assert close(body[0]["embedding"][0], body[1]["embedding"][0], 1e-5)
    status, _, body = srv.post("/embeddings", {"input": {"content": [
        {"type": "text", "text": "The cat sat "}, {"type": "text", "text": "on the mat."}]}})
    assert status == 200 and close(body[0]["embedding"][0], vectors(srv, CAT)[0], 1e-6)


# -- Ollama ---------------------------------------------------------------------------

def test_ollama_embed_gives_unit_vectors_equal_to_openais(srv):
    res = ollama.Client(host=srv.base).embed(model="smollm2", input=[CAT, STOCKS])
    assert len(res.embeddings) == 2 and res.prompt_eval_count > 0
    assert res.total_duration > 0
    cat, stocks = vectors(srv, [CAT, STOCKS])
    assert close(res.embeddings[0], cat) and close(res.embeddings[1], stocks)


def test_ollama_legacy_embeddings_are_the_unnormalized_state(srv):
    res = ollama.Client(host=srv.base).embeddings(model="smollm2", prompt=CAT)
    (unit,) = vectors(srv, CAT)
    assert norm(res.embedding) > 2
    assert close([x / norm(res.embedding) for x in res.embedding], unit, 1e-5)


def test_ollama_embed_truncates_unless_told_not_to(srv):
    long_text = "word " * 800                           # past the 512-token context
    status, _, body = srv.post("/api/embed", {"model": "m", "input": long_text})
    assert status == 200 and body["prompt_eval_count"] == CTX
    status, _, body = srv.post("/api/embed", {"model": "m", "input": long_text,
                                              "truncate": False})
    assert status == 400 and "too large" in body["error"]


def test_ollama_embed_of_nothing_answers_empty(srv):
    status, _, body = srv.post("/api/embed", {"model": "m"})
    assert status == 200 and body["embeddings"] == []


def test_ollama_dimensions_keep_the_leading_components_at_unit_length(srv):
    _, _, body = srv.post("/api/embed", {"model": "m", "input": CAT, "dimensions": 64})
    (vec,) = body["embeddings"]
    (full,) = vectors(srv, CAT)
    assert len(vec) == 64 and abs(norm(vec) - 1) < 1e-5
    assert close(vec, [x / norm(full[:64]) for x in full[:64]], 1e-5)


def test_langchain_ollama_embeddings(srv):
    emb = OllamaEmbeddings(model="smollm2", base_url=srv.base)
    docs = emb.embed_documents([CAT, STOCKS])
    query = emb.embed_query(CAT2)
    assert len(docs) == 2 and len(query) == DIMS
    assert cosine(query, docs[0]) > cosine(query, docs[1])


# -- the chat sessions are left alone -------------------------------------------------

def test_an_embedding_request_leaves_the_chat_cache_as_it_was(srv):
    prompt = {"prompt": "Once upon a time, in a land far away, there lived", "n_predict": 4,
              "temperature": 0, "cache_prompt": True}
    status, _, first = srv.post("/completion", prompt)
    assert status == 200
    _, _, before = srv.get("/slots")
    vectors(srv, [CAT, CAT2, STOCKS] * 5)
    srv.post("/embedding", {"content": "Once upon a time"})
    _, _, after = srv.get("/slots")
    assert [s["n_cached"] for s in after] == [s["n_cached"] for s in before]
    status, _, again = srv.post("/completion", prompt)
    assert again["content"] == first["content"]
    # the whole prompt came from the cache: only the last token is evaluated again
    assert again["timings"]["cache_n"] == first["tokens_evaluated"] - 1, again["timings"]


def worker_cpu_seconds(srv):
    """CPU time (user + system) of the server's model worker, its child process."""
    (pid,) = rawhttp.children(srv.proc.pid)
    with open("/proc/%d/stat" % pid) as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
def test_a_client_that_hangs_up_stops_its_embedding_request(srv):
    # 2000 inputs, about 30000 tokens: minutes of work, sent as worker calls
    # of a few hundred tokens; the hang-up stops it after the call running
    many = ["Sentence number %d says something about cats, rugs and mats." % i
            for i in range(2000)]
    idle = worker_cpu_seconds(srv)
    c = srv.conn()
    c.request("POST", "/v1/embeddings", body=json.dumps({"input": many}),
              headers={"Content-Type": "application/json"})
    # the request is under way once the worker computes for it (a fifth of a CPU second)
    deadline = time.monotonic() + 30
    while worker_cpu_seconds(srv) - idle < 0.2:
        assert time.monotonic() < deadline, "the request never got going"
        time.sleep(0.05)
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    deadline = time.monotonic() + 40
    while True:
        before = worker_cpu_seconds(srv)
        time.sleep(2.0)
        if worker_cpu_seconds(srv) - before < 0.2:
            break                                   # idle: the request has stopped
        assert time.monotonic() < deadline, "the worker still computes for a client gone"
    (vec,) = vectors(srv, CAT)
    assert len(vec) == DIMS


@pytest.mark.slow
def test_errors_name_the_input_by_its_index_in_the_request(srv):
    many = ["x" * 100] * 30 + [""]
    status, _, r = srv.post("/v1/embeddings", {"input": many})
    assert status == 400 and "input 30 is empty" in r["error"]["message"], r


# -- bad input, in each dialect's shape ----------------------------------------------

OPENAI_BAD = [
    ({}, "'input' is required"),
    ({"input": 5}, "must be a string"),
    ({"input": True}, "must be a string"),
    ({"input": []}, "must not be empty"),
    ({"input": [[]]}, "empty"),
    ({"input": ""}, "empty"),
    ({"input": ["ok", ""]}, "input 1 is empty"),
    ({"input": [1, 2.5]}, "token ids"),
    ({"input": [1, -1]}, "out of range"),
    ({"input": [N_VOCAB]}, "out of range"),
    ({"input": [[5], [10 ** 12]]}, "out of range"),
    ({"input": {"content": "x"}}, "content must be an array"),
    ({"input": {"content": [{"type": "image_url", "image_url": {"url": "x"}}]}}, "multimodal"),
    ({"input": ["x"] * 2049}, "at most 2048"),
    ({"input": "word " * 800}, "too large"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "x", "dimensions": "8"}, "'dimensions' must be an integer"),
    ({"input": "x", "embd_normalize": "l2"}, "'embd_normalize' must be an integer"),
]


@pytest.mark.parametrize("body,message", OPENAI_BAD, ids=[m for _, m in OPENAI_BAD])
def test_bad_openai_input_gets_a_400_in_openais_shape(srv, body, message):
    status, _, r = srv.post("/v1/embeddings", body)
    assert status == 400, r
    assert r["error"]["code"] == 400 and message in r["error"]["message"], r
    assert r["error"]["type"] in ("invalid_request_error", "exceed_context_size_error")


@pytest.mark.parametrize("path", ["/embedding", "/embeddings"])
def test_bad_llama_cpp_input_gets_a_400(srv, path):
    for body, message in [({}, '"input" or "content" must be provided'),
                          ({"content": [1, -5]}, "out of range"),
                          ({"content": "word " * 800}, "too large")]:
        status, _, r = srv.post(path, body)
        assert status == 400 and message in r["error"]["message"], r


def test_bad_ollama_input_gets_a_400_with_a_string_error(srv):
    for path, body, message in [
            ("/api/embed", {"model": "m", "input": 5}, "invalid input type"),
            ("/api/embed", {"model": "m", "input": ["a", 5]}, "invalid input type"),
            ("/api/embed", {"input": "x"}, "model is required"),
            ("/api/embed", {"model": "m", "input": "x", "truncate": "no"}, "'truncate'"),
            ("/api/embed", {"model": "m", "input": "x", "options": 5}, "'options' value"),
            ("/api/embeddings", {"model": "m", "prompt": 5}, "'prompt' must be a string")]:
        status, _, r = srv.post(path, body)
        assert status == 400 and list(r) == ["error"] and message in r["error"], (path, r)


def test_the_server_survives_the_bad_inputs(srv):
    (vec,) = vectors(srv, CAT)
    assert len(vec) == DIMS


# -- rerank --------------------------------------------------------------------------

def test_rerank_on_a_model_without_a_rank_head_answers_501_as_llama_server(srv):
    for path in ("/rerank", "/v1/rerank", "/reranking", "/v1/reranking"):
        status, _, r = srv.post(path, {"query": "q", "documents": ["a", "b"]})
        assert status == 501, r
        assert r["error"]["type"] == "not_supported_error"
        assert "Start it with `--reranking`" in r["error"]["message"]


@pytest.fixture(scope="module")
def ranker(smollm_path):
    with ServerProcess(smollm_path, "--reranking", threads=1, ctx=512) as s:
        yield s


DOCS = ["A machine is a physical system.", "Learning is acquiring knowledge.",
        "Machine learning studies algorithms that learn from data.", "Paris est une ville."]


def test_rerank_with_reranking_answers_in_jinas_shape(ranker):
    status, _, body = ranker.post("/rerank", {"query": "Machine learning is", "documents": DOCS})
    assert status == 200, body
    scores = [r["relevance_score"] for r in body["results"]]
    assert sorted(r["index"] for r in body["results"]) == [0, 1, 2, 3]
    assert scores == sorted(scores, reverse=True)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    # scores are per document, batched or not: the same query gives the same scores
    _, _, again = ranker.post("/v1/rerank", {"query": "Machine learning is",
                                             "documents": DOCS[2:3]})
    (one,) = again["results"]
    assert abs(one["relevance_score"] - [r for r in body["results"] if r["index"] == 2][0]
               ["relevance_score"]) < 1e-4
    assert any("no rank head" in line for line in ranker.output)


def test_rerank_tokens_count_as_prompt_work_in_metrics(ranker):
    before = ranker.metrics()["llamacpp:prompt_tokens_total"]
    _, _, body = ranker.post("/rerank", {"query": "Machine learning is", "documents": DOCS})
    after = ranker.metrics()["llamacpp:prompt_tokens_total"]
    assert after - before == body["usage"]["prompt_tokens"] > 0


def test_rerank_tei_shape_top_n_and_return_text(ranker):
    status, _, body = ranker.post("/rerank", {"query": "q", "texts": DOCS, "top_n": 2,
                                              "return_text": True})
    assert status == 200 and len(body) == 2
    assert all(set(r) == {"index", "score", "text"} and r["text"] == DOCS[r["index"]]
               for r in body)


@pytest.mark.parametrize("docs", [[], None, 123, [1, 2, 3]])
def test_rerank_bad_documents_get_a_400(ranker, docs):
    status, _, r = ranker.post("/rerank", {"query": "q", "documents": docs})
    assert status == 400 and "documents" in r["error"]["message"]


def test_rerank_needs_a_string_query(ranker):
    for body in ({"documents": ["a"]}, {"query": 5, "documents": ["a"]}):
        status, _, r = ranker.post("/rerank", body)
        assert status == 400 and "query" in r["error"]["message"]


def test_a_reranking_server_does_not_serve_embeddings(ranker):
    status, _, r = ranker.post("/v1/embeddings", {"input": "x"})
    assert status == 501 and "reranking" in r["error"]["message"]


# -- pooling none: a vector per token ------------------------------------------------

@pytest.fixture(scope="module")
def per_token(smollm_path):
    with ServerProcess(smollm_path, "--pooling", "none", "--embedding", threads=1,
                       ctx=512) as s:
        yield s


def test_pooling_none_gives_a_raw_vector_per_token_on_embedding(per_token):
    _, _, tok = per_token.post("/tokenize", {"content": "hello hello hello",
                                             "add_special": True})
    status, _, body = per_token.post("/embedding", {"content": "hello hello hello"})
    assert status == 200
    rows = body[0]["embedding"]
    assert len(rows) == len(tok["tokens"]) and len(rows[0]) == 576
    assert all(abs(norm(r) - 1) > 1e-3 for r in rows)       # not normalized
    # the first "hello" has attended to nothing but itself; the third to all three
    assert not close(rows[0], rows[-1], 1e-3)


def test_pooling_none_is_refused_on_the_openai_endpoint(per_token):
    status, _, r = per_token.post("/v1/embeddings", {"input": "hello"})
    assert status == 400 and "not OAI compatible" in r["error"]["message"]


# -- switched off ------------------------------------------------------------------------

def test_no_embeddings_answers_501_in_each_dialect(smollm_path):
    with ServerProcess(smollm_path, "--no-embeddings", threads=1, ctx=256) as off:
        for path, body in [("/v1/embeddings", {"input": "x"}), ("/embedding", {"content": "x"}),
                           ("/rerank", {"query": "q", "documents": ["a"]})]:
            status, _, r = off.post(path, body)
            assert status == 501 and "--embeddings" in r["error"]["message"], (path, r)
        status, _, r = off.post("/api/embed", {"model": "m", "input": "x"})
        assert status == 501 and "--embeddings" in r["error"]
        status, _, r = off.post("/completion", {"prompt": "Hi", "n_predict": 2})
        assert status == 200


# -- the engine ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fox(smollm):
    return smollm.tokenize("The quick brown fox jumps over the lazy dog. " * 30, add_special=True)


@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
@pytest.mark.slow
def test_a_long_input_in_chunks_equals_it_in_one_batch(smollm, fox, pooling):
    assert len(fox) > 300
    small = Embedder(smollm, pooling, n_ctx=512, n_batch=64, n_threads=1)
    big = Embedder(smollm, pooling, n_ctx=512, n_batch=512, n_threads=1)
    try:
        (a,), counts = small.embed([fox])
        (b,), _ = big.embed([fox])
    finally:
        small.close()
        big.close()
    assert counts == [len(fox)]
    # the same math in other matrix shapes: equal but for rounding
    assert cosine(a, b) > 0.999, cosine(a, b)


@pytest.mark.slow
def test_batches_equal_inputs_alone(smollm):
    lists = [smollm.tokenize(t, add_special=True) for t in (CAT, STOCKS, "hello")]
    e = Embedder(smollm, "mean", n_ctx=512, n_batch=256, n_threads=1)
    try:
        together, _ = e.embed(lists)
        alone = [e.embed([t])[0][0] for t in lists]
        with pytest.raises(Exception, match="too large"):
            e.embed([lists[0] * 100])        # past the context
        (cut,), counts = e.embed([lists[0] * 100], truncate=True)
        assert counts == [512]
    finally:
        e.close()
    for a, b in zip(together, alone):
        assert close(list(a), list(b))
        assert abs(norm(a) - 1) < 1e-5


def test_a_closed_embedder_refuses_rather_than_crash(smollm):
    e = Embedder(smollm, "last", n_ctx=64, n_batch=32, n_threads=1)
    e.embed([[1, 2, 3]])
    e.close()
    e.close()
    with pytest.raises(Exception, match="closed"):
        e.embed([[1, 2, 3]])


def test_a_batch_of_a_prime_size_still_batches_and_pools(smollm):
    # libllama reserves its graphs split evenly among the sequences: 97 tokens
    # can only be one sequence at a time, which must still work
    lists = [smollm.tokenize(t, add_special=True) for t in (CAT, CAT2, STOCKS)]
    e = Embedder(smollm, "mean", n_ctx=512, n_batch=97, n_threads=1)
    try:
        assert e.n_seqs == 1
        out, counts = e.embed(lists)
    finally:
        e.close()
    assert counts == [len(t) for t in lists]
    assert cosine(out[0], out[1]) > cosine(out[0], out[2])


def test_pooling_none_in_the_engine_gives_one_raw_row_per_token(smollm):
    tokens = smollm.tokenize(CAT, add_special=True)
    e = Embedder(smollm, "none", n_ctx=512, n_batch=64, n_threads=1)
    try:
        (rows,), _ = e.embed([tokens])
        (full, short), _ = e.embed([tokens, tokens[:2]])       # two sequences, one batch
    finally:
        e.close()
    assert len(rows) == len(tokens) and all(len(r) == DIMS for r in rows)
    assert abs(norm(rows[-1]) - 1) > 1e-3                        # as the model gives them
    # a causal model: a token's state depends on the tokens before it only
    assert len(short) == 2 and close(list(short[1]), list(rows[1]), 1e-4)
    assert close(list(full[-1]), list(rows[-1]), 1e-4)


def test_the_pooling_flag_offers_what_the_engine_knows():
    from offgrid.engine.embed import POOLING
    from offgrid.request import POOLINGS
    assert set(POOLINGS) == set(POOLING)
