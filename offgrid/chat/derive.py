"""A template's call shape, derived from its own renderings (as llama.cpp's auto-parser).

For a template in no entry of chat/shapes.py, the markers of its calls are
found the way llama.cpp's ``chat-diff-analyzer.cpp`` finds them: render the
template with an assistant message that makes one call, then two, to tools
with recognisable names, arguments and values (the needles), and read the
markers around them::

    <tool_call>FN_NEEDLE\\n<arg_key>ARG_NEEDLE</arg_key>\\n<arg_value>VAL_NEEDLE</arg_value>\\n</tool_call>
    ^call       ^name    ^key     ^arg     ^key end        ^value     ^val       ^value end    ^call end

- the call's text is what the message adds after the generation prompt,
  less the end of the turn (a message with text content shows where that is);
- the arguments are JSON when the rendering holds them as a JSON object
  (``{"ARG_NEEDLE": "VAL_NEEDLE"}``): a whole JSON call object around the
  name is the "json" body, a name before the object "name-json";
  otherwise they are tagged, and the text between the needles splits into
  the markers of the name, the key and the value;
- the markers before the name open the calls and the call, and those after
  the last value close them in reverse; two calls in one message show which
  of them repeat per call.

What a rendering cannot show -- how an argument's value is encoded beyond
plain text, gemma-4's strings, Python-style calls -- is the declared table's.
``derive_shape`` returns None when the needles are not all where a shape
could be read from (the template writes no calls, or writes them in a form
no shape holds); the reply is then read as before.
"""

import json
import re

from ..request import Message, Tool, ToolCall
from .shapes import Shape

_WS = " \t\n\r\v\f"
FN, FN2, ARG, VAL = "FN_NEEDLE", "FN_TWO_NEEDLE", "ARG_NEEDLE", "VAL_NEEDLE"
_TOOLS = [Tool(n, "A tool.", {"type": "object", "properties": {ARG: {"type": "string"}},
                              "required": [ARG]}) for n in (FN, FN2)]
_USER = Message("user", "USER_NEEDLE")
# a marker, an opening marker still waiting for its name ('<function='), or a word
_TOKEN = re.compile(r"<[^<>]*>|<[^<>]*$|[^<>\s]+")


def _calls(*names):
    return [ToolCall(n, json.dumps({ARG: VAL}), "call%05d" % k) for k, n in enumerate(names)]


def turn_text(render, calls, tools=_TOOLS):
    """What an assistant message of ``calls`` adds to the prompt, less the
    turn's end: the calls as the model was taught to write them; None where
    the renderings do not line up."""
    gp = render([_USER], tools, True)
    text_turn = render([_USER, Message("assistant", "CONTENT_NEEDLE")], tools, False)
    call_turn = render([_USER, Message("assistant", "", tool_calls=calls)], tools, False)
    if gp is None or text_turn is None or call_turn is None:
        return None                 # the template refuses the probe: nothing derived
    k = text_turn.find("CONTENT_NEEDLE")
    if k < 0:
        return None
    head, end = text_turn[:k], text_turn[k + len("CONTENT_NEEDLE"):]
    # the generation prompt may open what the text turn opens too (a header)
    start = head if call_turn.startswith(head) else gp if call_turn.startswith(gp) else None
    if start is None:
        return None
    body = call_turn[len(start):]
    if end.strip(_WS) and body.rstrip(_WS).endswith(end.strip(_WS)):
        body = body.rstrip(_WS)[:-len(end.strip(_WS))]
    return body.strip(_WS)


def _tokens(text):
    return _TOKEN.findall(text)


def _split(between):
    """The text between two needles as (the closing part of the first, the
    opening part of the second): at the first blank, else before a second tag."""
    m = re.search(r"\s+", between)
    if m:
        return between[:m.start()], between[m.end():]
    k = between.find("<", 1)
    if k > 0:
        return between[:k], between[k:]
    if between.startswith("<"):
        return "", between
    return between, ""


def _json_object_at(text, needle_at):
    """(start, end, value) of the outermost JSON value around ``needle_at``, or None."""
    dec = json.JSONDecoder()
    best = None
    for s in range(needle_at, -1, -1):
        if text[s] not in "{[":
            continue
        try:
            v, e = dec.raw_decode(text, s)
        except ValueError:
            continue
        if e > needle_at:
            best = (s, e, v)
    return best


def _openers_closers(pre, post):
    """Markers before the name that open, and those after the arguments that close."""
    opens, closes = _tokens(pre), _tokens(post)
    return opens, closes


def derive_shape(render):
    """The Shape of a template's calls (see the module's docstring), or None.

    ``render(messages, tools, add_generation_prompt)`` is the template's
    rendering (None where the template refuses those messages)."""
    one = turn_text(render, _calls(FN))
    if not one or FN not in one or VAL not in one:
        return None
    two = turn_text(render, _calls(FN, FN2))
    f = one.find(FN)
    obj = _json_object_at(one, f)
    args_at = one.find('{"%s"' % ARG)
    if obj is not None and obj[0] < f:
        return _json_shape(one, two, obj)
    if args_at > f:
        return _name_json_shape(one, two, f, args_at)
    return _tagged_shape(one, two, f)


