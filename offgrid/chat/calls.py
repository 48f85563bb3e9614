"""Reading calls in a family's shape (chat/shapes.py), whole or so far.

``read_calls(text, shape, partial, schemas)`` gives the content around the
calls, the calls, and whether a call is still being written.

A tagged argument's value is text; it is read as JSON (a number, a list)
unless the tool's schema says the argument is a string, which keeps "007"
and "true" strings (``typed_value``).

Streaming never takes back: while a call is unfinished, everything from its
opening marker is held; a text that ends with the beginning of an opening
marker holds that beginning; anything else is content at once.  A call is
sent once, whole.  What follows an opening marker and can never be a call
stays content.
"""

import ast
import json
import re

from .. import jsonlimit
from ..request import ToolCall
from .shapes import SHAPES, Shape

_WS = " \t\n\r\v\f"
_decoder = json.JSONDecoder()

# ---------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------

def schema_types(schema):
    """The JSON types a schema allows, through anyOf/oneOf; a string enum's is "string"."""
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    types = set(t) if isinstance(t, list) else {t} if isinstance(t, str) else set()
    for k in ("anyOf", "oneOf"):
        for sub in schema.get(k) or ():
            types |= schema_types(sub)
    if not types and isinstance(schema.get("enum"), list) \
            and all(isinstance(v, str) for v in schema["enum"]):
        types.add("string")
    return types


def typed_value(raw, schema):
    """A tagged argument's text as the value the tool's schema asks for: a
    string stays a string where the schema allows only text; otherwise JSON
    where the text is JSON, and the text itself where it is not."""
    types = schema_types(schema)
    if types and types <= {"string"}:
        return raw
    try:
        v = jsonlimit.loads(raw)
    except ValueError:
        return raw
    if isinstance(v, str) or (types and "string" in types and not _fits(v, types)):
        return raw
    return v


def _fits(v, types):
    kinds = {bool: "boolean", int: "integer", float: "number", list: "array", dict: "object",
             type(None): "null"}
    k = kinds.get(type(v))
    return k in types or (k == "integer" and "number" in types)


class _Incomplete(Exception):
    """The text ended inside a call."""


class _Broken(Exception):
    """What follows an opening marker is not a call."""


