#!/usr/bin/env python3
"""Port llama.cpp's own reply-parser cases (tests/test-chat.cpp) into a data file.

    python3 scripts/port_chat_parse_cases.py [--src PINNED_LLAMA_CPP] [--out FILE]

The pinned source's ``test_template_output_peg_parsers`` (and the
``test_lfm2_parser`` it calls per template) states each case in a small
fluent C++ language::

    auto tst = peg_tester("models/templates/Qwen3.5-4B.jinja", detailed_debug);
    tst.test("I'm\\nthinking\\n</think>\\n\\nHello")
        .enable_thinking(true)
        .tools({ special_function_tool })
        .expect(message_assist_thoughts)
        .run();

This script reads that language -- C++ string literals (escaped, raw,
adjacent, joined with ``+``), the file's named tools and messages, brace
lists, ``simple_assist_msg(...)`` and its siblings, the loops over
templates, the local messages a block builds field by field -- and writes
one JSON object per ``.run()``: the template, the request (messages,
tools, reasoning format, thinking, ...), the model output, and the message
llama.cpp reads from it.  Statements that are not parser cases (blocks
that render a template and check the prompt) are skipped.  Nothing here is
a guess at what llama.cpp does: an unknown construct in a case is an error,
so the port is whole or fails loudly.

tests/test_chat_parse_cases.py runs every case through offgrid's reader.
"""

import argparse
import json
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))


# -- tokens -------------------------------------------------------------------------

_ESC = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "0": "\0",
        "a": "\a", "b": "\b", "f": "\f", "v": "\v", "?": "?"}

_TOKEN = re.compile(r"""
    (?P<ws>\s+|//[^\n]*|/\*.*?\*/|\#[^\n]*)
  | (?P<raw>u8R"|R")
  | (?P<str>u8"|")
  | (?P<char>'(?:[^'\\]|\\.)*')
  | (?P<num>\d+(?:\.\d+)?[uUlLfF]*)
  | (?P<id>[A-Za-z_][A-Za-z0-9_]*(?:::[A-Za-z_][A-Za-z0-9_]*)*)
  | (?P<op>->|::|&&|\|\||==|!=|<=|>=|[{}()\[\];,.=+*&<>!?:~|-])
""", re.S | re.X)


def _string_body(src, i):
    """An ordinary literal's text from just after its opening quote: (text, end)."""
    out = bytearray()
    while True:
        c = src[i]
        if c == '"':
            return out.decode("utf-8"), i + 1
        if c == "\\":
            e = src[i + 1]
            if e in _ESC:
                out += _ESC[e].encode()
                i += 2
            elif e == "x":
                m = re.compile(r"[0-9a-fA-F]+").match(src, i + 2)
                out.append(int(m.group(0), 16) & 0xFF)
                i = m.end()
            elif e in "uU":
                n = 4 if e == "u" else 8
                out += chr(int(src[i + 2:i + 2 + n], 16)).encode("utf-8")
                i += 2 + n
            elif e in "01234567":
                m = re.compile(r"[0-7]{1,3}").match(src, i + 1)
                out.append(int(m.group(0), 8) & 0xFF)
                i = m.end()
            else:
                raise SyntaxError("unknown escape \\%s" % e)
        else:
            out += c.encode("utf-8")
            i += 1


def tokenize(src):
    toks, i = [], 0
    while i < len(src):
        m = _TOKEN.match(src, i)
        if not m:
            raise SyntaxError("cannot read %r" % src[i:i + 40])
        kind = m.lastgroup
        if kind == "ws":
            i = m.end()
        elif kind == "raw":
            j = src.index("(", m.end())
            delim = ")" + src[m.end():j] + '"'
            k = src.index(delim, j + 1)
            toks.append(("str", src[j + 1:k]))
            i = k + len(delim)
        elif kind == "str":
            text, i = _string_body(src, m.end())
            toks.append(("str", text))
        else:
            toks.append((kind, m.group(0)))
            i = m.end()
    return toks


# -- values ---------------------------------------------------------------------------

def msg(role="assistant", content="", reasoning="", calls=(), **extra):
    m = {"role": role, "content": content, "reasoning_content": reasoning,
         "tool_calls": [dict(c) for c in calls], "content_parts": [],
         "tool_name": "", "tool_call_id": ""}
    m.update(extra)
    return m


