"""A Jinja subset that renders chat templates exactly as llama-server does.

A GGUF model's chat template is Jinja.  llama-server renders it with its own
interpreter (llama.cpp ``common/jinja``), which differs from Python's Jinja2 in
small ways that change the prompt: whitespace control is always on
(``trim_blocks`` and ``lstrip_blocks``), ``None`` and objects print as
nothing, a filter is looked up by the type of its input, a macro sees the
variables of its caller, ``split()`` without arguments splits on one space.
This module follows llama.cpp's rules rather than Jinja2's, so the same
template and messages give the same prompt byte for byte.

    Template(source).render({"messages": [...], ...}) -> str

Three stages, read top to bottom: ``lex()`` turns the source into tokens,
``Parser`` builds a tree of nodes, and each node's ``eval(ctx)`` computes a
value.  Values, scopes and the builtins (filters, tests, methods, global
functions) live in .values, .functions and .builtins.

What is outside the subset -- ``{% include %}``, ``{% raw %}``, a filter a
type does not have, ``*args`` -- raises ``Unsupported`` naming it; a syntax
error raises ``TemplateSyntaxError``; the template's own
``raise_exception(msg)`` raises ``TemplateRaised``.  All three are
``TemplateError``, and every error says where in the template it happened.

Usage statistics: llama-server probes a template with sample messages and
watches which values the template touches, to learn whether it reads a
system message, tool calls, typed content and so on (``chat.detect_caps``).
A Context given a ``Stats`` records those touches; rendering without one
records nothing.

Known differences from llama.cpp: strings here are sequences of characters
where llama.cpp's are bytes, so ``length``, indexing and slicing differ for
text outside ASCII; nothing else is known to differ.
"""

import math

from .builtins import builtin
from .functions import GLOBALS, _test_in
from .values import (  # noqa: F401  (the first line is re-exported)
    TemplateError, TemplateSyntaxError, Unsupported, TemplateRaised, Stats, TrackedStr,
    Undefined, UNDEFINED, Func, Kwarg, Loop, Args, Context, _SPACE, _line_col, _key,
    as_int, equal, hashable, is_undefined, kind, to_str, truthy, type_name)


# ---------------------------------------------------------------------------
# Lexer
# ---------------------------------------------------------------------------

TEXT, NUMBER, STRING, NAME, EQUALS = "text", "number", "string", "name", "="
LPAREN, RPAREN, LBRACKET, RBRACKET, LBRACE, RBRACE = "(", ")", "[", "]", "{", "}"
COMMA, DOT, COLON, PIPE = ",", ".", ":", "|"
OPEN_STMT, CLOSE_STMT, OPEN_EXPR, CLOSE_EXPR, COMMENT = "{%", "%}", "{{", "}}", "comment"
ADD_OP, MUL_OP, CMP_OP, UNARY_OP, EOF = "additive", "multiplicative", "comparison", "unary", "eof"


class Token:
    __slots__ = ("type", "value", "pos")

    def __init__(self, type_, value, pos):
        self.type, self.value, self.pos = type_, value, pos

    def __repr__(self):
        return "Token(%s, %r)" % (self.type, self.value)


# Longest first where one is a prefix of another, as llama.cpp matches them.
_SYMBOLS = [
    ("{%-", OPEN_STMT), ("-%}", CLOSE_STMT), ("{{-", OPEN_EXPR), ("-}}", CLOSE_EXPR),
    ("{%", OPEN_STMT), ("%}", CLOSE_STMT), ("{{", OPEN_EXPR), ("}}", CLOSE_EXPR),
    ("(", LPAREN), (")", RPAREN), ("{", LBRACE), ("}", RBRACE), ("[", LBRACKET),
    ("]", RBRACKET), (",", COMMA), (".", DOT), (":", COLON), ("|", PIPE),
    ("<=", CMP_OP), (">=", CMP_OP), ("==", CMP_OP), ("!=", CMP_OP), ("<", CMP_OP),
    (">", CMP_OP), ("+", ADD_OP), ("-", ADD_OP), ("~", ADD_OP), ("*", MUL_OP),
    ("/", MUL_OP), ("%", MUL_OP), ("=", EQUALS),
]
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "v": "\v",
            "\\": "\\", "'": "'", '"': '"'}


def _is_word(c):
    return c == "_" or ("a" <= c <= "z") or ("A" <= c <= "Z") or ("0" <= c <= "9")


