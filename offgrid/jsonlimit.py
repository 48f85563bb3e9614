"""How deep JSON may nest, checked before anything recurses into it.

Python's ``json`` parses nesting by recursion (about a thousand levels before
RecursionError), and so does everything that walks the value afterwards:
``dataclasses.asdict`` on the worker protocol, the chat template's
``tojson``, a schema's grammar.  A 1.2 KB request of tool parameters nested
490 deep was a 500 and 217 KB of traceback in all four chat dialects.  So
every JSON text from outside (a request body, a JSON string inside one such
as a tool call's ``arguments`` or a tool result, a model's reply) is
measured here first, without recursion, and refused past ``MAX_DEPTH``.

``loads`` raises ValueError, which every caller already takes as "not valid
JSON", so a bound nobody reaches changes nothing, and one that is reached
is the caller's usual answer for bad JSON (the front's 400).
"""

import array
import itertools
import json
import re

# Levels of arrays and objects one JSON text may nest.  A request body is an
# object holding messages or tools (3-4 levels) holding a JSON schema whose
# every level of properties costs two more: 64 leaves a schema about 28 levels
# deep, far past any real one (OpenAI's structured outputs allow 5), and
# keeps every recursive walk of the value well inside Python's 1000 frames.
MAX_DEPTH = 64

# a JSON string (its escapes skipped whole), and what is neither bracket nor string
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(r'[^\[\]{}]+')
# an opening bracket a step of +1, a closing one -1 (as signed bytes)
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


def depth_over(text, limit=MAX_DEPTH):
    """Whether the JSON ``text`` nests arrays and objects deeper than ``limit``.

    No recursion and no Python loop per character: the strings and everything
    but brackets are cut out by two regular expressions, and the deepest
    point is the largest running sum of the brackets' steps (itertools, in C):
    0.3 s for 8 MB of nothing but brackets on a 2-core machine, nothing for
    text with no more than ``limit`` brackets, which is never scanned.
    """
    if text.count("[") + text.count("{") <= limit:
        return False
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if len(brackets) <= limit:
        return False
    steps = array.array("b", brackets.encode("ascii").translate(_STEPS))
    return max(itertools.accumulate(steps)) > limit


def loads(text, limit=MAX_DEPTH, **kw):
    """``json.loads``, refusing nesting past ``limit`` with a ValueError."""
    if isinstance(text, (bytes, bytearray)):
        text = text.decode("utf-8")
    if depth_over(text, limit):
        raise ValueError("JSON nested more than %d levels deep" % limit)
    try:
        return json.loads(text, **kw)
    except RecursionError:      # unreachable past the check; never a traceback if it is not
        raise ValueError("JSON nested too deeply")
