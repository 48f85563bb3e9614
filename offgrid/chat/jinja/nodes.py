"""The expression nodes of chat.jinja's tree, and how each evaluates.

Every node has a ``pos`` (an offset into the source) and ``run(ctx)``, which
evaluates it and turns any error into a TemplateError that says where in the
template it happened.  Expressions -- names, literals, operators, member
access, calls, filters, tests -- compute values with the rules of .values and
the builtins of .builtins and .functions; the statements built from them are
in .statements.  ``render_parts`` and ``run_body`` are how a body of nodes
becomes text.

Only .parser (which builds nodes), .statements and the package's
``Template`` import this module.
"""

import math

from .builtins import builtin
from .functions import GLOBALS, _test_in
from .values import (
    Args, Func, Kwarg, TemplateError, TemplateSyntaxError, UNDEFINED, Undefined, Unsupported,
    _key, _line_col, as_int, equal, hashable, is_undefined, kind, to_str, truthy, type_name)


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
        # every evaluation is a step of the rendering's budget (values.Budget),
        # and every result is held to its sizes
        budget = ctx.budget
        budget.steps += 1
        try:
            if not budget.steps & 1023:
                budget.check()
            return budget.value(self.eval(ctx))
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
    ctx.budget.chars(sum(map(len, out)))
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
                    if op == "*" and a.bit_length() + b.bit_length() > 66:
                        ctx.budget.integer(1 << 64)         # before the multiplication
                    return ctx.budget.integer(a + b if op == "+" else (a - b if op == "-"
                                                                      else a * b))
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
                ctx.budget.items(len(a) + len(b))
                return list(a) + list(b)
        elif kb in ("array", "tuple") and membership:
            found = _test_in(Args(ctx, [a, b], "in"))
            return found if op == "in" else not found
        if (ka == "str" or kb == "str") and op in ("~", "+"):
            a, b = to_str(a), to_str(b)
            ctx.budget.chars(len(a) + len(b))
            return a + b
        if op == "*" and ((ka == "str" and kb == "int") or (ka == "int" and kb == "str")):
            s, n = (a, b) if ka == "str" else (b, a)
            ctx.budget.chars(len(s) * max(0, n))    # before it is built
            return s * max(0, n)
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
