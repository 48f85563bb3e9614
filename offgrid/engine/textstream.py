"""Turning generated token bytes into text that is safe to show.

Tokens are byte pieces: a UTF-8 character may be split across two of them,
and a stop string may be split across several.  TextAssembler receives the
bytes of each generated token and hands back only text that can no longer
change: never half a character, never the start of what may yet become a stop
string, never the stop string itself.
"""

import codecs


class TextAssembler:
    """The text of one generation, released piece by piece.

    ``add(data)`` returns the text that may be sent now; ``finish()`` returns
    whatever was held back once generation ends for another reason.  After a
    stop string matches, ``stop_word`` names it and ``text`` ends before it.
    """

    def __init__(self, stops=(), n_indent=0):
        self.stops = [s for s in stops if s]
        self.n_indent = n_indent
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
        return self._release(len(self.text) - self._partial_stop_len()), False

    def finish(self):
        """Release everything still held (generation ended without a stop string)."""
        tail = self._decoder.decode(b"", final=True)
        if tail and self.stop_word is None and not self.indent_stop:
            self.text += tail
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

    def finish(self):
        """Every item still held (generation ended with all its text released)."""
        out = [h[2] for h in self._held]
        self._held.clear()
        self.released += out
        return out
