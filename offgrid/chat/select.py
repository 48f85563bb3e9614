"""Which chat template a model uses, settled once per model.

``--chat-template`` (the name of one of libllama's built-in templates,
"chatml", or Jinja text: a file's, read by the front, or given inline), else
the model's ``tokenizer.chat_template`` rendered by
``chat.jinja``; a model with neither falls back to libllama's built-in
template for its architecture (or ChatML), which cannot show tools to the
model, so tools are then described in a system message and calls are read in
the generic JSON form.

``template_for(entry)`` builds the template on first use and keeps it on the
entry that owns the model (its ``template`` attribute), so its lifetime is the
model's.  The ``model`` here is duck-typed (tokens, metadata, libllama's
built-in templates): this package never imports the engine or libllama.
"""

import json
import threading

from .. import jsonlimit
from . import template as chat_engine
from .template import ChatTemplateError

# general.architecture -> libllama built-in template name, for models that
# carry no template of their own
_ARCH_TEMPLATES = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3n": "gemma",
                   "llama": "llama3", "qwen2": "chatml", "qwen3": "chatml", "phi3": "phi3",
                   "mistral": "mistral-v7"}

# -- which template ------------------------------------------------------------------

class BuiltinTemplate:
    """libllama's llama_chat_apply_template by name, for models without a Jinja template.

    It knows roles and text only: tools are described in a system message,
    tool calls and results are written into the text, and the reply is read
    in the generic JSON form.
    """

    def __init__(self, model, name):
        self.model, self.name = model, name
        self.source = name
        self.caps = chat_engine.Caps(supports_tools=False, supports_tool_calls=False)
        self.tool_syntax = "generic"

    def apply(self, messages, tools=(), add_generation_prompt=True, tool_choice="auto",
              reasoning_format="auto", **_ignored):
        pairs = []
        for m in messages:
            role = "system" if m.role == "developer" else m.role
            text = m.text()
            if m.tool_calls:
                calls = [{"name": c.name, "arguments": _json_or_text(c.arguments)}
                         for c in m.tool_calls]
                text = (text + "\n" if text else "") + json.dumps(
                    calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
            pairs.append((role, text))
        if tools and tool_choice != "none":
            prompt = chat_engine.generic_tool_prompt(tools)
            if pairs and pairs[0][0] == "system":
                pairs[0] = ("system", pairs[0][1] + "\n\n" + prompt)
            else:
                pairs.insert(0, ("system", prompt))
        text = self.model.builtin_template(self.name, pairs, add_generation_prompt)
        if text is None:
            text = self.model.builtin_template("chatml", pairs, add_generation_prompt)
        if text is None:
            raise ChatTemplateError("could not apply a chat template to these messages")
        fmt = chat_engine.ReplyFormat(tool_syntax="generic",
                                      parse_tools=bool(tools) and tool_choice != "none",
                                      extract_reasoning=reasoning_format != "none",
                                      keep_reasoning_inline=reasoning_format == "deepseek-legacy")
        grammar = None
        if tools and tool_choice not in ("auto", "none"):
            grammar = chat_engine.tool_call_grammar(tools, "generic", tool_choice, False)
        return chat_engine.ChatPrompt(text, "", fmt, grammar)


def _json_or_text(s):
    try:
        return jsonlimit.loads(s)
    except ValueError:
        return s


_templates_lock = threading.Lock()


def template_for(entry):
    """The ChatTemplate (or BuiltinTemplate) of a model entry, built once and kept on it.

    ``entry`` has ``model`` and ``chat_template`` (the --chat-template text
    or name, or None) and gets a ``template`` attribute.
    """
    with _templates_lock:
        t = getattr(entry, "template", None)
        if t is None:
            t = _make_template(entry)
            entry.template = t
        return t


def _token_text(model, token):
    if token is None:
        return ""
    return model.token_text(token, special=True).decode("utf-8", "replace")


def _make_template(entry):
    model = entry.model
    spec = getattr(entry, "chat_template", None)
    builtin_names = model.builtin_template_names()
    if spec and spec != "chatml" and spec in builtin_names:
        return BuiltinTemplate(model, spec)
    if spec and spec != "chatml" and not any(c in spec for c in "{ \t\n"):
        # one word: a misspelt name or a missing file, not a template worth rendering
        raise ChatTemplateError("unknown chat template %r: not a file, nor \"chatml\" or "
                                "one of libllama's built-in templates (%s), nor template "
                                "text" % (spec, ", ".join(builtin_names)))
    # any other text given is the template's Jinja source, as llama-server --jinja
    # takes --chat-template (text with no tags renders as itself)
    source = spec or model.chat_template
    if not source:
        arch = model.meta.get("general.architecture", "")
        name = _ARCH_TEMPLATES.get(arch, "chatml")
        return BuiltinTemplate(model, name if name in builtin_names else "chatml")
    return chat_engine.ChatTemplate(source, _token_text(model, model.bos),
                                    _token_text(model, model.eos),
                                    add_bos=model.add_bos, add_eos=model.add_eos)
