"""Values, scopes and builtins of chat.jinja: what templates compute with.

Values are plain Python objects -- str, int, float, bool, None, list (an
array), tuple, dict (an object) -- plus ``Undefined``, ``Func`` (builtins and
macros), ``Kwarg`` and ``Loop``.  The rules on them are llama.cpp's
(common/jinja/value.cpp), not Python's or Jinja2's: ``to_str`` prints floats
with %f and trailing zeros dropped, ``to_json`` lays out like its tojson,
``equal`` compares containers only when they are hashable, and each type has
its own table of filters and methods (``builtin``), so ``x | upper`` on a list
is an error rather than a conversion.

``Stats`` records which values a rendering touched and how; llama-server's
capability probes (offgrid.chat.detect_caps) are built on it.  Only
chat.jinja and the probes use this module.
"""

import functools
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


def to_json(v, indent=-1, item_sep=", ", key_sep=": ", ensure_ascii=False):
    """JSON text of a value, laid out as llama.cpp's tojson lays it out."""
    out = []

    def walk(x, level):
        k = kind(x)
        if k in ("none", "undefined"):
            out.append("null")
        elif k == "bool":
            out.append("true" if x else "false")
        elif k == "int":
            out.append(str(x))
        elif k == "float":
            out.append(_g(x))
        elif k == "str":
            out.append(_json_str(x, ensure_ascii))
        elif k in ("array", "tuple", "object"):
            items = list(x.items()) if k == "object" else list(x)
            out.append("{" if k == "object" else "[")
            if items:
                nl = "\n" if indent >= 0 else ""
                pad = " " * (level * indent) if indent > 0 else ""
                step = " " * indent if indent > 0 else ""
                out.append(nl)
                for i, item in enumerate(items):
                    out.append(pad + step)
                    if k == "object":
                        out.append(_json_str(to_str(item[0]), ensure_ascii))
                        out.append(key_sep)
                        walk(item[1], level + 1)
                    else:
                        walk(item, level + 1)
                    if i < len(items) - 1:
                        out.append(item_sep)
                    out.append(nl)
                out.append(pad)
            out.append("}" if k == "object" else "]")
        else:
            out.append("null")

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
    __slots__ = ("vars", "stats", "now", "source")

    def __init__(self, variables=None, stats=None, now=None, source=""):
        self.vars = {"true": True, "True": True, "false": False, "False": False,
                     "none": None, "None": None}
        if variables:
            self.vars.update(variables)
        self.stats = stats
        self.now = time.time() if now is None else now
        self.source = source

    def child(self):
        c = Context.__new__(Context)
        c.vars = dict(self.vars)
        c.stats, c.now, c.source = self.stats, self.now, self.source
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


# ---------------------------------------------------------------------------
# Builtins: global functions, tests, and each type's filters and methods
# ---------------------------------------------------------------------------

def _not_implemented(what):
    def fn(_args):
        raise Unsupported("%s is not supported" % what)
    return fn


def _const(make):
    return lambda _args: make()


def _slice(seq, start, stop, step):
    """Python-like slicing with llama.cpp's treatment of negative steps."""
    n = len(seq)
    if step > 0:
        start = max(n + start, 0) if start < 0 else min(start, n)
        stop = max(n + stop, 0) if stop < 0 else min(stop, n)
    elif step < 0:
        start = max(n + start, 0) if start < 0 else min(start, n - 1)
        stop = max(n + stop, -1) if stop < -1 else min(stop, n - 1)
    else:
        return []
    d = 1 if step > 0 else -1
    out = []
    i = start
    while d * i < d * stop:
        if 0 <= i < n:
            out.append(seq[i])
        i += step
    return out


def _get_attribute(v, attr, default):
    if is_undefined(attr):
        return default
    k = kind(v)
    if k in ("array", "tuple"):
        idx = attr
        if kind(attr) == "str" and attr and attr.isdigit() and attr.isascii():
            idx = int(attr)
        if kind(idx) in ("int", "bool"):
            i = int(idx)
            if i < 0:
                i += len(v)
            return v[i] if 0 <= i < len(v) else default
        return default
    if k == "object":
        return v.get(_key(attr), default)
    return default


