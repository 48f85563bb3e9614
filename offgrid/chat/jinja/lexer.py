"""The lexer of chat.jinja: template source to tokens, with llama.cpp's whitespace control.

``lex(source)`` returns the tokens and the normalised text their positions
refer to.  Token types are the string constants below; ``Parser`` is their
only reader.  Imports only .values (the errors, _SPACE); only .parser and the
package's ``Template`` import it.
"""

from .values import TemplateSyntaxError, _SPACE, _line_col


TEXT, NUMBER, STRING, NAME, EQUALS = "text", "number", "string", "name", "="
LPAREN, RPAREN, LBRACKET, RBRACKET, LBRACE, RBRACE = "(", ")", "[", "]", "{", "}"
COMMA, DOT, COLON, PIPE = ",", ".", ":", "|"
OPEN_STMT, CLOSE_STMT, OPEN_EXPR, CLOSE_EXPR, COMMENT = "{%", "%}", "{{", "}}", "comment"
ADD_OP, MUL_OP, CMP_OP, UNARY_OP, EOF = "additive", "multiplicative", "comparison", "unary", "eof"


class Token:
    __slots__ = ("type", "value", "pos")

    def __init__(self, type_, value, pos):
        self.type, self.value, self.pos = type_, value, pos

    def __repr__(self):
        return "Token(%s, %r)" % (self.type, self.value)


# Longest first where one is a prefix of another, as llama.cpp matches them.
_SYMBOLS = [
    ("{%-", OPEN_STMT), ("-%}", CLOSE_STMT), ("{{-", OPEN_EXPR), ("-}}", CLOSE_EXPR),
    ("{%", OPEN_STMT), ("%}", CLOSE_STMT), ("{{", OPEN_EXPR), ("}}", CLOSE_EXPR),
    ("(", LPAREN), (")", RPAREN), ("{", LBRACE), ("}", RBRACE), ("[", LBRACKET),
    ("]", RBRACKET), (",", COMMA), (".", DOT), (":", COLON), ("|", PIPE),
    ("<=", CMP_OP), (">=", CMP_OP), ("==", CMP_OP), ("!=", CMP_OP), ("<", CMP_OP),
    (">", CMP_OP), ("+", ADD_OP), ("-", ADD_OP), ("~", ADD_OP), ("*", MUL_OP),
    ("/", MUL_OP), ("%", MUL_OP), ("=", EQUALS),
]
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "v": "\v",
            "\\": "\\", "'": "'", '"': '"'}


def _is_word(c):
    return c == "_" or ("a" <= c <= "z") or ("A" <= c <= "Z") or ("0" <= c <= "9")