def lex(source):
    """The tokens of a template, and the normalised text positions refer to.

    Whitespace control is llama.cpp's: ``trim_blocks`` and ``lstrip_blocks``
    are always on, ``{%-``/``-%}`` strip all whitespace on their side, a
    single trailing newline of the template is dropped.
    """
    src = source.replace("\r\n", "\n").replace("\r", "\n")
    if source.endswith("\n"):
        src = src[:-1]
    n = len(src)
    tokens = []
    pos = 0
    curly_depth = 0

    def at(i):
        return src[i] if i < n else "\0"

    def next_is(chars, k=1):
        return pos + k < n and src[pos + k] in chars

    def error(msg, where):
        return TemplateSyntaxError(msg, _line_col(src, min(where, n)))

    def consume_while(pred):
        nonlocal pos
        out = []
        while pred(at(pos)):
            if pos >= n:
                raise error("unexpected end of template (an unclosed string?)", pos)
            c = src[pos]
            if c == "\\":
                pos += 1
                if pos >= n:
                    raise error("unexpected end of input after escape character", pos)
                e = src[pos]
                pos += 1
                if e not in _ESCAPES:
                    raise error("unknown escape character \\%s" % e, pos)
                out.append(_ESCAPES[e])
                continue
            out.append(c)
            pos += 1
        return "".join(out)

    def consume_numeric():
        nonlocal pos
        num = consume_while(lambda c: "0" <= c <= "9")
        if at(pos) == "." and "0" <= at(pos + 1) <= "9":
            pos += 1
            num += "." + consume_while(lambda c: "0" <= c <= "9")
        return num

    while pos < n:
        start_pos = pos
        last = tokens[-1].type if tokens else CLOSE_STMT
        if last in (CLOSE_STMT, CLOSE_EXPR, COMMENT):
            # text up to the next {% {{ {#
            is_rstrip = can_drop_newline = False
            if pos > 3:
                c0, c1, c2 = src[pos - 3], src[pos - 2], src[pos - 1]
                is_rstrip = c0 == "-" and c1 in "%}#" and c2 == "}"
                can_drop_newline = c1 in "#%-" and c2 == "}"
            start = end = pos
            while pos < n and not (src[pos] == "{" and next_is("%{#")):
                pos += 1
                end = pos
            if at(pos) == "{" and next_is("%#-"):
                # lstrip_blocks: spaces between a newline and a block go
                cur = end
                while cur > start:
                    c = src[cur - 1]
                    if cur == 1:
                        end = 0
                        break
                    if c == "\n":
                        end = cur
                        break
                    if c not in _SPACE:
                        break
                    cur -= 1
            text = src[start:end]
            if can_drop_newline and text.startswith("\n"):
                text = text[1:]             # trim_blocks
            if is_rstrip:
                text = text.lstrip(" \t\r\n")
            if at(pos) == "{" and next_is("{%#") and next_is("-", 2):
                text = text.rstrip(" \t\r\n")
            if text:
                tokens.append(Token(TEXT, text, start))
                continue

        if at(pos) == "{" and next_is("#"):
            start = pos
            pos += 2
            chars = []
            while not (at(pos) == "#" and next_is("}")):
                if pos + 2 >= n:
                    raise error("missing end of comment tag", pos)
                chars.append(src[pos])
                pos += 1
            tokens.append(Token(COMMENT, "".join(chars), start))
            pos += 2
            continue

        if at(pos) == "-" and last in (OPEN_EXPR, OPEN_STMT):
            pos += 1
            if pos >= n:
                break
        consume_while(lambda c: c in _SPACE and c != "\0")
        if pos >= n:
            break
        ch = src[pos]
        closing = ch == "-" and next_is("%}")
        if not closing and ch in "-+":
            start_pos = pos
            prev = tokens[-1].type if tokens else EOF
            if prev in (TEXT, EOF):
                raise error("unexpected character: %s" % ch, pos)
            if prev not in (NAME, NUMBER, STRING, RPAREN, RBRACKET):
                pos += 1                    # a unary sign: -1, -x, (+2)
                num = consume_numeric()
                tokens.append(Token(NUMBER if num else UNARY_OP, ch + num, start_pos))
                continue

        matched = False
        for seq, typ in _SYMBOLS:
            if seq == "}}" and curly_depth > 0:
                continue                    # inside an object literal
            if src.startswith(seq, pos):
                tokens.append(Token(typ, seq, pos))
                if typ == OPEN_EXPR:
                    curly_depth = 0
                elif typ == LBRACE:
                    curly_depth += 1
                elif typ == RBRACE:
                    curly_depth -= 1
                pos += len(seq)
                matched = True
                break
        if matched:
            continue

        if ch in "'\"":
            start_pos = pos
            pos += 1
            value = consume_while(lambda c, q=ch: c != q)
            tokens.append(Token(STRING, value, start_pos))
            pos += 1
            continue
        if "0" <= ch <= "9":
            start_pos = pos
            tokens.append(Token(NUMBER, consume_numeric(), start_pos))
            continue
        if _is_word(ch):
            start_pos = pos
            tokens.append(Token(NAME, consume_while(_is_word), start_pos))
            continue
        raise error("unexpected character: %s" % ch, pos)
    return tokens, src


# ---------------------------------------------------------------------------
# The tree, and how each node evaluates
# ---------------------------------------------------------------------------

class _Break(Exception):
    pass


class _Continue(Exception):
    pass


_PYTHON_ERRORS = (TypeError, ValueError, KeyError, IndexError, AttributeError,
                  ZeroDivisionError, OverflowError, RecursionError)


class Node:
    """A statement or expression; ``run`` evaluates it and locates any error."""
    __slots__ = ("pos",)
    label = "statement"

    def run(self, ctx):
        try:
            return self.eval(ctx)
        except (_Break, _Continue):
            raise
        except TemplateError as e:
            if e.where is None:
                e.where = _line_col(ctx.source, self.pos)
            raise
        except _PYTHON_ERRORS as e:
            raise TemplateError("%s: %s" % (type(e).__name__, e), _line_col(ctx.source, self.pos))

    def eval(self, ctx):
        raise Unsupported("%s cannot be evaluated" % self.label)


def render_parts(value, out):
    """Append what a value prints as: strings and numbers; lists item by item; else nothing."""
    k = kind(value)
    if k == "str":
        out.append(value)
    elif k in ("int", "float", "bool"):
        out.append(to_str(value))
    elif k in ("array", "tuple"):
        for x in value:
            render_parts(x, out)


