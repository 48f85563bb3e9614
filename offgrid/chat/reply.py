"""The model's reply read as content, reasoning and tool calls, whole or piece by piece.

    reply = parse_reply(text, fmt)            # after generation
    stream = ReplyStream(fmt)                 # while generating
    for piece in pieces: deltas = stream.add(piece)
    deltas, reply = stream.finish()

``fmt`` is the ReplyFormat chat.ChatTemplate derived from the template and
the request.  Reasoning is a leading block between markers (``<think>`` ...
``</think>`` and the family's own), or everything up to the end marker when
the prompt already opened the block (DeepSeek-R1, Qwen3 thinking templates).
Tool calls are read in the template's syntax, and only there:

    hermes    <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes, Qwen,
              and Qwen3-Coder's <tool_call><function=...><parameter=...> form);
              several blocks are parallel calls, JSON outside them is content
    llama3    <|python_tag|>{"name": ..., "parameters": {...}}, or the whole reply
              that JSON alone (one call)
    mistral   [TOOL_CALLS][{"name": ..., "arguments": {...}}] or [TOOL_CALLS]name[ARGS]{...}
    generic   the whole reply one JSON call {"name", "arguments"} (or
              {"tool_call": ...}, {"tool_calls": [...]}, or a list of calls),
              optionally in a ```json fence

and, whatever the syntax, when the tool-call rescue watched the reply
(``fmt.bare_calls``, chat/rescue.py): the whole reply one {"name",
"arguments"} call, maybe in a ```json fence left open (the grammar ends the
reply with the object)
    harmony   gpt-oss: messages "<|channel|>analysis<|message|>...<|end|>" (reasoning),
              "<|start|>assistant<|channel|>final<|message|>..." (content), and
              "<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}"
              (a call), the recipient also allowed in the role header; or, with
              the channels left out, the generic form

as llama-server reads them.  Text outside calls is content.

Calls between markers, in every other family's shape, are read by
chat/calls.py (the shapes: chat/shapes.py); a reply that is one bare JSON
call by chat/bare.py.

Streaming parses the whole text so far after each piece and sends what grew
since the last parse.  To never take back what was sent, a partial parse
holds back only what can still become a marker ("<thi", "<tool_") or a call
in this template's form, and sends each tool call once, whole, when it is
complete.  A bare JSON call (Llama 3, generic) is held only while the reply's
start can still be its opener ({"name": <a given tool>, "arguments": ...),
decided within OPENER_LIMIT characters; prose, code fences and JSON answers
stream from their first pieces.
"""

import json
import re
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from .. import jsonlimit
from .bare import (HOLD, OPENER_LIMIT, arguments_text, bare_calls, call_from_json,  # noqa: F401
                   json_at, skip_ws)
from .calls import as_shape, held_back, read_calls, read_messages
from .template import ToolCall, new_tool_call_id

_WS = " \t\n\r\v\f"



@dataclass
class Reply:
    content: str = ""
    reasoning_content: str = ""
    tool_calls: List[ToolCall] = field(default_factory=list)


@dataclass
class Delta:
    """One step of a streamed reply: exactly one of the three is set."""
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_call: Optional[Tuple[int, ToolCall]] = None


# ---------------------------------------------------------------------------
# Reasoning
# ---------------------------------------------------------------------------

def split_reasoning(text, fmt, partial=False):
    """(reasoning, rest, found): a leading reasoning block and the text after it."""
    if not fmt.extract_reasoning:
        return "", text, False
    s, end = text, None
    if fmt.starts_in_reasoning:
        end = fmt.reasoning_end
        if fmt.parse_tools and (fmt.tool_syntax in ("llama3", "generic") or fmt.bare_calls) \
                and text.lstrip(_WS)[:1] in ("{", "["):
            # a bare JSON call (a forced call's grammar writes one from the
            # first token) is no reasoning, though the prompt opened a block
            return "", text, False
    else:
        head = text.lstrip(_WS)
        for start, e in fmt.reasoning_markers:
            if head.startswith(start):
                s, end = head[len(start):], e
                break
            if head.startswith(e):
                # an empty block whose start the prompt wrote (MiniMax-M3's </mm:think>)
                return "", head[len(e):].lstrip(_WS), True
        else:
            if partial and head and any(m.startswith(head)
                                        for pair in fmt.reasoning_markers for m in pair):
                return "", "", False        # may still become a reasoning block
    if end is None:
        return "", text, False
    k = s.find(end)
    openers = call_openers(fmt) if fmt.parse_tools else ()
    if k < 0 and openers:
        # a call ends the reasoning the prompt opened, closed or not (Qwen3.5
        # goes from thinking straight to <tool_call>); while the end marker may
        # still come it may be a call the model is only thinking about, so it
        # is held until the end marker or the reply's end decides
        o = min([o for o in (s.find(m) for m in openers) if o >= 0], default=-1)
        if o >= 0:
            return s[:o].strip(_WS), ("" if partial else s[o:]), True
    if k < 0:
        body = held_back(s, [end] + list(openers)) if partial else s
        return body.strip(_WS), "", True
    return s[:k].strip(_WS), s[k + len(end):].lstrip(_WS), True


