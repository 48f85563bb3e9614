"""Turning generated token bytes into text that is safe to show.

Tokens are byte pieces: a UTF-8 character may be split across two of them,
and a stop string may be split across several.  TextAssembler receives the
bytes of each generated token and hands back only text that can no longer
change: never half a character, never the start of what may yet become a stop
string, never the stop string itself.  For fill-in-the-middle, SuffixStop
also ends the text where it starts repeating what follows the cursor.
"""

import codecs


class TextAssembler:
    """The text of one generation, released piece by piece.

    ``add(data)`` returns the text that may be sent now; ``finish()`` returns
    whatever was held back once generation ends for another reason.  After a
    stop string matches, ``stop_word`` names it and ``text`` ends before it.
    ``suffix`` (FIM: the text after the cursor, None otherwise) stops the
    text where it meets the suffix (SuffixStop, ``indent``: the cursor
    line's); ``stop_word`` is then the text cut off.
    """

    def __init__(self, stops=(), n_indent=0, suffix=None, indent=0):
        self.stops = [s for s in stops if s]
        self.n_indent = n_indent
        self.suffix = SuffixStop(suffix, indent) if suffix is not None else None
        self.text = ""          # all text so far (cut at a stop string or indent limit)
        self.sent = 0           # how much of ``text`` has been released
        self.stop_word = None   # the stop string that ended generation
        self.indent_stop = False
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._line_start = None  # index where the line after the first newline starts

    def add(self, data):
        """Add one token's bytes.  Returns (text to send now, stopped)."""
        new = self._decoder.decode(data)
        if not new:
            return "", False
        self.text += new
        if self.stops:
            hit = self._find_stop()
            if hit is not None:
                pos, word = hit
                self.text = self.text[:pos]
                self.stop_word = word
                return self._release(len(self.text)), True
        if self.n_indent > 0 and self._indent_exceeded():
            self.indent_stop = True
            return self._release(len(self.text)), True
        end = len(self.text) - self._partial_stop_len()
        if self.suffix is not None:
            cut, hold = self.suffix.scan(self.text)
            if cut is not None:
                self.stop_word = self.text[cut:]
                self.text = self.text[:cut]
                return self._release(cut), True
            end = min(end, hold)
        return self._release(end), False

    def finish(self):
        """Release everything still held (generation ended without a stop string).

        With a suffix, a repeat of it that generation ended in the middle of
        is not returned either.
        """
        tail = self._decoder.decode(b"", final=True)
        if self.stop_word is None and not self.indent_stop:
            self.text += tail
            if self.suffix is not None:
                cut = self.suffix.cut_at_end(self.text)
                if cut is not None:
                    self.text = self.text[:max(cut, self.sent)]
        return self._release(len(self.text))

    def _release(self, end):
        end = max(end, self.sent)
        out = self.text[self.sent:end]
        self.sent = end
        return out

    def _find_stop(self):
        """Earliest (position, word) of a stop string in the unsent text, or None."""
        best = None
        for word in self.stops:
            # a match cannot start before ``sent``: text that could begin a
            # stop string is never released
            i = self.text.find(word, self.sent)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, word)
        return best

    def _partial_stop_len(self):
        """Length of the longest tail of the unsent text that begins a stop string."""
        unsent = len(self.text) - self.sent
        longest = 0
        for word in self.stops:
            for k in range(min(len(word) - 1, unsent), longest, -1):
                if self.text.endswith(word[:k]):
                    longest = k
                    break
        return longest

    def _indent_exceeded(self):
        """llama-server's n_indent rule for FIM.

        Every line after the first must be indented by at least n_indent
        spaces or tabs; at the first line that is not, cut the text at that
        line's first non-blank character and stop.
        """
        if self._line_start is None:
            nl = self.text.find("\n")
            if nl < 0:
                return False
            self._line_start = nl + 1
        while True:
            line_start = self._line_start
            pos = line_start
            while pos < len(self.text) and self.text[pos] in " \t":
                pos += 1
            if pos >= len(self.text):
                return False            # the line is still all blanks: wait
            if self.text[pos] != "\n" and pos - line_start < self.n_indent:
                self.text = self.text[:pos]
                return True
            nl = self.text.find("\n", pos)
            if nl < 0:
                return False
            self._line_start = nl + 1