def run_body(stmts, ctx):
    out = []
    for s in stmts:
        render_parts(s.run(ctx), out)
    return "".join(out)


class Text(Node):
    __slots__ = ("value",)
    label = "text"

    def __init__(self, value):
        self.value = value

    def eval(self, ctx):
        return self.value


class Comment(Node):
    __slots__ = ()

    def eval(self, ctx):
        return UNDEFINED


class Noop(Comment):
    __slots__ = ()


class Name(Node):
    __slots__ = ("name",)
    label = "name"

    def __init__(self, name):
        self.name = name

    def eval(self, ctx):
        v = ctx.get(self.name)
        if not is_undefined(v):
            if ctx.stats is not None:
                ctx.stats.mark(v)
            return v
        fn = GLOBALS.get(self.name)
        if fn is not None:
            return Func(self.name, fn)
        return v


class ArrayLiteral(Node):
    __slots__ = ("items",)

    def __init__(self, items):
        self.items = items

    def eval(self, ctx):
        return [x.run(ctx) for x in self.items]


class TupleLiteral(ArrayLiteral):
    __slots__ = ()

    def eval(self, ctx):
        return tuple(x.run(ctx) for x in self.items)


class ObjectLiteral(Node):
    __slots__ = ("pairs",)

    def __init__(self, pairs):
        self.pairs = pairs

    def eval(self, ctx):
        out = {}
        for k, v in self.pairs:
            key = _key(k.run(ctx))
            out[key] = v.run(ctx)
        return out


class Binary(Node):
    __slots__ = ("op", "left", "right")
    label = "expression"

    def __init__(self, op, left, right):
        self.op, self.left, self.right = op, left, right

    def eval(self, ctx):
        op = self.op
        a = self.left.run(ctx)
        if op == "and":
            return self.right.run(ctx) if truthy(a) else a
        if op == "or":
            return a if truthy(a) else self.right.run(ctx)
        b = self.right.run(ctx)
        if op == "==":
            return equal(a, b)
        if op == "!=":
            return not equal(a, b)
        ka, kb = kind(a), kind(b)
        membership = op in ("in", "not in")

        def concat_with_nothing():
            if (ka in ("none", "undefined") and kb == "str") or \
                    (kb in ("none", "undefined") and ka == "str"):
                return (a if ka == "str" else "") + (b if kb == "str" else "")
            return None

        if ka == "undefined" or kb == "undefined":
            if kb == "undefined" and membership:
                return op == "not in"
            if op in ("+", "~"):
                s = concat_with_nothing()
                if s is not None:
                    return s
            raise TemplateError("cannot apply '%s' to an undefined value" % op)
        if ka == "none" or kb == "none":
            if kb != "none" and membership:
                found = _test_in(Args(ctx, [a, b], "in"))
                return found if op == "in" else not found
            if op in ("+", "~"):
                s = concat_with_nothing()
                if s is not None:
                    return s
            raise TemplateError("cannot apply '%s' to none" % op)
        if ka in ("int", "float") and kb in ("int", "float"):
            is_float = ka == "float" or kb == "float"
            x, y = float(a), float(b)
            if op in ("+", "-", "*"):
                if not is_float:
                    return a + b if op == "+" else (a - b if op == "-" else a * b)
                return x + y if op == "+" else (x - y if op == "-" else x * y)
            if op == "/":
                if y == 0:      # IEEE division, as in C++
                    return math.copysign(math.inf, x) * math.copysign(1.0, y) if x else math.nan
                return x / y
            if op == "%":
                if y == 0:
                    if is_float:
                        return math.nan
                    raise TemplateError("integer modulo by zero")
                r = math.fmod(x, y)
                return r if is_float else int(r)
            if op == "<":
                return x < y
            if op == ">":
                return x > y
            if op == ">=":
                return x >= y
            if op == "<=":
                return x <= y
        if ka in ("array", "tuple") and kb in ("array", "tuple"):
            if op == "+":
                return list(a) + list(b)
        elif kb in ("array", "tuple") and membership:
            found = _test_in(Args(ctx, [a, b], "in"))
            return found if op == "in" else not found
        if (ka == "str" or kb == "str") and op in ("~", "+"):
            return to_str(a) + to_str(b)
        if op == "*" and ((ka == "str" and kb == "int") or (ka == "int" and kb == "str")):
            return (a if ka == "str" else b) * max(0, b if kb == "int" else a)
        if ka == "str" and kb == "str" and membership:
            found = _test_in(Args(ctx, [a, b], "in"))
            return found if op == "in" else not found
        if kb == "object" and membership:
            found = _test_in(Args(ctx, [a, b], "in"))
            return found if op == "in" else not found
        raise TemplateError("unknown operator '%s' between %s and %s"
                            % (op, type_name(a), type_name(b)))


class Unary(Node):
    __slots__ = ("op", "operand")

    def __init__(self, op, operand):
        self.op, self.operand = op, operand

    def eval(self, ctx):
        v = self.operand.run(ctx)
        if self.op == "not":
            return not truthy(v)
        k = kind(v)
        if k not in ("int", "float"):
            raise TemplateError("unary %s needs a number, got %s" % (self.op, type_name(v)))
        return -v if self.op == "-" else v


class Ternary(Node):
    __slots__ = ("test", "if_true", "if_false")

    def __init__(self, test, if_true, if_false):
        self.test, self.if_true, self.if_false = test, if_true, if_false

    def eval(self, ctx):
        return self.if_true.run(ctx) if truthy(self.test.run(ctx)) else self.if_false.run(ctx)


