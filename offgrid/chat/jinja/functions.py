"""The global functions and tests of chat.jinja: what templates call by name.

``GLOBALS`` maps a name to its function: ``raise_exception``, ``namespace``
and ``dict``, ``range``, ``strftime_now``, ``tojson``, and each ``is`` test
under ``test_is_<name>`` (as llama.cpp registers them).  A function takes an
Args and returns a value; where llama.cpp leaves one out (the ``escaped`` and
``filter`` tests) it raises Unsupported.

Imports only .values; .nodes (names and tests) and .builtins (select,
tojson) import it.
"""

import math
import time

from .values import (
    Kwarg, TemplateError, TemplateRaised, UNDEFINED, Unsupported, _key, as_int, compare, equal,
    is_undefined, kind, to_json, to_str, truthy, type_name)


def _not_implemented(what):
    def fn(_args):
        raise Unsupported("%s is not supported" % what)
    return fn



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
    return to_json(a.pos(0), ind, item_sep, key_sep, truthy(ensure_ascii), a.ctx.budget)


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
    a.ctx.budget.items(len(range(start, stop, step)))      # before the list is made
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

