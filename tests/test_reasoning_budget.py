"""A reasoning budget: N tokens of thinking, then the end of the block forced.

llama-server's ``reasoning_budget_tokens`` (and ``--reasoning-budget``,
``reasoning_budget_message``), Anthropic's ``thinking.budget_tokens``.  The
served model is the default one with DeepSeek-R1's template from the pinned
llama.cpp source, whose prompt opens the thinking block: greedy, the budgeted
reply's reasoning is exactly the first N tokens the model thinks (what
/completion gives for that prompt), then its end comes whatever the model
would have written.  A request with ``reasoning_control`` has its thinking ended
where it is by POST /v1/chat/completions/control.
"""

import json

import pytest

from offgrid.engine.thinkbudget import (COUNTING, DONE, FORCING, IDLE, NO_BOUND, ThinkBudget,
                                        utf8_complete)
from serverproc import ServerProcess

ASK = [{"role": "user", "content": "What is 2+2?"}]


# -- the state machine, as llama.cpp's common/reasoning-budget.cpp -------------------------

def spec(budget, counting=False, forced=(9, 8)):
    return {"budget": budget, "starts": [[1, 2]], "ends": [[8]], "forced": list(forced),
            "counting": counting}


def test_a_start_marker_opens_the_count_and_the_spent_budget_forces_the_end():
    b = ThinkBudget(spec(2))
    b.accept(5, b"a")
    b.accept(1, b"<")
    assert b.state == IDLE
    b.accept(2, b">")
    assert b.state == COUNTING and b.forced() is None
    b.accept(5, b"a")
    b.accept(5, b"a")
    assert b.state == FORCING and b.forced() == 9
    b.accept(9, b".")
    assert b.forced() == 8
    b.accept(8, b"</")
    assert b.state == DONE and b.forced() is None
    b.accept(1, b"<")
    b.accept(2, b">")                 # another block: a fresh budget
    assert b.state == COUNTING


def test_a_natural_end_ends_the_count_and_budget_0_forces_at_once():
    b = ThinkBudget(spec(5, counting=True))
    b.accept(5, b"a")
    b.accept(8, b"</")
    assert b.state == DONE and b.forced() is None
    assert ThinkBudget(spec(0, counting=True)).forced() == 9


def test_a_budget_spent_inside_a_character_waits_for_its_last_byte():
    b = ThinkBudget(spec(1, counting=True))
    b.accept(5, "é".encode()[:1])
    assert b.forced() is None
    b.accept(6, "é".encode()[1:])      # a piece of continuation bytes alone: unknown
    assert b.forced() is None
    b.accept(7, b"\xa9 ")
    assert b.forced() == 9
    assert utf8_complete(b"ab") and utf8_complete("é".encode()) and utf8_complete(b"")
    assert not utf8_complete("€".encode()[:2]) and not utf8_complete(b"\x82")


# -- served ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(qwen_path, llama_src):
    template = llama_src / "models" / "templates" / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
    with ServerProcess(qwen_path, "--chat-template-file", template, "--reasoning-budget", "5",
                       ctx=512) as s:
        yield s


def first_tokens(server, n):
    """The greedy text of the first ``n`` tokens the model thinks, by /completion."""
    status, _, out = server.post("/apply-template", {"messages": ASK})
    assert status == 200, out
    assert out["prompt"].endswith("<think>\n")       # the template opened the block
    status, _, out = server.post("/completion", {"prompt": out["prompt"], "n_predict": n,
                                                 "temperature": 0})
    assert status == 200 and out["tokens_predicted"] == n, out
    return out["content"]


def chat(server, **body):
    status, _, out = server.post("/v1/chat/completions", dict(
        {"messages": ASK, "max_tokens": 24, "temperature": 0}, **body))
    assert status == 200, out
    return out["choices"][0]["message"], out["usage"]


def test_the_budget_is_the_first_n_tokens_of_thinking_then_its_end(server):
    msg, usage = chat(server, reasoning_budget_tokens=8)
    assert msg["reasoning_content"] == first_tokens(server, 8).strip()
    assert usage["completion_tokens"] == 24     # the reply goes on after the forced end


def test_the_servers_budget_serves_a_request_that_does_not_say(server):
    msg, _ = chat(server)
    assert msg["reasoning_content"] == first_tokens(server, 5).strip()
    # -1: the server's budget too, as llama-server reads it
    assert chat(server, reasoning_budget_tokens=-1)[0] == msg


