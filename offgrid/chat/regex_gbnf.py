"""A JSON schema ``pattern`` (an ECMAScript regular expression) as GBNF.

    body = pattern_body("^wf_[a-z0-9-]{6,}$", g)   # g: the jsonschema.Grammar being built
    rule = '"\\"" %s "\\"" space' % body

``pattern_body`` returns a GBNF expression matching the *JSON text* between a
string's quotes whose decoded value the pattern matches -- so a ``"`` in the
language comes out as ``\\"``, a newline as ``\\n``, and a class like
``[^,]`` never lets a raw quote or control character end or break the JSON.
llama.cpp's json-schema-to-grammar.cpp (``_visit_pattern``) writes the
pattern's characters as they are, which is wrong for exactly those; the
subset and the shape of the output otherwise follow it: literals, ``.``,
classes, groups, ``|``, ``* + ? {m} {m,} {m,n}`` (lazy forms too: the same
language).  Added here: the class escapes ``\\d \\w \\s`` and their negations,
``\\xHH`` / ``\\uHHHH``, named groups (as plain groups), and patterns not
anchored at both ends, which JSON Schema means as a search (any text before
and after; llama.cpp gives up on them and accepts any string).

Refused with PatternError (the caller drops the pattern or reports it):
lookaround, back-references, ``\\b``, flags, anchors inside the pattern, an
empty class, counts above the grammar's repetition limit, nesting deeper
than MAX_DEPTH.  The text is read with an explicit position and Python
recursion bounded by MAX_DEPTH, so a hostile pattern costs little; what the
resulting grammar costs libllama is gbnf.check's to bound.
"""

import re

from .gbnf import Limits

# Nesting of groups a pattern may have (each level is a Python frame here and
# a "(" in the grammar, whose own nesting gbnf.Limits bounds at 100).
MAX_DEPTH = 20
MAX_CHARS = 4096
MAX_COUNT = Limits.max_repetition