class _Reader:
    """One pass over the calls that start at an opening marker: each method
    takes the index to read from and returns what it read and the index after
    it, raising _Incomplete where the text ends first and _Broken where the
    text can never be what the shape says."""

    def __init__(self, text, shape, schemas, partial):
        self.s, self.shape, self.schemas, self.partial = text, shape, schemas, partial

    # -- low level
    def ws(self, i):
        while i < len(self.s) and self.s[i] in _WS:
            i += 1
        return i

    def lit(self, i, word, ws=True):
        """The index after ``word`` at i (after blanks), or raise."""
        if not word:
            return i
        j = self.ws(i) if ws else i
        if self.s.startswith(word, j):
            return j + len(word)
        if word.startswith(self.s[j:]):
            raise _Incomplete()
        raise _Broken()

    def opt(self, i, word):
        """Like lit, but None where ``word`` is not there (blanks skipped)."""
        try:
            return self.lit(i, word)
        except _Broken:
            return None

    def end_or_none(self, i, word):
        """Past ``word`` where it follows, else i: an end marker that may be
        left out (at the reply's end, or before what comes next)."""
        j = self.ws(i)
        if self.s.startswith(word, j):
            return j + len(word)
        if self.partial and word.startswith(self.s[j:j + len(word)]):
            raise _Incomplete()         # the text ends in it, or before it
        return i

    def until(self, i, word):
        k = self.s.find(word, i)
        if k < 0:
            raise _Incomplete()
        return self.s[i:k], k + len(word)

    def json_at(self, i):
        i = self.ws(i)
        if i >= len(self.s):
            raise _Incomplete()
        try:
            return _decoder.raw_decode(self.s, i)
        except ValueError:
            # a value that is not finished yet, or one that never will be
            if self.s[i] in "{[\"-0123456789tfn":
                raise _Incomplete() if self._unclosed(i) else _Broken()
            raise _Broken()

    def _unclosed(self, i):
        depth, in_str, esc = 0, False, False
        for c in self.s[i:]:
            if in_str:
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth < 0:
                    return False
        return depth > 0 or in_str or self.s[i] not in "{[\""

    # -- a reply
    def calls(self, i):
        """The calls from the opening marker at i: (calls, end)."""
        sh = self.shape
        if not sh.section[0] or not self.s.startswith(sh.section[0], i):
            return self.one(i)          # the next call is found as this one was
        i = self.lit(i, sh.section[0], ws=False)
        nxt = sh.call[0] or sh.name[0]
        out = []
        while True:
            j = self.ws(i)
            rest = self.s[j:j + 64]
            if sh.section[1] and rest.startswith(sh.section[1]):
                return out, j + len(sh.section[1])
            if out:
                if not rest:
                    if self.partial:
                        raise _Incomplete()
                    return out, j       # the closing marker may be end-of-generation
                if self.partial and sh.section[1] and sh.section[1].startswith(rest):
                    raise _Incomplete()
                starts = rest.startswith(nxt) if nxt else rest[:1] in ("{", "[")
                if not starts:
                    if self.partial and nxt and nxt.startswith(rest):
                        raise _Incomplete()
                    return out, i       # what follows is the model's text again
            found, i = self.one(i)
            out += found

    def one(self, i):
        """One call (json bodies: maybe a list of them) at i: ([ToolCall], end)."""
        sh = self.shape
        marked = True
        if sh.loose_call and not self.s.startswith(sh.call[0], self.ws(i)) \
                and not sh.call[0].startswith(self.s[self.ws(i):]):
            marked = False                  # <function=...> without <tool_call>
        else:
            i = self.lit(i, sh.call[0], ws=bool(sh.section[0]))
        j = self.ws(i)
        if j >= len(self.s):
            raise _Incomplete()
        if sh.body == "json" or (self.s[j] == "{" and sh.body != "gemma4"):
            calls, i = self.json_calls(j)
        elif sh.body == "name-json":
            calls, i = self.name_json(i)
        elif sh.body == "name-tagged":
            calls, i = self.name_tagged(i)
        elif sh.body == "xml":
            calls, i = self.xml_call(i)
        elif sh.body == "python":
            calls, i = self.python(j)
        else:
            calls, i = self.gemma4(j)
        if sh.call[1] and sh.sectionless:
            i = self.end_or_none(i, sh.call[1])
        elif sh.call[1] and marked:
            i = self.lit(i, sh.call[1])
        elif sh.call[1]:
            i = self.opt(i, sh.call[1]) or i   # its closing marker may still be written
        return calls, i

    def json_calls(self, i):
        v, end = self.json_at(i)
        found = v if isinstance(v, list) else [v]
        calls = [call_from_json(o, self.schemas) for o in found]
        if not calls or None in calls:
            raise _Broken()
        return calls, end

    def read_name(self, i):
        sh = self.shape
        i = self.lit(i, sh.name[0])
        if sh.name[1]:
            name, i = self.until(i, sh.name[1])
            if "\n" in name.strip(_WS) or len(name) > 256:
                raise _Broken()
            # the name's own attributes may follow it (Kimi K3's index="1")
            return name.split('"', 1)[0].strip(_WS), i
        # a name with no markers of its own may stand on a line of its own
        # (GLM's "<tool_call>\nNAME"), as llama.cpp's readers take it
        i = self.ws(i) if not sh.name[0] else i
        m = re.compile(r"[^\s<>{}\[\]()]+").match(self.s, i)
        if not m or m.end() == len(self.s):
            raise _Incomplete() if self.partial or not m else _Broken()
        return m.group(0), m.end()

    def name_json(self, i):
        sh = self.shape
        name, i = self.read_name(i)
        call_id = ""
        if sh.indexed_name:
            m = re.fullmatch(r"(?:functions\.)?(.+?)(?::\d+)?", name)
            call_id, name = name, m.group(1)
        fence = sh.fenced and self.opt(i, "```json")
        if fence:
            i = fence
        args, i = self.json_at(i)
        if not isinstance(args, dict):
            raise _Broken()
        if fence:
            i = self.lit(i, "```")
        i = self.lit(i, sh.close)
        return [ToolCall(name, json.dumps(args, ensure_ascii=False), call_id)], i

    def name_tagged(self, i):
        sh = self.shape
        name, i = self.read_name(i)
        props = _properties(self.schemas.get(name))
        args = {}
        while True:
            j = self.ws(i)
            if sh.close and self.s.startswith(sh.close, j):
                i = j + len(sh.close)
                break
            if not sh.close and sh.call[1] and self.s.startswith(sh.call[1], j):
                break
            rest = self.s[j:j + 64]
            if any(w and w.startswith(rest) and w != rest for w in (sh.key[0], sh.close,
                                                                    sh.call[1])):
                raise _Incomplete()         # the text ends in the next marker
            i = self.lit(j, sh.key[0], ws=False)
            key, i = self.until(i, sh.key[1])
            key, string = _attributes(key)
            if sh.value[0]:
                i = self.lit(i, sh.value[0])
            cdata = self.opt(i, "<![CDATA[")
            if cdata:                       # MiniCPM5: a value holding markup
                raw, i = self.until(cdata, "]]>")
                i = self.lit(i, sh.value[1])
            else:
                raw, i = self.until(i, sh.value[1])
            if sh.value_lines:
                raw = raw[1:] if raw.startswith("\n") else raw
                raw = raw[:-1] if raw.endswith("\n") else raw
            if string is True:
                args[key] = raw
            elif string is False:
                args[key] = typed_value(raw, {})
            else:
                args[key] = typed_value(raw, props.get(key))
        return [ToolCall(name, json.dumps(args, ensure_ascii=False))], i

    def xml_call(self, i):
        """<invoke name="NAME"> <KEY>VALUE</KEY>... </invoke>, after the namespace token."""
        sh = self.shape
        name, i = self.read_name(i)
        props = _properties(self.schemas.get(name))
        args = self.xml_children(i, sh.close, props, {})[0]
        value, i = args
        return [ToolCall(name, json.dumps(value, ensure_ascii=False))], i

    _TAG = re.compile(r"<([A-Za-z_][\w.:-]*)>")

    def xml_children(self, i, close, props, items_schema):
        """Elements up to ``close``: ((a dict, or a list for <item>s), end), []."""
        obj, items = {}, []
        ns = self.shape.ns
        while True:
            j = self.ws(i)
            if self.s.startswith(close, j):
                return ((items if items and not obj else obj), j + len(close)), []
            rest = self.s[j:j + 64]
            if close.startswith(rest) or (ns + "<").startswith(rest):
                raise _Incomplete()
            if not self.s.startswith(ns, j):
                raise _Broken()
            m = self._TAG.match(self.s, j + len(ns))
            if not m:
                raise _Incomplete() if ">" not in self.s[j + len(ns):j + 200] else _Broken()
            tag = m.group(1)
            schema = items_schema if tag == "item" else props.get(tag)
            v, i = self.xml_value(m.end(), tag, schema)
            if tag == "item":
                items.append(v)
            else:
                obj[tag] = v

    def xml_value(self, i, tag, schema):
        ns = self.shape.ns
        close = ns + "</" + tag + ">"
        j = self.ws(i)
        nested = self.s.startswith(ns + "<", j) and not self.s.startswith(close, j)
        if nested and "string" in schema_types(schema):
            # a string takes any text, so a union with a string is a string (llama.cpp)
            raw, i = self.until(i, close)
            return raw, i
        if nested:
            sub = schema if isinstance(schema, dict) else {}
            for alt in [sub] + list(sub.get("anyOf") or ()) + list(sub.get("oneOf") or ()):
                if isinstance(alt, dict) and ("properties" in alt or "items" in alt):
                    sub = alt
                    break
            return self.xml_children(i, close, _properties(sub),
                                     sub.get("items") if isinstance(sub, dict) else {})[0]
        if (ns + "<").startswith(self.s[j:j + 64]) and j < len(self.s):
            raise _Incomplete()
        raw, i = self.until(i, close)
        return typed_value(raw, schema), i

    def python(self, i):
        """[NAME(key=value, ...), ...] (LFM2): Python's own parser reads it."""
        i = self.lit(i, "[")
        k = self.s.find("]" + self.shape.section[1], i) if self.shape.section[1] else -1
        if k < 0:
            if self.shape.section[1] and self.shape.section[1] not in self.s[i:]:
                raise _Incomplete()
            raise _Broken()
        try:
            tree = ast.parse("[" + self.s[i:k] + "]", mode="eval").body
        except SyntaxError:
            raise _Broken()
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args:
                raise _Broken()
            name = _dotted(node.func)
            args = {kw.arg: _literal(kw.value) for kw in node.keywords}
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return calls, k + 1

    def gemma4(self, i):
        """call:NAME{key:value,...}: bare keys, <|"|>-quoted strings."""
        i = self.lit(i, "call:")
        m = re.compile(r"[^{\s]+").match(self.s, i)
        if not m or m.end() >= len(self.s):
            raise _Incomplete()
        name, i = m.group(0), m.end()
        v, i = _Gemma(self.s, i).value()
        if not isinstance(v, dict):
            raise _Broken()
        return [ToolCall(name, json.dumps(v, ensure_ascii=False))], i


