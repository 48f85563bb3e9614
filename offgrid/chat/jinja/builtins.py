"""Each type's filters and methods in chat.jinja, and ``builtin()``, their lookup.

As in llama.cpp (common/jinja/value.cpp), a filter and a method are the same
thing, and each type of value has its own table of them: ``x | upper`` and
``x.upper()`` both find ``upper`` in the table of x's type, so ``upper`` on a
list is an error rather than a conversion.  The tables are by kind: numbers,
booleans, strings, arrays (and tuples), objects, None and undefined.
``builtin(ctx, name, value)`` returns the entry bound to the value, as a Func.

Imports .values and the shared helpers of .functions; only .nodes imports it.
"""

import functools
import re

from .functions import GLOBALS, _not_implemented, _tojson
from .values import (
    Args, Func, Kwarg, Loop, TemplateError, UNDEFINED, Undefined, Unsupported, _SPACE, _key,
    as_float, as_int, compare, is_undefined, kind, to_str, truthy, type_name)


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


def _default(a):
    a.count(2, 3)
    check_bool = truthy(a.kwarg_or_pos("boolean", 2))
    v = a.pos(0)
    missing = (not truthy(v)) if check_bool else (is_undefined(v) or v is None)
    return a.pos(1) if missing else v


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
    if len(new) > len(old):     # the result's size, before it is built
        n = s.count(old) if old else len(s) + 1
        a.ctx.budget.chars(len(s) + n * (len(new) - len(old)))
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
        a.ctx.budget.chars(width)
        pad = " " * width
    elif kind(width) == "str":
        pad = width
    else:
        pad = "    "
    a.ctx.budget.chars(len(s) + (s.count("\n") + 1) * len(pad))    # before it is built
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
    a.ctx.budget.chars(sum(map(len, parts)) + len(delim) * max(0, len(parts) - 1))
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