# ---------------------------------------------------------------------------
# Tool calls
# ---------------------------------------------------------------------------

def _xml_value(raw):
    v = raw[1:] if raw.startswith("\n") else raw
    v = v[:-1] if v.endswith("\n") else v
    try:
        parsed = jsonlimit.loads(v)
        if not isinstance(parsed, str):
            return parsed
    except ValueError:
        pass
    return v


def _starts_or_opens(text, i, word):
    """Whether text[i:] starts with ``word`` or is (so far) its beginning."""
    return text.startswith(word, i) or word.startswith(text[i:])


def _hermes_call(text, i, partial):
    """The call after ``<tool_call>`` at i: (ToolCall, end), (None, None) while
    it may still come, or (None, -1) when what follows can never be one."""
    i = skip_ws(text, i)
    if text[i:i + 1] not in ("", "{", "<") or \
            (text[i:i + 1] == "<" and not _starts_or_opens(text, i, "<function=")):
        return None, -1
    if text.startswith("<function=", i):
        m = re.compile(r"<function=([^>\n]+)>").match(text, i)
        if not m:
            return None, None
        close = text.find("</function>", m.end())
        if close < 0:
            return None, None
        body = text[m.end():close]
        args = {}
        for p in re.finditer(r"<parameter=([^>\n]+)>(.*?)</parameter>", body, re.S):
            args[p.group(1).strip()] = _xml_value(p.group(2))
        call, j = ToolCall(m.group(1).strip(), json.dumps(args, ensure_ascii=False)), \
            close + len("</function>")
    else:
        obj, j = json_at(text, i)
        if j is None:
            return None, None
        call = call_from_json(obj)
        if call is None:
            return None, -1         # whole JSON, but not a call
    k = skip_ws(text, j)
    if text.startswith("</tool_call>", k):
        return call, k + len("</tool_call>")
    if partial and "</tool_call>".startswith(text[k:]):
        return call, len(text)      # the closing tag may be on its way
    return call, j


def _tagged_calls(text, partial, marker, parse_one):
    """Content and calls where each call follows ``marker``; stops at an incomplete one."""
    parts, calls, pos = [], [], 0
    while True:
        k = text.find(marker, pos)
        if k < 0:
            tail = text[pos:]
            parts.append(held_back(tail, [marker]) if partial else tail)
            return "".join(parts), calls, False
        parts.append(text[pos:k])
        call, end = parse_one(text, k + len(marker), partial)
        if call is None:
            if partial and end != -1:
                return "".join(parts), calls, True
            parts.append(text[k:])
            return "".join(parts), calls, False
        calls.append(call)
        pos = end


def _hermes(text, partial):
    return _tagged_calls(text, partial, "<tool_call>", _hermes_call)


def _json_calls(text, i, sep=";"):
    """Consecutive JSON calls from text[i:] to the end: calls, or None if anything else is there."""
    calls = []
    i = skip_ws(text, i)
    while i < len(text):
        obj, j = json_at(text, i)
        if j is None:
            return None
        found = obj if isinstance(obj, list) else [obj]
        for o in found:
            call = call_from_json(o)
            if call is None:
                return None
            calls.append(call)
        i = skip_ws(text, j)
        if i < len(text) and text[i] in sep:
            i = skip_ws(text, i + 1)
    return calls or None


def _llama3(text, partial):
    k = text.find("<|python_tag|>")
    if k < 0:
        return (held_back(text, ["<|python_tag|>"]) if partial else text), [], False
    calls = _json_calls(text, k + len("<|python_tag|>"))
    if calls is None:
        return (text[:k], [], True) if partial else (text, [], False)
    return text[:k], calls, False


def _mistral_one(text, i, partial):
    """``name[ARGS]{...}`` or ``name[CALL_ID]id[ARGS]{...}`` after [TOOL_CALLS]."""
    m = re.compile(r"([^\[\]{}\s]+)(?:\[CALL_ID\]([A-Za-z0-9]+))?\[ARGS\]").match(text, i)
    if not m:
        return None, None
    obj, j = json_at(text, m.end())
    if j is None or not isinstance(obj, dict):
        return None, None
    return ToolCall(m.group(1), json.dumps(obj, ensure_ascii=False), m.group(2) or ""), j


