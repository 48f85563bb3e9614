"""Values, scopes and errors of chat.jinja: what templates compute with.

Values are plain Python objects -- str, int, float, bool, None, list (an
array), tuple, dict (an object) -- plus ``Undefined``, ``Func`` (builtins and
macros), ``Kwarg`` and ``Loop``.  The rules on them are llama.cpp's
(common/jinja/value.cpp), not Python's or Jinja2's: ``kind`` names a value's
type as llama.cpp does, ``to_str`` prints floats with %f and trailing zeros
dropped, ``to_json`` lays out like its tojson, ``equal`` compares containers
only when they are hashable.

``Context`` is a scope of variables, ``Args`` the arguments of one call.
``Stats`` records which values a rendering touched and how; llama-server's
capability probes (offgrid.chat.template.detect_caps) are built on it.  The errors
(``TemplateError`` and its kinds) live here because every stage raises them.

Every other module of the package imports this one, and it imports none of
them.  Code outside the package uses the names chat.jinja re-exports.
"""

import math
import re
import time

_SPACE = " \t\n\v\f\r"          # C isspace() in the C locale

# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


class TemplateError(Exception):
    """A template could not be parsed or rendered."""

    def __init__(self, message, where=None):
        super().__init__(message)
        self.message = message
        self.where = where          # "line L, column C", once known

    def __str__(self):
        return self.message if self.where is None else "%s (at %s)" % (self.message, self.where)


class TemplateSyntaxError(TemplateError):
    """The template's text is not valid in the subset (lexer or parser)."""


class Unsupported(TemplateError):
    """A construct this interpreter (like llama-server's) does not implement."""


class TemplateRaised(TemplateError):
    """The template called ``raise_exception(message)``: it refuses these inputs."""


class BudgetExceeded(TemplateError):
    """A rendering ran past its Budget: too many steps, too large a value, too long."""


# ---------------------------------------------------------------------------
# The budget of one rendering
# ---------------------------------------------------------------------------

# A template is code from a model file: it may loop for good (nested
# range(100000)) or build a string of gigabytes, and it runs inside a worker
# that serves every other request for the model.  Each rendering gets a
# budget, and running past it is a TemplateError like any other, never a
# hang.  Real templates are far inside it: the largest of llama.cpp's seventy
# (gemma-4's), with ten tools and 101 messages, takes 37 thousand steps and
# 170 ms on a busy 2-core machine; the budget allows 135 times as many.
MAX_STEPS = 5_000_000       # nodes evaluated (an expression, a statement, a loop turn)
MAX_CHARS = 16 << 20        # characters of any one string, the output included
MAX_ITEMS = 1 << 20         # items of any one list (range() included)
MAX_SECONDS = 10.0          # wall time of one rendering
# llama.cpp's integers are int64: past them is an overflow, and unbounded
# Python integers (a loop of x = x * x) would take minutes per multiplication
INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1


class Budget:
    """What one rendering may spend; shared by every scope of the rendering."""
    __slots__ = ("steps", "max_steps", "max_chars", "max_items", "seconds", "deadline")

    def __init__(self, max_steps=MAX_STEPS, max_chars=MAX_CHARS, max_items=MAX_ITEMS,
                 seconds=MAX_SECONDS):
        self.steps = 0
        self.max_steps, self.max_chars, self.max_items = max_steps, max_chars, max_items
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def tick(self):
        """One step that is not a node's evaluation (a loop's turn)."""
        self.steps += 1
        if not self.steps & 1023:
            self.check()

    def check(self):
        """Steps and time (Node.run calls it every 1024 steps)."""
        if self.steps > self.max_steps:
            raise BudgetExceeded("the template ran past its budget of %d steps"
                                 % self.max_steps)
        if time.monotonic() > self.deadline:
            raise BudgetExceeded("the template ran past its budget of %g seconds"
                                 % self.seconds)

    def chars(self, n):
        """Refuse a string of ``n`` characters past the budget (before it is built)."""
        if n > self.max_chars:
            raise BudgetExceeded("the template would build a string of %d characters, past "
                                 "its budget of %d" % (n, self.max_chars))

    def items(self, n):
        if n > self.max_items:
            raise BudgetExceeded("the template would build a list of %d items, past its "
                                 "budget of %d" % (n, self.max_items))

    def integer(self, v):
        if not INT_MIN <= v <= INT_MAX:
            raise BudgetExceeded("integer overflow: the result is past 64 bits")
        return v

    def value(self, v):
        """``v``, if it is within the budget's sizes (Node.run checks every result)."""
        t = type(v)
        if t is str:
            if len(v) > self.max_chars:
                self.chars(len(v))
        elif t is list:
            if len(v) > self.max_items:
                self.items(len(v))
        return v


