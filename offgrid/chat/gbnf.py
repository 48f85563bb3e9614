"""A GBNF reader that refuses, in Python, every grammar libllama cannot survive.

libllama's grammar parser and sampler trust their input.  A C++ exception
escaping through ctypes aborts the process, its parser recurses once per
``(`` (a deep nesting overflows the stack), its left-recursion check recurses
once per leading rule reference and revisits shared rules (exponential time),
``x{3,2}`` makes it allocate rules until memory runs out, and a grammar that no
token of the vocabulary can follow leaves the sampler with no candidate, which
ends in an abort on the next accept.  So every grammar, whether a client wrote
it or offgrid built it from a JSON schema or a tool list, goes through
``check()`` first; it raises GrammarError (a 400) naming the problem and where.

check() reads the text once, left to right, with the syntax of the pinned
llama.cpp (``src/llama-grammar.cpp``): ``#`` comments, ``name ::= ...`` rules
ending at a newline, ``|``, ``( )``, ``"..."`` literals and ``[...]`` /
``[^...]`` classes with the escapes ``\\x.. \\u.... \\U........ \\t \\r \\n
\\\\ \\" \\[ \\] \\-``, ``.``, rule references, ``* + ? {m} {m,} {m,n}``, and
token references ``<[id]>``, ``<text>``, ``!<[id]>``, ``!<text>``.  Nested
groups are kept on an explicit stack, never in Python recursion, and the
analysis after reading (nullable rules, leading references, cost) works on
worklists, so a hostile 40 KB ``((((...`` costs microseconds.

It also models what libllama builds from the text (every ``( )`` and every
repetition becomes a rule; ``S{m,n}`` inlines m copies of S and chains n-m
optional ones) to bound its size, the depth of its recursion and its
per-token cost before libllama sees any of it.  The limits are class
attributes of ``Limits``, each with the measurement behind it.
"""

import bisect
import threading
import weakref

from ..errors import InvalidRequest


class GrammarError(InvalidRequest):
    """A grammar libllama must not be given (a 400 that says why and where)."""


class Limits:
    """Bounds on a grammar, far above what real grammars need.

    Measured on offgrid's own grammars: a 60-property object (strings of
    maxLength 500, arrays of up to 100 objects, nested addresses, enums) as a
    JSON schema is 33 KB, 9,000 rules after expansion, 39,000 elements, nesting
    depth 2, a leading chain of 41 and a frontier of 41 stacks; as ten tools
    forced in parallel (hermes, llama3, mistral, harmony) 42 KB, 11,000 rules,
    48,000 elements; an open object with 60 named properties a frontier of 64.
    llama.cpp's ``grammars/*.gbnf`` stay under 100 rules, depth 2, frontier 23.
    """

    # The text itself: 256 KiB is 6x the largest schema grammar above.
    max_chars = 256 * 1024
    # ( ) nesting.  libllama's parser recurses once per level at 260-500 bytes
    # of C stack: 2,000 levels pass in a 1 MiB thread and 4,000 do not; 10,000
    # pass in an 8 MiB one and 30,000 do not.  100 is safe in a 64 KiB stack.
    max_depth = 100
    # Rules as libllama counts them, named plus one per group and repetition.
    # A rule costs libllama a vector and a name (about 100 bytes).
    max_rules = 100000
    # Grammar elements after libllama's expansion of repetitions (8 bytes
    # each, copied twice while building): 1,000,000 is about 24 MB at peak.
    max_elements = 1000000
    # libllama's MAX_REPETITION_THRESHOLD: it refuses m above this and
    # silently makes n above it unbounded; we refuse both.
    max_repetition = 2000
    # Longest chain of leading rule references: libllama's left-recursion
    # check recurses once per link at 100-200 bytes of stack (5,000 links
    # pass in a 1 MiB thread, 10,000 do not).
    max_leading_chain = 2000
    # Rule visits of that check, which revisits a rule once per path to it:
    # 22 levels of ``r_i ::= r_i+1 | r_i+1`` (4M visits) take 0.23 s.
    max_leading_visits = 1000000
    # Sampling cost: for every candidate token libllama walks every parse
    # stack alive at that point, so one sample costs about stacks x n_vocab,
    # and every token sampled while that many are alive pays it again.
    # Measured on gemma-3-270m (262,144 tokens), CPU time of one sample on
    # the 2-core build machine: an enum of 64 values 0.29 s, 128 values
    # 0.88 s, 256 values 1.8 s, 512 values 3.3 s (wall time under load: 1,000
    # values 10 s, 2,000 values 25 s); a rule tree of 128 literals 0.43 s; one
    # literal of 100,000 characters 0.07 s.  Building the sampler takes under
    # 2 ms for all of these: the cost is in sampling.  2**25 stack x token
    # checks is 128 stacks on a 262k vocabulary (about 1 s) and 1,024 on 32k.
    max_frontier_work = 2 ** 25