class _Gemma:
    """gemma-4's argument notation, read into JSON values."""
    Q = '<|"|>'

    def __init__(self, s, i):
        self.s, self.i = s, i

    def value(self):
        s = self.s
        self.ws()
        if self.i >= len(s):
            raise _Incomplete()
        if s.startswith(self.Q, self.i):
            k = s.find(self.Q, self.i + len(self.Q))
            if k < 0:
                raise _Incomplete()
            v = s[self.i + len(self.Q):k]
            self.i = k + len(self.Q)
            return v, self.i
        c = s[self.i]
        if c in "{[":
            close = "}" if c == "{" else "]"
            out = {} if c == "{" else []
            self.i += 1
            while True:
                self.ws()
                if self.i >= len(s):
                    raise _Incomplete()
                if s[self.i] == close:
                    self.i += 1
                    return out, self.i
                if c == "{":
                    m = re.compile(r'"?([^":{}\[\],]+)"?\s*:').match(s, self.i)
                    if not m:
                        raise _Incomplete() if ":" not in s[self.i:] else _Broken()
                    self.i = m.end()
                    out[m.group(1).strip()] = self.value()[0]
                else:
                    out.append(self.value()[0])
                self.ws()
                if s.startswith(",", self.i):
                    self.i += 1
        m = re.compile(r'-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?|true|false|null|"(?:[^"\\]|\\.)*"') \
            .match(s, self.i)
        rest = s[self.i:self.i + 8]
        if not m or m.end() >= len(s):
            if any(w.startswith(rest) for w in (self.Q, "true", "false", "null")) or m:
                raise _Incomplete()
            raise _Broken()
        self.i = m.end()
        return json.loads(m.group(0)), self.i

    def ws(self):
        while self.i < len(self.s) and self.s[self.i] in _WS:
            self.i += 1