def _line_col(source, pos):
    line = source.count("\n", 0, pos) + 1
    col = pos - (source.rfind("\n", 0, pos) + 1) + 1
    return "line %d, column %d" % (line, col)


# ---------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------

class Undefined:
    """A name or key that is not there (prints as nothing, is false)."""
    __slots__ = ("hint",)

    def __init__(self, hint=""):
        self.hint = hint

    def __repr__(self):
        return "Undefined(%r)" % self.hint


UNDEFINED = Undefined()


class Func:
    """A callable value: a builtin (bound to ``this`` for methods and filters) or a macro."""
    __slots__ = ("name", "fn", "this")
    _unbound = object()

    def __init__(self, name, fn, this=_unbound):
        self.name, self.fn, self.this = name, fn, this

    def call(self, args):
        items = args.items if self.this is Func._unbound else [self.this] + args.items
        return self.fn(Args(args.ctx, items, self.name))


class Kwarg:
    """``name=value`` in a call's arguments; it also takes a position, as in llama.cpp."""
    __slots__ = ("key", "value")

    def __init__(self, key, value):
        self.key, self.value = key, value


class Loop(dict):
    """The ``loop`` variable: an object without the builtins of other objects."""


class TrackedStr(str):
    """An input string with an identity of its own, so Stats can tell uses apart."""
    __slots__ = ()


_NONE = type(None)
_KINDS = {str: "str", int: "int", float: "float", bool: "bool", list: "array",
          tuple: "tuple", dict: "object", _NONE: "none", Undefined: "undefined",
          Func: "func", Kwarg: "kwarg", Loop: "object", TrackedStr: "str"}
_TYPE_NAMES = {"str": "String", "int": "Integer", "float": "Float", "bool": "Boolean",
               "array": "Array", "tuple": "Tuple", "object": "Object", "none": "None",
               "undefined": "Undefined", "func": "Function", "kwarg": "KwArg"}


def kind(v):
    k = _KINDS.get(type(v))
    if k is None:
        for t, name in ((bool, "bool"), (str, "str"), (int, "int"), (float, "float"),
                        (dict, "object"), (tuple, "tuple"), (list, "array")):
            if isinstance(v, t):
                return name
        raise TemplateError("a value of Python type %s cannot be used in a template"
                            % type(v).__name__)
    return k


def type_name(v):
    return _TYPE_NAMES[kind(v)]


def is_undefined(v):
    return type(v) is Undefined


def truthy(v):
    k = kind(v)
    if k in ("str", "array", "tuple", "object"):
        return len(v) > 0
    if k in ("int", "float", "bool"):
        return v != 0
    if k in ("none", "undefined"):
        return False
    raise TemplateError("%s is not a bool value" % type_name(v))


def as_int(v):
    k = kind(v)
    if k in ("int", "bool"):
        return int(v)
    if k == "float":
        return int(v) if math.isfinite(v) else 0
    raise TemplateError("%s is not an int value" % type_name(v))


def as_float(v):
    k = kind(v)
    if k in ("int", "bool", "float"):
        return float(v)
    raise TemplateError("%s is not a float value" % type_name(v))


def _float_str(v):
    """A float as llama.cpp prints it: printf %f with trailing zeros dropped."""
    s = "%f" % v
    if "." in s:
        s = s.rstrip("0")
        if s.endswith("."):
            s += "0"
    return s


def _g(v):
    """A float inside JSON, as C++ iostreams print a double (%g)."""
    return "%g" % v


def to_str(v):
    """A value as a string (llama.cpp's as_string)."""
    k = kind(v)
    if k == "str":
        return v
    if k == "int":
        return str(v)
    if k == "float":
        return _float_str(v)
    if k == "bool":
        return "True" if v else "False"
    if k == "array":
        return "[" + ", ".join(_repr(x) for x in v) + "]"
    if k == "tuple":
        inner = ", ".join(_repr(x) for x in v)
        return "(" + inner + ("," if len(v) == 1 else "") + ")"
    if k == "object":
        return "{" + ", ".join(_repr(a) + ": " + _repr(b) for a, b in v.items()) + "}"
    if k == "none":
        return "None"
    raise TemplateError("%s is not a string value" % type_name(v))