def _tojson(a):
    a.count(1, 5)
    ensure_ascii = a.kwarg_or_pos("ensure_ascii", 1)
    indent = a.kwarg_or_pos("indent", 2)
    separators = a.kwarg_or_pos("separators", 3)
    sort_keys = a.kwarg_or_pos("sort_keys", 4)
    if a.ctx.stats is not None:
        a.ctx.stats.mark(a.pos(0), deep=True)
    ind = indent if kind(indent) == "int" else -1
    if truthy(sort_keys):
        raise Unsupported("tojson(sort_keys=true) is not supported")
    seps = list(separators) if kind(separators) in ("array", "tuple") else []
    item_sep = to_str(seps[0]) if seps else (", " if ind < 0 else ",")
    key_sep = to_str(seps[1]) if len(seps) > 1 else ": "
    return to_json(a.pos(0), ind, item_sep, key_sep, truthy(ensure_ascii))


def _default(a):
    a.count(2, 3)
    check_bool = truthy(a.kwarg_or_pos("boolean", 2))
    v = a.pos(0)
    missing = (not truthy(v)) if check_bool else (is_undefined(v) or v is None)
    return a.pos(1) if missing else v


def _dict(a):
    out = {}
    it = a.pos(0, UNDEFINED)
    first_is_iterable = False
    k = kind(it)
    if k in ("array", "tuple"):
        first_is_iterable = True
        for pair in it:
            if kind(pair) not in ("array", "tuple") or len(pair) != 2:
                raise TemplateError("namespace/dict() iterable argument must consist of "
                                    "pairs, not %s" % type_name(pair))
            out[_key(pair[0])] = pair[1]
    elif k == "object":
        first_is_iterable = True
        out.update(it)
    for arg in a.items:
        if type(arg) is Kwarg:
            out[arg.key] = arg.value
        elif not first_is_iterable:
            raise TemplateError("namespace/dict() arguments must be keyword arguments, a dict "
                                "or pairs, not %s" % type_name(arg))
        first_is_iterable = False
    return out


def _raise_exception(a):
    a.expect("str")
    raise TemplateRaised(a.pos(0))


def _strftime_now(a):
    a.expect("str")
    out = time.strftime(a.pos(0), time.localtime(a.ctx.now))
    if not out or len(out.encode("utf-8")) >= 100:
        raise TemplateError("strftime_now: failed to format time")
    return out


def _range(a):
    a.count(1, 3)
    a.expect("int", required=1)
    vals = [as_int(x) for x in a.items]
    if len(vals) == 1:
        start, stop, step = 0, vals[0], 1
    elif len(vals) == 2:
        start, stop, step = vals[0], vals[1], 1
    else:
        start, stop, step = vals
    if step == 0:
        raise TemplateError("range() step argument must not be zero")
    return list(range(start, stop, step))


def _type_test(*kinds):
    def fn(a):
        a.count(1)
        return kind(a.pos(0)) in kinds
    return fn


def _compare_test(op):
    def fn(a):
        a.count(2, 2)
        return compare(a.pos(0), a.pos(1), op)
    return fn


def _test_in(a):
    a.count(2)
    needle, haystack = a.pos(0), a.pos(1)
    k = kind(haystack)
    if k == "undefined":
        return False
    if k in ("array", "tuple"):
        return any(equal(needle, x) for x in haystack)
    if k == "str":
        if kind(needle) != "str":
            raise TemplateError("'in' expects a string on the left of a string, got %s"
                                % type_name(needle))
        return needle in haystack
    if k == "object":
        return _key(needle) in haystack
    raise TemplateError("'in' expects something iterable on the right, got %s"
                        % type_name(haystack))