class VocabFacts:
    """What check() needs to know about a model's vocabulary.

    ``first_bytes``: the first bytes of the tokens libllama's grammar sampler
    may pick (not end-of-generation, not empty, not starting with NUL);
    ``eog``: the end-of-generation token ids; ``token_id(text)``: the single
    token ``<text>`` stands for, or None.  Built by ``Model.grammar_facts``.
    """

    def __init__(self, n_vocab, eog=(), first_bytes=None, token_id=None):
        self.n_vocab = n_vocab
        self.eog = frozenset(eog)
        self.first_bytes = frozenset(range(1, 256) if first_bytes is None else first_bytes)
        self.token_id = token_id
        self._spans = _lead_spans(self.first_bytes)

    def can_start(self, ranges, negated=False):
        """Whether a token may start with a character in ``ranges`` [(lo, hi)]."""
        return _meets(self._spans, ranges, negated)


class Stats:
    """What libllama would build from a grammar (check()'s return value)."""

    def __init__(self, rules, elements, depth, leading_chain, leading_visits, frontier):
        self.rules = rules
        self.elements = elements
        self.depth = depth
        self.leading_chain = leading_chain
        self.leading_visits = leading_visits
        self.frontier = frontier

    def __repr__(self):
        return ("Stats(rules=%d, elements=%d, depth=%d, leading_chain=%d, "
                "leading_visits=%d, frontier=%d)" % (self.rules, self.elements, self.depth,
                                                     self.leading_chain, self.leading_visits,
                                                     self.frontier))


_DEFAULT_FACTS = None
_CAP = 1 << 62          # saturating counts: a hostile grammar must not make bigints
_WORD = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-")
_DIGITS = frozenset("0123456789")
_ESCAPES = {"t": 9, "r": 13, "n": 10, "\\": 92, '"': 34, "[": 91, "]": 93, "-": 45}
_HEX = {"x": 2, "u": 4, "U": 8}


def check(text, facts=None, limits=Limits):
    """Raise GrammarError unless libllama can safely build and sample ``text``.

    ``facts`` (VocabFacts) adds the checks that need the model: token ids,
    end-of-generation tokens and characters no token can start with.
    Returns Stats.
    """
    global _DEFAULT_FACTS
    if facts is None:
        if _DEFAULT_FACTS is None:
            _DEFAULT_FACTS = VocabFacts(None)
        facts = _DEFAULT_FACTS
    if not isinstance(text, str):
        raise GrammarError("a grammar must be a string")
    if len(text) > limits.max_chars:
        raise GrammarError("the grammar is %d characters; the limit is %d"
                           % (len(text), limits.max_chars))
    reader = _Reader(text, facts, limits)
    reader.read()
    return _analyse(reader, facts, limits)


# ---------------------------------------------------------------------------
# Reading: the same loop as llama_grammar_parser, with an explicit group stack
# ---------------------------------------------------------------------------

class _Item:
    """One symbol of a sequence: a terminal or a rule reference, repeated.

    ``ref`` is a rule id or None (terminal); ``first``: the terminal consumes
    a character or token (an empty literal does not); ``size``: its elements;
    ``reps``: the repetitions applied, innermost first, as (min, n_opt,
    unbounded) the way libllama's handle_repetitions sees them.
    """
    __slots__ = ("ref", "first", "size", "reps", "n_prev")

    def __init__(self, ref, first, size):
        self.ref, self.first, self.size, self.reps, self.n_prev = ref, first, size, [], 1


class _Group:
    """A rule being read: a named rule's body or a ( ) group."""
    __slots__ = ("rule", "alts", "nested", "symbols_before", "open_at")

    def __init__(self, rule, nested, symbols_before, open_at):
        self.rule, self.alts, self.nested = rule, [[]], nested
        self.symbols_before, self.open_at = symbols_before, open_at


