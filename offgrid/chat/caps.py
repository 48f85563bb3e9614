"""What a chat template can do, learnt by rendering sample messages once at load.

llama-server's capability probes (``caps_get``): whether the template reads
a system message, tools, tool calls (and their arguments as objects or as
text), parallel calls, kept reasoning, a reasoning effort, and content as a
string or as typed parts.  chat/template.py adjusts each request's messages
by the answers.  Probing runs the template's code: every probe of a load
shares one budget (``load_budget``), past which the load fails.
"""

from dataclasses import dataclass

from . import jinja
from ..errors import InvalidRequest


class ChatTemplateError(InvalidRequest):
    """The template could not render these messages (it refused them, or failed)."""


class TemplateBudgetError(ChatTemplateError):
    """The template ran past its budget of steps, size or time (jinja.Budget): at load
    the model cannot be used; for a request, its messages are too much for it."""


# What probing a template at load may spend, all probes together: a real
# template needs a few thousand steps a probe (the largest of llama.cpp's
# seventy about 9,000 for a short conversation), a template that loops for good
# fails the load within seconds instead of spinning a core.
LOAD_STEPS = 2_000_000
LOAD_SECONDS = 10.0


def load_budget():
    return jinja.Budget(max_steps=LOAD_STEPS, seconds=LOAD_SECONDS)


# ---------------------------------------------------------------------------
# What the template can do: llama-server's capability probes
# ---------------------------------------------------------------------------

@dataclass
class Caps:
    """What a template does with its inputs, learnt by rendering sample messages."""
    supports_tools: bool = True
    supports_tool_calls: bool = True
    supports_system_role: bool = True
    supports_parallel_tool_calls: bool = True
    supports_preserve_reasoning: bool = False
    supports_reasoning_effort: bool = False
    supports_string_content: bool = True
    supports_typed_content: bool = False
    supports_object_arguments: bool = False

    def as_dict(self):
        return dict(self.__dict__)


def _tracked(v):
    """A fresh copy of plain JSON data whose strings can be told apart by Stats."""
    if isinstance(v, str):
        return jinja.TrackedStr(v)
    if isinstance(v, list):
        return [_tracked(x) for x in v]
    if isinstance(v, dict):
        return {k: _tracked(x) for k, x in v.items()}
    return v


def _probe(template, budget, messages, tools=None, extra=None):
    """Render sample inputs with usage statistics: (ok, variables, output, stats)."""
    variables = {"messages": _tracked(messages), "tools": _tracked(tools or []),
                 "bos_token": jinja.TrackedStr(""), "eos_token": jinja.TrackedStr(""),
                 "add_generation_prompt": True}
    variables.update(extra or {})
    stats = jinja.Stats()
    try:
        out = template.render(variables, stats=stats, budget=budget)
        return True, variables, out, stats
    except jinja.BudgetExceeded as e:       # no answer at all: the template is unusable
        raise TemplateBudgetError("the chat template ran past its budget while it was "
                                  "probed: %s" % e)
    except MemoryError:     # past the worker's memory ceiling (engine/lifeline.py)
        raise TemplateBudgetError("the chat template ran out of memory while it was probed")
    except Exception:       # a probe that fails is an answer, not an error
        return False, variables, "", stats


_PROBE_TOOLS = [{"name": "tool", "type": "function", "function": {
    "name": "tool1", "description": "Tool description",
    "parameters": {"type": "object",
                   "properties": {"arg": {"type": "string", "description": "Arg description"}},
                   "required": ["arg"]}}}]


def _probe_tool_messages(args, n_calls=1):
    calls = [{"id": "call0000%d" % (i + 1), "type": "function",
              "function": {"name": "tool1", "arguments": args}} for i in range(n_calls)]
    return [{"role": "user", "content": "User message"},
            {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "content": "Tool response", "tool_call_id": "call00001"},
            {"role": "assistant", "content": "The tool response was 'tool response'"},
            {"role": "user", "content": "User message"}]