class SuffixStop:
    """Where a fill-in-the-middle completion starts repeating the text after the cursor.

    Code models asked to fill a gap often write the gap, then go on with the
    lines that follow it (which they were shown as the suffix): ``return `` +
    ``a + b\\n\\ndef multiply(a, b):...`` when ``def multiply`` is the next
    line.  The anchor is the suffix's next non-blank lines (stripped, enough
    of them to make ``min_chars``, at most ``max_lines``); the completion
    meets the suffix where its own non-blank lines, from a line's start,
    are those lines in order (blank lines and indentation aside).  The
    completion then ends before that line, less the blank lines the suffix
    already begins with, so completion + suffix reads as the model meant.

    The rest of the cursor's line (the suffix before its first newline)
    counts too: a first line that ends with it, followed by the next anchor
    lines, is a repeat from there (``foo(`` + ``a, b)\\nprint(x)`` with
    suffix ``)\\nprint(x)`` gives ``a, b``).  It alone is not enough when
    short: ``)`` at the end of a line may be the completion's own.

    A suffix of blank text (the cursor at the end of the file) has nothing
    to repeat; there the completion meets the end of the file at a blank
    line followed by a line indented no deeper than the cursor's
    (``indent``): the model has finished what was begun and starts a block
    of its own (``return `` + ``a + b\\n\\ndef subtract(a, b):`` gives
    ``a + b``).

    ``scan(text)`` after each token says where a confirmed repeat starts
    (the text to keep), or how much of the text is safe to release: never
    the start of what may yet become a repeat.  ``cut_at_end(text)``, once
    generation has ended, cuts a repeat it ended in the middle of.
    """

    min_chars = 12      # of the anchor's stripped lines: shorter ones match by chance
    max_lines = 3

    def __init__(self, suffix, indent=0):
        self.at_end = not suffix.strip()
        self.indent = indent
        lines = suffix.split("\n")
        self.rest = lines[0].strip()            # the rest of the cursor's line
        later = [i for i in range(1, len(lines)) if lines[i].strip()]
        # the anchor after the cursor's line, and the newlines before it
        self.after = self._anchor([lines[i].strip() for i in later])
        self.gap_newlines = later[0] if later else 0
        # the anchor from the rest of the cursor's line on, where that can tell
        full = self._anchor([self.rest] + self.after) if self.rest else []
        self.full = full if len(full) > 1 or len(self.rest) >= self.min_chars else []
        self._scanned = 0       # text[:_scanned] has had its line starts found
        self._starts = []       # live candidates: line starts (after a newline)

    def _anchor(self, lines):
        out, n = [], 0
        for line in lines[:self.max_lines]:
            out.append(line)
            n += len(line)
            if n >= self.min_chars:
                break
        return out

    def scan(self, text):
        """(cut, hold): ``cut`` where a confirmed repeat starts (else None);
        ``hold``: text before it may be released."""
        nl = text.find("\n", self._scanned)
        while nl >= 0:
            self._starts.append(nl + 1)
            nl = text.find("\n", nl + 1)
        self._scanned = len(text)
        hold = len(text)
        first = self._first_line_start(text)
        if first is not None:
            state = _match(text[first:], self.full)
            if state == "done":
                return first, first
            if state is not None:
                hold = first
        live = []
        for p in self._starts:
            if self.at_end:
                state = self._new_block(text, p)
                cut = len(text[:p].rstrip())
            else:
                state = _match(text[p:], self.after)
                cut = self._cut(text, p) if state else None
            if state is None:
                continue
            if state == "done":
                return cut, cut
            live.append(p)
            hold = min(hold, len(text[:p].rstrip()))
        self._starts = live
        if self.at_end:
            # trailing newlines may turn out to be the blank line before a block
            body = len(text.rstrip())
            if "\n" in text[body:]:
                hold = min(hold, body)
        return None, hold

    def cut_at_end(self, text):
        """Where to end ``text``, whose generation is over, if it ends in a
        repeat (at least one character of the anchor written); else None."""
        first = self._first_line_start(text)
        if first is not None:
            nl = text.find("\n", first)
            if nl >= 0 and _match(text[first:], self.full) and text[nl:].strip():
                return first
        for p in self._starts:
            if not self.at_end and _match(text[p:], self.after) and text[p:].strip():
                return self._cut(text, p)
        return None

    def _new_block(self, text, p):
        """At the end of the file: whether the line starting at p, after a blank
        line, begins a block no deeper than the cursor's line ("done"), may
        yet ("live": nothing but blanks so far) or not (None)."""
        prev = text.rfind("\n", 0, p - 1) + 1
        if prev == 0 or text[prev:p].strip():
            return None         # no blank line before it (the first line is the cursor's)
        line = text[p:]
        body = line.lstrip(" \t")
        if not body:
            return "live"
        if body[0] == "\n":
            return None         # a blank line itself: the next line start is the candidate
        return "done" if len(line) - len(body) <= self.indent else None

    def _first_line_start(self, text):
        """Where the rest of the cursor's line may begin again in the first line."""
        if not self.full:
            return None
        nl = text.find("\n")
        if nl < 0:
            # still on the first line: its longest tail that may begin ``rest``
            line = text
            for k in range(min(len(self.rest), len(line)), 0, -1):
                if self.rest.startswith(line[-k:]):
                    return len(line) - k
            return None
        line = text[:nl].rstrip()
        if line.endswith(self.rest):
            return len(line) - len(self.rest)
        return None

    def _cut(self, text, p):
        """Where the kept text ends, for a repeat from the line starting at p:
        its trailing blank lines go, but for those the suffix does not begin with."""
        first = len(text) - len(text[p:].lstrip())      # the repeat's first character
        kept = text[:text.rfind("\n", 0, first) + 1]
        body = kept.rstrip()
        keep_nl = max(0, kept.count("\n", len(body)) - self.gap_newlines)
        cut = len(body)
        for _ in range(keep_nl):
            cut = kept.index("\n", cut) + 1
        return cut