def _repr(v):
    k = kind(v)
    if k == "str":
        return to_json(v) if "'" in v else "'" + v + "'"
    if k == "undefined":
        return "Undefined"
    if k == "func":
        return "Function<%s>" % v.name
    if k == "kwarg":
        return "KwArg"
    return to_str(v)


_JSON_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n",
                 "\r": "\\r", "\t": "\\t"}
_JSON_SPECIAL = re.compile(r'["\\\x00-\x1f]')
_NON_ASCII = re.compile(r"[^\x00-\x7f]")


def _json_str(s, ensure_ascii=False):
    def esc(m):
        c = m.group(0)
        return _JSON_ESCAPES.get(c) or "\\u%04x" % ord(c)

    out = _JSON_SPECIAL.sub(esc, s)
    if ensure_ascii:
        def uesc(m):
            cp = ord(m.group(0))
            if cp <= 0xFFFF:
                return "\\u%04x" % cp
            cp -= 0x10000
            return "\\u%04x\\u%04x" % (0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF))
        out = _NON_ASCII.sub(uesc, out)
    return '"' + out + '"'


def to_json(v, indent=-1, item_sep=", ", key_sep=": ", ensure_ascii=False, budget=None):
    """JSON text of a value, laid out as llama.cpp's tojson lays it out; ``budget`` (a
    Budget) bounds its size as it grows: a list of one long string a million times
    is small to hold and huge to print."""
    out = []
    size = [0, budget.max_chars if budget is not None else None]

    def put(text):
        out.append(text)
        if size[1] is not None:
            size[0] += len(text)
            if size[0] > size[1]:
                budget.chars(size[0])

    def walk(x, level):
        k = kind(x)
        if k in ("none", "undefined"):
            put("null")
        elif k == "bool":
            put("true" if x else "false")
        elif k == "int":
            put(str(x))
        elif k == "float":
            put(_g(x))
        elif k == "str":
            put(_json_str(x, ensure_ascii))
        elif k in ("array", "tuple", "object"):
            items = list(x.items()) if k == "object" else list(x)
            put("{" if k == "object" else "[")
            if items:
                if size[1] is not None and indent > 0:
                    budget.chars((level + 1) * indent)      # before the padding is made
                nl = "\n" if indent >= 0 else ""
                pad = " " * (level * indent) if indent > 0 else ""
                step = " " * indent if indent > 0 else ""
                put(nl)
                for i, item in enumerate(items):
                    put(pad + step)
                    if k == "object":
                        put(_json_str(to_str(item[0]), ensure_ascii))
                        put(key_sep)
                        walk(item[1], level + 1)
                    else:
                        walk(item, level + 1)
                    if i < len(items) - 1:
                        put(item_sep)
                    put(nl)
                put(pad)
            put("}" if k == "object" else "]")
        else:
            put("null")

    walk(v, 0)
    return "".join(out)


def _immutable(v):
    return kind(v) not in ("array", "object")


def hashable(v):
    k = kind(v)
    if k in ("str", "int", "float", "bool", "none", "kwarg"):
        return True
    if k in ("array", "tuple"):
        return all(_immutable(x) and hashable(x) for x in v)
    if k == "object":
        return all(_immutable(x) and hashable(x) for x in v.values())
    return False


def _key(v):
    """A value usable as a Python dict key, or an error as llama.cpp refuses it."""
    if not (_immutable(v) and hashable(v)):
        raise TemplateError("Object key of unhashable type: %s" % type_name(v))
    if kind(v) == "tuple":
        return tuple(_key(x) for x in v)
    return v


_NUMERIC = ("int", "float", "bool")


def equal(a, b):
    """``a == b`` by llama.cpp's rules (containers compare only when hashable)."""
    ka, kb = kind(a), kind(b)
    if ka in _NUMERIC:
        return kb in _NUMERIC and a == b
    if ka == "str":
        return kb == "str" and str.__eq__(a, b)
    if ka in ("array", "tuple"):
        return (ka == kb and hashable(a) and hashable(b) and len(a) == len(b)
                and all(equal(x, y) for x, y in zip(a, b)))
    if ka == "object":
        if kb != "object" or not (hashable(a) and hashable(b)) or len(a) != len(b):
            return False
        return all(equal(k1, k2) and equal(v1, v2)
                   for (k1, v1), (k2, v2) in zip(a.items(), b.items()))
    if ka == "none":
        return kb == "none"
    if ka == "undefined":
        return kb == "undefined"
    if ka == "func":
        return kb == "func" and a.fn is b.fn
    return kb == "kwarg" and a.key == b.key and a.value is b.value