def call(name, arguments="", id_=""):
    return {"name": name, "arguments": arguments, "id": id_}


def simple_assist_msg(content, reasoning="", name="", arguments="", id_=""):
    calls = [call(name, arguments, id_)] if name or id_ else []
    return msg("assistant", content, reasoning, calls)


def _as_str(v):
    if v == []:             # `{}` where a string is meant
        return ""
    if not isinstance(v, str):
        raise TypeError("not a string: %r" % (v,))
    return v


def _as_tool(v):
    if isinstance(v, dict):
        return v
    name, desc, params = v
    return {"name": _as_str(name), "description": _as_str(desc), "parameters": _as_str(params)}


def _as_call(v):
    if isinstance(v, dict):
        return v
    v = list(v) + [""] * (3 - len(v))
    return call(_as_str(v[0]), _as_str(v[1]), _as_str(v[2]))


def _as_msg(v):
    if isinstance(v, dict):
        return v
    # common_chat_msg's aggregate order: role, content, content_parts,
    # tool_calls, reasoning_content, tool_name, tool_call_id
    v = list(v) + [""] * (7 - len(v))
    parts = [{"type": _as_str(p[0]), "text": _as_str(p[1])} for p in (v[2] or [])]
    return msg(_as_str(v[0]), _as_str(v[1]), _as_str(v[4]), [_as_call(c) for c in (v[3] or [])],
               content_parts=parts, tool_name=_as_str(v[5]), tool_call_id=_as_str(v[6]))


FUNCTIONS = {
    "simple_assist_msg": lambda *a: simple_assist_msg(*map(_as_str, a)),
    "message_with_tool_calls": lambda n, a: simple_assist_msg("", "", n, a),
    "message_with_tool_calls_and_reasoning": lambda n, a, r: simple_assist_msg("", r, n, a),
    "message_with_content_and_tool_call": lambda c, n, a: simple_assist_msg(c, "", n, a),
    "message_with_reasoning_and_tool_call": lambda r, n, a: simple_assist_msg("", r, n, a),
    "message_with_reasoning_content_and_multiple_tool_calls":
        lambda r, c, calls: msg("assistant", c, r, [call(_as_str(n), _as_str(a))
                                                    for n, a in calls]),
    "std::string": lambda s="": _as_str(s),
}

ENUMS = {"true": True, "false": False, "detailed_debug": False, "nullptr": None}
for _name in ("NONE", "AUTO", "DEEPSEEK", "DEEPSEEK_LEGACY"):
    ENUMS["COMMON_REASONING_FORMAT_" + _name] = _name.lower().replace("_", "-")
for _name in ("AUTO", "REQUIRED", "NONE"):
    ENUMS["COMMON_CHAT_TOOL_CHOICE_" + _name] = _name.lower()
for _name in ("NONE", "CONTENT", "REASONING"):
    ENUMS["COMMON_CHAT_CONTINUATION_" + _name] = _name.lower()


class Skip(Exception):
    """A statement that is not a parser case (rendering checks, GGML_ASSERTs)."""


