"""The statement nodes of chat.jinja's tree: if, for, set, macro, call and filter blocks.

Each produces text (or, for set and macro, changes its scope) from the
expression nodes of .nodes.  A ``{% for %}`` binds ``loop`` and catches the
break and continue that its body raises; a macro runs in a scope copied from
its caller's, as in llama.cpp.

Only .parser imports this module.
"""

from .nodes import (
    KwargNode, Member, Name, Node, Select, TupleLiteral, _Break, _Continue, apply_filter,
    render_parts, run_body)
from .values import (
    Args, Func, Loop, TemplateError, TemplateSyntaxError, UNDEFINED, Undefined, is_undefined,
    kind, truthy, type_name)


class If(Node):
    __slots__ = ("test", "body", "orelse")

    def __init__(self, test, body, orelse):
        self.test, self.body, self.orelse = test, body, orelse

    def eval(self, ctx):
        return run_body(self.body if truthy(self.test.run(ctx)) else self.orelse, ctx)


class For(Node):
    __slots__ = ("target", "iterable", "body", "orelse")

    def __init__(self, target, iterable, body, orelse):
        self.target, self.iterable, self.body, self.orelse = target, iterable, body, orelse

    def eval(self, ctx):
        scope = ctx.child()
        it_node, cond = self.iterable, None
        if type(it_node) is Select:
            it_node, cond = it_node.value, it_node.test
        seq = it_node.run(scope)
        stats = ctx.stats
        if stats is not None:
            stats.mark(seq, "array_access")
        if is_undefined(seq):
            seq = []
        k = kind(seq)
        if k not in ("array", "tuple", "object"):
            raise TemplateError("cannot loop over a value of type %s" % type_name(seq))
        if k == "object":
            items = [tuple(kv) for kv in seq.items()]
            if stats is not None:
                stats.mark(seq, "object_access")
        else:
            items = list(seq)
            if stats is not None:
                stats.mark(seq, "array_access")

        target = self.target
        kept, values = [], []
        budget = ctx.budget
        for item in items:
            budget.tick()       # a turn is a step, whether or not its body has any
            if type(target) is Name:
                current = item[0] if k == "object" else item
                bind = [(target.name, current)]
            elif type(target) is TupleLiteral:
                current = item
                if kind(current) not in ("array", "tuple"):
                    raise TemplateError("cannot unpack a value of type %s" % type_name(current))
                if len(target.items) != len(current):
                    raise TemplateError("too %s items to unpack"
                                        % ("few" if len(target.items) > len(current) else "many"))
                bind = []
                for name_node, v in zip(target.items, current):
                    if type(name_node) is not Name:
                        raise TemplateSyntaxError("can only unpack into names")
                    bind.append((name_node.name, v))
            else:
                raise TemplateSyntaxError("invalid loop variable")
            if cond is not None:
                test_scope = scope.child()
                for name, v in bind:
                    test_scope.set(name, v)
                if not truthy(cond.run(test_scope)):
                    continue
            kept.append(current)
            values.append(bind)

        out = []
        n = len(kept)
        no_iteration = True
        for i in range(n):
            budget.tick()
            loop = Loop(index=i + 1, index0=i, revindex=n - i, revindex0=n - i - 1,
                        first=i == 0, last=i == n - 1, length=n,
                        previtem=kept[i - 1] if i > 0 else Undefined("previtem"),
                        nextitem=kept[i + 1] if i < n - 1 else Undefined("nextitem"))
            scope.set("loop", loop)
            for name, v in values[i]:
                scope.set(name, v)
            try:
                for stmt in self.body:
                    render_parts(stmt.run(scope), out)
            except _Continue:
                continue
            except _Break:
                break
            no_iteration = False
        if no_iteration:
            for stmt in self.orelse:
                render_parts(stmt.run(ctx), out)
        budget.chars(sum(map(len, out)))
        return "".join(out)


class BreakNode(Node):
    __slots__ = ()

    def eval(self, ctx):
        raise _Break()


class ContinueNode(Node):
    __slots__ = ()

    def eval(self, ctx):
        raise _Continue()


class SetNode(Node):
    __slots__ = ("target", "value", "body")

    def __init__(self, target, value, body):
        self.target, self.value, self.body = target, value, body

    def eval(self, ctx):
        rhs = self.value.run(ctx) if self.value is not None else run_body(self.body, ctx)
        t = self.target
        if type(t) is Name:
            ctx.set(t.name, rhs)
        elif type(t) is TupleLiteral:
            if kind(rhs) not in ("array", "tuple"):
                raise TemplateError("cannot unpack a value of type %s" % type_name(rhs))
            if len(rhs) != len(t.items):
                raise TemplateError("wrong number of values to unpack in set")
            for name_node, v in zip(t.items, rhs):
                if type(name_node) is not Name:
                    raise TemplateSyntaxError("can only unpack into names")
                ctx.set(name_node.name, v)
        elif type(t) is Member:
            if t.computed or type(t.prop) is not Name:
                raise TemplateSyntaxError("can only assign to obj.name")
            obj = t.obj.run(ctx)
            if kind(obj) != "object":
                raise TemplateError("cannot assign a property of %s" % type_name(obj))
            obj[t.prop.name] = rhs
        else:
            raise TemplateSyntaxError("invalid target of set")
        return UNDEFINED


def _bind_parameters(name, params, args, ctx):
    """Bind a macro's parameters the way llama.cpp does (keyword args also count as positions)."""
    for i, p in enumerate(params):
        if i < len(args.items):
            if type(p) is Name:
                ctx.set(p.name, args.kwarg_or_pos(p.name, i))
            elif type(p) is KwargNode and type(p.key) is Name:
                ctx.set(p.key.name, args.kwarg_or_pos(p.key.name, i))
            else:
                raise TemplateSyntaxError("invalid parameter of '%s'" % name)
        elif type(p) is KwargNode and type(p.key) is Name:
            ctx.set(p.key.name, p.value.run(args.ctx))
        else:
            raise TemplateError("not enough arguments for '%s'" % name)


class Macro(Node):
    __slots__ = ("name", "params", "body")

    def __init__(self, name, params, body):
        self.name, self.params, self.body = name, params, body

    def eval(self, ctx):
        if type(self.name) is not Name:
            raise TemplateSyntaxError("a macro's name must be an identifier")
        name = self.name.name

        def invoke(args):
            scope = args.ctx.child()        # the caller's variables, as in llama.cpp
            _bind_parameters(name, self.params, args, scope)
            return run_body(self.body, scope)

        ctx.set(name, Func(name, invoke))
        return UNDEFINED


class CallBlock(Node):
    """``{% call(args) macro(...) %}body{% endcall %}``: the body is ``caller()``."""
    __slots__ = ("call", "caller_params", "body")

    def __init__(self, call, caller_params, body):
        self.call, self.caller_params, self.body = call, caller_params, body

    def eval(self, ctx):
        fn = self.call.callee.run(ctx)
        if type(fn) is not Func:
            raise TemplateError("%s is not callable" % type_name(fn))
        caller_ctx = ctx.child()

        def caller(args):
            scope = caller_ctx.child()
            _bind_parameters("caller", self.caller_params, args, scope)
            return run_body(self.body, scope)

        call_ctx = ctx.child()
        call_ctx.set("caller", Func("caller", caller))
        args = [a.run(ctx) for a in self.call.args]
        return fn.call(Args(call_ctx, args))


class FilterBlock(Node):
    __slots__ = ("filter", "body")

    def __init__(self, flt, body):
        self.filter, self.body = flt, body

    def eval(self, ctx):
        return apply_filter(ctx, self.filter, run_body(self.body, ctx))

