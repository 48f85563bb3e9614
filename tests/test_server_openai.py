"""The official openai client against offgrid: what OpenAI users will run.

gemma-3-270m serves text and chat; the tiny FIM model serves ``suffix``
requests through --fim-model, which also checks the routing between the two.
"""

import threading
import time

import openai
import pytest

try:
    from .serverproc import ServerProcess
except ImportError:
    from serverproc import ServerProcess


@pytest.fixture(scope="module")
def srv(gemma_path, fim_model_path):
    with ServerProcess(gemma_path, "--fim-model", fim_model_path, "-a", "gemma",
                       "--api-key", "sk-test-1", "--api-key", "sk-test-2") as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="sk-test-2", max_retries=0)


def test_completions(client):
    r = client.completions.create(model="gemma", prompt="The capital of France is",
                                  max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.model == "gemma"
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.choices[0].text.strip()
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens == 6


def test_completions_with_suffix_use_the_fim_model(client, srv):
    r = client.completions.create(model="gemma", prompt="def add(a, b):\n    return ",
                                  suffix="\n\nprint(add(1, 2))\n", max_tokens=6, temperature=0)
    # the tiny FIM model never stops early, so exactly max_tokens come back
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    status, _, slots = srv.get("/slots", headers={"Authorization": "Bearer sk-test-1"})
    fim_slots = [s for s in slots if s["model"] != "gemma"]
    assert fim_slots and fim_slots[0]["n_cached"] > 6    # the FIM model ran the prompt


def test_completions_stream(client):
    chunks = list(client.completions.create(model="gemma", prompt="Once upon a time",
                                            max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text
    assert 0 < chunks[-1].usage.completion_tokens <= 10
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("length", "stop") and all(f is None for f in finishes[:-1])


def test_chat(client):
    r = client.chat.completions.create(
        model="gemma", max_tokens=12, temperature=0,
        messages=[{"role": "system", "content": "You answer briefly."},
                  {"role": "user", "content": "Say hello."}])
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream(client):
    stream = client.chat.completions.create(
        model="gemma", max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Count to three."}])
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert 0 < chunks[-1].usage.completion_tokens <= 12


def test_chat_stream_matches_non_stream(client):
    msgs = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model="gemma", max_tokens=10, temperature=0,
                                           messages=msgs).choices[0].message.content
    parts = client.chat.completions.create(model="gemma", max_tokens=10, temperature=0,
                                           messages=msgs, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == whole


def test_models(client):
    ids = [m.id for m in client.models.list()]
    assert ids[0] == "gemma" and len(ids) == 2


def test_a_model_is_retrieved_by_id_or_alias(client, srv):
    for listed in client.models.list():
        m = client.models.retrieve(listed.id)
        assert m.id == listed.id and m.object == "model" and m.owned_by
        for alias in listed.model_dump().get("aliases", []):
            assert client.models.retrieve(alias).id == listed.id
    status, _, body = srv.get("/v1/models/gemma?x=1", headers={"Authorization":
                                                                "Bearer sk-test-1"})
    assert status == 200 and body["id"] == "gemma"


def test_retrieving_an_unknown_model_is_a_404_in_openai_shape(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["type"] == "invalid_request_error" and "gpt-4o" in e.value.body["message"]


def test_wrong_key_is_401_in_openai_shape(srv):
    bad = openai.OpenAI(base_url=srv.base + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401
    assert e.value.body["type"] == "authentication_error"


def test_x_api_key_header_and_open_health(srv):
    assert srv.get("/v1/models", headers={"x-api-key": "sk-test-1"})[0] == 200
    assert srv.get("/v1/models")[0] == 401
    assert srv.get("/health")[0] == 200      # health stays open for load balancers


def test_bad_request_surfaces_as_openai_error(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="gemma", prompt="x", max_tokens=4, best_of=2)
    assert "'best_of' must be 1" in e.value.message


def test_an_empty_prompt_without_a_suffix_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="gemma", prompt="", max_tokens=4)
    assert "prompt must not be empty" in e.value.message.replace("'", "")


def test_a_superseded_completion_finishes_with_an_openai_reason(srv):
    key = {"Authorization": "Bearer sk-test-1"}
    result = {}

    def first():
        result["r"] = srv.post("/v1/completions", {"model": "gemma", "prompt": "Once upon",
                                                   "max_tokens": 400, "id_slot": 0,
                                                   "ignore_eos": True}, headers=key)
    t = threading.Thread(target=first, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if any(s["is_processing"] and s["n_cached"] > 3 for s in srv.get("/slots",
                                                                         headers=key)[2]):
            break
        time.sleep(0.02)
    srv.post("/v1/completions", {"model": "gemma", "prompt": "Hi", "max_tokens": 1,
                                 "id_slot": 0}, headers=key)
    t.join(30)
    status, _, body = result["r"]
    assert status == 200
    assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls",
                                                   "content_filter")
    assert body["usage"]["completion_tokens"] < 400, "it was not superseded"


def test_verbose_chat_answers_carry_the_prompt_as_llama_servers_do(gemma_path):
    with ServerProcess(gemma_path, "-v") as s:
        status, _, body = s.post("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "What is the best book"}],
            "max_tokens": 2})
    assert status == 200
    verbose = body["__verbose"]
    assert "What is the best book" in verbose["prompt"]
    assert verbose["content"] == body["choices"][0]["message"]["content"]


def test_chat_answers_leave_verbose_out_by_default(srv):
    body = {"model": "gemma", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    key = {"Authorization": "Bearer sk-test-1"}
    assert "__verbose" not in srv.post("/v1/chat/completions", body, headers=key)[2]
    verbose = srv.post("/v1/chat/completions", dict(body, verbose=True), headers=key)[2]
    assert "hi" in verbose["__verbose"]["prompt"]


def test_system_fingerprint_has_llama_servers_shape(client):
    r = client.chat.completions.create(model="gemma", max_tokens=1,
                                       messages=[{"role": "user", "content": "hi"}])
    assert r.system_fingerprint.startswith("b0-offgrid-")
