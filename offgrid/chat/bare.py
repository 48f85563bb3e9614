"""A reply that is nothing but a JSON call object: read, and held while it may become one.

Llama 3.x writes a call as bare JSON, and so do models taught the generic
form, and a small model the tool-call rescue watched (chat/rescue.py); a
reply that starts with "{" may be a call or may be an answer in JSON.
``bare_calls(text, fmt, partial)`` gives the calls, HOLD while the reply's
start can still become one, or None.  The JSON helpers here are also the
other readers' (chat/reply.py).
"""

import json
import logging
import re

from .. import jsonlimit
from ..request import ToolCall
from .rescue import call_key, copied_arguments, tool_by_arguments

_WS = " \t\n\r\v\f"

log = logging.getLogger("offgrid.chat")

_decoder = json.JSONDecoder()


def json_at(text, i):
    """(value, end) of the JSON value at text[i:], or (None, None) if there is none (yet)."""
    try:
        return _decoder.raw_decode(text, i)
    except ValueError:
        return None, None


def skip_ws(text, i):
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def arguments_text(args):
    if isinstance(args, str):
        try:
            jsonlimit.loads(args)
            return args
        except ValueError:
            return json.dumps(args, ensure_ascii=False)
    return json.dumps({} if args is None else args, ensure_ascii=False)


def call_from_json(obj):
    """A ToolCall from {"name", "arguments"|"parameters"} (or OpenAI's nested form), else None."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict) and "name" not in obj:
        inner = obj["function"]
        call = call_from_json(inner)
        if call is not None and isinstance(obj.get("id"), str):
            call.id = obj["id"]
        return call
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    if "arguments" in obj:
        args = obj["arguments"]
    elif "parameters" in obj:
        args = obj["parameters"]
    else:
        args = {}
    call = ToolCall(name, arguments_text(args))
    if isinstance(obj.get("id"), str):
        call.id = obj["id"]
    return call



# ---------------------------------------------------------------------------
# Bare JSON calls: a reply that is nothing but a call object
# ---------------------------------------------------------------------------
#
# Llama 3.x writes a call as bare JSON, and so do models taught the generic
# form; a reply to them that starts with "{" may be a call or may be an
# answer in JSON.  llama-server reads such a call only in the shape its
# grammar writes, {["type": "function",] "name": <a given tool>, "arguments"
# (or "parameters"): ...}; so a streamed reply is held back only while its
# start can still become that opener, and released as content the moment it
# cannot ({"city": ..., a name no tool has, a ```python fence, prose).  The
# opener is decided within OPENER_LIMIT characters or not at all, which
# bounds what is held before a call is known; once it is known the call is
# held whole, as every call is.  Hermes and Mistral templates mark their
# calls, so bare JSON there is content, as in llama-server.

# Every optional key of the longest generic opener (```json, a list, "type",
# an "id"), plus a name at OpenAI's 64-character limit, fits well within this.
OPENER_LIMIT = 200


class _More(Exception):
    """The text ended before the opener was decided."""


class _Opener:
    """A scan of the start of a reply for a bare call's opener.

    ``nested`` allows the generic form's extras: a ```json fence, a list of
    calls, {"tool_calls": [...]}, {"tool_call": {...}} and {"function": {...}}.
    """

    def __init__(self, text, names, nested, fence=None):
        self.s, self.i, self.names, self.nested = text, 0, names, nested
        self.fence = nested if fence is None else fence
        self.start = 0          # where the JSON value begins, after any fence

    def ws(self):
        self.i = skip_ws(self.s, self.i)

    def lit(self, word, optional=False):
        got = self.s[self.i:self.i + len(word)]
        if got == word:
            self.i += len(word)
            return True
        if self.i + len(got) == len(self.s) and word.startswith(got):
            raise _More()
        return optional and None

    def string(self, allowed=None):
        """A JSON string's raw text, or None if there is none or it cannot be in ``allowed``."""
        if not self.lit('"'):
            return None
        m = re.compile(r'(?:[^"\\]|\\.)*').match(self.s, self.i)
        end = m.end()
        if end == len(self.s) or self.s[end] == "\\":       # not closed yet
            if allowed is not None and not any(a.startswith(m.group(0)) for a in allowed):
                return None
            raise _More()
        self.i = end + 1
        value = m.group(0)
        return value if allowed is None or value in allowed else None

    def key(self, allowed):
        self.ws()
        k = self.string(allowed)
        if k is None:
            return None
        self.ws()
        return k if self.lit(":") else None

    def reply(self):
        self.ws()
        if self.fence and self.lit("```"):
            # its language: json, or any other a small model writes (markdown, ...)
            tag = re.compile(r"[A-Za-z0-9_+.-]{0,16}").match(self.s, self.i)
            if tag.end() == len(self.s):
                raise _More()
            self.i = tag.end()
            self.ws()
        self.start = self.i
        if self.nested and self.lit("[", optional=True):
            self.ws()
        return self.call()

    def call(self):
        if not self.lit("{"):
            return False
        keys = ["name", "type", "id"] + (["function", "tool_call", "tool_calls"]
                                         if self.nested else [])
        for _ in range(3):          # "type" and "id" may come before the name
            k = self.key(keys)
            if k is None:
                return False
            self.ws()
            if k == "name":
                if self.string(self.names or None) is None:
                    return False
                self.ws()
                return bool(self.lit(",") and self.key(["arguments", "parameters"]))
            if k in ("function", "tool_call"):
                return self.call()
            if k == "tool_calls":
                if not self.lit("["):
                    return False
                self.ws()
                return self.call()
            if k == "type" and self.string(["function"]) is None:
                return False
            if k == "id" and self.string() is None:
                return False
            self.ws()
            if not self.lit(","):
                return False
            keys = [x for x in keys if x != k]
        return False