class Reader:
    """Walks the token list: declarations, blocks, loops and case chains."""

    def __init__(self, toks, globals_, functions_src):
        self.t, self.i = toks, 0
        self.scopes = [globals_]
        self.functions = functions_src
        self.cases = []

    # token helpers
    def peek(self, k=0):
        j = self.i + k
        return self.t[j] if j < len(self.t) else ("eof", "")

    def take(self, value=None):
        tok = self.peek()
        if value is not None and tok[1] != value:
            raise SyntaxError("expected %r, got %r near %r" % (value, tok[1], self.t[self.i:self.i + 8]))
        self.i += 1
        return tok

    def at(self, value):
        return self.peek()[1] == value and self.peek()[0] != "str"

    def lookup(self, name):
        for s in reversed(self.scopes):
            if name in s:
                return s[name]
        if name in ENUMS:
            return ENUMS[name]
        raise NameError(name)

    # expressions
    def expr(self):
        v = self.primary()
        while self.at("+"):
            self.take()
            v = _as_str(v) + _as_str(self.primary())
        return v

    def primary(self):
        kind, val = self.peek()
        if kind == "str":
            s = ""
            while self.peek()[0] == "str":
                s += self.take()[1]
            return s
        if kind == "num":
            self.take()
            return float(val.rstrip("uUlLfF")) if "." in val else int(val.rstrip("uUlL"))
        if val == "{":
            return self.brace()
        if kind == "id":
            self.take()
            if self.at("("):
                args = self.args()
                if val not in FUNCTIONS:
                    raise NameError("function " + val)
                return FUNCTIONS[val](*args)
            return self.lookup(val)
        raise SyntaxError("unexpected %r" % (val,))

    def args(self):
        self.take("(")
        out = []
        while not self.at(")"):
            out.append(self.expr())
            if self.at(","):
                self.take()
        self.take(")")
        return out

    def brace(self):
        self.take("{")
        out = []
        while not self.at("}"):
            out.append(self.expr())
            if self.at(","):
                self.take()
        self.take("}")
        return out

    # statements
    def skip_statement(self):
        """Past the statement here: to its ';' at depth 0, or its block."""
        depth = 0
        while True:
            kind, val = self.take()
            if kind == "eof":
                return
            if kind == "str":
                continue
            if val in "({[":
                depth += 1
            elif val in ")}]":
                depth -= 1
                if depth == 0 and val == "}" and not self.at(";") and not self.at("else") \
                        and not self.at("catch"):
                    return
            elif val == ";" and depth == 0:
                return

    def block(self):
        self.take("{")
        self.scopes.append({})
        while not self.at("}"):
            self.statement()
        self.take("}")
        self.scopes.pop()

    def statement(self):
        kind, val = self.peek()
        if val == "{" and kind == "op":
            return self.block()
        if val == "for":
            return self.for_loop()
        if val in ("if", "try", "GGML_ASSERT", "LOG_DBG", "LOG_INF", "LOG_ERR", "return", "throw"):
            return self.skip_statement()
        if kind == "id" and val in self.functions and self.peek(1)[1] == "(":
            self.take()
            args = self.args()
            self.take(";")
            return self.call_function(val, args)
        if self.case():             # a case that cannot be read is an error
            return
        start = self.i
        try:
            if self.declaration() or self.assignment():
                return
        except (NameError, Skip):
            pass
        self.i = start
        self.skip_statement()

    def declaration(self):
        """``[static|const] TYPE NAME (= EXPR | {...} | ;)`` for the types a case uses."""
        j = self.i
        while self.peek()[1] in ("static", "const"):
            self.take()
        kind, typ = self.peek()
        if typ not in ("auto", "common_chat_msg", "common_chat_tool", "std::string", "char"):
            self.i = j
            return False
        self.take()
        if self.at("*"):
            self.take()
        name = self.take()[1]
        scope = self.scopes[-1]
        if self.at(";"):
            self.take()
            scope[name] = msg("") if typ == "common_chat_msg" else ""
            return True
        if self.at("{"):
            v = self.brace()
            v = _as_tool(v) if typ == "common_chat_tool" else _as_msg(v)
        else:
            self.take("=")
            if self.peek()[1] == "peg_tester":
                self.take()
                path = self.args()[0]
                v = ("tester", path)
            else:
                v = self.expr()
        self.take(";")
        scope[name] = v
        return True

    def assignment(self):
        """``NAME.field = EXPR;`` on a message being built."""
        if not (self.peek()[0] == "id" and self.peek(1)[1] == "." and self.peek(3)[1] == "="):
            return False
        target = self.lookup(self.take()[1])
        self.take(".")
        field = self.take()[1]
        self.take("=")
        value = self.expr()
        self.take(";")
        if not isinstance(target, dict):
            raise Skip()
        target[field] = value
        return True

    def case(self):
        """``TESTER.test(INPUT).setting(...)...run();``"""
        name = self.peek()[1]
        if self.peek(1)[1] != "." or self.peek(2)[1] != "test":
            return False
        tester = self.lookup(name)
        if not (isinstance(tester, tuple) and tester[0] == "tester"):
            return False
        self.take(), self.take("."), self.take("test")
        case = {"template": tester[1].replace("models/templates/", ""),
                "input": _as_str(self.args()[0]), "params": {}, "expect": msg()}
        ran = False
        while self.at("."):
            self.take()
            method = self.take()[1]
            a = self.args()
            self.apply(case, method, a)
            ran = method == "run"
        self.take(";")
        if not ran:
            raise SyntaxError("a case without .run() at token %d" % self.i)
        self.cases.append(case)
        return True

    @staticmethod
    def apply(case, method, a):
        p, e = case["params"], case["expect"]
        if method in ("reasoning_format", "enable_thinking", "parallel_tool_calls",
                      "add_generation_prompt", "continue_final_message", "tool_choice",
                      "json_schema"):
            p[method] = a[0]
        elif method == "tools":
            p["tools"] = [_as_tool(t) for t in a[0]]
        elif method == "messages":
            p["messages"] = [_as_msg(m) for m in a[0]]
        elif method == "is_partial":
            case["is_partial"] = a[0]
        elif method == "expect":
            case["expect"] = dict(_as_msg(a[0]))
        elif method == "expect_content":
            e["content"] = _as_str(a[0])
        elif method == "expect_reasoning":
            e["reasoning_content"] = _as_str(a[0])
        elif method == "expect_tool_calls":
            e["tool_calls"] = [_as_call(c) for c in a[0]]
        elif method in ("expect_reconstruction", "run"):
            pass
        else:
            raise SyntaxError("unknown setting ." + method)

    def for_loop(self):
        """``for (const char * X : { "a", "b" }) BODY`` (or ``const auto & X``)."""
        self.take("for")
        self.take("(")
        while not self.at(":"):
            name = self.take()[1]
        self.take(":")
        values = self.expr()
        self.take(")")
        body = self.i
        for v in values:
            self.i = body
            self.scopes.append({name: v})
            self.statement()
            self.scopes.pop()

    def call_function(self, fname, args):
        params, toks = self.functions[fname]
        saved = self.t, self.i
        self.t, self.i = toks, 0
        self.scopes.append(dict(zip(params, args)))
        self.block()
        self.scopes.pop()
        self.t, self.i = saved


