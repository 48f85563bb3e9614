"""A reasoning budget: at most N tokens of thinking, then its end forced.

llama-server's ``reasoning_budget_tokens`` (``--reasoning-budget N``;
Anthropic's ``thinking.budget_tokens``), as llama.cpp's
common/reasoning-budget.cpp runs it: idle (watching for a start marker's
tokens), counting (thinking: each token spends one; a natural end marker
ends it), waiting (spent in the middle of a character's bytes: until the
character is whole), forcing (the budget message and the end marker, one
token a step, whatever the model would have picked), done (and armed again
by another start marker).  The generation loop (engine/generate.py) asks
``forced()`` before it samples and tells ``accept()`` every token kept.

A request with ``reasoning_control`` may have its thinking ended while it
runs (llama-server's POST /v1/chat/completions/control, "reasoning_end"):
``control()``, from another thread, asks; the next ``forced()`` begins the
forcing if the budget is counting then (as common_reasoning_budget_force,
which leaves any other state as it is).
"""

IDLE, COUNTING, WAITING, FORCING, DONE = range(5)
NO_BOUND = 2 ** 31 - 1      # a budget of no bound that can still be ended (llama.cpp's INT_MAX)


class _Matcher:
    """Which of several token sequences the tokens seen so far end with."""

    def __init__(self, seqs):
        self.seqs = [list(s) for s in seqs if s]
        self.longest = max((len(s) for s in self.seqs), default=0)
        self.recent = []

    def advance(self, token):
        self.recent = (self.recent + [token])[-self.longest:] if self.longest else []
        for i, s in enumerate(self.seqs):
            if self.recent[-len(s):] == s:
                return i
        return -1

    def reset(self):
        self.recent = []


def utf8_complete(piece):
    """Whether ``piece`` (bytes) does not end inside a character, as llama.cpp's
    common_utf8_is_complete judges it from the piece alone."""
    if not piece:
        return True
    for back in range(1, min(4, len(piece)) + 1):
        b = piece[-back]
        if b & 0xC0 != 0x80:        # ASCII or a lead byte: its character's length
            need = 4 if b >= 0xF0 else 3 if b >= 0xE0 else 2 if b >= 0xC0 else 1
            return back >= need
    return False                    # continuation bytes only


class ThinkBudget:
    """One request's budget: ``spec`` as the worker makes it (worker.think_spec):
    budget, starts, ends (token sequences), forced (tokens), counting (the
    prompt ended inside a reasoning block)."""

    def __init__(self, spec):
        self.budget = spec["budget"]
        self.starts = _Matcher(spec["starts"])
        self.ends = _Matcher(spec["ends"])
        self.forced_tokens = list(spec["forced"])
        self.state, self.left, self.at = IDLE, self.budget, 0
        self.end_asked = False
        if spec["counting"]:
            self._open()

    def _open(self):
        self.state, self.left = COUNTING, self.budget
        self.ends.reset()
        if self.left <= 0:
            self.state, self.at = FORCING, 0

    def control(self, action):
        """A control of the running request (RequestCancel.control): "reasoning_end"
        ends the thinking at the next step."""
        if action == "reasoning_end":
            self.end_asked = True

    def forced(self):
        """The token this step must be, or None to sample."""
        if self.end_asked:
            self.end_asked = False
            if self.state == COUNTING:
                self.state, self.at = FORCING, 0
                self.ends.reset()
        if self.state == FORCING and self.at < len(self.forced_tokens):
            return self.forced_tokens[self.at]
        return None

    def give_up(self):
        """The forced token cannot be taken (a grammar forbids it): sample freely on."""
        self.state = DONE

    def accept(self, token, piece):
        """A token kept in the reply, its bytes ``piece``."""
        if self.state in (IDLE, DONE):
            if self.starts.advance(token) >= 0:
                self._open()
        elif self.state in (COUNTING, WAITING):
            if self.ends.advance(token) >= 0:
                self.state = DONE
            elif self.state == WAITING:
                if utf8_complete(piece):
                    self.state, self.at = FORCING, 0
            else:
                self.left -= 1
                if self.left <= 0:
                    self.state = WAITING
                    if utf8_complete(piece):
                        self.state, self.at = FORCING, 0
        elif self.state == FORCING:
            self.at += 1
            if self.at >= len(self.forced_tokens):
                self.state = DONE
                self.starts.reset()