def _test_sameas(a):
    a.count(2)
    x, y = a.pos(0), a.pos(1)
    kx, ky = kind(x), kind(y)
    if "undefined" in (kx, ky):
        return False
    if kx == ky == "none":
        return True
    if kx == ky == "bool":
        return x == y
    if kx == ky == "int":
        return -5 <= x <= 256 and x == y
    return x is y and kx not in ("str", "int", "float")


def _int_test(pred):
    def fn(a):
        a.expect("int")
        return pred(a.pos(0))
    return fn


def _case_test(upper):
    def fn(a):
        a.expect("str")
        s = a.pos(0)
        return not any(("a" <= c <= "z") if upper else ("A" <= c <= "Z") for c in s)
    return fn


def _test_divisibleby(a):
    a.expect("int", "int")
    x, y = a.pos(0), a.pos(1)
    return math.fmod(x, y) == 0


def _test_test(a):
    a.expect("str")
    return ("test_is_" + a.pos(0)) in GLOBALS


GLOBALS = {
    "raise_exception": _raise_exception,
    "dict": _dict,
    "namespace": _dict,
    "strftime_now": _strftime_now,
    "range": _range,
    "tojson": _tojson,
    "test_is_boolean": _type_test("bool"),
    "test_is_callable": _type_test("func"),
    "test_is_odd": _int_test(lambda v: math.fmod(v, 2) != 0),
    "test_is_even": _int_test(lambda v: math.fmod(v, 2) == 0),
    "test_is_false": lambda a: (a.count(1), kind(a.pos(0)) == "bool" and not a.pos(0))[1],
    "test_is_true": lambda a: (a.count(1), kind(a.pos(0)) == "bool" and bool(a.pos(0)))[1],
    "test_is_divisibleby": _test_divisibleby,
    "test_is_string": _type_test("str"),
    "test_is_integer": _type_test("int"),
    "test_is_float": _type_test("float"),
    "test_is_number": _type_test("int", "float"),
    "test_is_iterable": _type_test("object", "array", "tuple", "str", "undefined"),
    "test_is_sequence": _type_test("object", "array", "tuple", "str", "undefined"),
    "test_is_mapping": _type_test("object"),
    "test_is_lower": _case_test(upper=False),
    "test_is_upper": _case_test(upper=True),
    "test_is_none": _type_test("none"),
    "test_is_defined": lambda a: (a.count(1), not is_undefined(a.pos(0)))[1],
    "test_is_undefined": _type_test("undefined"),
    "test_is_eq": _compare_test("eq"),
    "test_is_equalto": _compare_test("eq"),
    "test_is_ge": _compare_test("ge"),
    "test_is_gt": _compare_test("gt"),
    "test_is_greaterthan": _compare_test("gt"),
    "test_is_lt": _compare_test("lt"),
    "test_is_lessthan": _compare_test("lt"),
    "test_is_ne": _compare_test("ne"),
    "test_is_in": _test_in,
    "test_is_test": _test_test,
    "test_is_sameas": _test_sameas,
    "test_is_escaped": _not_implemented("the 'escaped' test"),
    "test_is_filter": _not_implemented("the 'filter' test"),
}


# -- numbers and booleans -----------------------------------------------------

def _num_abs(a):
    return abs(a.pos(0))


NUMBER_BUILTINS = {
    "default": _default,
    "abs": _num_abs,
    "int": lambda a: as_int(a.pos(0)),
    "float": lambda a: as_float(a.pos(0)),
    "safe": _tojson,
    "string": _tojson,
    "tojson": _tojson,
}

BOOL_BUILTINS = {
    "default": _default,
    "int": lambda a: int(a.pos(0)),
    "float": lambda a: float(a.pos(0)),
    "safe": lambda a: "True" if a.pos(0) else "False",
    "string": lambda a: "True" if a.pos(0) else "False",
    "tojson": _tojson,
}


# -- strings ---------------------------------------------------------------------

_UPPER = {c: c - 32 for c in range(ord("a"), ord("z") + 1)}
_LOWER = {c: c + 32 for c in range(ord("A"), ord("Z") + 1)}