def _dotted(node):
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return _dotted(node.value) + "." + node.attr
    raise _Broken()


_PY_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False,
             "null": None}


def _literal(node):
    """A Python (or JSON) literal's value."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in _PY_NAMES:
        return _PY_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_literal(node.operand)
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {str(_literal(k)): _literal(v) for k, v in zip(node.keys, node.values)}
    raise _Broken()


def _attributes(key):
    """A tagged key's name, and whether its value is declared a string (DSML's
    ``name="x" string="true"``, Kimi K3's ``key="x" type="string"``):
    (name, True/False/None)."""
    name = key.split('"', 1)[0].strip(_WS)
    m = re.search(r'\bstring="(true|false)"', key)
    if m:
        return name, m.group(1) == "true"
    m = re.search(r'\btype="([a-z]+)"', key)
    if m:
        return name, m.group(1) == "string"
    return name, None


def _properties(schema):
    if isinstance(schema, dict) and isinstance(schema.get("properties"), dict):
        return schema["properties"]
    return {}


def call_from_json(obj, schemas=None):
    """A ToolCall from a JSON call object in any of the families' spellings, else None."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict) and "name" not in obj:
        return call_from_json(obj["function"], schemas)
    name = obj.get("name", obj.get("tool_name"))
    if name is None and len(obj) == 1 and isinstance(next(iter(obj.values())), dict):
        name, args = next(iter(obj.items()))      # {"NAME": {...arguments}} (Apertus)
    else:
        args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(name, str) or not name:
        return None
    if isinstance(args, str):
        try:
            args = jsonlimit.loads(args)
        except ValueError:
            return None
    call_id = obj.get("id", obj.get("tool_call_id", ""))
    return ToolCall(name, json.dumps({} if args is None else args, ensure_ascii=False),
                    call_id if isinstance(call_id, str) else "")


