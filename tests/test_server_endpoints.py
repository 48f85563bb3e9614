"""Every endpoint's success shape, over real HTTP, on the tiny FIM model.

The fields asserted are the ones real clients read: llama.vscode and llama.vim
read ``content``, ``timings/*``, ``truncated`` and ``tokens_cached`` through
``response_fields``; OpenAI clients read ``choices``, ``usage`` and
``finish_reason``; streams must be well-formed SSE that end as the protocol says.
"""

import time

import pytest

try:
    from .serverproc import ServerProcess
except ImportError:
    from serverproc import ServerProcess

VSCODE_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                 "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                 "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated",
                 "tokens_cached"]


@pytest.fixture(scope="module")
def srv(fim_model_path):
    with ServerProcess(fim_model_path, "-np", "2", "-a", "tiny-fim") as s:
        yield s


def editor_body(prefix, **extra):
    """An /infill body shaped like llama.vscode's."""
    body = {
        "id_slot": 0,
        "input_prefix": prefix,
        "input_suffix": "\n    return result\n\n\ndef main():\n    print(compute(3))\n",
        "input_extra": [{"filename": "util.py", "text": "def helper(x):\n    return x * 2\n"},
                        {"filename": "consts.py", "text": "LIMIT = 10\nNAME = 'demo'\n"}],
        "prompt": "    result = ",
        "n_predict": 12,
        "top_k": 40,
        "top_p": 0.9,
        "stream": False,
        "samplers": ["top_k", "top_p", "infill"],
        "cache_prompt": True,
        "t_max_prompt_ms": 500,
        "t_max_predict_ms": 1000,
        "n_indent": 4,
        "response_fields": VSCODE_FIELDS,
        "time": {"unused": True},
        "lora": [],         # no adapters of its own: the server's (none here)
    }
    body.update(extra)
    return body


def test_health_is_ok_when_ready(srv):
    status, _, body = srv.get("/health")
    assert status == 200 and body["status"] == "ok"


def test_props_reports_context_and_slots(srv):
    status, _, body = srv.get("/props")
    assert status == 200
    assert body["default_generation_settings"]["n_ctx"] == 2048
    assert body["default_generation_settings"]["params"]["n_predict"] == -1
    assert body["total_slots"] == 2
    assert body["model_path"].endswith(".gguf")


def test_models_lists_the_model_by_alias(srv):
    for path in ("/v1/models", "/models"):
        status, _, body = srv.get(path)
        assert status == 200 and body["object"] == "list"
        assert [m["id"] for m in body["data"]] == ["tiny-fim"]
        assert body["data"][0]["object"] == "model"


def test_completion_returns_llama_server_fields(srv):
    status, _, body = srv.post("/completion", {"prompt": "def add(a, b):", "n_predict": 8,
                                                "temperature": 0})
    assert status == 200
    assert body["stop"] is True and body["stop_type"] == "limit"
    assert body["tokens_predicted"] == 8
    assert body["tokens_evaluated"] == len(srv.post("/tokenize", {"content": "def add(a, b):",
                                                                  "add_special": True})[2]["tokens"])
    assert isinstance(body["content"], str) and body["content"]
    assert body["model"] == "tiny-fim"
    assert body["generation_settings"]["n_ctx"] == 2048
    assert body["generation_settings"]["n_predict"] == 8
    t = body["timings"]
    assert t["predicted_n"] == 8 and t["prompt_n"] + t["cache_n"] == body["tokens_evaluated"]
    for key in ("prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_ms",
                "predicted_per_token_ms", "predicted_per_second"):
        assert t[key] >= 0
    assert body["truncated"] is False and body["stopping_word"] == ""


def test_two_prompts_taking_turns_each_land_on_their_warm_session(srv):
    # the front knows each session's cached tokens (the worker sends back
    # only what follows the prompt) and gives a prompt the session that holds it
    a = "def alpha(values):\n    total = 0\n    for v in values:\n        total += v\n"
    b = "class Beta:\n    name = 'beta'\n    def greet(self):\n        return self.name\n"
    # (b, b: a session handed out in turn would put the second b on the other one)
    for i, prompt in enumerate([a, b, b, a, a, b]):
        body = srv.post("/completion", {"prompt": prompt, "n_predict": 2, "temperature": 0})[2]
        if i >= 2:
            t = body["timings"]
            assert t["cache_n"] == body["tokens_evaluated"] - 1, (i, t)
            assert body["tokens_cached"] == body["tokens_evaluated"] + 1