def _mistral(text, partial):
    marker = "[TOOL_CALLS]"
    k = text.find(marker)
    if k < 0:
        return (held_back(text, [marker]) if partial else text), [], False
    i = skip_ws(text, k + len(marker))
    if text.startswith("[", i):
        calls = _json_calls(text, i)
        if calls is None:
            return (text[:k], [], True) if partial else (text, [], False)
        return text[:k], calls, False
    content, calls, pending = _tagged_calls(text[k:], partial, marker, _mistral_one)
    return text[:k] + content, calls, pending


_SYNTAXES = {"hermes": _hermes, "llama3": _llama3, "mistral": _mistral}


_OPENERS = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",),
            "llama3": ("<|python_tag|>",)}


def call_openers(fmt):
    """The markers that open a call in this reply's syntax."""
    if fmt.call_shape:
        return tuple(as_shape(fmt.call_shape).openers)
    return _OPENERS.get(fmt.tool_syntax, ())


def split_tool_calls(text, fmt, partial=False):
    """(content, calls, pending): calls in the template's syntax (or, for Llama 3
    and generic templates, the whole reply one bare call)."""
    if fmt.tool_syntax in ("llama3", "generic") or fmt.bare_calls:
        bare = bare_calls(text, fmt, partial)
        if bare == HOLD:
            return "", [], True
        if bare:
            return "", bare, False
    if fmt.call_shape:
        return read_calls(text, fmt.call_shape, partial, fmt.tool_schemas)
    parse = _SYNTAXES.get(fmt.tool_syntax)
    return parse(text, partial) if parse else (text, [], False)


# ---------------------------------------------------------------------------
# gpt-oss (harmony): the reply is a run of messages with channels
# ---------------------------------------------------------------------------

_HARMONY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_HARMONY_HELD = _HARMONY_ENDS + ("<|start|>",)
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=functions\.([^\s<]+)")
_ANY_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def _harmony_reply(text, fmt, partial):
    """A Reply from gpt-oss output, which starts inside the assistant message
    the generation prompt (``<|start|>assistant``) opened.

    analysis -> reasoning_content; final, and commentary without a recipient
    (a preamble) -> content; a message to ``functions.NAME`` -> a call, once
    its JSON is complete and the message closed (or the reply ended: libllama
    ends generation on <|call|> and <|return|>, so they rarely reach the text).
    """
    if fmt.parse_tools and "<|message|>" not in text:
        bare = bare_calls(text, fmt, partial)     # a call with the channels left out
        if bare == HOLD:
            return Reply()
        if bare:
            return Reply("", "", bare)
    text = fmt.open_header + text   # a continued message: the prompt ends inside it
    reasoning, content, calls = [], [], []
    chunks = text.split("<|start|>")
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        header, sep, body = chunk.partition("<|message|>")
        if not sep:
            plain = header.strip(_WS)
            if i == 0 and plain and not plain.startswith(("<|", "to=")) \
                    and not "<|channel|>".startswith(plain) \
                    and not (partial and "to=".startswith(plain)):
                # no channels (a continued message, or a grammar's bare output)
                content.append(held_back(plain, _HARMONY_HELD) if partial and last else plain)
            continue                        # else a header, maybe still coming
        ends = [k for k in (body.find(e) for e in _HARMONY_ENDS) if k >= 0]
        closed = bool(ends)
        if closed:
            body = body[:min(ends)]
        elif partial and last:
            body = held_back(body, _HARMONY_HELD)
        # the last channel named is the message's (a header may carry two)
        channels = _CHANNEL.findall(header)
        channel = channels[-1] if channels else ""
        recipient = _RECIPIENT.search(header)
        other = _ANY_RECIPIENT.search(header)
        if other and not recipient and other.group(1) not in ("assistant", "user", "all"):
            continue                        # a call to a built-in tool (python, container.*)
        if recipient:
            if not fmt.parse_tools or (partial and not closed):
                continue                    # unsolicited, or not whole yet
            args = body.strip(_WS)
            obj, j = json_at(args, 0)
            if j is not None and not args[j:].strip(_WS) and isinstance(obj, dict):
                calls.append(ToolCall(recipient.group(1), arguments_text(obj)))
            else:
                content.append(args)        # a broken call stays content
        elif channel == "analysis" and fmt.extract_reasoning:
            reasoning.append(body.strip(_WS))
        elif channel == "analysis":         # reasoning_format none: shown as written
            content.append(_AsWritten("<|channel|>analysis<|message|>" + body
                                      + ("<|end|>" if closed else "")))
        else:
            content.append(body.strip(_WS))
    # messages' texts are joined by a blank line; what follows an analysis
    # shown as written follows its own <|end|> directly (llama.cpp)
    out = ""
    for k, c in enumerate(c for c in content if c):
        out += ("" if k == 0 or isinstance(prev, _AsWritten) else "\n\n") + c
        prev = c
    return Reply(out, "\n\n".join(r for r in reasoning if r), calls)