def _upper(s):
    return s.translate(_UPPER)


def _lower(s):
    return s.translate(_LOWER)


def _title(s):
    out = []
    cap = True
    for c in s:
        if c in _SPACE:
            cap = True
            out.append(c)
        elif cap:
            out.append(_upper(c))
            cap = False
        else:
            out.append(_lower(c))
    return "".join(out)


def _capitalize(s):
    return _upper(s[:1]) + _lower(s[1:]) if s else s


def _str_strip(left, right):
    def fn(a):
        s = a.pos(0)
        if kind(s) != "str":
            raise TemplateError("strip() first argument must be a string")
        chars = a.kwarg_or_pos("chars", 1)
        chars = _SPACE if is_undefined(chars) else to_str(chars)
        if left:
            s = s.lstrip(chars)
        if right:
            s = s.rstrip(chars)
        return str(s)
    return fn


def _str_split(from_right):
    def fn(a):
        a.count(1, 3)
        s = a.pos(0)
        if kind(s) != "str":
            raise TemplateError("split() first argument must be a string")
        delim = to_str(a.pos(1)) if len(a) > 1 else " "
        if not delim:
            raise TemplateError("split(): empty separator")
        maxsplit = as_int(a.pos(2)) if len(a) > 2 else -1
        s = str(s)
        return s.rsplit(delim, maxsplit) if from_right else s.split(delim, maxsplit)
    return fn


def _str_replace(a):
    a.expect("str", "str", "str", required=3)
    s, old, new = str(a.pos(0)), a.pos(1), a.pos(2)
    if len(a) > 3 and as_int(a.pos(3)) > 0:
        raise Unsupported("replace() with a count is not supported")
    return s.replace(old, new) if old != new else s


def _str_format(a):
    fmt = a.pos(0)
    if kind(fmt) != "str":
        raise TemplateError("format() first argument must be a string")
    out = []
    i, n, arg = 0, len(fmt), 1
    while i < n:
        c = fmt[i]
        if c != "{":
            out.append(c)
            i += 1
            continue
        if i + 1 >= n or fmt[i + 1] != "}":
            raise Unsupported("format() supports only '{}' placeholders")
        out.append(to_str(a.pos(arg)))
        arg += 1
        i += 2
    return "".join(out)


_INT_PREFIX = re.compile(r"[ \t\n\v\f\r]*([+-]?)(0[xX])?([0-9a-zA-Z]*)")


def _str_int(a):
    s = a.pos(0)
    default = a.kwarg_or_pos("default", 1)
    base = a.kwarg_or_pos("base", 2)
    base = 10 if is_undefined(base) else as_int(base)
    if base != 0 and not 2 <= base <= 36:
        raise TemplateError("int() base must be 0 or between 2 and 36")
    if kind(s) != "str":
        raise TemplateError("int() first argument must be a string")
    fallback = 0 if is_undefined(default) else as_int(default)
    m = _INT_PREFIX.match(s)
    sign, hexp, digits = m.group(1), m.group(2), m.group(3)
    b = base
    if b == 0:
        b = 16 if hexp else (8 if digits.startswith("0") and len(digits) > 1 else 10)
    elif hexp and b != 16:
        digits, hexp = "0", None
    valid = ""
    for ch in digits:
        d = int(ch, 36) if ch.isalnum() else 99
        if d >= b:
            break
        valid += ch
    if not valid:
        return fallback
    v = int(sign + valid, b)
    return v if -2 ** 31 <= v < 2 ** 31 else fallback


_FLOAT_PREFIX = re.compile(r"[ \t\n\v\f\r]*([+-]?(?:inf(?:inity)?|nan|"
                           r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?))", re.I)


def _str_float(a):
    a.expect("str")
    default = a.kwarg_or_pos("default", 1)
    m = _FLOAT_PREFIX.match(a.pos(0))
    if not m:
        return 0.0 if is_undefined(default) else as_float(default)
    return float(m.group(1))


