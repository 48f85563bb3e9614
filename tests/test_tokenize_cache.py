"""Model.tokenize keeps the tokens of recent long texts (an editor's prefix and
suffix come again with every keystroke); a kept answer is libllama's own."""

import pytest

from offgrid.engine import model as model_mod
from offgrid.engine.model import Model


class Counting:
    """The model's handle, counting tokenize calls that reach libllama."""

    def __init__(self, handle):
        self._handle = handle
        self.calls = 0

    def tokenize(self, *args):
        self.calls += 1
        return self._handle.tokenize(*args)

    def __getattr__(self, name):
        return getattr(self._handle, name)


@pytest.fixture()
def qwen(lib, qwen_path):
    m = Model.load(str(qwen_path), progress=False, vocab_only=True)
    m._handle = Counting(m._handle)
    try:
        yield m
    finally:
        m._handle = m._handle._handle
        m.close()


def prefix(n):
    return "".join("    total_%d = add(total_%d, %d)  # line %d\n" % (i, i - 1, i, i)
                   for i in range(n))


def test_a_long_text_again_is_not_tokenized_again_and_is_the_same(qwen):
    text = prefix(40)
    first = qwen.tokenize(text, add_special=False)
    calls = qwen._handle.calls
    second = qwen.tokenize(text, add_special=False)
    assert second == first
    assert qwen._handle.calls == calls, "the same long text went to libllama again"
    second.append(-1)           # a caller's list is its own
    assert qwen.tokenize(text, add_special=False) == first


def test_the_flags_are_part_of_what_is_kept(qwen):
    text = "<|fim_prefix|>" + prefix(40)
    plain = qwen.tokenize(text, add_special=False, parse_special=False)
    special = qwen.tokenize(text, add_special=False, parse_special=True)
    assert special != plain and special[1:] == plain[len(plain) - len(special) + 1:]
    assert qwen.tokenize(text, add_special=False, parse_special=True) == special


def test_the_oldest_long_text_goes_first_and_short_ones_never_push_it_out(qwen):
    texts = [prefix(40) + "# %d\n" % i for i in range(model_mod.TOKENIZED_KEPT + 1)]
    for t in texts:
        qwen.tokenize(t, add_special=False)
    # many short texts (an editor's typed line, once per keystroke) in between
    for i in range(3 * model_mod.TOKENIZED_SHORT_KEPT):
        qwen.tokenize("x = %d" % i, add_special=False)
    calls = qwen._handle.calls
    qwen.tokenize(texts[-1], add_special=False)
    qwen.tokenize(texts[1], add_special=False)
    assert qwen._handle.calls == calls, "a short text pushed a long one out"
    qwen.tokenize(texts[0], add_special=False)
    assert qwen._handle.calls == calls + 1, "the least recently used text was still kept"


def test_short_texts_are_kept_apart_the_last_few_of_them(qwen):
    short = ["def add(a, b):", "def add(a, b):\n    return", "<|fim_prefix|>x"]
    first = [qwen.tokenize(t, add_special=False, parse_special=True) for t in short]
    calls = qwen._handle.calls
    assert [qwen.tokenize(t, add_special=False, parse_special=True) for t in short] == first
    assert qwen._handle.calls == calls, "a short text went to libllama again"
    for i in range(model_mod.TOKENIZED_SHORT_KEPT):
        qwen.tokenize("y = %d" % i, add_special=False)
    calls = qwen._handle.calls
    assert qwen.tokenize(short[0], add_special=False, parse_special=True) == first[0]
    assert qwen._handle.calls == calls + 1, "more short texts were kept than the limit"
    calls = qwen._handle.calls
    qwen.tokenize(short[1], add_special=False, parse_special=True, keep=False)
    assert qwen._handle.calls == calls + 1, "keep=False was kept"
