"""chat.jinja: a Jinja subset that renders chat templates exactly as llama-server does.

A GGUF model's chat template is Jinja.  llama-server renders it with its own
interpreter (llama.cpp ``common/jinja``), which differs from Python's Jinja2 in
small ways that change the prompt: whitespace control is always on
(``trim_blocks`` and ``lstrip_blocks``), ``None`` and objects print as
nothing, a filter is looked up by the type of its input, a macro sees the
variables of its caller, ``split()`` without arguments splits on one space.
This package follows llama.cpp's rules rather than Jinja2's, so the same
template and messages give the same prompt byte for byte.

    Template(source).render({"messages": [...], ...}) -> str

The modules, in the order a template goes through them (llama.cpp splits
common/jinja the same way):

    lexer.py       source -> tokens, with llama.cpp's whitespace control
    parser.py      tokens -> a tree of nodes
    nodes.py       expression nodes and how each evaluates
    statements.py  if, for, set, macro, call and filter blocks
    values.py      value kinds, conversions, equality, scopes (Context, Args), errors
    functions.py   global functions (raise_exception, namespace, range, ...) and tests
    builtins.py    each type's filters and methods, and builtin(), their lookup

Imports point one way: parser -> lexer, nodes, statements; statements ->
nodes; nodes -> builtins, functions; builtins -> functions; everything ->
values.  Code outside the package imports only what this module exports:
``Template``, the errors, and ``Stats`` and ``TrackedStr`` for the probes.

What is outside the subset -- ``{% include %}``, ``{% raw %}``, a filter a
type does not have, ``*args`` -- raises ``Unsupported`` naming it; a syntax
error raises ``TemplateSyntaxError``; the template's own
``raise_exception(msg)`` raises ``TemplateRaised``.  All three are
``TemplateError``, and every error says where in the template it happened.

Usage statistics: llama-server probes a template with sample messages and
watches which values the template touches, to learn whether it reads a
system message, tool calls, typed content and so on (``chat.template.detect_caps``).
A Context given a ``Stats`` records those touches; rendering without one
records nothing.

Known differences from llama.cpp: strings here are sequences of characters
where llama.cpp's are bytes, so ``length``, indexing and slicing differ for
text outside ASCII; integers past 64 bits are an error here (llama.cpp's
wrap); and every rendering has a budget (``Budget``: steps, sizes, time)
past which it fails with ``BudgetExceeded``, where llama.cpp's would run on.
"""

from .lexer import lex
from .nodes import _Break, _Continue, render_parts
from .parser import Parser
from .values import (
    Budget, BudgetExceeded, Context, Stats, TemplateError, TemplateRaised, TemplateSyntaxError,
    TrackedStr, Unsupported)

__all__ = ["Template", "TemplateError", "TemplateSyntaxError", "Unsupported", "TemplateRaised",
           "BudgetExceeded", "Budget", "Stats", "TrackedStr"]


class Template:
    """A parsed template; render() may be called any number of times, from any thread."""

    def __init__(self, source):
        tokens, self.source = lex(source)
        self.body = Parser(tokens, self.source).parse()

    def render(self, variables=None, now=None, stats=None, budget=None):
        """The text the template produces for ``variables`` (a dict of plain values).

        ``now`` (a Unix time) is what ``strftime_now`` formats; ``stats``, a
        Stats, records which values the rendering touched.  ``budget`` (a
        Budget; by default a new one of the default size) bounds its steps,
        sizes and time: past it, BudgetExceeded.  Templates may modify the
        lists and dicts they are given, so pass copies.
        """
        ctx = Context(variables, stats, now, self.source, budget)
        out = []
        try:
            for stmt in self.body:
                render_parts(stmt.run(ctx), out)
        except (_Break, _Continue):
            raise TemplateError("{% break %} or {% continue %} outside a loop")
        except RecursionError:
            raise TemplateError("the template recurses too deeply")
        ctx.budget.chars(sum(map(len, out)))       # the whole text, before it is joined
        return "".join(out)