def _slice_args(a, kind):
    """(start, stop, step) of slice(stop) / slice(start, stop[, step]) on a ``kind``."""
    a.count(1, 4)
    a.expect(kind, "int", required=2)
    vals = [as_int(x) for x in a.items[1:]]
    start, stop, step = (0, vals[0], 1) if len(vals) == 1 else \
        ((vals[0], vals[1], 1) if len(vals) == 2 else vals)
    if step == 0:
        raise TemplateError("slice step cannot be zero")
    return start, stop, step


def _str_slice(a):
    return "".join(_slice(a.pos(0), *_slice_args(a, "str")))


def _str_indent(a):
    a.count(1, 4)
    s = a.pos(0)
    width = a.kwarg_or_pos("width", 1)
    first = truthy(a.kwarg_or_pos("first", 2))
    blank = truthy(a.kwarg_or_pos("blank", 3))
    if kind(s) != "str":
        raise TemplateError("indent() first argument must be a string")
    if kind(width) == "int":
        pad = " " * width
    elif kind(width) == "str":
        pad = width
    else:
        pad = "    "
    lines = s.split("\n") if s else []
    if s.endswith("\n"):
        lines.pop()
    text = ""
    for line in lines:
        # llama.cpp's loop, including its quirk: leading empty lines vanish
        if text:
            text += "\n"
        if first if not text else (line or blank):
            text += pad
        text += line
    if s.endswith("\n"):
        text += "\n" + (pad if blank else "")
    return text


STRING_BUILTINS = {
    "default": _default,
    "upper": lambda a: (a.expect("str"), _upper(a.pos(0)))[1],
    "lower": lambda a: (a.expect("str"), _lower(a.pos(0)))[1],
    "strip": _str_strip(True, True),
    "rstrip": _str_strip(False, True),
    "lstrip": _str_strip(True, False),
    "title": lambda a: (a.expect("str"), _title(a.pos(0)))[1],
    "capitalize": lambda a: (a.expect("str"), _capitalize(a.pos(0)))[1],
    "length": lambda a: (a.expect("str"), len(a.pos(0).encode("utf-8", "surrogatepass")))[1],
    "startswith": lambda a: (a.expect("str", "str"), a.pos(0).startswith(a.pos(1)))[1],
    "endswith": lambda a: (a.expect("str", "str"), a.pos(0).endswith(a.pos(1)))[1],
    "split": _str_split(False),
    "rsplit": _str_split(True),
    "replace": _str_replace,
    "format": _str_format,
    "int": _str_int,
    "float": _str_float,
    "string": lambda a: (a.expect("str"), a.pos(0))[1],
    "slice": _str_slice,
    "safe": lambda a: (a.expect("str"), a.pos(0))[1],
    "tojson": _tojson,
    "indent": _str_indent,
    "join": _not_implemented("join on a string"),
}


# -- arrays ------------------------------------------------------------------------

def _same_shape(orig, items):
    return tuple(items) if kind(orig) == "tuple" else list(items)


def _select(reject):
    def fn(a):
        a.count(2, 4)
        a.expect("array", "str", required=2)
        arr, attr = a.pos(0), a.pos(1)
        out = []
        if len(a) == 2:
            for item in arr:
                keep = truthy(_get_attribute(item, attr, UNDEFINED))
                if keep != reject:
                    out.append(item)
            return out
        if len(a) == 3:
            test_name, test_arg, take_attr = to_str(a.pos(1)), a.pos(2), False
        else:
            test_name, test_arg, take_attr = to_str(a.pos(2)), a.pos(3), True
        test = GLOBALS.get("test_is_" + test_name)
        if test is None:
            raise Unsupported("select/selectattr: unknown test '%s'" % test_name)
        for item in arr:
            subject = _get_attribute(item, attr, UNDEFINED) if take_attr else item
            keep = truthy(test(Args(a.ctx, [subject, test_arg], test_name)))
            if keep != reject:
                out.append(item)
        return out
    return fn


