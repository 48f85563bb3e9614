"""TextAssembler: what a client is shown while tokens arrive as byte pieces.

Pieces here are bytes, as generated tokens are: a character or a stop string
may be split across any number of them.  What the client sees is the
concatenation of every released piece plus what finish() returns.
"""

import itertools

from offgrid.engine.textstream import TextAssembler


def feed(asm, pieces):
    """Add each piece (str pieces are UTF-8 encoded); returns (released, stopped) per piece."""
    out = []
    for piece in pieces:
        out.append(asm.add(piece.encode() if isinstance(piece, str) else piece))
        if out[-1][1]:
            break
    return out


def shown(asm, pieces):
    """Everything the client would see: released pieces, then the tail from finish()."""
    return "".join(r for r, _ in feed(asm, pieces)) + asm.finish()


def splits(data, cuts):
    """Every way to cut ``data`` into pieces at ``cuts`` places."""
    for points in itertools.combinations(range(1, len(data)), cuts):
        bounds = (0,) + points + (len(data),)
        yield [data[a:b] for a, b in zip(bounds, bounds[1:])]


# --------------------------------------------------------------------------
# Without stop strings
# --------------------------------------------------------------------------

def test_text_is_released_as_it_arrives():
    asm = TextAssembler()
    assert feed(asm, ["Hello", ",", " world"]) == [("Hello", False), (",", False),
                                                    (" world", False)]
    assert asm.finish() == ""
    assert asm.text == "Hello, world"


def test_empty_stop_strings_are_ignored():
    asm = TextAssembler(stops=[""])
    assert feed(asm, ["abc"]) == [("abc", False)]


# --------------------------------------------------------------------------
# Stop strings
# --------------------------------------------------------------------------

def test_a_stop_string_inside_one_piece_ends_the_text_before_it():
    asm = TextAssembler(stops=["</s>"])
    assert feed(asm, ["abc</s>def"]) == [("abc", True)]
    assert asm.stop_word == "</s>"
    assert asm.text == "abc"
    assert asm.finish() == ""


def test_a_stop_string_split_across_pieces_is_found():
    asm = TextAssembler(stops=["STOP"])
    assert feed(asm, ["one S", "T", "O", "P two"]) == [
        ("one ", False), ("", False), ("", False), ("", True)]
    assert asm.stop_word == "STOP"
    assert asm.text == "one "


def test_a_possible_start_of_a_stop_string_is_held_until_it_diverges():
    asm = TextAssembler(stops=["STOP"])
    assert feed(asm, ["a ST", "ART"]) == [("a ", False), ("START", False)]
    assert asm.stop_word is None


def test_held_back_text_is_released_at_finish():
    asm = TextAssembler(stops=["STOP"])
    assert feed(asm, ["the end ST"]) == [("the end ", False)]
    assert asm.finish() == "ST"
    assert asm.text == "the end ST"


def test_the_earliest_stop_string_wins():
    asm = TextAssembler(stops=["world", "lo w"])
    assert shown(asm, ["hello world"]) == "hel"
    assert asm.stop_word == "lo w"


def test_however_the_bytes_are_split_the_stop_string_is_never_shown():
    data = "say é STOP later".encode()
    for cuts in (1, 2, 3):
        for pieces in splits(data, cuts):
            asm = TextAssembler(stops=["STOP"])
            released = [r for r, _ in feed(asm, pieces)]
            assert "".join(released) + asm.finish() == "say é ", pieces
            assert asm.stop_word == "STOP"
            assert not any("S" in r for r in released), pieces


def test_however_the_bytes_are_split_text_without_a_stop_arrives_whole():
    data = "STO STOP! no: ST ".encode()
    for pieces in splits(data, 3):
        asm = TextAssembler(stops=["STOP!!"])
        assert shown(asm, pieces) == "STO STOP! no: ST ", pieces


# --------------------------------------------------------------------------
# UTF-8
# --------------------------------------------------------------------------

def test_a_two_byte_character_split_in_two_is_released_whole():
    asm = TextAssembler()
    assert feed(asm, [b"caf\xc3", b"\xa9!"]) == [("caf", False), ("\u00e9!", False)]


def test_an_emoji_split_into_single_bytes_is_released_once_complete():
    emoji = "\U0001F999".encode()        # llama, 4 bytes
    asm = TextAssembler()
    released = [r for r, _ in feed(asm, [emoji[0:1], emoji[1:2], emoji[2:3], emoji[3:4]])]
    assert released == ["", "", "", "\U0001F999"]


def test_cjk_split_mid_character_never_shows_a_replacement_character():
    data = "你好，世界".encode()             # 3 bytes per character
    for pieces in splits(data, 4):
        asm = TextAssembler()
        released = [r for r, _ in feed(asm, pieces)]
        assert "".join(released) + asm.finish() == "你好，世界"
        assert not any("\ufffd" in r for r in released)


def test_a_multibyte_stop_string_split_mid_character_is_found():
    data = "hi 世界 bye".encode()
    for pieces in splits(data, 2):
        asm = TextAssembler(stops=["世界"])
        assert shown(asm, pieces) == "hi ", pieces
        assert asm.stop_word == "世界"


def test_an_incomplete_character_at_the_end_becomes_a_replacement_character():
    asm = TextAssembler()
    assert feed(asm, [b"ok\xe4\xb8"]) == [("ok", False)]
    assert asm.finish() == "\ufffd"


# --------------------------------------------------------------------------
# n_indent (FIM): lines after the first must keep the indentation
# --------------------------------------------------------------------------

def test_an_indented_body_continues():
    asm = TextAssembler(n_indent=4)
    assert feed(asm, ["x = 1\n", "    y = 2\n", "        z = 3\n"]) == [
        ("x = 1\n", False), ("    y = 2\n", False), ("        z = 3\n", False)]
    assert not asm.indent_stop


def test_a_tab_counts_as_one_column_as_in_llama_server():
    assert shown(TextAssembler(n_indent=1), ["x\n", "\ty\n"]) == "x\n\ty\n"
    assert shown(TextAssembler(n_indent=2), ["x\n", "\ty\n"]) == "x\n\t"


def test_the_first_line_is_never_checked():
    asm = TextAssembler(n_indent=4)
    assert feed(asm, ["return x"]) == [("return x", False)]


def test_a_line_indented_less_stops_and_is_cut_at_its_first_character():
    asm = TextAssembler(n_indent=4)
    result = feed(asm, ["a = 1\n    b = 2\n", "c = 3\n", "more"])
    assert result[-1][1] is True
    assert len(result) == 2
    assert asm.indent_stop
    assert asm.text == "a = 1\n    b = 2\n"
    assert asm.finish() == ""


def test_indentation_arriving_in_pieces_is_counted_whole():
    asm = TextAssembler(n_indent=4)
    assert feed(asm, ["a\n", "  ", "  b"]) == [("a\n", False), ("  ", False), ("  b", False)]


def test_a_short_indentation_split_across_pieces_stops_at_the_text():
    asm = TextAssembler(n_indent=4)
    assert feed(asm, ["a\n", "  ", "b"]) == [("a\n", False), ("  ", False), ("", True)]
    assert asm.text == "a\n  "


def test_blank_lines_do_not_stop():
    asm = TextAssembler(n_indent=4)
    assert shown(asm, ["a\n", "\n", "    b\n"]) == "a\n\n    b\n"
    assert not asm.indent_stop
