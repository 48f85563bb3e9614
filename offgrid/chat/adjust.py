"""The messages as llama-server hands them to a template: its adjustments.

Which family a template is (``template_family``, llama-server's detection
of its specialised templates), the changes it makes to some families'
messages before rendering (``adjust_for_family``), and where system turns
go for templates that cannot place them.  chat/template.py applies them.
"""

from .. import jsonlimit
from ..request import Message


def system_before_last_turn(msgs):
    """System messages that end the conversation after a user's message, moved
    to just before it.

    Claude Code sends its environment notes as a system turn after the user's
    request; rendered last, right before the reply, a small model answers the
    note (Qwen2.5-Coder-0.5B recites it) instead of the request.  Before the
    request they are the same context and the request is what is answered.
    """
    k = len(msgs)
    while k > 0 and msgs[k - 1]["role"] == "system":
        k -= 1
    if k == len(msgs) or k == 0 or msgs[k - 1]["role"] != "user":
        return msgs
    return msgs[:k - 1] + msgs[k:] + [msgs[k - 1]]


def leading_system(msgs):
    """The system messages after the first message joined onto the leading one
    (made if there is none), for templates that cannot place them."""
    later = [i for i, m in enumerate(msgs) if m["role"] == "system" and i > 0]
    if not later:
        return msgs
    msgs = list(msgs)
    if msgs[0]["role"] != "system":
        msgs.insert(0, {"role": "system", "content": ""})
        later = [i + 1 for i in later]
    lead = dict(msgs[0])
    texts = [as_text(lead["content"])] + [as_text(msgs[i]["content"]) for i in later]
    text = "\n\n".join(t for t in texts if t)
    lead["content"] = [{"type": "text", "text": text}] if isinstance(lead["content"], list) \
        else text
    drop = set(later)
    return [lead] + [m for i, m in enumerate(msgs) if i and i not in drop]


# ---------------------------------------------------------------------------
# Template families: the ones whose messages or prompt llama-server adjusts
# ---------------------------------------------------------------------------

def asr_prompt(src):
    """(system, user) text of a transcription's chat turn for a template of source ``src``
    (llama.cpp's common_chat_get_asr_prompt): LFM2's audio models are told in a system
    turn, the others in the user's, before the audio."""
    if "<|tool_list_start|>" in src and "<|tool_list_end|>" in src:     # is_lfm2_template
        return "Perform ASR.", ""
    return "", "Transcribe audio to text"


def template_family(src):
    """llama-server's specialised-template detection, in its order (first match wins)."""
    has = src.__contains__
    if has("[SYSTEM_PROMPT]") and has("[TOOL_CALLS]") and has("[ARGS]") and not has("[CALL_ID]"):
        return "ministral3"
    if has("<|channel|>"):
        return "gpt-oss"
    if has("<atem:function_calls>") and has("<|eom|>"):
        return "muse-glimmer"
    if has(">>>all") and has(">>>${recipient}"):
        return "functionary-v3.2"
    if has("<|tool_calls_section_begin|>") and has("<|tool_call_begin|>"):
        return "kimi-k2"
    if has("<|open|>") and has("<|close|>") and has("<|end_of_msg|>"):
        return "kimi-k3"
    if has("<role>ASSISTANT</role>") and has("<arg_key>"):
        return "ling3"
    if has("<|START_TEXT|>") and has("<|START_ACTION|>"):
        return "cohere2moe"
    if has("<|tool_list_start|>") and has("<|tool_list_end|>"):
        return "lfm2"
    if has("List of tools: [") and not has("<|tool_list_start|>"):
        return "lfm2.5"
    if has("<|role_sep|>") and has("<|message_sep|>") and not has("<|function_call|>"):
        return "gigachat3"
    if has("]<]minimax[>[") and has("<tool_call>") and has("<invoke name="):
        return "minimax-m3"
    if has("dsml_token") and has("DSML") and (has("function_calls") or has("tool_calls")):
        return "deepseek-v3.2"
    if has("'<|tool_call>call:'"):
        return "gemma4"
    if has("Tool usage guidelines:") and has('<function name="') and has('<param name="'):
        return "minicpm5"
    if has("<tool_call>") and has("<function=") and has("<parameter=") \
            and not has("'<tool_call><function=' ~ tool_call.name ~ '>'"):
        return "qwen3-coder"
    return None


def adjust_for_family(family, src, messages):
    """Message changes llama-server makes for some families before rendering."""
    if family == "ministral3":
        out = []
        for m in messages:
            if m.get("role") not in ("system", "assistant"):
                out.append(m)
                continue
            blocks = []
            if isinstance(m.get("reasoning_content"), str):
                blocks.append({"type": "thinking", "thinking": m["reasoning_content"]})
            c = m.get("content")
            if isinstance(c, str):
                blocks.append({"type": "text", "text": c})
            elif isinstance(c, list):
                blocks += c
            m = dict(m, content=blocks)
            m.pop("reasoning_content", None)
            out.append(m)
        return out
    if family in ("gpt-oss", "lfm2", "lfm2.5"):
        out = []
        for m in messages:
            if isinstance(m.get("reasoning_content"), str):
                m = dict(m, thinking=m["reasoning_content"])
                if family == "gpt-oss" and m.get("tool_calls"):
                    m.pop("content", None)
            out.append(m)
        return out
    if family == "deepseek-v3.2" and "function_calls" not in src:
        return _deepseek_v4_sort_tool_results(messages)
    if family == "gemma4" and "{#- OpenAI Chat Completions:" not in src:
        return _gemma4_tool_responses(messages)
    return messages