def _function(src, name):
    """(parameter names, tokens of the body) of ``static void NAME(...) {...}``."""
    m = re.search(r"static void %s\(([^)]*)\)\s*\{" % name, src)
    params = [p.split()[-1].lstrip("&*") for p in m.group(1).split(",")]
    toks = tokenize(src[m.end() - 1:])
    depth = 0
    for k, (kind, val) in enumerate(toks):
        if kind == "op" and val == "{":
            depth += 1
        elif kind == "op" and val == "}":
            depth -= 1
            if depth == 0:
                return params, toks[:k + 1]
    raise SyntaxError("no end of " + name)


def _globals(src):
    """The file's named tools, messages and helper values, before the cases."""
    head = src[:src.index("// Use for PEG parser implementations")]
    head = head[head.index("static common_chat_tool special_function_tool"):]
    r = Reader(tokenize(head), {}, {})
    while r.peek()[0] != "eof":
        start = r.i
        try:
            if r.declaration():
                continue
        except (NameError, SyntaxError, TypeError, ValueError):
            pass
        r.i = start
        r.skip_statement()
    return r.scopes[0]


def port(src_root):
    path = Path(src_root) / "tests" / "test-chat.cpp"
    src = path.read_text(encoding="utf-8")
    functions = {"test_lfm2_parser": _function(src, "test_lfm2_parser")}
    params, body = _function(src, "test_template_output_peg_parsers")
    r = Reader(body, _globals(src), functions)
    r.scopes.append({})
    r.block()
    for n, c in enumerate(r.cases):
        c["id"] = "%03d-%s" % (n, c["template"].replace(".jinja", ""))
    return r.cases


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    import tinymodels
    ap.add_argument("--src", default=str(tinymodels.llama_cpp_source()))
    ap.add_argument("--out", default=str(HERE.parent / "tests" / "golden" / "chat_parse_cases.json"))
    a = ap.parse_args()
    cases = port(a.src)
    templates = sorted({c["template"] for c in cases})
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump({"source": "tests/test-chat.cpp of the pinned llama.cpp "
                   "(scripts/port_chat_parse_cases.py)", "cases": cases}, f,
                  indent=1, ensure_ascii=False)
        f.write("\n")
    print("%d cases over %d templates -> %s" % (len(cases), len(templates), a.out))


if __name__ == "__main__":
    main()