def _match(text, anchor):
    """Whether the non-blank lines of ``text`` are ``anchor``'s (stripped):
    "done" when all of them are there, each complete; "live" while the text
    may yet become that; None when it cannot."""
    if not anchor:
        return None
    *complete, partial = text.split("\n")
    i = 0
    for line in complete:
        line = line.strip()
        if not line:
            continue
        if line != anchor[i]:
            return None
        i += 1
        if i == len(anchor):
            return "done"
    partial = partial.strip()
    if partial and not anchor[i].startswith(partial):
        return None
    return "live"


class TokenLedger:
    """Which generated tokens each released piece of text belongs to.

    For token probabilities: a piece carries the tokens whose text it
    completes, so a streamed event holds exactly the tokens of its content.
    ``add(data, item)`` records a token's bytes (the same bytes, in the same
    order, as TextAssembler.add) with what to report for it; ``release``
    hands back the items whose text the assembler has released.

    A token goes with the first piece that shows any of its text.
    Positions are characters of the text before any stop-string cut (this
    decodes the bytes again, as TextAssembler does).  A token that is only
    the first bytes of a UTF-8 character begins with that character, so it
    goes out with the piece that shows it, as llama-server holds a token
    back while its text is incomplete UTF-8; a token held as the possible
    start of a stop string goes with the piece that releases it.  When a
    stop string (or the n_indent rule) cuts the text, the tokens wholly
    inside the stop string are dropped (llama-server's non-streamed result
    drops the stop string's tokens too); one that straddles the cut stays.
    """

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._pos = 0
        self._held = []         # [start, end or None while its character is unfinished, item]
        self.released = []      # every item released, in order

    def add(self, data, item):
        start = self._pos
        self._pos += len(self._decoder.decode(data))
        done = not self._decoder.getstate()[0]
        if self._pos > start or done:
            # characters ended here: so did the text of tokens waiting on them
            for h in reversed(self._held):
                if h[1] is not None:
                    break
                h[1] = self._pos
        self._held.append([start, self._pos if done else None, item])

    def release(self, sent, cut=None):
        """Items whose text begins in the first ``sent`` characters released (or
        that have no text and end there); with ``cut`` (the text ended there)
        the rest, wholly after it, is dropped."""
        held = self._held
        end = sent if cut is None else cut
        i = 0
        while i < len(held) and (held[i][0] < end
                                 or (held[i][1] is not None and held[i][1] <= end)):
            i += 1
        out = [h[2] for h in held[:i]]
        if cut is None:
            del held[:i]
        else:
            held.clear()
        self.released += out
        return out

    def finish(self, end=None):
        """Every item still held (generation ended with all its text released);
        with ``end``, the text ended there: the items wholly after it are dropped."""
        if end is not None:
            return self.release(end, end)
        out = [h[2] for h in self._held]
        self._held.clear()
        self.released += out
        return out