class Select(Node):
    """``value if test`` without ``else`` (also the filter of a for loop)."""
    __slots__ = ("value", "test")

    def __init__(self, value, test):
        self.value, self.test = value, test

    def eval(self, ctx):
        if not truthy(self.test.run(ctx)):
            return UNDEFINED
        return self.value.run(ctx)


class KwargNode(Node):
    __slots__ = ("key", "value")

    def __init__(self, key, value):
        self.key, self.value = key, value

    def eval(self, ctx):
        if type(self.key) is not Name:
            raise TemplateSyntaxError("a keyword argument's name must be an identifier")
        return Kwarg(self.key.name, self.value.run(ctx))


class Spread(Node):
    __slots__ = ("value",)
    label = "*args (argument unpacking)"

    def __init__(self, value):
        self.value = value


class SliceNode(Node):
    __slots__ = ("start", "stop", "step")

    def __init__(self, start, stop, step):
        self.start, self.stop, self.step = start, stop, step


class Blank(Node):
    """``x[]``: an empty subscript."""
    __slots__ = ()

    def eval(self, ctx):
        return UNDEFINED


class Member(Node):
    """``obj.name``, ``obj[expr]``, ``obj[a:b:c]``."""
    __slots__ = ("obj", "prop", "computed")

    def __init__(self, obj, prop, computed):
        self.obj, self.prop, self.computed = obj, prop, computed

    def eval(self, ctx):
        obj = self.obj.run(ctx)
        prop = self.prop
        stats = ctx.stats
        if self.computed:
            if type(prop) is SliceNode:
                return self._slice(ctx, obj, prop)
            key = prop.run(ctx)
        elif type(prop) is Text and isinstance(prop.value, int):
            key = prop.value
        else:
            if type(prop) is not Name:
                raise TemplateSyntaxError("a property after '.' must be a name")
            key = prop.name
            # obj.items is the method even when obj has an 'items' key, as in Jinja2
            v = builtin(ctx, key, obj, True)
            if not is_undefined(v):
                return v
        val = Undefined("object_property")
        if is_undefined(key):
            return val
        if not hashable(key):
            raise TemplateError("a value of type %s cannot be used as a key" % type_name(key))
        ko, kk = kind(obj), kind(key)
        if ko == "undefined":
            return val
        if ko == "object":
            name = to_str(key)
            val = obj.get(_key(key), val)
            if is_undefined(val):
                val = builtin(ctx, name, obj, True)
        elif ko in ("array", "tuple", "str"):
            if kk in ("int", "bool"):
                i = int(key)
                if ko != "str" and i < 0:
                    i += len(obj)
                if 0 <= i < len(obj):
                    val = obj[i]
            elif kk == "str":
                val = builtin(ctx, key, obj, True)
        else:
            if kk != "str":
                raise TemplateError("cannot access a property of %s with a %s"
                                    % (type_name(obj), type_name(key)))
            val = builtin(ctx, key, obj, True)
        if stats is not None:
            stats.mark(val)
            stats.mark(key)
            stats.mark(obj)
            if ko == "object" or kk in ("str", "float", "array", "tuple", "none"):
                stats.mark(obj, "object_access")
            elif kk in ("int", "bool"):
                stats.mark(obj, "array_access")
        return val

    @staticmethod
    def _slice(ctx, obj, s):
        size = len(obj) if kind(obj) in ("array", "tuple", "str") else 0
        step = s.step.run(ctx) if s.step is not None else 1
        back = as_int(step) < 0
        start = s.start.run(ctx) if s.start is not None else (size - 1 if back else 0)
        stop = s.stop.run(ctx) if s.stop is not None else (-1 if back else size)
        return builtin(ctx, "slice", obj).call(Args(ctx, [start, stop, step]))


class Call(Node):
    __slots__ = ("callee", "args")

    def __init__(self, callee, args):
        self.callee, self.args = callee, args

    def eval(self, ctx):
        args = [a.run(ctx) for a in self.args]
        fn = self.callee.run(ctx)
        if type(fn) is not Func:
            what = self.callee.name if type(self.callee) is Name else type_name(fn)
            if type(self.callee) is Name and is_undefined(fn):
                raise Unsupported("unknown function '%s'" % what)
            raise TemplateError("%s is not callable" % what)
        return fn.call(Args(ctx, args))


def apply_filter(ctx, flt, value):
    """``value | flt`` where flt is a name or a call (llama.cpp looks it up on value's type)."""
    if type(flt) is Name:
        name, arg_nodes = flt.name, []
    elif type(flt) is Call and type(flt.callee) is Name:
        name, arg_nodes = flt.callee.name, flt.args
    else:
        raise TemplateSyntaxError("a filter must be a name or a call")
    name = {"count": "length", "d": "default", "e": "escape", "trim": "strip"}.get(name, name)
    if name in ("capitalize", "lower", "replace", "strip", "title", "upper", "wordcount") \
            and kind(value) not in ("undefined", "str"):
        value = to_str(value)
    args = [a.run(ctx) for a in arg_nodes]
    return builtin(ctx, name, value).call(Args(ctx, args))


class Filter(Node):
    __slots__ = ("value", "filter")

    def __init__(self, value, flt):
        self.value, self.filter = value, flt

    def eval(self, ctx):
        return apply_filter(ctx, self.filter, self.value.run(ctx))


