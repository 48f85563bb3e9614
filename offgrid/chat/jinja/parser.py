"""The parser of chat.jinja: tokens to a tree of nodes, with llama.cpp's grammar.

``Parser(tokens, source).parse()`` returns the template's top-level nodes.
Precedence, lowest first: ``x if c else y``, or, and, not, comparisons and
``in``, ``+ - ~``, ``* / %``, ``is`` tests, ``|`` filters, unary signs, member
access and calls.  Statements outside the subset raise Unsupported naming
them.

Imports .lexer (token types), .nodes and .statements (what it builds) and the
errors of .values; only the package's ``Template`` imports it.
"""

from .lexer import (
    ADD_OP, CLOSE_EXPR, CLOSE_STMT, CMP_OP, COLON, COMMA, COMMENT, DOT, EOF, EQUALS, LBRACE,
    LBRACKET, LPAREN, MUL_OP, NAME, NUMBER, OPEN_EXPR, OPEN_STMT, PIPE, RBRACE, RBRACKET, RPAREN,
    STRING, TEXT, UNARY_OP, Token)
from .nodes import (
    ArrayLiteral, Binary, Blank, Call, Comment, Filter, KwargNode, Member, Name, Noop,
    ObjectLiteral, Select, SliceNode, Spread, Ternary, Test, Text, TupleLiteral, Unary)
from .statements import (
    BreakNode, CallBlock, ContinueNode, FilterBlock, For, If, Macro, SetNode)
from .values import TemplateSyntaxError, Unsupported, _line_col


_KNOWN_UNSUPPORTED = {
    "include": "{% include %}", "import": "{% import %}", "from": "{% from ... import %}",
    "extends": "{% extends %}", "block": "{% block %}", "raw": "{% raw %}",
    "with": "{% with %}", "autoescape": "{% autoescape %}", "do": "{% do %}",
    "trans": "{% trans %}",
}