def test_a_budget_of_0_ends_the_thinking_at_once_and_a_message_is_forced_before_the_end(server):
    msg, _ = chat(server, reasoning_budget_tokens=0)
    assert not msg.get("reasoning_content")
    msg, _ = chat(server, reasoning_budget_tokens=3, reasoning_budget_message=" Time is up.")
    assert msg["reasoning_content"] == (first_tokens(server, 3) + " Time is up.").strip()


def test_anthropics_budget_tokens_is_the_budget(server):
    status, _, out = server.post("/v1/messages", {
        "model": "x", "max_tokens": 24, "temperature": 0, "messages": ASK,
        "thinking": {"type": "enabled", "budget_tokens": 6}})
    assert status == 200, out
    thinking = [b["thinking"] for b in out["content"] if b["type"] == "thinking"]
    assert thinking == [first_tokens(server, 6).strip()]
    status, _, out = server.post("/v1/messages", {
        "model": "x", "max_tokens": 8, "messages": ASK,
        "thinking": {"type": "enabled", "budget_tokens": "many"}})
    assert status == 400 and "budget_tokens" in out["error"]["message"], out


# -- ended while it runs: POST /v1/chat/completions/control ----------------------------------

def test_a_control_ends_the_thinking_of_a_running_request_where_it_is():
    b = ThinkBudget(spec(NO_BOUND, counting=True))
    b.accept(5, b"a")
    b.control("reasoning_end")
    assert b.state == COUNTING          # taken at the next step, in the generating thread
    assert b.forced() == 9 and b.state == FORCING
    idle = ThinkBudget(spec(NO_BOUND))
    idle.control("reasoning_end")       # not thinking: left as it is, as llama.cpp's
    assert idle.forced() is None and idle.state == IDLE


def stream_chat(server, at_thinking, **body):
    """A streamed chat's (reasoning, content); ``at_thinking(id)`` is called once, at its
    first piece of thinking, while it runs."""
    c = server.conn()
    c.request("POST", "/v1/chat/completions", body=json.dumps(dict(
        {"messages": ASK, "max_tokens": 48, "temperature": 0, "stream": True}, **body)),
        headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    reasoning, content, called = "", "", False
    try:
        for line in iter(r.readline, b""):
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[len(b"data: "):])
            if not chunk["choices"]:
                continue
            delta = chunk["choices"][0]["delta"]
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            if reasoning and not called:
                called = True
                at_thinking(chunk["id"])
    finally:
        c.close()
    return reasoning, content


def control(server, cid):
    status, _, out = server.post("/v1/chat/completions/control",
                                 {"id": cid, "action": "reasoning_end"})
    assert status == 200, out
    return out


def test_reasoning_end_ends_a_streaming_chats_thinking_and_its_answer_follows(server):
    natural = first_tokens(server, 48)
    answers = []
    reasoning, content = stream_chat(server, lambda cid: answers.append(control(server, cid)),
                                     reasoning_budget_tokens=100000, reasoning_control=True)
    assert answers == [{"success": True}]
    # the thinking the model would have gone on with, cut where the control came
    assert "</think>" not in natural
    assert natural.strip().startswith(reasoning.strip()) and len(reasoning) < len(natural)
    assert content.strip(), (reasoning, content)


def test_a_control_names_a_running_request_that_asked_for_it(server):
    post = server.post
    assert post("/v1/chat/completions/control", {"action": "reasoning_end"})[::2] == \
        (400, {"error": {"code": 400, "message": "missing completion id",
                         "type": "invalid_request_error"}})
    status, _, out = post("/v1/chat/completions/control", {"id": "x", "action": "stop"})
    assert (status, out["error"]["message"]) == (400, "unknown control action")
    assert control(server, "chatcmpl-none") == \
        {"success": False, "message": "no active completion for this id"}
    # running, but without reasoning_control: its thinking goes on to the budget's end
    answers = []
    reasoning, _ = stream_chat(server, lambda cid: answers.append(control(server, cid)),
                               max_tokens=12, reasoning_budget_tokens=8)
    assert answers == [{"success": False,
                        "message": "reasoning control not enabled for this completion"}]
    assert reasoning.strip() == first_tokens(server, 8).strip()