class Test(Node):
    """``value is [not] name`` or ``value is name(args)`` / ``value is name arg``."""
    __slots__ = ("value", "negate", "test")

    def __init__(self, value, negate, test):
        self.value, self.negate, self.test = value, negate, test

    def eval(self, ctx):
        v = self.value.run(ctx)
        args = [v]
        if type(self.test) is Name:
            name = self.test.name
        elif type(self.test) is Call and type(self.test.callee) is Name:
            name = self.test.callee.name
            args += [a.run(ctx) for a in self.test.args]
        else:
            raise TemplateSyntaxError("a test must be a name")
        fn = GLOBALS.get("test_is_" + name)
        if fn is None:
            raise Unsupported("unknown test '%s'" % name)
        if ctx.stats is not None:
            ctx.stats.mark(v, "test_is_" + name)
        r = fn(Args(ctx, args, name))
        return (not truthy(r)) if self.negate else r


class If(Node):
    __slots__ = ("test", "body", "orelse")

    def __init__(self, test, body, orelse):
        self.test, self.body, self.orelse = test, body, orelse

    def eval(self, ctx):
        return run_body(self.body if truthy(self.test.run(ctx)) else self.orelse, ctx)


class For(Node):
    __slots__ = ("target", "iterable", "body", "orelse")

    def __init__(self, target, iterable, body, orelse):
        self.target, self.iterable, self.body, self.orelse = target, iterable, body, orelse

    def eval(self, ctx):
        scope = ctx.child()
        it_node, cond = self.iterable, None
        if type(it_node) is Select:
            it_node, cond = it_node.value, it_node.test
        seq = it_node.run(scope)
        stats = ctx.stats
        if stats is not None:
            stats.mark(seq, "array_access")
        if is_undefined(seq):
            seq = []
        k = kind(seq)
        if k not in ("array", "tuple", "object"):
            raise TemplateError("cannot loop over a value of type %s" % type_name(seq))
        if k == "object":
            items = [tuple(kv) for kv in seq.items()]
            if stats is not None:
                stats.mark(seq, "object_access")
        else:
            items = list(seq)
            if stats is not None:
                stats.mark(seq, "array_access")

        target = self.target
        kept, values = [], []
        for item in items:
            if type(target) is Name:
                current = item[0] if k == "object" else item
                bind = [(target.name, current)]
            elif type(target) is TupleLiteral:
                current = item
                if kind(current) not in ("array", "tuple"):
                    raise TemplateError("cannot unpack a value of type %s" % type_name(current))
                if len(target.items) != len(current):
                    raise TemplateError("too %s items to unpack"
                                        % ("few" if len(target.items) > len(current) else "many"))
                bind = []
                for name_node, v in zip(target.items, current):
                    if type(name_node) is not Name:
                        raise TemplateSyntaxError("can only unpack into names")
                    bind.append((name_node.name, v))
            else:
                raise TemplateSyntaxError("invalid loop variable")
            if cond is not None:
                test_scope = scope.child()
                for name, v in bind:
                    test_scope.set(name, v)
                if not truthy(cond.run(test_scope)):
                    continue
            kept.append(current)
            values.append(bind)

        out = []
        n = len(kept)
        no_iteration = True
        for i in range(n):
            loop = Loop(index=i + 1, index0=i, revindex=n - i, revindex0=n - i - 1,
                        first=i == 0, last=i == n - 1, length=n,
                        previtem=kept[i - 1] if i > 0 else Undefined("previtem"),
                        nextitem=kept[i + 1] if i < n - 1 else Undefined("nextitem"))
            scope.set("loop", loop)
            for name, v in values[i]:
                scope.set(name, v)
            try:
                for stmt in self.body:
                    render_parts(stmt.run(scope), out)
            except _Continue:
                continue
            except _Break:
                break
            no_iteration = False
        if no_iteration:
            for stmt in self.orelse:
                render_parts(stmt.run(ctx), out)
        return "".join(out)


class BreakNode(Node):
    __slots__ = ()

    def eval(self, ctx):
        raise _Break()


class ContinueNode(Node):
    __slots__ = ()

    def eval(self, ctx):
        raise _Continue()


class SetNode(Node):
    __slots__ = ("target", "value", "body")

    def __init__(self, target, value, body):
        self.target, self.value, self.body = target, value, body

    def eval(self, ctx):
        rhs = self.value.run(ctx) if self.value is not None else run_body(self.body, ctx)
        t = self.target
        if type(t) is Name:
            ctx.set(t.name, rhs)
        elif type(t) is TupleLiteral:
            if kind(rhs) not in ("array", "tuple"):
                raise TemplateError("cannot unpack a value of type %s" % type_name(rhs))
            if len(rhs) != len(t.items):
                raise TemplateError("wrong number of values to unpack in set")
            for name_node, v in zip(t.items, rhs):
                if type(name_node) is not Name:
                    raise TemplateSyntaxError("can only unpack into names")
                ctx.set(name_node.name, v)
        elif type(t) is Member:
            if t.computed or type(t.prop) is not Name:
                raise TemplateSyntaxError("can only assign to obj.name")
            obj = t.obj.run(ctx)
            if kind(obj) != "object":
                raise TemplateError("cannot assign a property of %s" % type_name(obj))
            obj[t.prop.name] = rhs
        else:
            raise TemplateSyntaxError("invalid target of set")
        return UNDEFINED