def _join(a):
    a.count(1, 3)
    arr = a.pos(0)
    if kind(arr) not in ("array", "tuple"):
        raise TemplateError("join() first argument must be an array")
    delim = a.kwarg_or_pos("d", 1)
    attr = a.kwarg_or_pos("attribute", 2)
    delim = "" if is_undefined(delim) else to_str(delim)
    parts = []
    for item in arr:
        if not is_undefined(attr):
            item = _get_attribute(item, attr, UNDEFINED)
        if kind(item) not in ("str", "int", "float"):
            raise TemplateError("join() can only join arrays of strings or numbers")
        parts.append(to_str(item))
    return delim.join(parts)


def _map(a):
    a.count(2)
    arr = a.pos(0)
    if kind(arr) not in ("array", "tuple"):
        raise TemplateError("map: first argument must be an array")
    if type(a.items[1]) is not Kwarg:
        raise Unsupported("map() with a filter name is not supported; use map(attribute=...)")
    attr = a.kwarg_or_pos("attribute", 1)
    default = a.kwarg("default", UNDEFINED)
    return _same_shape(arr, [_get_attribute(x, attr, default) for x in arr])


def _append(a):
    a.count(2)
    arr = a.pos(0)
    if kind(arr) != "array":
        raise TemplateError("append: first argument must be a list")
    arr.append(a.pos(1))
    return arr


def _pop(a):
    a.count(1, 2)
    a.expect("array", required=1)
    arr = a.pos(0)
    if kind(arr) != "array":
        raise TemplateError("Attempting to modify immutable type")
    i = as_int(a.pos(1)) if len(a) == 2 else -1
    j = i + len(arr) if i < 0 else i
    if not 0 <= j < len(arr):
        raise TemplateError("Index %d out of bounds for array of size %d" % (j, len(arr)))
    return arr.pop(j)


def _sort_key(attr, op):
    def cmp(x, y):
        if not is_undefined(attr):
            x, y = _get_attribute(x, attr, UNDEFINED), _get_attribute(y, attr, UNDEFINED)
        if compare(x, y, op):
            return -1
        if compare(y, x, op):
            return 1
        return 0
    return functools.cmp_to_key(cmp)


def _sort(a):
    a.count(1, 4)
    arr = a.pos(0)
    if kind(arr) not in ("array", "tuple"):
        raise TemplateError("sort: first argument must be an array")
    reverse = truthy(a.kwarg_or_pos("reverse", 1))
    attr = a.kwarg_or_pos("attribute", 3)
    return _same_shape(arr, sorted(arr, key=_sort_key(attr, "gt" if reverse else "lt")))


def _minmax(op):
    def fn(a):
        a.count(1, 4)
        a.expect("array", required=1)
        attr = a.kwarg_or_pos("attribute", 2)
        arr = a.pos(0)
        if not arr:
            return UNDEFINED
        best = arr[0]
        for item in arr:
            x, y = item, best
            if not is_undefined(attr):
                x, y = _get_attribute(x, attr, UNDEFINED), _get_attribute(y, attr, UNDEFINED)
            if compare(x, y, op):
                best = item
        return best
    return fn


def _deep_string(a):
    if a.ctx.stats is not None:
        a.ctx.stats.mark(a.pos(0), deep=True)
    return to_str(a.pos(0))


def _first_last(i):
    def fn(a):
        a.expect("array")
        arr = a.pos(0)
        return arr[i] if arr else UNDEFINED
    return fn


def _array_slice(a):
    return _same_shape(a.pos(0), _slice(a.pos(0), *_slice_args(a, "array")))