def _markers(pre, post, two, first_end):
    """section, call and the name's own prefix from the markers around one call,
    where ``two``'s text between the calls (from ``first_end``) shows which repeat."""
    opens, closes = _openers_closers(pre, post)
    name_prefix = ""
    if opens and not opens[-1].endswith(">"):
        name_prefix = opens.pop()           # '<function=', '<invoke name="'
    per_call = None
    if two and FN2 in two:
        between = two[first_end:two.find(FN2)]
        per_call = _tokens(between)
        if name_prefix and per_call and per_call[-1] == name_prefix:
            per_call = per_call[:-1]
        # a special token that ends the turn after the calls (<|eom_id|>) is no call's
        while closes and len(closes) > len(opens) and closes[-1] not in per_call \
                and not closes[-1].startswith("</"):
            closes.pop()
    section, call = ("", ""), ("", "")
    n = len(opens)
    if n and len(closes) >= n:
        pairs = list(zip(opens, reversed(closes[-n:])))
        repeated = per_call is not None and pairs and pairs[-1][0] in per_call \
            and pairs[-1][1] in per_call
        if n >= 2 or (n == 1 and per_call is not None and not repeated):
            section = ("".join(o for o, _ in pairs[:n - 1]) if n >= 2 else pairs[0][0],
                       "".join(c for _, c in reversed(pairs[:n - 1])) if n >= 2 else pairs[0][1])
            if n >= 2:
                call = pairs[-1]
        else:
            call = pairs[0]
        extra = closes[:len(closes) - n]
    else:
        extra = closes
    return section, call, name_prefix, extra


def _json_shape(one, two, obj):
    s, e, v = obj
    pre = one[:s].strip(_WS)
    # what closes the calls is the first marker after them; the rest is the
    # turn's (Command-R+ writes its next instructions there)
    after = _tokens(one[e:])
    post = after[0] if after else ""
    if not pre and not post:
        return None                         # a bare JSON call: the generic reader's
    return Shape("json", section=(pre, post))


def _name_json_shape(one, two, f, args_at):
    dec = json.JSONDecoder()
    try:
        _, args_end = dec.raw_decode(one, args_at)
    except ValueError:
        return None
    name_end = one[f + len(FN):args_at]
    first_end = args_end + len(one[args_end:]) - len(one[args_end:].lstrip(_WS))
    pre, post = one[:f], one[args_end:]
    second_args = two.find('{"%s"' % ARG, two.find(FN2)) if two and FN2 in two else -1
    section, call, name_prefix, extra = _markers(pre, post, two, args_end if second_args > 0
                                                 else first_end)
    if call != ("", ""):
        # the per-call opener is the name's prefix, what closes the call its close
        name_prefix = call[0] + name_prefix
        close = "".join(extra) + call[1]
    else:
        close = "".join(extra)
    return Shape("name-json", section=section, name=(name_prefix, name_end.strip(_WS) or "\n"),
                 close=close)


def _tagged_shape(one, two, f):
    a = one.find(ARG, f + len(FN))
    v = one.find(VAL, a + len(ARG)) if a > 0 else -1
    if a < 0 or v < 0:
        return None
    name_end, key_start = _split(one[f + len(FN):a])
    key_end, value_start = _split(one[a + len(ARG):v])
    if key_end.startswith('"') and key_end.endswith(">"):
        key_end = ">"                       # attributes after the key: read, not matched
    between = one[a + len(ARG):v]
    lines = between.endswith("\n") and one[v + len(VAL):].startswith("\n")
    post_tokens = _tokens(one[v + len(VAL):])
    if not post_tokens or not key_start:
        return None
    value_end = post_tokens[0]
    rest = one[v + len(VAL):]
    rest = rest[rest.find(value_end) + len(value_end):]
    first_end = len(one) - len(rest)
    section, call, name_prefix, extra = _markers(one[:f], rest, two, first_end)
    return Shape("name-tagged", section=section, call=call, name=(name_prefix, name_end),
                 key=(key_start, key_end), value=(value_start, value_end),
                 close="".join(extra), value_lines=lines)


def json_call_of(render):
    """How the template writes one call's JSON, for a shape whose body is
    "json": (the call object with the needles where the name and the
    arguments go, whether the calls are one JSON list), or None where its
    rendering shows no such object (chat/forced.py then writes the usual one)."""
    one = turn_text(render, _calls(FN))
    f = one.find(FN) if one else -1
    found = _json_object_at(one, f) if f >= 0 else None
    if found is None:
        return None
    v = found[2]
    listed = isinstance(v, list)
    if listed:
        v = v[0] if v else None
    text = json.dumps(v)
    if not isinstance(v, dict) or json.dumps(FN) not in text or \
            json.dumps({ARG: VAL}) not in text:
        return None                 # arguments as a string, or no call object at all
    return v, listed


def reads_own_call(render, read):
    """Whether ``read(text, tool_names)`` (a reader: the calls it finds, as
    ToolCalls) takes the template's own rendering of one call as that call;
    None where the template renders none to try."""
    one = turn_text(render, _calls(FN))
    if not one or FN not in one:
        return None
    calls = read(one, (FN, FN2))
    return [(c.name, _json_or_none(c.arguments)) for c in calls] == [(FN, {ARG: VAL})]


def _json_or_none(text):
    try:
        return json.loads(text)
    except ValueError:
        return None