def test_completion_accepts_token_ids_and_mixed_prompts(srv):
    ids = srv.post("/tokenize", {"content": "x = 1"})[2]["tokens"]
    a = srv.post("/completion", {"prompt": ids, "n_predict": 4, "temperature": 0})[2]
    b = srv.post("/completion", {"prompt": ["x = 1"], "n_predict": 4, "temperature": 0,
                                 "add_special": False})[2]
    assert a["tokens_evaluated"] == len(ids)
    assert a["content"] == b["content"]     # no BOS in this vocab: same tokens, same text


def test_completion_stream_is_sse_ending_with_a_final_object(srv):
    status, events = srv.stream("/completion", {"prompt": "import os\n", "n_predict": 6,
                                                "temperature": 0, "stream": True})
    assert status == 200
    pieces, final = events[:-1], events[-1]
    assert pieces and all(e["stop"] is False for e in pieces)
    assert final["stop"] is True and final["stop_type"] == "limit"
    assert final["content"] == ""     # llama-server sends the text in the pieces only
    whole = srv.post("/completion", {"prompt": "import os\n", "n_predict": 6, "temperature": 0})
    assert "".join(e["content"] for e in pieces) == whole[2]["content"]


def test_n_predict_zero_warms_the_cache(srv):
    prompt = "class Cache:\n    def __init__(self):\n"
    status, _, body = srv.post("/completion", {"prompt": prompt, "n_predict": 0, "id_slot": 1})
    assert status == 200 and body["content"] == "" and body["tokens_predicted"] == 0
    again = srv.post("/completion", {"prompt": prompt + "        self.x = 1", "n_predict": 2,
                                     "id_slot": 1})[2]
    assert again["tokens_cached"] >= body["tokens_evaluated"] - 1


def test_response_fields_select_nested_paths(srv):
    body = srv.post("/completion", {"prompt": "a", "n_predict": 2,
                                    "response_fields": ["content", "timings/prompt_n", "nope/x"]})[2]
    assert set(body) == {"content", "timings/prompt_n"}


def test_infill_editor_request_and_cache_reuse(srv):
    prefix = "import math\n\n\ndef compute(n):\n"
    # no prompt budget: on a busy machine it drops a cold request's chunks,
    # which the next request then evaluates (test_infill_budget.py covers it)
    first = srv.post("/infill", editor_body(prefix, t_max_prompt_ms=0))
    assert first[0] == 200
    assert set(first[2]) == set(VSCODE_FIELDS)
    assert first[2]["timings/predicted_n"] > 0
    # the next keystroke: the same request, one more character typed
    second = srv.post("/infill", editor_body(prefix, prompt="    result = m",
                                             t_max_prompt_ms=0))[2]
    # tokens_cached: the cache after the request, prompt and generated tokens
    total = second["tokens_cached"] - second["timings/predicted_n"]
    # everything before the typed line is reused; the line and the suffix after it are not
    assert total - second["timings/prompt_n"] > total / 2, second


def test_infill_takes_a_grammar(srv):
    # llama-server's grammar field, with the editor's sampler chain ending in infill
    status, _, body = srv.post("/infill", dict(editor_body("def f():\n"), n_predict=8,
                                               grammar="root ::= [0-9] [0-9] [0-9]"))
    assert status == 200
    assert len(body["content"]) == 3 and body["content"].isdigit(), body["content"]


def test_infill_n_cmpl_returns_an_array(srv):
    status, _, body = srv.post("/infill", dict(editor_body("def f():\n"), n_cmpl=3,
                                               response_fields=[]))
    assert status == 200 and isinstance(body, list) and len(body) == 3
    assert [r["index"] for r in body] == [0, 1, 2]
    assert all(r["stop"] is True for r in body)


def test_infill_stream(srv):
    status, events = srv.stream("/infill", dict(editor_body("def g():\n"), stream=True,
                                                response_fields=[]))
    assert status == 200 and events[-1]["stop"] is True
    assert all(e["stop"] is False for e in events[:-1])


def test_tokenize_and_detokenize_round_trip(srv):
    text = "def héllo():\n    return '🙂'"
    toks = srv.post("/tokenize", {"content": text})[2]["tokens"]
    assert all(isinstance(t, int) for t in toks)
    assert srv.post("/detokenize", {"tokens": toks})[2] == {"content": text}
    pieces = srv.post("/tokenize", {"content": "🙂", "with_pieces": True})[2]["tokens"]
    # a byte-level vocabulary splits the emoji: pieces that are not UTF-8 come as byte lists
    assert all(set(p) == {"id", "piece"} for p in pieces)
    assert any(isinstance(p["piece"], list) for p in pieces)