ARRAY_BUILTINS = {
    "default": _default,
    "list": lambda a: (a.expect("array"), list(a.pos(0)))[1],
    "first": _first_last(0),
    "last": _first_last(-1),
    "length": lambda a: (a.expect("array"), len(a.pos(0)))[1],
    "slice": _array_slice,
    "selectattr": _select(False),
    "select": _select(False),
    "rejectattr": _select(True),
    "reject": _select(True),
    "join": _join,
    "string": _deep_string,
    "tojson": _tojson,
    "map": _map,
    "append": _append,
    "pop": _pop,
    "sort": _sort,
    "reverse": lambda a: (a.expect("array"), _same_shape(a.pos(0), a.pos(0)[::-1]))[1],
    "min": _minmax("lt"),
    "max": _minmax("gt"),
    "unique": _not_implemented("the 'unique' filter"),
}


# -- objects, None, undefined ------------------------------------------------------

def _obj_get(a):
    a.count(2, 3)
    obj, key = a.pos(0), a.pos(1)
    if kind(obj) != "object":
        raise TemplateError("get: first argument must be an object")
    if kind(key) != "str":
        raise TemplateError("get: second argument must be a string (key)")
    return obj.get(key, a.pos(2) if len(a) == 3 else None)


def _dictsort(a):
    obj = a.pos(0)
    by = a.kwarg_or_pos("by", 2)
    reverse = truthy(a.kwarg_or_pos("reverse", 3))
    by_value = kind(by) == "str" and by == "value"
    key = _sort_key(UNDEFINED, "gt" if reverse else "lt")
    items = sorted(obj.items(), key=lambda kv: key(kv[1] if by_value else kv[0]))
    return dict(items)


OBJECT_BUILTINS = {
    "get": _obj_get,
    "keys": lambda a: (a.expect("object"), list(a.pos(0).keys()))[1],
    "values": lambda a: (a.expect("object"), list(a.pos(0).values()))[1],
    "items": lambda a: (a.expect("object"), [tuple(kv) for kv in a.pos(0).items()])[1],
    "tojson": _tojson,
    "string": _deep_string,
    "length": lambda a: (a.expect("object"), len(a.pos(0)))[1],
    "dictsort": _dictsort,
    "join": _not_implemented("join on an object"),
}

NONE_BUILTINS = {
    "default": _default,
    "tojson": _tojson,
    "string": _const(lambda: "None"),
    "safe": _const(lambda: "None"),
}
for _name in ("items", "map", "reject", "rejectattr", "select", "selectattr", "unique"):
    NONE_BUILTINS[_name] = _const(list)

UNDEFINED_BUILTINS = {"default": _default}
for _name in ("capitalize", "join", "lower", "replace", "safe", "string", "strip", "title",
              "truncate", "upper"):
    UNDEFINED_BUILTINS[_name] = _const(str)
for _name in ("items", "list", "map", "reject", "rejectattr", "reverse", "select",
              "selectattr", "sort", "unique"):
    UNDEFINED_BUILTINS[_name] = _const(list)
for _name in ("length", "sum", "wordcount"):
    UNDEFINED_BUILTINS[_name] = _const(int)
for _name in ("first", "last", "max", "min"):
    UNDEFINED_BUILTINS[_name] = _const(Undefined)

_BUILTINS_BY_KIND = {"int": NUMBER_BUILTINS, "float": NUMBER_BUILTINS, "bool": BOOL_BUILTINS,
                     "str": STRING_BUILTINS, "array": ARRAY_BUILTINS, "tuple": ARRAY_BUILTINS,
                     "object": OBJECT_BUILTINS, "none": NONE_BUILTINS,
                     "undefined": UNDEFINED_BUILTINS}


def builtin(ctx, name, value, undefined_if_missing=False):
    """The method or filter ``name`` of ``value``'s type, bound to it."""
    if ctx.stats is not None:
        ctx.stats.mark(value, name)
    k = kind(value)
    table = _BUILTINS_BY_KIND.get(k)
    if table is None:
        raise TemplateError("%s has no builtins" % type_name(value))
    if type(value) is Loop:
        table = {}
    fn = table.get(name)
    if fn is not None:
        return Func(name, fn, value)
    if undefined_if_missing:
        return Undefined(name)
    raise Unsupported("unknown filter or method '%s' for a value of type %s"
                      % (name, type_name(value)))