# ---------------------------------------------------------------------------
# The reply
# ---------------------------------------------------------------------------

def held_back(text, markers):
    """``text`` without a suffix that is the beginning of one of ``markers``."""
    cut = len(text)
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:n]):
                cut = min(cut, len(text) - n)
                break
    return text[:cut]


def as_shape(shape):
    """A Shape from its name in SHAPES, itself, or its fields (as a ReplyFormat carries it)."""
    if isinstance(shape, Shape):
        return shape
    if isinstance(shape, str):
        return SHAPES[shape]
    return Shape(**{k: tuple(v) if isinstance(v, list) else v for k, v in shape.items()})


def read_calls(text, shape_name, partial, schemas=None):
    """(content, calls, pending) of a reply in the named shape.

    ``schemas`` maps each tool's name to its parameters' schema (tagged
    values are typed by it).  ``pending``: a call is still being written,
    and everything from its opening marker is held.
    """
    shape = as_shape(shape_name)
    openers = shape.openers
    parts, calls, pos = [], [], 0
    while True:
        found_at = [(text.find(o, pos), o) for o in openers]
        found_at = [f for f in found_at if f[0] >= 0]
        if not found_at:
            tail = text[pos:]
            parts.append(held_back(tail, openers) if partial else tail)
            return "".join(parts), calls, False
        k, opener = min(found_at)
        parts.append(text[pos:k])
        r = _Reader(text, shape, schemas or {}, partial)
        try:
            found, end = r.calls(k)
        except _Incomplete:
            if partial:
                return "".join(parts), calls, True
            parts.append(text[k:])
            return "".join(parts), calls, False
        except (_Broken, RecursionError):
            parts.append(text[k:k + len(opener)])
            pos = k + len(opener)
            continue
        calls += found
        pos = end


# Recipients that are not tools: the user sees the message, the model's own is reasoning.
_TO_USER = ("all", "user")
_TO_SELF = ("self",)
_NAME_LIMIT = 64


def read_messages(text, shape, partial, schemas=None):
    """(content, reasoning, calls) of a reply that is a run of messages to
    recipients (Shape.recipients: Functionary v3.2, Muse); a message still
    being written is held, whole, until it is complete (a call) or shows
    whom it is for (text)."""
    shape = as_shape(shape)
    sep, name_end, ends = shape.recipients[0], shape.recipients[1], shape.recipients[2:]
    content, reasoning, calls = [], [], []
    chunks = text.split(sep)
    for k, chunk in enumerate(chunks):
        last = k == len(chunks) - 1
        head, found, body = chunk.partition(name_end)
        recipient = head.strip(_WS)
        if recipient.startswith("to="):
            recipient = recipient[3:]
        if not found:
            # a recipient's name is short: a longer text without one is plain
            # text (a reply with no messages), shown as it comes
            if recipient and (not partial or len(recipient) > _NAME_LIMIT):
                content.append(head)
            continue
        closed = [body.find(e) for e in ends if e in body]
        if closed:
            body = body[:min(closed)]
        elif partial and last:
            body = held_back(body, list(ends) + [sep])
        if recipient in _TO_USER:
            content.append(body)
        elif recipient in _TO_SELF:
            reasoning.append(body)
        elif partial and last and not closed:
            continue                            # a call, not whole yet
        elif shape.section[0] or shape.call[0] or shape.name[0]:
            got, found_calls, _ = read_calls(body, shape, False, schemas)
            calls += found_calls
            if got.strip(_WS):
                content.append(got)
        else:
            try:
                args = json.loads(body)
            except ValueError:
                content.append(body)
                continue
            calls.append(ToolCall(recipient, json.dumps(args, ensure_ascii=False)))
    return "".join(content).strip(_WS), \
        "\n\n".join(r.strip(_WS) for r in reasoning if r.strip(_WS)), calls