def lex(source):
    """The tokens of a template, and the normalised text positions refer to.

    Whitespace control is llama.cpp's: ``trim_blocks`` and ``lstrip_blocks``
    are always on, ``{%-``/``-%}`` strip all whitespace on their side, a
    single trailing newline of the template is dropped.
    """
    src = source.replace("\r\n", "\n").replace("\r", "\n")
    if source.endswith("\n"):
        src = src[:-1]
    n = len(src)
    tokens = []
    pos = 0
    curly_depth = 0

    def at(i):
        return src[i] if i < n else "\0"

    def next_is(chars, k=1):
        return pos + k < n and src[pos + k] in chars

    def error(msg, where):
        return TemplateSyntaxError(msg, _line_col(src, min(where, n)))

    def consume_while(pred):
        nonlocal pos
        out = []
        while pred(at(pos)):
            if pos >= n:
                raise error("unexpected end of template (an unclosed string?)", pos)
            c = src[pos]
            if c == "\\":
                pos += 1
                if pos >= n:
                    raise error("unexpected end of input after escape character", pos)
                e = src[pos]
                pos += 1
                if e not in _ESCAPES:
                    raise error("unknown escape character \\%s" % e, pos)
                out.append(_ESCAPES[e])
                continue
            out.append(c)
            pos += 1
        return "".join(out)

    def consume_numeric():
        nonlocal pos
        num = consume_while(lambda c: "0" <= c <= "9")
        if at(pos) == "." and "0" <= at(pos + 1) <= "9":
            pos += 1
            num += "." + consume_while(lambda c: "0" <= c <= "9")
        return num

    while pos < n:
        start_pos = pos
        last = tokens[-1].type if tokens else CLOSE_STMT
        if last in (CLOSE_STMT, CLOSE_EXPR, COMMENT):
            # text up to the next {% {{ {#
            is_rstrip = can_drop_newline = False
            if pos > 3:
                c0, c1, c2 = src[pos - 3], src[pos - 2], src[pos - 1]
                is_rstrip = c0 == "-" and c1 in "%}#" and c2 == "}"
                can_drop_newline = c1 in "#%-" and c2 == "}"
            start = end = pos
            while pos < n and not (src[pos] == "{" and next_is("%{#")):
                pos += 1
                end = pos
            if at(pos) == "{" and next_is("%#-"):
                # lstrip_blocks: spaces between a newline and a block go
                cur = end
                while cur > start:
                    c = src[cur - 1]
                    if cur == 1:
                        end = 0
                        break
                    if c == "\n":
                        end = cur
                        break
                    if c not in _SPACE:
                        break
                    cur -= 1
            text = src[start:end]
            if can_drop_newline and text.startswith("\n"):
                text = text[1:]             # trim_blocks
            if is_rstrip:
                text = text.lstrip(" \t\r\n")
            if at(pos) == "{" and next_is("{%#") and next_is("-", 2):
                text = text.rstrip(" \t\r\n")
            if text:
                tokens.append(Token(TEXT, text, start))
                continue

        if at(pos) == "{" and next_is("#"):
            start = pos
            pos += 2
            chars = []
            while not (at(pos) == "#" and next_is("}")):
                if pos + 2 >= n:
                    raise error("missing end of comment tag", pos)
                chars.append(src[pos])
                pos += 1
            tokens.append(Token(COMMENT, "".join(chars), start))
            pos += 2
            continue

        if at(pos) == "-" and last in (OPEN_EXPR, OPEN_STMT):
            pos += 1
            if pos >= n:
                break
        consume_while(lambda c: c in _SPACE and c != "\0")
        if pos >= n:
            break
        ch = src[pos]
        closing = ch == "-" and next_is("%}")
        if not closing and ch in "-+":
            start_pos = pos
            prev = tokens[-1].type if tokens else EOF
            if prev in (TEXT, EOF):
                raise error("unexpected character: %s" % ch, pos)
            if prev not in (NAME, NUMBER, STRING, RPAREN, RBRACKET):
                pos += 1                    # a unary sign: -1, -x, (+2)
                num = consume_numeric()
                tokens.append(Token(NUMBER if num else UNARY_OP, ch + num, start_pos))
                continue

        matched = False
        for seq, typ in _SYMBOLS:
            if seq == "}}" and curly_depth > 0:
                continue                    # inside an object literal
            if src.startswith(seq, pos):
                tokens.append(Token(typ, seq, pos))
                if typ == OPEN_EXPR:
                    curly_depth = 0
                elif typ == LBRACE:
                    curly_depth += 1
                elif typ == RBRACE:
                    curly_depth -= 1
                pos += len(seq)
                matched = True
                break
        if matched:
            continue

        if ch in "'\"":
            start_pos = pos
            pos += 1
            value = consume_while(lambda c, q=ch: c != q)
            tokens.append(Token(STRING, value, start_pos))
            pos += 1
            continue
        if "0" <= ch <= "9":
            start_pos = pos
            tokens.append(Token(NUMBER, consume_numeric(), start_pos))
            continue
        if _is_word(ch):
            start_pos = pos
            tokens.append(Token(NAME, consume_while(_is_word), start_pos))
            continue
        raise error("unexpected character: %s" % ch, pos)
    return tokens, src