def _deepseek_v4_sort_tool_results(messages):
    """Runs of tool results in the order of the calls that asked for them."""
    out = list(messages)
    order = {}
    i = 0
    while i < len(out):
        m = out[i]
        role = m.get("role", "")
        if role == "assistant" and m.get("tool_calls"):
            order = {tc.get("id", ""): k for k, tc in enumerate(m["tool_calls"]) if tc.get("id")}
            i += 1
            continue
        if role not in ("user", "tool"):
            i += 1
            continue
        end = i
        positions = []
        while end < len(out) and out[end].get("role", "") in ("user", "tool"):
            if out[end].get("role") == "tool":
                positions.append(end)
            end += 1
        if len(positions) > 1 and order:
            results = sorted((out[p] for p in positions),
                             key=lambda r: order.get(r.get("tool_call_id", ""), 0))
            for p, r in zip(positions, results):
                out[p] = r
        i = end
    return out


def _gemma4_tool_responses(messages):
    """assistant(tool calls) + tool results (+ final answer) as one assistant message."""
    out, i = [], 0
    while i < len(messages):
        m = messages[i]
        if m.get("role") != "assistant" or not m.get("tool_calls"):
            out.append(m)
            i += 1
            continue
        calls, responses = list(m["tool_calls"]), []
        reasoning = m.get("reasoning_content") if isinstance(m.get("reasoning_content"), str) \
            else None
        content = None
        i += 1
        while i < len(messages) and messages[i].get("role") == "tool":
            r = messages[i]
            resp = r.get("content")
            if isinstance(resp, str):
                try:
                    resp = jsonlimit.loads(resp)
                except ValueError:
                    pass
            name = ""
            if len(responses) < len(calls):
                name = calls[len(responses)].get("function", {}).get("name", "")
            responses.append({"name": name or r.get("tool_call_id", ""), "response": resp})
            i += 1
        if i < len(messages) and messages[i].get("role") == "assistant":
            nxt = messages[i]
            c = nxt.get("content")
            if not nxt.get("tool_calls") and c:
                content = c
                i += 1
        built = {"role": "assistant", "tool_calls": calls}
        if responses:
            built["tool_responses"] = responses
        if content is not None:
            built["content"] = content
        if reasoning is not None:
            built["reasoning_content"] = reasoning
        out.append(built)
    return out


def trimmed(m):
    return Message(m.role, m.content.strip(" \t\n\r\v\f"),
                   None if m.parts is None else [p.strip(" \t\n\r\v\f") for p in m.parts],
                   m.reasoning_content.strip(" \t\n\r\v\f"), m.tool_calls, m.tool_call_id,
                   m.name)


def as_text(content):
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content


# ---------------------------------------------------------------------------
# A continued assistant turn (continue_final_message, assistant prefill)
# ---------------------------------------------------------------------------

# How llama-server's reader for a family writes the turn it continues:
# (head, opener, closer).  The turn is the head (None: the generation prompt
# the template renders), then the opener, the message's reasoning and, when
# its content is continued, the closer and the content.  An opener None: the
# family writes no reasoning there, only head + closer + content.  Families
# not listed (and those the auto-parser reads) take the template's own
# reasoning markers (ChatTemplate.reasoning_start/end).  From the pinned
# source's common/parsers/*.cpp, each family's "has_continuation" branch.
CONTINUED_TURNS = {
    "gemma4": (None, "<|channel>thought\n", "<channel|>"),
    "kimi-k2": ("<|im_assistant|>assistant<|im_middle|>", "<think>", "</think>"),
    "kimi-k3": ('<|open|>message role="assistant"<|sep|>', "<|open|>think<|sep|>",
                "<|close|>think<|sep|><|open|>response<|sep|>"),
    "cohere2moe": ("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>", "<|START_THINKING|>",
                   "<|END_THINKING|><|START_TEXT|>"),
    "gpt-oss": ("<|start|>assistant", "<|channel|>analysis<|message|>",
                "<|end|><|start|>assistant<|channel|>final<|message|>"),
    "muse-glimmer": ("<|start|>assistant to=self<|message|>", "",
                     "<|eom|><|start|>assistant to=user<|message|>"),
    "functionary-v3.2": (None, None, "all\n"),
}


def continued_turn(family, src):
    """(head, opener, closer) of ``CONTINUED_TURNS`` for this template, or None."""
    if family == "qwen3-coder" and "<think>" in src:
        # its reasoning templates (Qwen3.5, Nemotron 3, StepFun) close the block
        # as llama-server's reader does, whatever their history rendering writes
        return ("<|im_start|>assistant\n", "<think>\n", "\n</think>\n\n")
    return CONTINUED_TURNS.get(family)