class Parser:
    """Tokens to a list of nodes, with llama.cpp's grammar and precedences."""

    def __init__(self, tokens, source):
        self.tokens, self.source, self.i = tokens, source, 0

    # -- token helpers --
    def peek(self, k=0):
        j = self.i + k
        return self.tokens[j] if j < len(self.tokens) else Token(EOF, "", len(self.source))

    def next(self):
        if self.i >= len(self.tokens):
            raise self.error("unexpected end of template", len(self.source))
        t = self.tokens[self.i]
        self.i += 1
        return t

    def error(self, msg, pos=None, cls=TemplateSyntaxError):
        pos = self.peek().pos if pos is None else pos
        return cls(msg, _line_col(self.source, pos))

    def expect(self, type_, what):
        t = self.peek()
        if t.type != type_:
            raise self.error("expected %s, got %r" % (what, t.value or t.type))
        self.i += 1
        return t

    def expect_name(self, name):
        t = self.peek()
        if t.type != NAME or t.value != name:
            raise self.error("expected '%s', got %r" % (name, t.value or t.type))
        self.i += 1

    def is_(self, type_):
        return self.peek().type == type_

    def is_name(self, name):
        t = self.peek()
        return t.type == NAME and t.value == name

    def at_statement(self, *names):
        if self.peek().type == EOF:
            raise self.error("unexpected end of template: missing {%% %s %%}" % names[-1])
        return self.peek().type == OPEN_STMT and self.peek(1).type == NAME \
            and self.peek(1).value in names

    def node(self, cls, pos, *args):
        n = cls(*args)
        n.pos = pos
        return n

    # -- statements --
    def parse(self):
        body = []
        while self.i < len(self.tokens):
            body.append(self.parse_any())
        return body

    def parse_any(self):
        t = self.peek()
        if t.type == COMMENT:
            self.i += 1
            return self.node(Comment, t.pos)
        if t.type == TEXT:
            self.i += 1
            return self.node(Text, t.pos, t.value)
        if t.type == OPEN_STMT:
            return self.parse_statement()
        if t.type == OPEN_EXPR:
            self.i += 1
            e = self.parse_expression()
            self.expect(CLOSE_EXPR, "}}")
            return e
        raise self.error("unexpected %r" % (t.value or t.type))

    def block_until(self, *names):
        body = []
        while not self.at_statement(*names):
            body.append(self.parse_any())
        return body

    def end(self, name):
        self.expect(OPEN_STMT, "{%")
        self.expect_name(name)
        self.expect(CLOSE_STMT, "%}")

    def parse_statement(self):
        self.expect(OPEN_STMT, "{%")
        t = self.peek()
        if t.type != NAME:
            raise self.error("expected a statement name after {%")
        self.i += 1
        name, pos = t.value, t.pos
        if name == "set":
            return self.parse_set(pos)
        if name == "if":
            n = self.parse_if(pos)
            self.end("endif")
            return n
        if name == "macro":
            mname = self.parse_primary()
            params = self.parse_args()
            self.expect(CLOSE_STMT, "%}")
            body = self.block_until("endmacro")
            self.end("endmacro")
            return self.node(Macro, pos, mname, params, body)
        if name == "for":
            n = self.parse_for(pos)
            self.end("endfor")
            return n
        if name == "break":
            self.expect(CLOSE_STMT, "%}")
            return self.node(BreakNode, pos)
        if name == "continue":
            self.expect(CLOSE_STMT, "%}")
            return self.node(ContinueNode, pos)
        if name == "call":
            caller_params = self.parse_args() if self.is_(LPAREN) else []
            callee = self.parse_primary()
            if type(callee) is not Name:
                raise self.error("expected a macro name after {% call %}")
            args = self.parse_args()
            self.expect(CLOSE_STMT, "%}")
            body = self.block_until("endcall")
            self.end("endcall")
            return self.node(CallBlock, pos, self.node(Call, pos, callee, args), caller_params, body)
        if name == "filter":
            flt = self.parse_primary()
            if type(flt) is Name and self.is_(LPAREN):
                flt = self.parse_call(flt)
            self.expect(CLOSE_STMT, "%}")
            body = self.block_until("endfilter")
            self.end("endfilter")
            return self.node(FilterBlock, pos, flt, body)
        if name in ("generation", "endgeneration"):
            self.i += 1         # transformers' assistant-mask markers: ignored
            return self.node(Noop, pos)
        what = _KNOWN_UNSUPPORTED.get(name, "the statement {%% %s %%}" % name)
        raise self.error("%s is not supported" % what, pos, Unsupported)

    def parse_set(self, pos):
        target = self.parse_sequence()
        value, body = None, []
        if self.is_(EQUALS):
            self.i += 1
            value = self.parse_sequence()
        else:
            self.expect(CLOSE_STMT, "%}")
            body = self.block_until("endset")
            self.expect(OPEN_STMT, "{%")
            self.expect_name("endset")
        self.expect(CLOSE_STMT, "%}")
        return self.node(SetNode, pos, target, value, body)

    def parse_if(self, pos):
        test = self.parse_expression()
        self.expect(CLOSE_STMT, "%}")
        body = self.block_until("elif", "else", "endif")
        orelse = []
        if self.at_statement("elif"):
            p = self.peek(1).pos
            self.i += 2
            orelse.append(self.parse_if(p))
        elif self.at_statement("else"):
            self.i += 2
            self.expect(CLOSE_STMT, "%}")
            orelse = self.block_until("endif")
        return self.node(If, pos, test, body, orelse)

    def parse_for(self, pos):
        target = self.parse_sequence(primary=True)
        if not self.is_name("in"):
            raise self.error("expected 'in' in a for loop")
        self.i += 1
        iterable = self.parse_expression()
        self.expect(CLOSE_STMT, "%}")
        body = self.block_until("endfor", "else")
        orelse = []
        if self.at_statement("else"):
            self.i += 2
            self.expect(CLOSE_STMT, "%}")
            orelse = self.block_until("endfor")
        return self.node(For, pos, target, iterable, body, orelse)

    # -- expressions, lowest precedence first --
    def parse_sequence(self, primary=False):
        pos = self.peek().pos
        parse = self.parse_primary if primary else self.parse_expression
        items = [parse()]
        is_tuple = self.is_(COMMA)
        while self.is_(COMMA):
            self.i += 1
            items.append(parse())
        return self.node(TupleLiteral, pos, items) if is_tuple else items[0]

    def parse_expression(self):
        a = self.parse_or()
        if self.is_name("if"):
            pos = self.peek().pos
            self.i += 1
            test = self.parse_or()
            if self.is_name("else"):
                pos = self.peek().pos
                self.i += 1
                return self.node(Ternary, pos, test, a, self.parse_expression())
            return self.node(Select, pos, a, test)
        return a

    def parse_or(self):
        left = self.parse_and()
        while self.is_name("or"):
            pos = self.next().pos
            left = self.node(Binary, pos, "or", left, self.parse_and())
        return left

    def parse_and(self):
        left = self.parse_not()
        while self.is_name("and"):
            pos = self.next().pos
            left = self.node(Binary, pos, "and", left, self.parse_not())
        return left

    def parse_not(self):
        if self.is_name("not"):
            pos = self.next().pos
            return self.node(Unary, pos, "not", self.parse_not())
        return self.parse_comparison()

    def parse_comparison(self):
        left = self.parse_additive()
        while True:
            t = self.peek()
            if self.is_name("not") and self.peek(1).type == NAME and self.peek(1).value == "in":
                self.i += 2
                op = "not in"
            elif self.is_name("in"):
                self.i += 1
                op = "in"
            elif t.type == CMP_OP:
                self.i += 1
                op = t.value
            else:
                return left
            left = self.node(Binary, t.pos, op, left, self.parse_additive())

    def parse_additive(self):
        left = self.parse_multiplicative()
        while self.is_(ADD_OP):
            t = self.next()
            left = self.node(Binary, t.pos, t.value, left, self.parse_multiplicative())
        return left

    def parse_multiplicative(self):
        left = self.parse_test()
        while self.is_(MUL_OP):
            t = self.next()
            left = self.node(Binary, t.pos, t.value, left, self.parse_test())
        return left

    def parse_test(self):
        operand = self.parse_filter()
        while self.is_name("is"):
            pos = self.next().pos
            negate = False
            if self.is_name("not"):
                self.i += 1
                negate = True
            test = self.parse_primary()
            if self.is_(LPAREN):
                test = self.parse_call(test)
            elif self.peek().type in (NUMBER, STRING, LBRACE, LBRACKET) or (
                    self.is_(NAME) and not self.is_name("and") and not self.is_name("or")
                    and not self.is_name("else")):
                p = self.peek().pos
                test = self.node(Call, p, test, [self.parse_unary()])
            operand = self.node(Test, pos, operand, negate, test)
        return operand

    def parse_filter(self):
        operand = self.parse_unary()
        while self.is_(PIPE):
            pos = self.next().pos
            flt = self.parse_primary()
            if self.is_(LPAREN):
                flt = self.parse_call(flt)
            operand = self.node(Filter, pos, operand, flt)
        return operand

    def parse_unary(self):
        if self.is_(UNARY_OP):
            t = self.next()
            return self.node(Unary, t.pos, t.value, self.parse_unary())
        member = self.parse_member(self.parse_primary())
        return self.parse_call(member) if self.is_(LPAREN) else member

    def parse_call(self, callee):
        pos = self.peek().pos
        n = self.node(Call, pos, callee, self.parse_args())
        n = self.parse_member(n)
        return self.parse_call(n) if self.is_(LPAREN) else n

    def parse_args(self):
        self.expect(LPAREN, "(")
        args = []
        while not self.is_(RPAREN):
            if self.peek().type == EOF:
                raise self.error("unexpected end of template in an argument list")
            if self.peek().type == MUL_OP and self.peek().value == "*":
                pos = self.next().pos
                arg = self.node(Spread, pos, self.parse_expression())
            else:
                arg = self.parse_expression()
                if self.is_(EQUALS):
                    pos = self.next().pos
                    arg = self.node(KwargNode, pos, arg, self.parse_expression())
            args.append(arg)
            if self.is_(COMMA):
                self.i += 1
        self.expect(RPAREN, ")")
        return args

    def parse_member(self, obj):
        pos = self.peek().pos
        while self.is_(DOT) or self.is_(LBRACKET):
            computed = self.next().type == LBRACKET
            if computed:
                prop = self.parse_subscript()
                self.expect(RBRACKET, "]")
            else:
                prop = self.parse_primary()
            obj = self.node(Member, pos, obj, prop, computed)
        return obj

    def parse_subscript(self):
        pos = self.peek().pos
        parts, is_slice = [], False
        while not self.is_(RBRACKET):
            if self.peek().type == EOF:
                raise self.error("unexpected end of template in a subscript")
            if self.is_(COLON):
                parts.append(None)
                self.i += 1
                is_slice = True
            else:
                parts.append(self.parse_expression())
                if self.is_(COLON):
                    self.i += 1
                    is_slice = True
        if is_slice:
            parts += [None] * (3 - len(parts))
            return self.node(SliceNode, pos, parts[0], parts[1], parts[2])
        if not parts:
            return self.node(Blank, pos)
        return parts[0]

    def parse_primary(self):
        t = self.next()
        pos = t.pos
        if t.type == NUMBER:
            v = float(t.value) if "." in t.value else int(t.value)
            return self.node(Text, pos, v)
        if t.type == STRING:
            value = t.value
            while self.is_(STRING):
                value += self.next().value
            return self.node(Text, pos, value)
        if t.type == NAME:
            return self.node(Name, pos, t.value)
        if t.type == LPAREN:
            e = self.parse_sequence()
            self.expect(RPAREN, ")")
            return e
        if t.type == LBRACKET:
            items = []
            while not self.is_(RBRACKET):
                if self.peek().type == EOF:
                    raise self.error("unexpected end of template in a list")
                items.append(self.parse_expression())
                if self.is_(COMMA):
                    self.i += 1
            self.i += 1
            return self.node(ArrayLiteral, pos, items)
        if t.type == LBRACE:
            pairs = []
            while not self.is_(RBRACE):
                if self.peek().type == EOF:
                    raise self.error("unexpected end of template in an object literal")
                k = self.parse_expression()
                self.expect(COLON, ":")
                pairs.append((k, self.parse_expression()))
                if self.is_(COMMA):
                    self.i += 1
            self.i += 1
            return self.node(ObjectLiteral, pos, pairs)
        raise self.error("unexpected %r" % (t.value or t.type), pos)
