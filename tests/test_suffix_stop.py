"""A fill-in-the-middle completion stops where it meets the suffix (textstream.SuffixStop).

Code models fill the gap, then go on writing the lines after it, which they
were shown as the suffix.  The completion ends before the repeat, which is
never returned, streamed or not; at the end of the file (a blank suffix) it
ends where the model starts a block of its own.  llama-server's n_indent and
t_max_predict_ms rules hold as before.
"""

import pytest

from offgrid.engine.textstream import TextAssembler, TokenLedger

try:
    from .test_textstream import splits
except ImportError:
    from test_textstream import splits


def complete(suffix, pieces, indent=0, **kw):
    """(everything the client saw, the final text, stop_word) for these pieces."""
    asm = TextAssembler(suffix=suffix, indent=indent, **kw)
    seen = ""
    for piece in pieces:
        released, stopped = asm.add(piece.encode() if isinstance(piece, str) else piece)
        seen += released
        if stopped:
            break
    seen += asm.finish()
    return seen, asm.text, asm.stop_word


NEXT = "\n\ndef multiply(a, b):\n    return a * b\n"


def test_a_repeat_of_the_next_lines_is_cut_with_the_blank_lines_before_it():
    seen, text, stop = complete(NEXT, ["a + b", "\n\n", "def multiply(a, b):", "\n",
                                       "    return a * b"])
    assert seen == text == "a + b"
    assert stop == "\n\ndef multiply(a, b):\n"     # what was cut off


@pytest.mark.parametrize("cuts", [1, 2, 3])
def test_no_split_of_the_pieces_shows_any_of_the_repeat(cuts):
    data = "a + b\n\ndef multiply(a, b):\n    return"
    for pieces in splits(data, cuts):
        seen, text, _ = complete(NEXT, pieces)
        assert seen == text == "a + b", pieces


def test_blank_lines_the_suffix_does_not_have_are_kept():
    # the model wanted three blank lines; the suffix brings one
    assert complete(NEXT, ["a + b\n\n\n\ndef multiply(a, b):\n"])[1] == "a + b\n\n"
    # an indented line inserted before the suffix's own line
    assert complete("\n    return 1\n", ["    x = 2\n    return 1\n"])[1] == "    x = 2"


def test_the_rest_of_the_cursor_line_counts_with_the_next_line():
    # foo( + "a, b)" and then the next line: the model wrote the rest again
    assert complete(")\nprint(x)\n", ["a, b)\nprint(x)\n"])[1] == "a, b"
    # the completion is only the suffix again: nothing to add
    assert complete(")\nprint(x)\n", [")\nprint(x)\nprint(x)\n"])[1] == ""
    # a short rest alone proves nothing: ")" may close the completion's own call
    assert complete(")\n", ["foo(x)\nbar(y)\n"])[1] == "foo(x)\nbar(y)\n"


def test_lines_that_only_look_like_the_suffix_are_kept():
    seen, text, stop = complete(NEXT, ["a + b\n\ndef subtract(a, b):\n    return a - b\n"])
    assert seen == text == "a + b\n\ndef subtract(a, b):\n    return a - b\n"
    assert stop is None


def test_a_repeat_that_generation_ended_inside_is_not_returned():
    # n_predict ran out in the middle of the repeated line
    seen, text, _ = complete(NEXT, ["a + b\n\ndef mul"])
    assert seen == text == "a + b"
    # ...but blank lines alone at the end are the completion's own
    assert complete(NEXT, ["a + b\n"])[1] == "a + b\n"


def test_at_the_end_of_the_file_a_new_block_ends_the_completion():
    """The issue's case: ``def add(a, b): return `` with suffix "\\n"."""
    seen, text, stop = complete("\n", ["a + b", "\n\n", "def", " subtract(a, b): return a - b"])
    assert seen == text == "a + b"
    # deeper lines, blank lines between them, are the completion's own
    body = "\n    a = 1\n\n    return a\n"
    assert complete("\n", [body + "\ndef g():\n"], indent=0)[1] == body.rstrip()
    # a line at the cursor's indentation right after another is too
    assert complete("", ["import os\nimport sys\n"])[1] == "import os\nimport sys\n"


