"""The embedding and rerank models people bring, over HTTP: an encoder (BERT
and its kin: bge, all-MiniLM, nomic-embed) as an embedding model, a tiny BERT
built by libllama with the real BERT vocabulary (archmodels.py); EmbeddingGemma
and its projections after the pooling; a BERT reranker; a decoder reranker;
and what is not served, an encoder-decoder.

An encoder has no memory: each input is read whole, every token seeing every
other, and pooled (bge's: the first token's state).  Its embeddings are
checked against libllama's own pooling of the same model; the requests it
cannot serve (text generation: libllama would decode and hand back logits it
never computed) are refused in every dialect's shape before a stream opens,
and what it is shows as Ollama and the model list say it.  A reranker (the
same with its classifier head) scores as libllama's rank pooling does, and a
decoder reranker (Qwen3-Reranker's kind) as well, a pair longer than a batch
too.  An encoder-decoder (T5), whose every decode libllama aborts without an
encode first, is a load error for that model alone.
"""

import array
import math
import shutil

import pytest

import archmodels
from memclass import text
from serverproc import ServerProcess

from offgrid import libllama
from offgrid.engine.model import Model

TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "hello world",
         "An encoder reads the whole input at once, both ways."]


@pytest.fixture(scope="module")
def bert(tiny_dir):
    return archmodels.build("bert", tiny_dir)


@pytest.fixture(scope="module")
def srv(bert):
    with ServerProcess(bert, "-np", "2", ctx=512) as s:
        yield s


def unit(v):
    norm = math.sqrt(sum(x * x for x in v))
    return [x / norm for x in v]


def pooled_by_libllama(path, inputs, pooling, n_ctx=512):
    """Each input's output as libllama's graph pools it, one input a decode;
    ``inputs(model)`` gives the token lists."""
    model = Model.load(str(path), progress=False)
    try:
        ctx = libllama.ContextHandle(model.lib, model.handle, n_ctx, n_ctx, n_ctx, 1, 1,
                                     embeddings=True, pooling=pooling)
        try:
            n = 1 if pooling == libllama.LLAMA_POOLING_TYPE_RANK else model.n_embd_out
            out = []
            for tokens in inputs(model):
                assert ctx.decode_sequences([(0, tokens, 0)]) == 0
                out.append(array.array("f", ctx.embedding_seq(0, n)))
                ctx.memory.clear(False)
            return out
        finally:
            ctx.close()
    finally:
        model.close()


def libllamas_own(path, texts, pooling=libllama.LLAMA_POOLING_TYPE_CLS):
    """Each text's embedding as libllama pools it, normalized as /v1/embeddings
    normalizes."""
    return [unit(v) for v in pooled_by_libllama(
        path, lambda m: [m.tokenize(t, add_special=True) for t in texts], pooling)]


def embed(srv, inputs):
    status, _, body = srv.post("/v1/embeddings", {"input": inputs})
    assert status == 200, body
    return [d["embedding"] for d in body["data"]]


def test_embeddings_are_libllamas_own_pooling(srv, bert):
    got = embed(srv, TEXTS)
    want = libllamas_own(bert, TEXTS)
    assert [len(v) for v in got] == [len(v) for v in want]
    for g, w in zip(got, want):
        assert max(abs(a - b) for a, b in zip(g, w)) < 1e-5


def test_projections_after_the_pooling_are_applied_as_libllama_applies_them(tiny_dir):
    """EmbeddingGemma's two dense layers project the pooled vector; offgrid pools
    the per-token rows libllama gives (each already projected), and the mean of
    the projected rows is the projection of the mean: the same vector."""
    path = archmodels.build("gemma-embedding", tiny_dir)
    with ServerProcess(path, ctx=512) as s:
        got = embed(s, TEXTS)
        assert s.get("/props")[2]["memory"]["class"] == "none"
    want = libllamas_own(path, TEXTS, libllama.LLAMA_POOLING_TYPE_MEAN)
    for g, w in zip(got, want):
        assert max(abs(a - b) for a, b in zip(g, w)) < 1e-5


def test_inputs_batched_together_do_not_see_each_other(srv):
    # every token attends to every other of its input: one batch of three
    # inputs must keep them apart, as three requests do
    alone = [embed(srv, [t])[0] for t in TEXTS]
    together = embed(srv, TEXTS)
    for a, b in zip(alone, together):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    assert max(abs(x - y) for x, y in zip(alone[0], alone[1])) > 1e-3


def test_the_ollama_and_llama_cpp_routes_embed_the_same(srv):
    want = embed(srv, ["hello world"])[0]
    status, _, body = srv.post("/api/embed", {"model": "x", "input": "hello world"})
    assert status == 200, body
    assert max(abs(x - y) for x, y in zip(body["embeddings"][0], want)) < 1e-5


def test_an_input_longer_than_a_batch_is_refused_with_the_flag_to_change(bert):
    with ServerProcess(bert, "-b", "64", "-ub", "64", ctx=512) as s:
        status, _, body = s.post("/v1/embeddings", {"input": " ".join(["word"] * 100)})
        assert status == 400, body
        assert "one batch" in body["error"]["message"] and "-ub" in body["error"]["message"]
        assert embed(s, ["short"])