class _Reader:
    def __init__(self, text, facts, limits):
        self.text = text
        self.n = len(text)
        self.facts = facts
        self.limits = limits
        self.names = {}         # rule name -> id (libllama's symbol_ids, named part)
        self.n_symbols = 0      # named and generated, as libllama numbers them
        self.rules = {}         # id -> list of alternatives (lists of _Item)
        self.defined_at = {}    # id -> text offset of its definition
        self.used_at = {}       # id -> text offset of a first reference
        self.elements = 0
        self.depth = 0

    # -- errors and positions ---------------------------------------------------
    def fail(self, pos, what):
        line = self.text.count("\n", 0, pos) + 1
        col = pos - (self.text.rfind("\n", 0, pos) + 1) + 1
        snippet = self.text[pos:pos + 20]
        raise GrammarError("grammar, line %d column %d: %s%s" % (
            line, col, what, (" at %r" % snippet) if snippet else " at the end"))

    # -- symbols -----------------------------------------------------------------
    def symbol(self, name, pos):
        rid = self.names.get(name)
        if rid is None:
            rid = self.names[name] = self.new_symbol(pos)
            self.used_at[rid] = pos
        return rid

    def new_symbol(self, pos):
        rid = self.n_symbols
        self.n_symbols += 1
        if self.n_symbols > self.limits.max_rules:
            self.fail(pos, "more than %d rules (groups and repetitions count as rules)"
                      % self.limits.max_rules)
        return rid

    def add_elements(self, k, pos):
        self.elements += k
        if self.elements > self.limits.max_elements:
            self.fail(pos, "the grammar expands to more than %d elements "
                      "(repetitions are expanded)" % self.limits.max_elements)

    # -- lexing helpers -----------------------------------------------------------
    def space(self, pos, newline_ok):
        text, n = self.text, self.n
        while pos < n:
            c = text[pos]
            if c == " " or c == "\t" or (newline_ok and (c == "\n" or c == "\r")):
                pos += 1
            elif c == "#":
                while pos < n and text[pos] not in "\r\n":
                    pos += 1
            else:
                break
        return pos

    def name_end(self, pos):
        end = pos
        while end < self.n and self.text[end] in _WORD:
            end += 1
        if end == pos:
            self.fail(pos, "expecting a rule name")
        return end

    def int_end(self, pos):
        end = pos
        while end < self.n and self.text[end] in _DIGITS:
            end += 1
        if end == pos:
            self.fail(pos, "expecting an integer")
        return end

    def char(self, pos):
        """(code point, next offset) of one character of a literal or class."""
        text = self.text
        if pos >= self.n:
            self.fail(pos, "unexpected end of input")
        c = text[pos]
        if c != "\\":
            return ord(c), pos + 1
        e = text[pos + 1] if pos + 1 < self.n else ""
        if e in _HEX:
            k = _HEX[e]
            digits = text[pos + 2:pos + 2 + k]
            if len(digits) != k or any(d not in "0123456789abcdefABCDEF" for d in digits):
                self.fail(pos, "expecting %d hex digits after \\%s" % (k, e))
            return int(digits, 16), pos + 2 + k
        if e in _ESCAPES:
            return _ESCAPES[e], pos + 2
        self.fail(pos, "unknown escape")

    # -- the grammar ----------------------------------------------------------------
    def read(self):
        text = self.text
        for i, c in enumerate(text):
            if c == "\x00":
                self.fail(i, "a NUL character")
            if "\ud800" <= c <= "\udfff":
                self.fail(i, "a lone surrogate (not UTF-8)")
        pos = self.space(0, True)
        while pos < self.n:
            pos = self.rule(pos)
        for name, rid in self.names.items():
            if rid not in self.rules:
                self.fail(self.used_at[rid], "rule %r is used but never defined" % name)
        if "root" not in self.names:
            raise GrammarError("the grammar has no 'root' rule")

    def rule(self, pos):
        end = self.name_end(pos)
        rid = self.symbol(self.text[pos:end], pos)
        self.defined_at[rid] = pos
        pos = self.space(end, False)
        if self.text[pos:pos + 3] != "::=":
            self.fail(pos, "expecting ::=")
        pos = self.alternates(self.space(pos + 3, True), rid)
        if pos < self.n:
            if self.text[pos] == "\r":
                pos += 2 if self.text[pos + 1:pos + 2] == "\n" else 1
            elif self.text[pos] == "\n":
                pos += 1
            else:
                self.fail(pos, "expecting newline or end")
        return self.space(pos, True)

    def alternates(self, pos, rid):
        """Read one rule body, groups included; returns the offset after it."""
        text, n, limits = self.text, self.n, self.limits
        stack = [_Group(rid, False, 0, pos)]
        while True:
            g = stack[-1]
            seq = g.alts[-1]
            nested = g.nested
            c = text[pos] if pos < n else ""
            if c == '"':
                pos, item = self.literal(pos)
                seq.append(item)
                pos = self.space(pos, nested)
            elif c == "[":
                pos, item = self.char_class(pos)
                seq.append(item)
                pos = self.space(pos, nested)
            elif c == "<" or c == "!":
                pos, item = self.token(pos)
                seq.append(item)
                pos = self.space(pos, nested)
            elif c in _WORD and c:
                end = self.name_end(pos)
                item = _Item(self.symbol(text[pos:end], pos), True, 1)
                self.add_elements(1, pos)
                seq.append(item)
                pos = self.space(end, nested)
            elif c == "(":
                if len(stack) > limits.max_depth:
                    self.fail(pos, "groups nested more than %d deep" % limits.max_depth)
                before = self.n_symbols
                sub = self.new_symbol(pos)
                self.add_elements(1, pos)
                item = _Item(sub, True, 1)
                seq.append(item)
                stack.append(_Group(sub, True, before, pos))
                self.depth = max(self.depth, len(stack) - 1)
                pos = self.space(pos + 1, True)
            elif c == ".":
                self.add_elements(1, pos)
                seq.append(_Item(None, True, 1))
                pos = self.space(pos + 1, nested)
            elif c in ("*", "+", "?"):
                at = pos
                pos = self.space(pos + 1, nested)
                self.repeat(seq, at, 0 if c != "+" else 1, 1 if c == "?" else None)
            elif c == "{":
                at = pos
                pos, lo, hi = self.braces(pos, nested)
                self.repeat(seq, at, lo, hi)
            elif c == "|":
                self.add_elements(1, pos)
                g.alts.append([])
                pos = self.space(pos + 1, True)
            else:
                # the end of this group or of the rule
                self.add_elements(1, pos)           # END
                self.rules[g.rule] = g.alts
                if not g.nested:
                    return pos
                if c != ")":
                    self.fail(pos, "expecting ')' to close the group opened at offset %d"
                              % g.open_at)
                stack.pop()
                parent = stack[-1].alts[-1]
                parent[-1].n_prev = max(1, self.n_symbols - g.symbols_before)
                pos = self.space(pos + 1, stack[-1].nested)

    def literal(self, pos):
        start = pos
        pos += 1
        chars = 0
        first = None
        while True:
            if pos >= self.n:
                self.fail(start, "unterminated string literal")
            if self.text[pos] == '"':
                break
            at = pos
            cp, pos = self.char(pos)
            if cp == 0:
                self.fail(at, "a NUL character (\\x00) in a literal")
            if cp > 0x10FFFF:
                self.fail(at, "code point U+%X is beyond Unicode" % cp)
            if first is None:
                first = cp
                if not self.facts.can_start([(cp, cp)]):
                    self.fail(at, "no token of the model can start with %r" % _show(cp))
            chars += 1
        self.add_elements(chars, start)
        return pos + 1, _Item(None, chars > 0, chars)

    def char_class(self, pos):
        start = pos
        pos += 1
        negated = pos < self.n and self.text[pos] == "^"
        if negated:
            pos += 1
        ranges = []
        while True:
            if pos >= self.n:
                self.fail(start, "unterminated character class")
            if self.text[pos] == "]":
                break
            at = pos
            lo, pos = self.char(pos)
            hi = lo
            if self.text[pos:pos + 1] == "-" and self.text[pos + 1:pos + 2] not in ("]", ""):
                hi, pos = self.char(pos + 1)
            if lo > 0x10FFFF or hi > 0x10FFFF:
                self.fail(at, "a code point beyond Unicode (U+10FFFF)")
            if hi < lo:
                self.fail(at, "the range %s-%s is empty" % (_show(lo), _show(hi)))
            if not negated and lo == hi == 0:
                self.fail(at, "a NUL character (\\x00) in a character class")
            ranges.append((lo, hi))
        self.add_elements(sum(1 if lo == hi else 2 for lo, hi in ranges), start)
        if ranges and not self.facts.can_start(ranges, negated):
            self.fail(start, "no token of the model can start with a character of this class")
        return pos + 1, _Item(None, bool(ranges), len(ranges))

    def token(self, pos):
        start = pos
        negated = self.text[pos] == "!"
        if negated:
            pos += 1
        if self.text[pos:pos + 1] != "<":
            self.fail(pos, "expecting '<' after '!'")
        if self.text[pos + 1:pos + 2] == "[":
            end = self.int_end(pos + 2)
            if self.text[end:end + 2] != "]>":
                self.fail(end, "expecting ']>'")
            tid = int(self.text[pos + 2:end])
            pos = end + 2
        else:
            end = self.text.find(">", pos)
            if end < 0:
                self.fail(pos, "expecting '>'")
            tid = None
            if self.facts.token_id is not None:
                tid = self.facts.token_id(self.text[pos:end + 1])
                if tid is None:
                    self.fail(start, "%r is not a single token of the model"
                              % self.text[pos:end + 1])
            pos = end + 1
        n_vocab = self.facts.n_vocab
        if tid is not None:
            if tid > 0xFFFFFFFF or (n_vocab is not None and tid >= n_vocab):
                self.fail(start, "token %d is outside the vocabulary%s"
                          % (tid, "" if n_vocab is None else " [0, %d)" % n_vocab))
            if not negated and tid in self.facts.eog:
                self.fail(start, "token %d ends generation; a grammar cannot require it" % tid)
        self.add_elements(1, start)
        return pos, _Item(None, True, 1)

    def braces(self, pos, nested):
        text = self.text
        pos = self.space(pos + 1, nested)
        end = self.int_end(pos)
        lo = int(text[pos:end])
        pos = self.space(end, nested)
        if text[pos:pos + 1] == "}":
            return self.space(pos + 1, nested), lo, lo
        if text[pos:pos + 1] != ",":
            self.fail(pos, "expecting ',' or '}'")
        pos = self.space(pos + 1, nested)
        hi = None
        if text[pos:pos + 1] in _DIGITS and pos < self.n:
            end = self.int_end(pos)
            hi = int(text[pos:end])
            pos = self.space(end, nested)
        if text[pos:pos + 1] != "}":
            self.fail(pos, "expecting '}'")
        return self.space(pos + 1, nested), lo, hi

    def repeat(self, seq, at, lo, hi):
        """Apply {lo,hi} (hi None: unbounded) to the last item, as libllama does."""
        limit = self.limits.max_repetition
        if not seq or seq[-1].size == 0:
            self.fail(at, "a repetition needs something before it to repeat")
        if lo > limit or (hi is not None and hi > limit):
            self.fail(at, "a repetition count above %d (libllama's limit)" % limit)
        if hi is not None and hi < lo:
            self.fail(at, "the repetition {%d,%d} has its minimum above its maximum" % (lo, hi))
        item = seq[-1]
        total = hi if hi else (lo if lo else 1)
        if item.n_prev * total > limit:
            self.fail(at, "repeating %d rules %d times exceeds libllama's limit of %d"
                      % (item.n_prev, total, limit))
        n_opt = 1 if hi is None else hi - lo
        # the parent keeps lo copies and a reference; each optional copy is a rule
        grown = item.size * max(lo, 1) + (1 if n_opt else 0) - item.size
        self.add_elements(grown + n_opt * (item.size + 3), at)
        for _ in range(n_opt):
            self.new_symbol(at)
        item.size = item.size * lo + (1 if n_opt else 0)
        item.reps.append((lo, n_opt, hi is None))
        item.n_prev *= total