def _bind_parameters(name, params, args, ctx):
    """Bind a macro's parameters the way llama.cpp does (keyword args also count as positions)."""
    for i, p in enumerate(params):
        if i < len(args.items):
            if type(p) is Name:
                ctx.set(p.name, args.kwarg_or_pos(p.name, i))
            elif type(p) is KwargNode and type(p.key) is Name:
                ctx.set(p.key.name, args.kwarg_or_pos(p.key.name, i))
            else:
                raise TemplateSyntaxError("invalid parameter of '%s'" % name)
        elif type(p) is KwargNode and type(p.key) is Name:
            ctx.set(p.key.name, p.value.run(args.ctx))
        else:
            raise TemplateError("not enough arguments for '%s'" % name)


class Macro(Node):
    __slots__ = ("name", "params", "body")

    def __init__(self, name, params, body):
        self.name, self.params, self.body = name, params, body

    def eval(self, ctx):
        if type(self.name) is not Name:
            raise TemplateSyntaxError("a macro's name must be an identifier")
        name = self.name.name

        def invoke(args):
            scope = args.ctx.child()        # the caller's variables, as in llama.cpp
            _bind_parameters(name, self.params, args, scope)
            return run_body(self.body, scope)

        ctx.set(name, Func(name, invoke))
        return UNDEFINED


class CallBlock(Node):
    """``{% call(args) macro(...) %}body{% endcall %}``: the body is ``caller()``."""
    __slots__ = ("call", "caller_params", "body")

    def __init__(self, call, caller_params, body):
        self.call, self.caller_params, self.body = call, caller_params, body

    def eval(self, ctx):
        fn = self.call.callee.run(ctx)
        if type(fn) is not Func:
            raise TemplateError("%s is not callable" % type_name(fn))
        caller_ctx = ctx.child()

        def caller(args):
            scope = caller_ctx.child()
            _bind_parameters("caller", self.caller_params, args, scope)
            return run_body(self.body, scope)

        call_ctx = ctx.child()
        call_ctx.set("caller", Func("caller", caller))
        args = [a.run(ctx) for a in self.call.args]
        return fn.call(Args(call_ctx, args))


class FilterBlock(Node):
    __slots__ = ("filter", "body")

    def __init__(self, flt, body):
        self.filter, self.body = flt, body

    def eval(self, ctx):
        return apply_filter(ctx, self.filter, run_body(self.body, ctx))


# ---------------------------------------------------------------------------
# Parser
# ---------------------------------------------------------------------------

_KNOWN_UNSUPPORTED = {
    "include": "{% include %}", "import": "{% import %}", "from": "{% from ... import %}",
    "extends": "{% extends %}", "block": "{% block %}", "raw": "{% raw %}",
    "with": "{% with %}", "autoescape": "{% autoescape %}", "do": "{% do %}",
    "trans": "{% trans %}",
}