class _AsWritten(str):
    """A message's text given with its markup (reasoning_format none)."""


# ---------------------------------------------------------------------------
# The reply, whole or streamed
# ---------------------------------------------------------------------------

def parse_reply(text, fmt, partial=False):
    """A Reply from the generated text.  ``partial``: more text may follow."""
    if fmt.tool_syntax == "harmony":
        return _harmony_reply(text, fmt, partial)
    if fmt.call_shape and as_shape(fmt.call_shape).recipients:
        content, reasoning, calls = read_messages(fmt.open_header + text, fmt.call_shape,
                                                  partial, fmt.tool_schemas)
        if fmt.json_fence:
            content = _unfenced(content, partial)
        return Reply(content, reasoning if fmt.extract_reasoning else "",
                     calls if fmt.parse_tools else [])
    if fmt.reopened and not fmt.extract_reasoning:
        # reasoning_format none: the block the prompt opened is the reply's
        # text as the model sees it, so it is given back as written (llama-server)
        text = fmt.reopened + text
    reasoning, rest, found = split_reasoning(text, fmt, partial)
    if found and fmt.reasoning_lead and fmt.starts_in_reasoning:
        reasoning = (fmt.reasoning_lead + reasoning).strip(_WS)
    if fmt.parse_tools:
        content, calls, _ = split_tool_calls(rest, fmt, partial)
        content = content.strip(_WS)
    else:
        content, calls = rest, []
    if found and fmt.keep_reasoning_inline and not calls:
        content = text if not partial else held_back(text, [m for p in fmt.reasoning_markers
                                                             for m in p])
    if fmt.stray_markers:
        # with reasoning_format none, reasoning's own markup stays as written
        keep = () if fmt.extract_reasoning else [m for pair in fmt.reasoning_markers
                                                 for m in pair]
        strays = [m for m in fmt.stray_markers
                  if not any(m in k or k in m or k.startswith(m) for k in keep)]
        content = _without_markers(content, strays, partial)
    if fmt.json_fence:
        content = _unfenced(content, partial)
    return Reply(content, reasoning, calls)


def _without_markers(text, markers, partial):
    """``text`` less the family's markup that is no part of the answer
    (<|START_RESPONSE|>, a stray <channel|>), and, streamed, less a suffix
    that may still become one."""
    if partial:
        text = held_back(text, markers)
    for m in markers:
        text = text.replace(m, "")
    return text


def _unfenced(text, partial):
    """An answer held to a JSON schema less the ```json fence a model may put
    around it (llama-server strips it too)."""
    head = text.lstrip(_WS)
    if partial and head and "```json".startswith(head):
        return ""                           # may still open a fence
    if not head.startswith("```"):
        return text
    nl = head.find("\n")
    if nl < 0:
        return "" if partial else text
    body = head[nl + 1:]
    tail = body.rstrip(_WS)
    if tail.endswith("```"):
        return tail[:-3]
    return held_back(body, ["\n```"]) if partial else body


class ReplyStream:
    """Turns generated pieces into deltas that only ever add to what was sent."""

    def __init__(self, fmt, id_length=32):
        self.fmt = fmt
        self.id_length = id_length
        self.text = ""
        self.sent = Reply()

    def add(self, piece):
        self.text += piece
        return self._diff(parse_reply(self.text, self.fmt, partial=True))

    def finish(self):
        """The last deltas, and the whole reply (its tool calls carry the ids sent)."""
        final = parse_reply(self.text, self.fmt, partial=False)
        return self._diff(final), final

    def _diff(self, r):
        out = []
        sent = self.sent
        # never take back what was sent: a parse that disagrees keeps the old text
        if r.reasoning_content.startswith(sent.reasoning_content):
            if len(r.reasoning_content) > len(sent.reasoning_content):
                out.append(Delta(reasoning_content=r.reasoning_content[
                    len(sent.reasoning_content):]))
        else:
            r.reasoning_content = sent.reasoning_content
        if r.content.startswith(sent.content):
            if len(r.content) > len(sent.content):
                out.append(Delta(content=r.content[len(sent.content):]))
        else:
            r.content = sent.content
        calls = list(sent.tool_calls)
        for i in range(len(sent.tool_calls), len(r.tool_calls)):
            tc = r.tool_calls[i]
            if not tc.id:
                tc.id = new_tool_call_id(self.id_length)
            calls.append(tc)
            out.append(Delta(tool_call=(i, tc)))
        r.tool_calls = calls
        self.sent = r
        return out
