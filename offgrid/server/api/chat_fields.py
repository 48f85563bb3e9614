"""A chat request's own fields, typed at the edge: messages, tools, tool_choice.

OpenAI's shapes; the other dialects turn theirs into these or build the same
Message and Tool objects (``anthropic.py``, ``responses.py``, ``ollama.py``).
"""

import json

from ...request import Message, Tool, ToolCall
from ..httpd.httperrors import BadRequest
from . import media


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def chat_messages_from(v):
    """OpenAI ``messages`` as chat.Message, with tool calls, tool results and text parts.

    Validation follows llama-server: every message has a role; messages other
    than the assistant's have ``content``; an assistant message has content or
    tool calls; content is a string, null, or an array of text parts.
    """
    if not isinstance(v, list) or not v:
        raise BadRequest("'messages' must be a non-empty array")
    out = []
    for i, m in enumerate(v):
        where = "messages[%d]" % i
        if not isinstance(m, dict):
            raise BadRequest("%s must be an object" % where)
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise BadRequest("%s.role must be a non-empty string" % where)
        if role not in CHAT_ROLES:
            # OpenAI's 400; a template would otherwise render a role its model never saw
            raise BadRequest("%s.role must be one of %s, got %r"
                             % (where, ", ".join(CHAT_ROLES), role[:40]))
        if role != "assistant" and "content" not in m:
            raise BadRequest("%s: all non-assistant messages must contain 'content'" % where)
        if role == "assistant" and "content" not in m and "tool_calls" not in m:
            raise BadRequest("%s: an assistant message must contain 'content' or 'tool_calls'"
                             % where)
        msg = Message(role)
        content = m.get("content")
        if isinstance(content, str):
            msg.content = content
        elif isinstance(content, list):
            msg.parts = []
            for j, part in enumerate(content):
                # an image or audio part: its marker among the text (api/media.py)
                data = media.openai_part(part, "%s.content[%d]" % (where, j)) \
                    if isinstance(part, dict) else None
                if data is not None:
                    msg.parts.append(media.MARKER)
                    msg.media.append(data)
                    continue
                if not isinstance(part, dict) or part.get("type") != "text" \
                        or not isinstance(part.get("text"), str):
                    raise BadRequest("%s.content[%d] must be a text part ({\"type\": \"text\", "
                                     "\"text\": ...}), an image_url or an input_audio part"
                                     % (where, j))
                msg.parts.append(part["text"])
        elif content is not None:
            raise BadRequest("%s.content must be a string, null or an array of content parts"
                             % where)
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise BadRequest("%s.tool_calls must be an array" % where)
            for j, tc in enumerate(calls):
                fn = tc.get("function") if isinstance(tc, dict) else None
                if not isinstance(fn, dict) or tc.get("type", "function") != "function" \
                        or not isinstance(fn.get("name"), str):
                    raise BadRequest("%s.tool_calls[%d] must be {\"type\": \"function\", "
                                     "\"function\": {\"name\": ..., \"arguments\": ...}}"
                                     % (where, j))
                args = fn.get("arguments", "{}")
                if not isinstance(args, str):
                    args = json.dumps(args, ensure_ascii=False)
                tc_id = tc.get("id") or ""
                if not isinstance(tc_id, str):
                    raise BadRequest("%s.tool_calls[%d].id must be a string" % (where, j))
                msg.tool_calls.append(ToolCall(fn["name"], args, tc_id))
        for name in ("reasoning_content", "tool_call_id", "name"):
            val = m.get(name)
            if val is not None:
                if not isinstance(val, str):
                    raise BadRequest("%s.%s must be a string" % (where, name))
                setattr(msg, name, val)
        out.append(msg)
    media.count_check(out)
    return out


def tools_from(v):
    """OpenAI ``tools`` (functions only) as chat.Tool; None or [] gives []."""
    if v is None:
        return []
    if not isinstance(v, list):
        raise BadRequest("'tools' must be an array")
    out = []
    for i, t in enumerate(v):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest("tools[%d] must be {\"type\": \"function\", \"function\": "
                             "{\"name\": ..., \"parameters\": ...}}" % i)
        params = fn.get("parameters")
        out.append(tool_of(fn["name"], fn.get("description"), {} if params is None else params,
                           "tools[%d]" % i))
    return out


def tool_of(name, description, schema, where, schema_key="parameters"):
    """A Tool from a client's tool fields, the last step of every dialect's
    tools reader: a missing description is "", the schema must be an object."""
    description = description or ""
    if not isinstance(description, str) or not isinstance(schema, dict):
        raise BadRequest("%s: 'description' must be a string and '%s' an object"
                         % (where, schema_key))
    return Tool(name, description, schema)


def tool_choice_from(v, tools):
    """``tool_choice``: "auto" | "none" | "required", or the name of one of ``tools``."""
    if v is None:
        return "auto"
    if isinstance(v, str):
        if v not in ("auto", "none", "required"):
            raise BadRequest("'tool_choice' must be \"auto\", \"none\", \"required\" or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}")
        return v
    fn = v.get("function") if isinstance(v, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadRequest("'tool_choice' must be \"auto\", \"none\", \"required\" or "
                         "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if fn["name"] not in [t.name for t in tools]:
        raise BadRequest("'tool_choice' names %r, which is not in 'tools'" % fn["name"])
    return fn["name"]