def compare(a, b, op):
    """llama.cpp's value_compare: numbers, strings (and number-vs-string as text), bools."""
    ka, kb = kind(a), kind(b)
    if ka in ("int", "float") and kb in ("int", "float"):
        x, y = float(a), float(b)
    elif (ka == "str" and kb in ("str", "int", "float")) or (kb == "str" and ka in ("int", "float")):
        x, y = to_str(a), to_str(b)
    elif ka == "bool" and kb == "bool":
        if op == "eq":
            return a == b
        if op == "ne":
            return a != b
        raise TemplateError("Unsupported comparison operator for bool type")
    else:
        return False
    return {"eq": x == y, "ne": x != y, "lt": x < y, "gt": x > y, "ge": x >= y}[op]


# ---------------------------------------------------------------------------
# Context and usage statistics
# ---------------------------------------------------------------------------

class Stats:
    """Which values a rendering touched, and how (llama.cpp's value stats)."""

    def __init__(self):
        self.used = set()
        self.ops = {}

    def mark(self, v, op=None, deep=False):
        self.used.add(id(v))
        if op is not None:
            self.ops.setdefault(id(v), set()).add(op)
        if deep:
            k = kind(v)
            if k in ("array", "tuple"):
                for x in v:
                    self.mark(x, deep=True)
            elif k == "object":
                for a, b in v.items():
                    self.mark(a, deep=True)
                    self.mark(b, deep=True)

    def was_used(self, v):
        return id(v) in self.used

    def has_op(self, v, op):
        return op in self.ops.get(id(v), ())


class Context:
    """Variables in scope.  A new scope starts as a copy of its parent's."""
    __slots__ = ("vars", "stats", "now", "source", "budget")

    def __init__(self, variables=None, stats=None, now=None, source="", budget=None):
        self.vars = {"true": True, "True": True, "false": False, "False": False,
                     "none": None, "None": None}
        if variables:
            self.vars.update(variables)
        self.stats = stats
        self.now = time.time() if now is None else now
        self.source = source
        self.budget = budget if budget is not None else Budget()

    def child(self):
        c = Context.__new__(Context)
        c.vars = dict(self.vars)
        c.stats, c.now, c.source, c.budget = self.stats, self.now, self.source, self.budget
        return c

    def get(self, name):
        v = self.vars.get(name)
        if v is None and name not in self.vars:
            return Undefined(name)
        return v

    def set(self, name, value):
        self.vars[name] = value


class Args:
    """The arguments of one call: positional values and Kwargs, in call order."""
    __slots__ = ("ctx", "items", "name")

    def __init__(self, ctx, items, name=""):
        self.ctx, self.items, self.name = ctx, items, name

    def __len__(self):
        return len(self.items)

    def pos(self, i, default=Func._unbound):
        if i < len(self.items):
            return self.items[i]
        if default is not Func._unbound:
            return default
        raise TemplateError("%s() expected at least %d arguments, got %d"
                            % (self.name, i + 1, len(self.items)))

    def kwarg(self, key, default=UNDEFINED):
        for a in self.items:
            if type(a) is Kwarg and a.key == key:
                return a.value
        return default

    def kwarg_or_pos(self, key, i):
        v = self.kwarg(key)
        if is_undefined(v) and i < len(self.items) and type(self.items[i]) is not Kwarg:
            return self.items[i]
        return v

    def count(self, lo, hi=999):
        if not lo <= len(self.items) <= hi:
            raise TemplateError("%s() expected between %d and %d arguments, got %d"
                                % (self.name, lo, hi, len(self.items)))

    def expect(self, *kinds, required=None):
        """Check the leading arguments' kinds (llama.cpp's ensure_vals)."""
        required = len(kinds) if required is None else required
        self.count(required)
        for i, want in enumerate(kinds[:required]):
            if i < len(self.items):
                got = kind(self.items[i])
                if got != want and not (want == "array" and got == "tuple"):
                    raise TemplateError("%s() expected a %s as argument %d, got %s"
                                        % (self.name, _TYPE_NAMES[want], i + 1,
                                           type_name(self.items[i])))