# ---------------------------------------------------------------------------
# Analysis: nullable rules, leading references, what sampling will cost
# ---------------------------------------------------------------------------

def _analyse(r, facts, limits):
    rules = r.rules
    nullable = _nullable_rules(rules)

    def item_nullable(it):
        if any(lo == 0 for lo, _, _ in it.reps):
            return True
        return nullable.get(it.ref, False) if it.ref is not None else not it.first

    def body(rid):
        return nullable.get(rid, False)

    # Leading references: the rules libllama's left-recursion check recurses
    # into (and the rules whose first characters start a sample).
    leads = {}
    for rid, alts in rules.items():
        out = []
        for seq in alts:
            for it in seq:
                if it.ref is not None:
                    out.append((it.ref, it))
                if not item_nullable(it):
                    break
        leads[rid] = out
    order = _topological(rules, leads, r)
    for alts in rules.values():
        for seq in alts:
            for it in seq:
                _check_repeats(r, it, nullable)

    chain, visits, first = {}, {}, {}
    for rid in reversed(order):
        c, v, f = 1, sum(len(seq) + 1 for seq in rules[rid]), 0
        for ref, it in leads[rid]:
            extra = sum(n_opt for lo, n_opt, _ in it.reps) if nullable.get(ref) else 0
            c = max(c, chain[ref] + 1 + extra)
            v = min(_CAP, v + visits[ref])
        chain[rid], visits[rid] = c, v
        for seq in rules[rid]:
            f = min(_CAP, f + _sequence_first(seq, 0, first, item_nullable, body))
        first[rid] = f

    longest = max(chain.values()) if chain else 0
    if longest > limits.max_leading_chain:
        raise GrammarError("a chain of %d rules each starting with the next; the limit is %d"
                           % (longest, limits.max_leading_chain))
    referenced = {ref for out in leads.values() for ref, _ in out}
    total_visits = min(_CAP, sum(visits[rid] for rid in rules if rid not in referenced))
    if total_visits > limits.max_leading_visits:
        raise GrammarError("rules reach each other through %d paths of leading references; "
                           "the limit is %d" % (total_visits, limits.max_leading_visits))

    # The frontier: parse stacks alive at one point, bounded by the terminals
    # that can come first from any position of any sequence.
    frontier = max([1] + list(first.values()))     # a rule's alternatives, all at once
    for alts in rules.values():
        for seq in alts:
            suffix = 0
            for it in reversed(seq):
                f = _item_first(it, first, body)
                suffix = min(_CAP, f + (suffix if item_nullable(it) else 0))
                frontier = max(frontier, suffix)
    n_vocab = facts.n_vocab or 262144
    if frontier * n_vocab > limits.max_frontier_work:
        raise GrammarError(
            "the grammar allows %d alternatives at one point; with this model's %d tokens "
            "the limit is %d (each sampled token checks every alternative against every "
            "token, about 1 s per 128 on a 262k vocabulary)"
            % (frontier, n_vocab, max(1, limits.max_frontier_work // n_vocab)))
    return Stats(r.n_symbols, r.elements, r.depth, longest, total_visits, frontier)


def _check_repeats(r, it, nullable):
    """libllama turns S* into S' ::= S S' | (empty): left-recursive when S can be empty."""
    empty = nullable.get(it.ref, False) if it.ref is not None else not it.first
    for lo, _, unbounded in it.reps:
        if unbounded and empty:
            names = {v: k for k, v in r.names.items()}
            what = ("rule %r" % names[it.ref]) if it.ref in names else "a group"
            raise GrammarError("%s that can match nothing is repeated without bound "
                               "(left recursion to libllama)" % what)
        empty = empty or lo == 0


def _item_first(it, first, body_nullable):
    base = first[it.ref] if it.ref is not None else (1 if it.first else 0)
    if it.ref is not None and it.reps and body_nullable(it.ref):
        # a nullable body repeated: each copy may be where the text starts
        copies = sum(max(lo, 1) + n_opt for lo, n_opt, _ in it.reps)
        return min(_CAP, base * copies)
    return base


def _sequence_first(seq, start, first, item_nullable, body_nullable):
    f = 0
    for it in seq[start:]:
        f = min(_CAP, f + _item_first(it, first, body_nullable))
        if not item_nullable(it):
            break
    return f


def _nullable_rules(rules):
    """{rule id: True} for the rules that can match the empty text (a worklist)."""
    nullable = {}
    pending = {}            # (rule, alt index) -> references still blocking it
    users = {}              # rule -> [(rule, alt index)] waiting on it
    work = []
    for rid, alts in rules.items():
        for i, seq in enumerate(alts):
            blockers = []
            for it in seq:
                if any(lo == 0 for lo, _, _ in it.reps):
                    continue
                if it.ref is None:
                    if it.first:
                        break
                    continue
                blockers.append(it.ref)
            else:
                if not blockers:
                    if rid not in nullable:
                        nullable[rid] = True
                        work.append(rid)
                    continue
                pending[(rid, i)] = len(blockers)
                for ref in blockers:
                    users.setdefault(ref, []).append((rid, i))
    while work:
        done = work.pop()
        for key in users.get(done, ()):
            pending[key] -= 1
            if pending[key] == 0 and key[0] not in nullable:
                nullable[key[0]] = True
                work.append(key[0])
    return nullable


def _topological(rules, leads, reader):
    """Rule ids with every rule before the rules it leads with (Kahn's algorithm);
    a cycle is left recursion, which libllama refuses."""
    indeg = dict.fromkeys(rules, 0)
    for out in leads.values():
        for ref, _ in out:
            indeg[ref] += 1
    ready = [rid for rid, d in indeg.items() if d == 0]
    order = []
    while ready:
        rid = ready.pop()
        order.append(rid)
        for ref, _ in leads[rid]:
            indeg[ref] -= 1
            if indeg[ref] == 0:
                ready.append(ref)
    if len(order) != len(rules):
        stuck = min(rid for rid, d in indeg.items() if d > 0)
        names = {v: k for k, v in reader.names.items()}
        raise GrammarError("the grammar is left-recursive (rule %r can start with itself)"
                           % names.get(stuck, "a group"))
    return order


# ---------------------------------------------------------------------------
# Which characters a token can start with
# ---------------------------------------------------------------------------

def _lead_spans(first_bytes):
    """Merged code point ranges whose UTF-8 form starts with one of ``first_bytes``."""
    spans = []
    for b in sorted(first_bytes):
        if b < 0x80:
            lo, hi = b, b
        elif 0xC2 <= b <= 0xDF:
            lo = (b & 0x1F) << 6
            hi = lo + 0x3F
        elif 0xE0 <= b <= 0xEF:
            lo = (b & 0x0F) << 12
            hi = lo + 0xFFF
        elif 0xF0 <= b <= 0xF4:
            lo = (b & 0x07) << 18
            hi = min(lo + 0x3FFFF, 0x10FFFF)
        else:
            continue        # a continuation byte or never valid UTF-8: cannot start a char
        if spans and spans[-1][1] + 1 >= lo:
            spans[-1] = (spans[-1][0], max(spans[-1][1], hi))
        else:
            spans.append((lo, hi))
    return spans


def _meets(spans, ranges, negated):
    """Whether [lo, hi] ranges (or their complement) meet the spans."""
    if not negated:
        starts = [s[0] for s in spans]
        for lo, hi in ranges:
            i = bisect.bisect_right(starts, hi) - 1
            if i >= 0 and spans[i][1] >= lo:
                return True
        return False
    covered = sorted(ranges)
    for lo, hi in spans:
        # does the union of ``covered`` leave a gap inside [lo, hi]?
        at = lo
        for clo, chi in covered:
            if chi < at:
                continue
            if clo > at:
                return True
            at = chi + 1
            if at > hi:
                break
        if at <= hi:
            return True
    return False


def _show(cp):
    return chr(cp) if 0x20 <= cp < 0x7F else "U+%04X" % cp


# -- the check every grammar goes through ----------------------------------------------

_facts = weakref.WeakKeyDictionary()        # model -> its VocabFacts
_facts_lock = threading.Lock()


def facts_of(model):
    """The VocabFacts of a loaded model, made once from ``model.grammar_facts``."""
    with _facts_lock:
        facts = _facts.get(model)
        if facts is None:
            facts = _facts[model] = VocabFacts(*model.grammar_facts)
        return facts


def check_grammar(model, grammar, triggers=()):
    """Raise GrammarError (a 400) unless ``grammar`` is safe to give libllama.

    Every grammar goes through here before the engine builds a sampler from
    it, whichever way it came (``grammar``, ``json_schema``,
    ``response_format``, tool grammars): the checks are Python's, against
    the model's vocabulary (``model.grammar_facts``), and no libllama sampler
    is made until the request is running.
    """
    check(grammar, facts_of(model))
    for t in triggers:
        if not isinstance(t, str) or "\x00" in t:
            raise GrammarError("a grammar trigger must be a string without NUL")
