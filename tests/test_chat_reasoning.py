"""Reasoning: thinking text goes to reasoning_content, the rest to content, in streams too.

Parsing is checked on given text (markers of several families, a prompt that
already opened the block, markers split across pieces, reasoning_format
none/deepseek-legacy).  The server path uses a grammar to make gemma-3-270m
write a reasoning block, so the split is checked on real generated tokens
(``</think>`` arrives as several tokens), streamed and not.
"""

import pytest

from offgrid.chat.replyformat import REASONING_MARKERS
from offgrid.chat.template import ChatTemplate, Message, ReplyFormat
from offgrid.chat.reply import ReplyStream, parse_reply

try:
    from .serverproc import ServerProcess
except ImportError:
    from serverproc import ServerProcess


def stream_all(text, f, size):
    s = ReplyStream(f)
    deltas = []
    for i in range(0, len(text), size):
        deltas += s.add(text[i:i + size])
    last, reply = s.finish()
    deltas += last
    return ("".join(d.reasoning_content for d in deltas if d.reasoning_content),
            "".join(d.content for d in deltas if d.content), reply)


@pytest.mark.parametrize("start, end", REASONING_MARKERS)
def test_leading_block_is_reasoning(start, end):
    f = ReplyFormat(reasoning_markers=[(start, end)])
    r = parse_reply("%s\nLet me think.\n%s\n\nThe answer." % (start, end), f)
    assert (r.reasoning_content, r.content) == ("Let me think.", "The answer.")


@pytest.mark.parametrize("size", [1, 2, 3, 7, 100])
def test_streamed_split_matches_whole_with_markers_across_pieces(size):
    f = ReplyFormat()
    text = "<think>\nStep one.\nStep two.\n</think>\n\nFinal answer: 42."
    reasoning, content, reply = stream_all(text, f, size)
    assert (reasoning, content) == ("Step one.\nStep two.", "Final answer: 42.")
    assert (reply.reasoning_content, reply.content) == (reasoning, content)


def test_a_partial_end_marker_is_never_sent_as_reasoning():
    s = ReplyStream(ReplyFormat())
    sent = []
    for piece in ["<think>", "abc", "</th", "ink>", "done"]:
        sent += s.add(piece)
    assert [d.reasoning_content for d in sent if d.reasoning_content] == ["abc"]
    assert [d.content for d in sent if d.content] == ["done"]


def test_prompt_that_opened_the_block(llama_src):
    src = (llama_src / "models" / "templates" /
           "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text(encoding="utf-8")
    prompt = ChatTemplate(src).apply([Message("user", "2+2?")])
    assert prompt.text.endswith("<think>\n")
    assert prompt.reply_format.starts_in_reasoning
    r = parse_reply("Four, clearly.\n</think>\n\n4", prompt.reply_format)
    assert (r.reasoning_content, r.content) == ("Four, clearly.", "4")
    reasoning, content, _ = stream_all("Four, clearly.\n</think>\n\n4", prompt.reply_format, 2)
    assert (reasoning, content) == ("Four, clearly.", "4")


def test_thinking_disabled_prompt_closes_the_block(llama_src):
    src = (llama_src / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
    t = ChatTemplate(src)
    assert t.supports_thinking
    off = t.apply([Message("user", "hi")], enable_thinking=False)
    assert off.text.endswith("<think>\n\n</think>\n\n") and not off.reply_format.starts_in_reasoning


def test_unfinished_reasoning_is_all_reasoning():
    r = parse_reply("<think>still going", ReplyFormat())
    assert (r.reasoning_content, r.content) == ("still going", "")


def test_think_later_in_the_text_is_content():
    r = parse_reply("Hello <think>x</think>", ReplyFormat())
    assert r.content == "Hello <think>x</think>" and r.reasoning_content == ""


def test_reasoning_format_none_keeps_it_inline():
    text = "<think>hmm</think>ok"
    r = parse_reply(text, ReplyFormat(extract_reasoning=False))
    assert (r.reasoning_content, r.content) == ("", text)


def test_reasoning_format_deepseek_legacy_fills_both():
    text = "<think>hmm</think>ok"
    r = parse_reply(text, ReplyFormat(keep_reasoning_inline=True))
    assert (r.reasoning_content, r.content) == ("hmm", text)


def test_reasoning_then_tool_call():
    f = ReplyFormat(tool_syntax="hermes", parse_tools=True)
    text = '<think>Need weather.</think>\n<tool_call>\n{"name": "w", "arguments": {}}\n</tool_call>'
    reasoning, content, reply = stream_all(text, f, 4)
    assert reasoning == "Need weather." and content == ""
    assert [c.name for c in reply.tool_calls] == ["w"]


# -- on the server, with gemma-3-270m --------------------------------------------------

# a literal grammar: cheap to apply, and the tokens are still the model's own
FORCED = 'root ::= "<think>" "I should greet." "</think>" "Hello there."'


@pytest.fixture(scope="module")
def srv(gemma_path):
    with ServerProcess(gemma_path) as s:
        yield s


def _ask(srv, **extra):
    body = dict({"messages": [{"role": "user", "content": "Think, then answer."}],
                 "grammar": FORCED, "max_tokens": 40, "temperature": 0}, **extra)
    return body


def test_server_splits_reasoning(srv):
    status, _, body = srv.post("/v1/chat/completions", _ask(srv))
    assert status == 200
    msg = body["choices"][0]["message"]
    assert msg["reasoning_content"] == "I should greet."
    assert msg["content"] == "Hello there."


def test_server_streams_the_same_split(srv):
    status, events = srv.stream("/v1/chat/completions", _ask(srv, stream=True))
    assert status == 200 and events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    assert (reasoning, content) == ("I should greet.", "Hello there.")
    # several deltas (the marker arrived in pieces), reasoning ones first
    kinds = [("r" if d.get("reasoning_content") else "c") for d in deltas
             if d.get("reasoning_content") or d.get("content")]
    assert len(kinds) > 2 and kinds == sorted(kinds, reverse=True)


def test_server_reasoning_format_none(srv):
    _, _, body = srv.post("/v1/chat/completions", _ask(srv, reasoning_format="none"))
    msg = body["choices"][0]["message"]
    assert msg["content"] == "<think>I should greet.</think>Hello there."
    assert "reasoning_content" not in msg
