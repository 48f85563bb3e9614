"""Tool calls a small model can make: a reply that opens as a bare JSON call is held to one.

With ``tool_choice`` "auto", a small model often writes its call as a bare
JSON object -- ``{"name": "Read", "arguments": {"file_path": ...}}``, maybe
inside a ```` ```json ```` fence -- instead of its template's form
(``<tool_call>...</tool_call>`` for Qwen), and then goes on to invent the
tool's result.  Every server reads that as text, so no agent gets a call.

The rescue: when a reply *opens* with such an object whose ``name`` is one of
the request's tools, the rest of the reply is held to that tool's call
grammar (its arguments per its schema), and generation ends with the
object; the reply reader then takes the object as the call, in every
dialect.  A reply that does not open that way is never constrained (a plain
answer, prose or code, or a JSON answer whose first key is not "name").

How (engine/sampling.py's CallRescue does the watching):

  * ``bare_call_grammar`` is a grammar for a whole reply of that form, from
    its first character: a little whitespace, an optional fence, the object.
    It runs beside the request's own sampling and is fed each token the
    model picks, for as long as it allows them; the moment it would not,
    the watch ends and nothing was changed.
  * Once the text so far matches ``OPENER`` (up to the tool's name) with a
    name in ``names``, that grammar -- fed with the whole reply so far, so
    it is exactly where the model is -- becomes the request's grammar.
    libllama's lazy triggers are not used: they replay the matched text
    into the grammar from the middle of a token, and a piece the grammar
    refuses there ends the process.

One more form is read, not held: a reply that is nothing but an object
``{"name": X, "arguments": {...}, ...}`` where X is no tool's name but the
arguments are unmistakably one tool's -- every key that tool requires is
there, and no other tool's required keys are -- is a call to that tool
(Qwen2.5-Coder-0.5B, given Codex's tools, writes ``"name": "cat calc.py"``
with exec_command's ``{"cmd": "cat calc.py", ...}``); keys the tool does not
have are dropped from it (``tool_args`` here, chat/reply.py reads).

A rescued call's optional arguments are kept, except those that are plainly
copied out of the tool's schema rather than meant (``copied_arguments``): a
model that writes bare JSON fills optional parameters from their
descriptions, and some of what it copies makes the call fail where the
same call without it works.  Seen with Claude Code and Codex on the 0.5B
model: Read's ``"offset": 9007199254740991`` (its schema's maximum; the
read then starts past the end of the file) and ``"pages": "Page range for
PDF files ..."`` (refused), exec_command's ``"justification": "User-facing
approval question for ..."`` (refused without sandbox_permissions) and
``"prefix_rule": ["git", "pull"]`` (the description's example).  Only
values no caller means are dropped -- an empty string, a number at a bound
as large as 2^31 or beyond (JavaScript's Number.MAX_SAFE_INTEGER is what
zod writes for an integer with no maximum), prose or a JSON example found
in the parameter's own description -- never a required argument or one of
an enum's choices, so a call that means ``offset: 120`` or a ``workdir``
keeps it (dropping every optional argument would run a command in the
wrong folder or read the wrong part of a file, silently).  The calls a
model writes in its template's own form are left as written.

A rescued call never repeats a finished one: a reply that would be a call
identical (name and arguments, as JSON values) to one whose result the
conversation already holds stays the model's text (``finished_calls``).
After a tool result, Qwen2.5-Coder-0.5B often writes the very call it just
made; read as a call again, the agent runs it again and gets the same
reply, forever (openai-agents stops at its turn limit, `llm` and the
LangChain and Node follow-ups never get an answer).  As text, the turn ends.

``--no-tool-call-rescue`` turns it off (the worker passes ``enabled``).
"""

import json

from .jsonschema import Grammar, json_literal