@pytest.fixture(scope="module")
def ranker(tiny_dir):
    path = archmodels.build("bert-rank", tiny_dir)
    with ServerProcess(path, ctx=512) as s:     # its GGUF's pooling: rank
        yield path, s


def libllamas_own_scores(path, query, docs, n_ctx=512):
    """Each document's score as libllama's rank pooling gives it, on the pair laid
    out as llama-server's format_prompt_rerank lays it out (no rerank template:
    BOS if the vocabulary adds one, the query, EOS (else SEP) if it adds EOS,
    SEP if it adds SEP, the document, EOS again)."""
    def pairs(model):
        eos = model.eos if model.eos is not None else model.sep
        return [([model.bos] if model.add_bos else [])
                + model.tokenize(query, add_special=False)
                + ([eos] if model.add_eos else []) + ([model.sep] if model.add_sep else [])
                + model.tokenize(d, add_special=False) + ([eos] if model.add_eos else [])
                for d in docs]
    return [v[0] for v in pooled_by_libllama(path, pairs, libllama.LLAMA_POOLING_TYPE_RANK,
                                             n_ctx)]


def test_a_reranker_scores_as_libllamas_rank_head_and_sorts(ranker):
    path, s = ranker
    query = "what is a fox"
    status, _, body = s.post("/rerank", {"query": query, "documents": TEXTS})
    assert status == 200, body
    want = libllamas_own_scores(path, query, TEXTS)
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    assert sorted(got) == [0, 1, 2]
    for i, w in enumerate(want):
        assert abs(got[i] - w) < 1e-5
    assert [r["index"] for r in body["results"]] == sorted(range(3), key=lambda i: -want[i])
    status, _, body = s.post("/v1/embeddings", {"input": "hello"})
    assert status == 501, body          # it pools for ranking: no embeddings


def test_a_causal_reranker_scores_a_document_longer_than_a_batch(tiny_dir):
    """A decoder reranker (Qwen3-Reranker's kind) scores the pair's last token,
    which attends to all before it: a pair longer than a batch goes in chunks
    through the cache, as llama-server takes it, and scores as in one batch
    (within what the chunks' other rounding moves)."""
    path = archmodels.build("qwen3-rank", tiny_dir)
    query, docs = "what is a fox", ["a fox is an animal", text(400, 3)]
    with ServerProcess(path, "-b", "64", "-ub", "64", ctx=4096) as s:
        status, _, body = s.post("/rerank", {"query": query, "documents": docs})
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] > 500
    got = {r["index"]: r["relevance_score"] for r in body["results"]}
    want = libllamas_own_scores(path, query, docs, n_ctx=1024)
    assert len(set(want)) == 2 and 0 < min(want) and max(want) < 1   # p("yes")
    for i, w in enumerate(want):
        assert abs(got[i] - w) < 1e-3


GENERATE = [
    ("/completion", {"prompt": "hi", "n_predict": 4}),
    ("/completion", {"prompt": "hi", "n_predict": 4, "stream": True}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
    ("/v1/messages", {"model": "x", "max_tokens": 4,
                      "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"model": "x", "input": "hi"}),
    ("/api/generate", {"model": "x", "prompt": "hi"}),
    ("/api/chat", {"model": "x", "messages": [{"role": "user", "content": "hi"}]}),
]


@pytest.mark.parametrize("path,body", GENERATE, ids=["%s%s" % (p, " stream" if b.get("stream")
                                                            or p.startswith("/api/") else "")
                                                     for p, b in GENERATE])
def test_text_generation_is_refused_in_each_dialects_shape(srv, path, body):
    # (Ollama's routes stream unless told not to)
    status, headers, answer = srv.post(path, body)
    assert status == 501, answer
    text = str(answer)
    assert "encoder" in text and "embeddings" in text
    if path.startswith("/api/"):
        assert isinstance(answer["error"], str)
    elif path == "/v1/messages":
        assert answer["type"] == "error"
    else:
        assert answer["error"]["type"] == "not_supported_error"


def test_what_it_is_shows_in_props_the_model_list_and_ollamas_show(srv):
    memory = srv.get("/props")[2]["memory"]
    assert memory["class"] == "none" and memory["speculation"] is False
    assert memory["description"].startswith("none: an encoder")
    models = srv.get("/v1/models")[2]["data"]
    assert [m["capabilities"] for m in models] == [["embedding"]]
    status, _, show = srv.post("/api/show", {"model": models[0]["id"]})
    assert status == 200 and show["capabilities"] == ["embedding"]
    assert any("memory none: an encoder" in line for line in srv.output)


def test_an_encoder_decoder_is_a_load_error_for_it_alone(bert, tiny_dir, tmp_path):
    shutil.copy(archmodels.build("t5", tiny_dir), tmp_path / "t5-tiny.gguf")
    with ServerProcess(bert, "--models-dir", tmp_path, ctx=512) as s:
        status, _, body = s.post("/v1/chat/completions", {
            "model": "t5-tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert status == 500, body
        assert "encoder-decoder model (t5)" in body["error"]["message"]
        listed = {m["id"]: m for m in s.get("/v1/models")[2]["data"]}
        assert listed["t5-tiny"]["status"]["value"] == "error"
        assert embed(s, ["still serving"])      # the default model goes on