def test_v1_completions_with_and_without_suffix(srv):
    status, _, plain = srv.post("/v1/completions", {"prompt": "x = ", "max_tokens": 5,
                                                    "temperature": 0})
    assert status == 200 and plain["object"] == "text_completion"
    choice = plain["choices"][0]
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    assert plain["usage"]["completion_tokens"] == 5
    assert plain["usage"]["total_tokens"] == plain["usage"]["prompt_tokens"] + 5
    status, _, fim = srv.post("/v1/completions", {"prompt": "def f(x):\n    return ",
                                                  "suffix": "\n\nprint(f(2))\n", "max_tokens": 5,
                                                  "temperature": 0})
    assert status == 200 and fim["usage"]["completion_tokens"] == 5
    # FIM puts the suffix in the prompt: many more prompt tokens than the prefix alone
    assert fim["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 5


def test_v1_completions_stream_with_usage_ends_with_done(srv):
    status, events = srv.stream("/v1/completions", {"prompt": "y = ", "max_tokens": 4,
                                                    "stream": True,
                                                    "stream_options": {"include_usage": True}})
    assert status == 200
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4
    finish = events[-3]
    assert finish["choices"][0]["finish_reason"] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in events[:-3])


def test_chat_completion_shape(srv):
    status, _, body = srv.post("/v1/chat/completions", {
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "max_completion_tokens": 3})
    assert status == 200 and body["object"] == "chat.completion"
    msg = body["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    assert body["usage"]["completion_tokens"] == 3


def test_chat_stream_deltas(srv):
    status, events = srv.stream("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])


def test_apply_template_returns_prompt(srv):
    status, _, body = srv.post("/apply-template", {"messages": [{"role": "user",
                                                                 "content": "ping"}]})
    assert status == 200 and "ping" in body["prompt"]


def test_metrics_are_prometheus_text(srv):
    # its own request to count, whatever ran before it on this server
    before = srv.metrics()
    status, _, body = srv.post("/infill", editor_body("def f():\n", n_predict=3,
                                                      t_max_prompt_ms=0, response_fields=None))
    assert status == 200 and body["tokens_predicted"] > 0, body
    m = srv.wait_idle()
    assert m["llamacpp:tokens_predicted_total"] == \
        before["llamacpp:tokens_predicted_total"] + body["tokens_predicted"]
    assert m["offgrid_sessions_idle"] + m["offgrid_sessions_busy"] == 2
    key = 'offgrid_requests_total{endpoint="infill"}'
    assert m[key] == before.get(key, 0) + 1
    assert m["llamacpp:prompt_tokens_cached_total"] == m["offgrid_prompt_tokens_cached_total"]


def test_metrics_say_when_the_counters_started(srv):
    status, headers, _ = srv.get("/metrics")
    assert status == 200
    assert 0 < time.time() - int(headers["Process-Start-Time-Unix"]) < 3600


def test_metrics_and_slots_switched_off_answer_501(fim_model_path):
    with ServerProcess(fim_model_path, "--no-metrics", "--no-slots") as s:
        for path, flag in (("/metrics", "--metrics"), ("/slots", "--slots")):
            status, _, body = s.get(path)
            assert status == 501, path
            assert body["error"]["type"] == "not_supported_error"
            assert flag in body["error"]["message"]


def test_any_authorization_is_accepted_without_keys(srv):
    status, _, _ = srv.post("/completion", {"prompt": "a", "n_predict": 1},
                            headers={"Authorization": "Bearer undefined"})
    assert status == 200


def test_infill_keystroke_reuses_the_suffix_after_the_typed_line(srv):
    suffix = "\n    return result\n\n\n"
    suffix += "".join("def other_%d(x):\n    return x + %d\n\n" % (i, i) for i in range(40))
    body = editor_body("import math\n\n\ndef compute(n):\n", input_suffix=suffix, id_slot=3,
                       t_max_prompt_ms=0)      # no budget: see the test above
    srv.post("/infill", body)
    second = srv.post("/infill", dict(body, prompt="    result = math."))[2]
    total = second["tokens_cached"] - second["timings/predicted_n"]
    # the changed line and the few tokens after the suffix are all that is evaluated
    assert second["timings/prompt_n"] < 0.1 * total, second