def test_without_a_suffix_nothing_changes():
    seen, text, stop = complete(None, ["a + b\n\ndef multiply(a, b):\n"])
    assert seen == text == "a + b\n\ndef multiply(a, b):\n" and stop is None


def test_n_indent_still_cuts_first():
    # llama-server's rule: the line indented less than n_indent is cut at its text
    seen, text, stop = complete("\n}\n\nint main() {\n", ["  x++;\n", "}\n\nint main() {\n"],
                                n_indent=2)
    assert seen == text == "  x++;\n" and stop is None


def test_stop_strings_still_win_when_they_come_first():
    seen, text, stop = complete(NEXT, ["a + b;", "\n\ndef multiply(a, b):\n"], stops=[";"])
    assert text == "a + b" and stop == ";"


def test_token_probabilities_leave_out_the_tokens_of_a_cut_repeat():
    pieces = ["a", " + b", "\n\n", "def", " mul"]
    asm, ledger = TextAssembler(suffix=NEXT), TokenLedger()
    for i, piece in enumerate(pieces):
        asm.add(piece.encode())
        ledger.add(piece.encode(), i)
        ledger.release(asm.sent)
    asm.finish()
    assert asm.text == "a + b"
    assert ledger.released + ledger.finish(len(asm.text)) == [0, 1]


# -- on the real code model ------------------------------------------------------

try:
    from .serverproc import ServerProcess, TEST_THREADS
except ImportError:
    from serverproc import ServerProcess, TEST_THREADS


@pytest.fixture(scope="module")
def server(qwen_path):
    with ServerProcess(qwen_path, threads=TEST_THREADS) as s:
        yield s


def _infill(server, prefix, suffix, **kw):
    body = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 48, "temperature": 0,
            "cache_prompt": False}
    body.update(kw)
    status, _, out = server.post("/infill", body, timeout=600)
    assert status == 200, out
    return out


def test_qwen_stops_at_the_end_of_a_one_line_function(server):
    """Qwen2.5-Coder-Instruct, greedy, at the end of a file, goes on with
    def subtract, def multiply ...; the completion is the line's end."""
    out = _infill(server, "def add(a, b): return ", "\n")
    assert out["content"] == "a + b"
    assert out["stop_type"] == "word" and out["stopping_word"].startswith("\n\ndef")
    assert out["tokens_predicted"] < 10


def test_qwen_does_not_repeat_the_suffix_streamed(server):
    prefix = "import math\n\n\ndef area(r):\n    return "
    suffix = "\n\n\ndef perimeter(r):\n    return 2 * math.pi * r\n"
    plain = _infill(server, prefix, suffix, n_predict=24)["content"]
    assert "def perimeter" not in plain and plain.strip()
    status, events = server.stream("/infill", {"input_prefix": prefix, "input_suffix": suffix,
                                               "n_predict": 24, "temperature": 0,
                                               "stream": True, "cache_prompt": False},
                                   timeout=600)
    assert status == 200
    assert "".join(e.get("content", "") for e in events[:-1]) == plain


def test_openai_completions_with_a_suffix_stop_there_too(server):
    status, _, out = server.post("/v1/completions", {"prompt": "def add(a, b): return ",
                                                     "suffix": "\n", "max_tokens": 48,
                                                     "temperature": 0})
    assert status == 200
    assert out["choices"][0]["text"] == "a + b"
    assert out["choices"][0]["finish_reason"] == "stop"


def test_n_indent_and_t_max_predict_ms_keep_llama_servers_rules(server):
    # n_indent 4: the first line at column 0 is cut at its text, as llama-server does
    out = _infill(server, "def f(x):\n    if x:\n        return 1\n    ", "\n", n_indent=4)
    assert "\ndef " not in out["content"]
    # t_max_predict_ms: a newline after the time is up ends it
    out = _infill(server, "def add(a, b): return ", "\n", t_max_predict_ms=1)
    assert len(out["content"].strip().split("\n")) == 1