_MAX_CP = 0x10FFFF
_LINE_TERMINATORS = [(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]
_DIGITS = [(0x30, 0x39)]
_WORD = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACES = [(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
           (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
           (0xFEFF, 0xFEFF)]
_SIMPLE_ESCAPES = {"t": 0x09, "n": 0x0A, "v": 0x0B, "f": 0x0C, "r": 0x0D, "0": 0x00}
# How JSON writes the characters that cannot appear raw in a string
_JSON_SHORT = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r",
               0x09: "\\t"}


_LITERAL = re.compile(r'"(?:[^"\\]|\\.)*"\Z')


class PatternError(ValueError):
    """A pattern (or a part of one) this converter cannot express exactly."""


# -- character sets: sorted, disjoint (lo, hi) code point ranges ------------------------

def _normal(ranges):
    out = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _complement(ranges):
    out, nxt = [], 0
    for lo, hi in _normal(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= _MAX_CP:
        out.append((nxt, _MAX_CP))
    return out


def _minus(ranges, cut):
    return _normal(_intersect(ranges, _complement(cut)))


def _intersect(a, b):
    out, i, j = [], 0, 0
    a, b = _normal(a), _normal(b)
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _contains(ranges, cp):
    return any(lo <= cp <= hi for lo, hi in ranges)


def _class_char(cp):
    if cp < 0x20 or cp == 0x7F:
        return "\\x%02X" % cp
    if cp > 0x7E:
        return "\\U%08X" % cp
    c = chr(cp)
    return "\\" + c if c in "]\\^-[\"" else c


# Characters JSON may not have raw in a string (and 0x7F, which the grammar's
# ``char`` primitive also writes escaped), plus the surrogates, which are not
# characters.
_NOT_RAW = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F), (0xD800, 0xDFFF)]


def json_chars(ranges):
    """GBNF matching the JSON text of one character from ``ranges``: the raw
    characters JSON allows, and the escapes of the others.  None if empty."""
    ranges = _normal(ranges)
    alts = []
    raw = _minus(ranges, _NOT_RAW)
    if raw:
        alts.append("[" + "".join(_class_char(lo) if lo == hi else
                                  "%s-%s" % (_class_char(lo), _class_char(hi))
                                  for lo, hi in raw) + "]")
    shorts = sorted(c for c in _JSON_SHORT if _contains(ranges, c))
    for c in shorts:
        alts.append('"%s"' % _JSON_SHORT[c].replace("\\", "\\\\").replace('"', '\\"'))
    if _contains(ranges, 0x2F):
        alts.append('"\\\\/"')          # JSON's optional escape of "/"
    # The other control characters only as \u escapes; written out one by one
    # they would make every character position dozens of alternatives, so only
    # a set with all of them gets them (one rule); a set of some gets none of
    # them, which narrows what is matched, never widens it.
    if _intersect(ranges, [(0x00, 0x1F)]) == [(0x00, 0x1F)]:
        alts.append('"\\\\u00" [01] [0-9a-fA-F]')
    if _contains(ranges, 0x7F):
        alts.append('"\\\\u007f"')
    if not alts:
        return None
    return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"


# -- the parser: regex text -> GBNF, one pass -------------------------------------------

class _Reader:
    def __init__(self, text, add_rule):
        self.s, self.i = text, 0
        self.add_rule = add_rule
        self.depth = 0

    def peek(self):
        return self.s[self.i] if self.i < len(self.s) else ""

    def fail(self, what):
        raise PatternError("%s at offset %d" % (what, self.i))

    def alternation(self):
        """GBNF of ``a|b|...`` up to a ")" or the end; None for the empty string only."""
        alts = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            alts.append(self.sequence())
        filled = [a for a in alts if a is not None]
        if not filled:
            return None
        body = filled[0] if len(filled) == 1 else "(" + " | ".join(filled) + ")"
        if len(filled) < len(alts):
            body = "(" + body + ")?"        # one alternative is empty
        return body

    def sequence(self):
        items = []
        while self.peek() not in ("", "|", ")"):
            atom = self.atom()
            atom = self.quantified(atom)
            if atom is None:
                continue
            if items and _LITERAL.match(atom) and _LITERAL.match(items[-1]):
                items[-1] = items[-1][:-1] + atom[1:]      # "ab": one literal, not two
            else:
                items.append(atom)
        return " ".join(items) if items else None

    def quantified(self, atom):
        c = self.peek()
        if c in ("*", "+", "?"):
            self.i += 1
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
        elif c == "{" and self._count_ahead():
            lo, hi = self._count()
        else:
            return atom
        if self.peek() == "?":
            self.i += 1         # lazy: the same language
        if self.peek() in ("*", "+", "?") or (self.peek() == "{" and self._count_ahead()):
            self.fail("a quantifier after a quantifier")
        if atom is None:
            return None         # a repeated empty string is the empty string
        if lo > MAX_COUNT or (hi is not None and hi > MAX_COUNT):
            self.fail("a count above %d" % MAX_COUNT)
        if hi is not None and hi < lo:
            self.fail("a count {m,n} with n below m")
        if hi == 0:
            return None
        if (lo, hi) == (1, 1):
            return atom
        suffix = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((lo, hi))
        if suffix is None:
            suffix = "{%d}" % lo if lo == hi else "{%d,%s}" % (lo, "" if hi is None else hi)
        return "(%s)%s" % (atom, suffix)

    def _count_ahead(self):
        j = self.s.find("}", self.i)
        if j < 0:
            return False
        inner = self.s[self.i + 1:j]
        lo, _, hi = inner.partition(",")
        return lo.isdigit() and (hi == "" or hi.isdigit())

    def _count(self):
        j = self.s.find("}", self.i)
        inner = self.s[self.i + 1:j]
        self.i = j + 1
        lo, comma, hi = inner.partition(",")
        lo = int(lo)
        if not comma:
            return lo, lo
        return lo, (int(hi) if hi else None)

    def atom(self):
        c = self.peek()
        if c == "(":
            return self.group()
        if c == "[":
            return self.char_class()
        if c == ".":
            self.i += 1
            return self.chars(_complement(_LINE_TERMINATORS))
        if c in ("^", "$"):
            self.fail("an anchor inside the pattern")
        if c in ("*", "+", "?"):
            self.fail("nothing to repeat")
        if c == "{" and self._count_ahead():
            self.fail("nothing to repeat")
        if c == "\\":
            return self.chars(self.escape(in_class=False))
        self.i += 1
        return self.chars([(ord(c), ord(c))])

    def chars(self, ranges):
        if len(ranges) == 1 and ranges[0][0] == ranges[0][1] \
                and not _contains(_NOT_RAW, ranges[0][0]):
            cp = ranges[0][0]
            return '"%s"' % (chr(cp) if 0x20 <= cp < 0x7F and chr(cp) not in '"\\'
                             else "\\U%08X" % cp)
        out = json_chars(ranges)
        if out is None:
            self.fail("a class that matches nothing")
        return out

    def group(self):
        self.i += 1
        if self.s.startswith("?:", self.i):
            self.i += 2
        elif self.s.startswith("?<", self.i) and self.s[self.i + 2:self.i + 3] not in ("=", "!"):
            j = self.s.find(">", self.i)
            if j < 0:
                self.fail("an unterminated group name")
            self.i = j + 1                  # a named group: a plain group here
        elif self.peek() == "?":
            self.fail("lookaround or flags (?%s" % self.s[self.i + 1:self.i + 2])
        self.depth += 1
        if self.depth > MAX_DEPTH:
            self.fail("groups nested deeper than %d" % MAX_DEPTH)
        body = self.alternation()
        self.depth -= 1
        if self.peek() != ")":
            self.fail("an unbalanced parenthesis")
        self.i += 1
        return None if body is None else "(" + body + ")"

    def char_class(self):
        self.i += 1
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges = []
        first = True
        while True:
            c = self.peek()
            if c == "":
                self.fail("an unterminated character class")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo = self._class_atom()
            if self.peek() == "-" and self.s[self.i + 1:self.i + 2] not in ("]", ""):
                self.i += 1
                hi = self._class_atom()
                if len(lo) != 1 or len(hi) != 1 or lo[0][0] != lo[0][1] \
                        or hi[0][0] != hi[0][1]:
                    self.fail("a range with a class escape at one end")
                if hi[0][0] < lo[0][0]:
                    self.fail("a range out of order")
                ranges.append((lo[0][0], hi[0][0]))
            else:
                ranges += lo
        if negated:
            ranges = _complement(ranges)
        return self.chars(ranges)

    def _class_atom(self):
        c = self.peek()
        if c == "\\":
            return self.escape(in_class=True)
        self.i += 1
        return [(ord(c), ord(c))]

    def escape(self, in_class):
        """The ranges of the escape at ``\\``."""
        self.i += 1
        c = self.peek()
        if c == "":
            self.fail("a trailing backslash")
        self.i += 1
        if c in "dDwWsS":
            base = {"d": _DIGITS, "w": _WORD, "s": _SPACES}[c.lower()]
            return _complement(base) if c.isupper() else list(base)
        if c in _SIMPLE_ESCAPES:
            if c == "0" and self.peek().isdigit():
                self.fail("an octal escape")
            cp = _SIMPLE_ESCAPES[c]
            return [(cp, cp)]
        if c == "b" and in_class:
            return [(0x08, 0x08)]
        if c in ("x", "u"):
            n = 2 if c == "x" else 4
            digits = self.s[self.i:self.i + n]
            if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
                self.fail("a malformed \\%s escape" % c)
            self.i += n
            cp = int(digits, 16)
            return [(cp, cp)]
        if c.isalnum():
            # \b \B (word boundaries), \1 (back-references), \k, \p, \c, ...
            self.fail("the escape \\%s" % c)
        return [(ord(c), ord(c))]       # an escaped punctuation character: itself


def pattern_body(pattern, grammar=None):
    """GBNF for the JSON text of a string's content that ``pattern`` matches (a
    search, as JSON Schema means it: unanchored ends match anything).

    ``grammar`` (a jsonschema.Grammar) supplies the ``char`` rule unanchored
    ends need.  "" when only the empty string matches.  Raises PatternError
    for what cannot be expressed exactly.
    """
    if not isinstance(pattern, str):
        raise PatternError("a pattern must be a string")
    if len(pattern) > MAX_CHARS:
        raise PatternError("a pattern longer than %d characters" % MAX_CHARS)
    head = pattern.startswith("^")
    tail = len(pattern) > head and pattern.endswith("$") and not _escaped_at(pattern,
                                                                             len(pattern) - 1)
    inner = pattern[1 if head else 0:len(pattern) - 1 if tail else len(pattern)]
    r = _Reader(inner, None)
    body = r.alternation()
    if r.i != len(inner):
        r.fail("an unbalanced parenthesis")
    if (head or tail) and _top_level_bar(inner):
        # "^a|b$" is (^a)|(b$): each anchor binds to one alternative only
        raise PatternError("an anchor on one alternative only (group the alternatives)")
    any_text = None
    if not (head and tail):
        any_text = (grammar.primitive("char") if grammar is not None else "char") + "*"
    parts = [any_text if not head else None, body, any_text if not tail else None]
    return " ".join(p for p in parts if p)


def _escaped_at(s, k):
    """Whether s[k] is escaped (an odd run of backslashes before it)."""
    n = 0
    while k - n - 1 >= 0 and s[k - n - 1] == "\\":
        n += 1
    return n % 2 == 1


def _top_level_bar(s):
    depth, i, in_class = 0, 0, False
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if s[i + 1:i + 2] == "]":
                i += 1
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == "|" and depth == 0:
            return True
        i += 1
    return False