# The reply's start up to the tool's name, as the grammar writes it but with
# any JSON whitespace (the grammar, fed token by token, is what holds the exact
# form); group 1 is the name as written (JSON-escaped, which tool names rarely
# need).
OPENER = (r'[ \t\n]{0,40}(?:```[ \t]{0,2}[A-Za-z0-9_+.-]{0,16}[ \t]{0,4}\n[ \t\n]{0,8})?'
          r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')

# How much of a reply's start is watched: an opener longer than this is not one.
WATCH_CHARS = 256


def bare_call_grammar(tools):
    """GBNF for a whole reply that is one bare call to one of ``tools``:
    ``{"name": <tool>, "arguments" (or "parameters"): <its arguments>}``,
    after at most 40 blanks and an optional fence (```json or any other
    language), and nothing after it (the arguments may be left out when the
    schema requires none)."""
    g = Grammar(strict=False)
    alts = []
    key = "(%s | %s)" % (json_literal("arguments"), json_literal("parameters"))
    for i, t in enumerate(tools):
        params = t.parameters or {"type": "object"}
        g.root_schema = params
        g._refs = {}
        args = g.schema(params, "tool-%d-args" % i)
        tail = '"," space %s space ":" space %s' % (key, args)
        if not (isinstance(params, dict) and params.get("required")):
            tail = "(%s)?" % tail
        alts.append(g.add("tool-%d-call" % i, '"{" space %s space ":" space %s space %s "}"'
                          % (json_literal("name"), json_literal(t.name), tail)))
    # a fence of any language: the model writes ```json, ```markdown, ``` ...
    fence = '"```" [ \\t]{0,2} [A-Za-z0-9_+.\\-]{0,16} [ \\t]{0,4} "\\n" [ \\t\\n]{0,8}'
    g.rules["root"] = '[ \\t\\n]{0,40} (%s)? (%s)' % (fence, " | ".join(alts))
    return g.text()


def rescue_of(tools, tool_choice, enabled=True):
    """What the worker needs to watch a reply for a bare call (a dict for the
    generate frame's chat settings), or None when there is nothing to rescue."""
    if not enabled or not tools or tool_choice != "auto":
        return None
    return {"grammar": bare_call_grammar(tools), "opener": OPENER,
            "names": [t.name for t in tools], "watch_chars": WATCH_CHARS}


def tool_args(tools):
    """[name, required keys, property keys, hints] per tool: to read a misnamed
    call, and to drop what a rescued call copied (``copied_arguments``).  Hints
    map each optional key to [its description, its numeric bounds]."""
    out = []
    for t in tools:
        p = t.parameters if isinstance(t.parameters, dict) else {}
        required = p.get("required") if isinstance(p.get("required"), list) else []
        required = tuple(k for k in required if isinstance(k, str))
        props = p.get("properties") if isinstance(p.get("properties"), dict) else {}
        hints = {}
        for k, sub in props.items():
            if k in required or not isinstance(sub, dict) or "enum" in sub or "const" in sub:
                continue        # an enum's choices are all meant
            desc = sub.get("description") if isinstance(sub.get("description"), str) else ""
            bounds = [sub[b] for b in ("minimum", "maximum", "exclusiveMinimum",
                                       "exclusiveMaximum")
                      if _is_number(sub.get(b)) and abs(sub[b]) >= _HUGE]
            hints[k] = [desc[:4000], bounds]
        out.append((t.name, required, tuple(props), hints))
    return tuple(out)


def tool_by_arguments(args, candidates):
    """(the tool's name, its arguments) when ``args`` (a dict) can only be that
    tool's: it has every key the tool requires, and no other tool has all of
    its own required keys there; None otherwise.  Keys the tool does not know
    are dropped (a small model copies its schema's words into them)."""
    if not isinstance(args, dict) or not args:
        return None
    keys = set(args)
    fits = [(c[0], c[2]) for c in candidates if c[1] and set(c[1]) <= keys]
    if len(fits) != 1:
        return None
    name, props = fits[0]
    return name, {k: v for k, v in args.items() if k in props}


# A bound this large is a schema's "no bound", never a value a caller means.
_HUGE = 2 ** 31


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _squeezed(text):
    return "".join(text.split()).casefold()


def _copied(value, desc, bounds):
    """Whether an optional argument's ``value`` is one no caller means (see the docstring)."""
    if value == "":
        return True
    if _is_number(value):
        return abs(value) >= 2 ** 53 - 1 or value in bounds
    if not desc:
        return False
    if isinstance(value, str):
        # prose (a space in it), long enough not to be a short example value
        v = value.strip()
        return (len(v) >= 12 and " " in v and _squeezed(v) in _squeezed(desc)) or \
            _squeezed(v) == _squeezed(desc)
    if isinstance(value, (list, dict)) and value:
        return _squeezed(json.dumps(value, ensure_ascii=False)) in _squeezed(desc)
    return False


def copied_arguments(name, args, candidates):
    """The keys of ``args`` (a rescued call to ``name``) that hold a value
    copied out of the tool's schema (see the module's docstring)."""
    hints = next((c[3] for c in candidates if c[0] == name and len(c) > 3), None)
    if not isinstance(args, dict) or not hints:
        return []
    return [k for k, v in args.items()
            if k in hints and _copied(v, hints[k][0], hints[k][1])]


def call_key(name, arguments):
    """A call as one string that two identical calls share: the name and the
    arguments as canonical JSON (their text as written when it is not JSON)."""
    try:
        args = json.dumps(json.loads(arguments), sort_keys=True, ensure_ascii=False,
                          separators=(",", ":"))
    except (TypeError, ValueError):
        args = arguments
    return "%s\n%s" % (name, args)


def finished_calls(messages):
    """call_key of every assistant call whose result a later tool message holds:
    by its id, or, where the results carry no ids, by position (the k-th
    result after the calls answers the k-th call)."""
    out = []
    for i, m in enumerate(messages):
        if m.role != "assistant" or not m.tool_calls:
            continue
        results = []
        for later in messages[i + 1:]:
            if later.role == "assistant":
                break
            if later.role == "tool":
                results.append(later)
        ids = {r.tool_call_id for r in results if r.tool_call_id}
        for k, c in enumerate(m.tool_calls):
            if (c.id and c.id in ids) or (k < len(results) and not results[k].tool_call_id):
                out.append(call_key(c.name, c.arguments))
    return tuple(out)