HOLD = "hold"       # bare_calls: not decided yet, send nothing of it


def bare_calls(text, fmt, partial):
    """The calls when the whole of ``text`` is a bare call in the template's
    form; HOLD while (partial) it may still become one; else None."""
    # the generic form's extras where it is the template's form; the rescue's
    # (fmt.bare_calls) writes only {"name", "arguments"}, maybe in a fence
    nested = fmt.tool_syntax not in ("llama3", "hermes", "mistral")
    s = text.strip(_WS)
    # a rescued reply may name no tool and still be one's call by its arguments
    names = () if fmt.bare_calls and fmt.tool_args else fmt.tool_names
    scan = _Opener(s[:OPENER_LIMIT], names, nested, nested or fmt.bare_calls)
    try:
        if not scan.reply():
            return None
    except _More:
        return HOLD if partial and len(text.lstrip(_WS)) < OPENER_LIMIT else None
    obj, j = json_at(s, scan.start)
    if j is None:
        return HOLD if partial else None       # the call is still being written
    tail = s[j:].strip(_WS)
    fenced = s.startswith("```")
    if tail not in (("```", "") if fenced else ("",)):
        # only the closing fence may follow, and only while it is coming (a
        # rescued call ends at its object: its fence is never closed)
        return HOLD if partial and fenced and "```".startswith(tail) else None
    calls = _calls_of(obj, nested)
    if calls and fmt.bare_calls and fmt.tool_args:
        calls = [c if c.name in fmt.tool_names else _by_arguments(c, obj, fmt) for c in calls]
        if None in calls:
            return None
    if not calls or (fmt.tool_names and any(c.name not in fmt.tool_names for c in calls)):
        return None
    if partial:
        return HOLD                        # sent at the end: nothing may follow a bare call
    if fmt.bare_calls and fmt.tool_args:
        calls = [_without_copies(c, fmt) for c in calls]
    if fmt.finished_calls and any(call_key(c.name, c.arguments) in fmt.finished_calls
                                  for c in calls):
        log.debug("tool-call rescue: %s repeats a finished call; left as text",
                  ", ".join(c.name for c in calls))
        return None                         # the model's text: an agent's loop ends here
    return calls


def _without_copies(call, fmt):
    """A rescued call less the optional arguments copied out of its schema (rescue.py)."""
    try:
        args = json.loads(call.arguments)
    except ValueError:
        return call
    drop = copied_arguments(call.name, args, fmt.tool_args)
    if not drop:
        return call
    log.debug("tool-call rescue: %s's %s dropped (copied out of its schema)",
              call.name, ", ".join("%s=%s" % (k, json.dumps(args[k])[:60]) for k in drop))
    kept = {k: v for k, v in args.items() if k not in drop}
    return ToolCall(call.name, json.dumps(kept, ensure_ascii=False), call.id)


def _by_arguments(call, obj, fmt):
    """A call naming no tool, read as the one tool its arguments fit (rescue.py),
    or None.  Only an object with "name" and an "arguments" object qualifies
    (other keys beside them are the model's chatter)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("arguments"), dict):
        return None
    try:
        args = json.loads(call.arguments)
    except ValueError:
        return None
    found = tool_by_arguments(args, fmt.tool_args)
    if found is None:
        return None
    return ToolCall(found[0], json.dumps(found[1], ensure_ascii=False), call.id)


def _calls_of(obj, nested):
    """The calls a bare JSON value holds: one object, or (generic) a list or a wrapper."""
    if nested and isinstance(obj, list):
        found = [call_from_json(o) for o in obj]
    elif nested and isinstance(obj, dict) and isinstance(obj.get("tool_calls"), list):
        found = [call_from_json(o) for o in obj["tool_calls"]]
    elif nested and isinstance(obj, dict) and isinstance(obj.get("tool_call"), dict):
        found = [call_from_json(obj["tool_call"])]
    else:
        found = [call_from_json(obj)]
    return found if found and None not in found else None