class Parser:
    """Tokens to a list of nodes, with llama.cpp's grammar and precedences."""

    def __init__(self, tokens, source):
        self.tokens, self.source, self.i = tokens, source, 0

    # -- token helpers --
    def peek(self, k=0):
        j = self.i + k
        return self.tokens[j] if j < len(self.tokens) else Token(EOF, "", len(self.source))

    def next(self):
        if self.i >= len(self.tokens):
            raise self.error("unexpected end of template", len(self.source))
        t = self.tokens[self.i]
        self.i += 1
        return t

    def error(self, msg, pos=None, cls=TemplateSyntaxError):
        pos = self.peek().pos if pos is None else pos
        return cls(msg, _line_col(self.source, pos))

    def expect(self, type_, what):
        t = self.peek()
        if t.type != type_:
            raise self.error("expected %s, got %r" % (what, t.value or t.type))
        self.i += 1
        return t

    def expect_name(self, name):
        t = self.peek()
        if t.type != NAME or t.value != name:
            raise self.error("expected '%s', got %r" % (name, t.value or t.type))
        self.i += 1

    def is_(self, type_):
        return self.peek().type == type_

    def is_name(self, name):
        t = self.peek()
        return t.type == NAME and t.value == name

    def at_statement(self, *names):
        if self.peek().type == EOF:
            raise self.error("unexpected end of template: missing {%% %s %%}" % names[-1])
        return self.peek().type == OPEN_STMT and self.peek(1).type == NAME \
            and self.peek(1).value in names

    def node(self, cls, pos, *args):
        n = cls(*args)
        n.pos = pos
        return n

    # -- statements --
    def parse(self):
        body = []
        while self.i < len(self.tokens):
            body.append(self.parse_any())
        return body

    def parse_any(self):
        t = self.peek()
        if t.type == COMMENT:
            self.i += 1
            return self.node(Comment, t.pos)
        if t.type == TEXT:
            self.i += 1
            return self.node(Text, t.pos, t.value)
        if t.type == OPEN_STMT:
            return self.parse_statement()
        if t.type == OPEN_EXPR:
            self.i += 1
            e = self.parse_expression()
            self.expect(CLOSE_EXPR, "}}")
            return e
        raise self.error("unexpected %r" % (t.value or t.type))

    def block_until(self, *names):
        body = []
        while not self.at_statement(*names):
            body.append(self.parse_any())
        return body

    def end(self, name):
        self.expect(OPEN_STMT, "{%")
        self.expect_name(name)
        self.expect(CLOSE_STMT, "%}")

    def parse_statement(self):
        self.expect(OPEN_STMT, "{%")
        t = self.peek()
        if t.type != NAME:
            raise self.error("expected a statement name after {%")
        self.i += 1
        name, pos = t.value, t.pos
        if name == "set":
            return self.parse_set(pos)
        if name == "if":
            n = self.parse_if(pos)
            self.end("endif")
            return n
        if name == "macro":
            mname = self.parse_primary()
            params = self.parse_args()
            self.expect(CLOSE_STMT, "%}")
            body = self.block_until("endmacro")
            self.end("endmacro")
            return self.node(Macro, pos, mname, params, body)
        if name == "for":
            n = self.parse_for(pos)
            self.end("endfor")
            return n
        if name == "break":
            self.expect(CLOSE_STMT, "%}")
            return self.node(BreakNode, pos)
        if name == "continue":
            self.expect(CLOSE_STMT, "%}")
            return self.node(ContinueNode, pos)
        if name == "call":
            caller_params = self.parse_args() if self.is_(LPAREN) else []
            callee = self.parse_primary()
            if type(callee) is not Name:
                raise self.error("expected a macro name after {% call %}")
            args = self.parse_args()
            self.expect(CLOSE_STMT, "%}")
            body = self.block_until("endcall")
            self.end("endcall")
            return self.node(CallBlock, pos, self.node(Call, pos, callee, args), caller_params, body)
        if name == "filter":
            flt = self.parse_primary()
            if type(flt) is Name and self.is_(LPAREN):
                flt = self.parse_call(flt)
            self.expect(CLOSE_STMT, "%}")
            body = self.block_until("endfilter")
            self.end("endfilter")
            return self.node(FilterBlock, pos, flt, body)
        if name in ("generation", "endgeneration"):
            self.i += 1         # transformers' assistant-mask markers: ignored
            return self.node(Noop, pos)
        what = _KNOWN_UNSUPPORTED.get(name, "the statement {%% %s %%}" % name)
        raise self.error("%s is not supported" % what, pos, Unsupported)

    def parse_set(self, pos):
        target = self.parse_sequence()
        value, body = None, []
        if self.is_(EQUALS):
            self.i += 1
            value = self.parse_sequence()
        else:
            self.expect(CLOSE_STMT, "%}")
            body = self.block_until("endset")
            self.expect(OPEN_STMT, "{%")
            self.expect_name("endset")
        self.expect(CLOSE_STMT, "%}")
        return self.node(SetNode, pos, target, value, body)

    def parse_if(self, pos):
        test = self.parse_expression()
        self.expect(CLOSE_STMT, "%}")
        body = self.block_until("elif", "else", "endif")
        orelse = []
        if self.at_statement("elif"):
            p = self.peek(1).pos
            self.i += 2
            orelse.append(self.parse_if(p))
        elif self.at_statement("else"):
            self.i += 2
            self.expect(CLOSE_STMT, "%}")
            orelse = self.block_until("endif")
        return self.node(If, pos, test, body, orelse)

    def parse_for(self, pos):
        target = self.parse_sequence(primary=True)
        if not self.is_name("in"):
            raise self.error("expected 'in' in a for loop")
        self.i += 1
        iterable = self.parse_expression()
        self.expect(CLOSE_STMT, "%}")
        body = self.block_until("endfor", "else")
        orelse = []
        if self.at_statement("else"):
            self.i += 2
            self.expect(CLOSE_STMT, "%}")
            orelse = self.block_until("endfor")
        return self.node(For, pos, target, iterable, body, orelse)

    # -- expressions, lowest precedence first --
    def parse_sequence(self, primary=False):
        pos = self.peek().pos
        parse = self.parse_primary if primary else self.parse_expression
        items = [parse()]
        is_tuple = self.is_(COMMA)
        while self.is_(COMMA):
            self.i += 1
            items.append(parse())
        return self.node(TupleLiteral, pos, items) if is_tuple else items[0]

    def parse_expression(self):
        a = self.parse_or()
        if self.is_name("if"):
            pos = self.peek().pos
            self.i += 1
            test = self.parse_or()
            if self.is_name("else"):
                pos = self.peek().pos
                self.i += 1
                return self.node(Ternary, pos, test, a, self.parse_expression())
            return self.node(Select, pos, a, test)
        return a

    def parse_or(self):
        left = self.parse_and()
        while self.is_name("or"):
            pos = self.next().pos
            left = self.node(Binary, pos, "or", left, self.parse_and())
        return left

    def parse_and(self):
        left = self.parse_not()
        while self.is_name("and"):
            pos = self.next().pos
            left = self.node(Binary, pos, "and", left, self.parse_not())
        return left

    def parse_not(self):
        if self.is_name("not"):
            pos = self.next().pos
            return self.node(Unary, pos, "not", self.parse_not())
        return self.parse_comparison()

    def parse_comparison(self):
        left = self.parse_additive()
        while True:
            t = self.peek()
            if self.is_name("not") and self.peek(1).type == NAME and self.peek(1).value == "in":
                self.i += 2
                op = "not in"
            elif self.is_name("in"):
                self.i += 1
                op = "in"
            elif t.type == CMP_OP:
                self.i += 1
                op = t.value
            else:
                return left
            left = self.node(Binary, t.pos, op, left, self.parse_additive())

    def parse_additive(self):
        left = self.parse_multiplicative()
        while self.is_(ADD_OP):
            t = self.next()
            left = self.node(Binary, t.pos, t.value, left, self.parse_multiplicative())
        return left

    def parse_multiplicative(self):
        left = self.parse_test()
        while self.is_(MUL_OP):
            t = self.next()
            left = self.node(Binary, t.pos, t.value, left, self.parse_test())
        return left

    def parse_test(self):
        operand = self.parse_filter()
        while self.is_name("is"):
            pos = self.next().pos
            negate = False
            if self.is_name("not"):
                self.i += 1
                negate = True
            test = self.parse_primary()
            if self.is_(LPAREN):
                test = self.parse_call(test)
            elif self.peek().type in (NUMBER, STRING, LBRACE, LBRACKET) or (
                    self.is_(NAME) and not self.is_name("and") and not self.is_name("or")
                    and not self.is_name("else")):
                p = self.peek().pos
                test = self.node(Call, p, test, [self.parse_unary()])
            operand = self.node(Test, pos, operand, negate, test)
        return operand

    def parse_filter(self):
        operand = self.parse_unary()
        while self.is_(PIPE):
            pos = self.next().pos
            flt = self.parse_primary()
            if self.is_(LPAREN):
                flt = self.parse_call(flt)
            operand = self.node(Filter, pos, operand, flt)
        return operand

    def parse_unary(self):
        if self.is_(UNARY_OP):
            t = self.next()
            return self.node(Unary, t.pos, t.value, self.parse_unary())
        member = self.parse_member(self.parse_primary())
        return self.parse_call(member) if self.is_(LPAREN) else member

    def parse_call(self, callee):
        pos = self.peek().pos
        n = self.node(Call, pos, callee, self.parse_args())
        n = self.parse_member(n)
        return self.parse_call(n) if self.is_(LPAREN) else n

    def parse_args(self):
        self.expect(LPAREN, "(")
        args = []
        while not self.is_(RPAREN):
            if self.peek().type == EOF:
                raise self.error("unexpected end of template in an argument list")
            if self.peek().type == MUL_OP and self.peek().value == "*":
                pos = self.next().pos
                arg = self.node(Spread, pos, self.parse_expression())
            else:
                arg = self.parse_expression()
                if self.is_(EQUALS):
                    pos = self.next().pos
                    arg = self.node(KwargNode, pos, arg, self.parse_expression())
            args.append(arg)
            if self.is_(COMMA):
                self.i += 1
        self.expect(RPAREN, ")")
        return args

    def parse_member(self, obj):
        pos = self.peek().pos
        while self.is_(DOT) or self.is_(LBRACKET):
            computed = self.next().type == LBRACKET
            if computed:
                prop = self.parse_subscript()
                self.expect(RBRACKET, "]")
            else:
                prop = self.parse_primary()
            obj = self.node(Member, pos, obj, prop, computed)
        return obj

    def parse_subscript(self):
        pos = self.peek().pos
        parts, is_slice = [], False
        while not self.is_(RBRACKET):
            if self.peek().type == EOF:
                raise self.error("unexpected end of template in a subscript")
            if self.is_(COLON):
                parts.append(None)
                self.i += 1
                is_slice = True
            else:
                parts.append(self.parse_expression())
                if self.is_(COLON):
                    self.i += 1
                    is_slice = True
        if is_slice:
            parts += [None] * (3 - len(parts))
            return self.node(SliceNode, pos, parts[0], parts[1], parts[2])
        if not parts:
            return self.node(Blank, pos)
        return parts[0]

    def parse_primary(self):
        t = self.next()
        pos = t.pos
        if t.type == NUMBER:
            v = float(t.value) if "." in t.value else int(t.value)
            return self.node(Text, pos, v)
        if t.type == STRING:
            value = t.value
            while self.is_(STRING):
                value += self.next().value
            return self.node(Text, pos, value)
        if t.type == NAME:
            return self.node(Name, pos, t.value)
        if t.type == LPAREN:
            e = self.parse_sequence()
            self.expect(RPAREN, ")")
            return e
        if t.type == LBRACKET:
            items = []
            while not self.is_(RBRACKET):
                if self.peek().type == EOF:
                    raise self.error("unexpected end of template in a list")
                items.append(self.parse_expression())
                if self.is_(COMMA):
                    self.i += 1
            self.i += 1
            return self.node(ArrayLiteral, pos, items)
        if t.type == LBRACE:
            pairs = []
            while not self.is_(RBRACE):
                if self.peek().type == EOF:
                    raise self.error("unexpected end of template in an object literal")
                k = self.parse_expression()
                self.expect(COLON, ":")
                pairs.append((k, self.parse_expression()))
                if self.is_(COMMA):
                    self.i += 1
            self.i += 1
            return self.node(ObjectLiteral, pos, pairs)
        raise self.error("unexpected %r" % (t.value or t.type), pos)


# ---------------------------------------------------------------------------
# Template
# ---------------------------------------------------------------------------

class Template:
    """A parsed template; render() may be called any number of times, from any thread."""

    def __init__(self, source):
        tokens, self.source = lex(source)
        self.body = Parser(tokens, self.source).parse()

    def render(self, variables=None, now=None, stats=None):
        """The text the template produces for ``variables`` (a dict of plain values).

        ``now`` (a Unix time) is what ``strftime_now`` formats; ``stats``, a
        Stats, records which values the rendering touched.  Templates may
        modify the lists and dicts they are given, so pass copies.
        """
        ctx = Context(variables, stats, now, self.source)
        out = []
        try:
            for stmt in self.body:
                render_parts(stmt.run(ctx), out)
        except (_Break, _Continue):
            raise TemplateError("{% break %} or {% continue %} outside a loop")
        except RecursionError:
            raise TemplateError("the template recurses too deeply")
        return "".join(out)