def detect_caps(template, budget=None):
    """llama-server's caps_get(): which inputs the template reads, and how.

    ``budget`` (a jinja.Budget) is what all the probes may spend together;
    past it TemplateBudgetError."""
    budget = budget or load_budget()
    caps = Caps()
    marker = "STRING_MARKER"

    ok, v, out, st = _probe(template, budget, [{"role": "user", "content": marker}])
    content = v["messages"][0]["content"]
    checks_for_string = st.has_op(content, "test_is_string")
    as_array = st.has_op(content, "selectattr") or st.has_op(content, "array_access")
    if as_array:
        caps.supports_typed_content = True
    if not ok or (as_array and marker not in out):
        caps.supports_string_content = False
    if checks_for_string:
        ok, v, out, st = _probe(template, budget, [{"role": "user", "content": []}])
        content = v["messages"][0]["content"]
        if ok and (st.has_op(content, "selectattr") or st.has_op(content, "array_access")):
            caps.supports_typed_content = True

    ok, v, out, st = _probe(template, budget, [{"role": "system", "content": "System message"},
                                       {"role": "user", "content": "User message"}])
    if not st.was_used(v["messages"][0]["content"]):
        caps.supports_system_role = False

    ok, v, out, st = _probe(template, budget, _probe_tool_messages({"arg": "value"}), _PROBE_TOOLS)
    if ok:
        if not st.was_used(v["tools"][0]["function"]["name"]):
            caps.supports_tools = False
        calls = v["messages"][1]["tool_calls"]
        if not st.was_used(calls):
            caps.supports_tool_calls = False
        elif st.was_used(calls[0]["function"]["arguments"]["arg"]):
            caps.supports_object_arguments = True
    if not caps.supports_object_arguments:
        ok, v, out, st = _probe(template, budget, _probe_tool_messages('{"arg": "value"}'), _PROBE_TOOLS)
        if not ok:
            caps.supports_tool_calls = caps.supports_tools = False
        else:
            if not st.was_used(v["tools"][0]["function"]["name"]):
                caps.supports_tools = False
            if not st.was_used(v["messages"][1]["tool_calls"]):
                caps.supports_tool_calls = False

    args = {"arg": "value"} if caps.supports_object_arguments else '{"arg": "value"}'
    ok, v, out, st = _probe(template, budget, _probe_tool_messages(args, 2), _PROBE_TOOLS)
    if not ok or not st.was_used(v["messages"][1]["tool_calls"][1]["function"]):
        caps.supports_parallel_tool_calls = False

    placeholder = "<REASONING_CONTENT_PLACEHOLDER>"
    msgs = [{"role": "user", "content": "User message"},
            {"role": "assistant", "content": "Assistant message", "reasoning_content": placeholder},
            {"role": "user", "content": "User message"},
            {"role": "assistant", "content": "Assistant message",
             "reasoning_content": "Reasoning content"},
            {"role": "user", "content": "User message"}]
    ok, v, out, st = _probe(template, budget, msgs, extra=dict(preserve_reasoning_vars(True),
                                                        enable_thinking=True))
    if placeholder in out:
        caps.supports_preserve_reasoning = True

    effort = jinja.TrackedStr("low")
    ok, v, out, st = _probe(template, budget, [{"role": "user", "content": "User message"}],
                            extra={"enable_thinking": True, "reasoning_effort": effort,
                                   "reasoning_strength": effort})
    caps.supports_reasoning_effort = st.was_used(effort)
    return caps


def renders_later_system(template, budget):
    """Whether the template writes a system message that is not the first one
    where it stands (Qwen, Llama 3, ChatML do; Gemma's refuses it, some drop it)."""
    marker = "LATER_SYSTEM_MARKER"
    ok, _, out, _ = _probe(template, budget, [{"role": "system", "content": "System message"},
                                      {"role": "user", "content": "User message"},
                                      {"role": "assistant", "content": "Assistant message"},
                                      {"role": "system", "content": marker},
                                      {"role": "user", "content": "User message"}])
    return ok and marker in out


def preserve_reasoning_vars(enabled):
    return {"preserve_thinking": enabled, "clear_thinking": not enabled,
            "truncate_history_thinking": not enabled, "drop_thinking": not enabled}
