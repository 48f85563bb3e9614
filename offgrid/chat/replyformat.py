"""How a reply looks: where its reasoning is, and which tool-call syntax it writes.

A ``ReplyFormat`` is decided once per request from the template
(chat/template.py) and travels with the generation to the reader
(chat/reply.py), across the worker's pipe as JSON (engine/worker.py).
"""

import re
from dataclasses import dataclass, field
from typing import List


# (start, end) of a reasoning block, as the families write them
REASONING_MARKERS = [
    ("<think>", "</think>"),
    ("<seed:think>", "</seed:think>"),
    ("[THINK]", "[/THINK]"),
    ("<|START_THINKING|>", "<|END_THINKING|>"),
    ("<|channel>thought", "<channel|>"),
    ("◁think▷", "◁/think▷"),
    ("<mm:think>", "</mm:think>"),
    ("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
    # Apriel: the prompt opens the reasoning with these words, no marker
    ("Here are my reasoning steps:\n", "[BEGIN FINAL RESPONSE]"),
]


@dataclass
class ReplyFormat:
    """How to read a reply: where reasoning is, and which tool-call syntax to expect."""
    reasoning_markers: List[tuple] = field(default_factory=lambda: [REASONING_MARKERS[0]])
    starts_in_reasoning: bool = False   # the prompt ends inside an open reasoning block
    reasoning_end: str = "</think>"     # its end marker, when it does
    tool_syntax: str = "generic"        # hermes, llama3, mistral, harmony or generic
    parse_tools: bool = False           # tools were given and tool_choice is not "none"
    extract_reasoning: bool = True      # reasoning_format other than "none"
    keep_reasoning_inline: bool = False  # reasoning_format "deepseek-legacy"
    # the tools' names: a bare JSON call must name one (empty: any name, for
    # formats made by hand); they also bound how long a reply is held back
    tool_names: tuple = ()
    # a reply that is one bare JSON call ({"name", "arguments"}, maybe in a
    # ```json fence) is a call whatever the template's syntax: the tool-call
    # rescue (chat/rescue.py) held it to that form
    bare_calls: bool = False
    # with bare_calls: per tool [name, required keys, property keys], to read a
    # call whose "name" is no tool's by its arguments (chat/rescue.py)
    tool_args: tuple = ()
    # with bare_calls: rescue.call_key of each call the conversation already
    # has a result for; a rescued call identical to one stays text (rescue.py)
    finished_calls: tuple = ()
    # the family's call shape (a name in shapes.SHAPES, or a derived Shape's
    # fields), read instead of tool_syntax's reader
    call_shape: object = ""
    # each tool's parameters' schema by its name: tagged argument values are typed by it
    tool_schemas: dict = field(default_factory=dict)
    # the reasoning block the prompt opened, as written ("<think>\n"): given back
    # in the content with reasoning_format none
    reopened: str = ""
    # the words (no markup) the prompt opened the reasoning with: part of the
    # reasoning, as llama.cpp reads Apriel's "Here are my reasoning steps:"
    reasoning_lead: str = ""
    # the family's markup around its answers, dropped from the content
    stray_markers: tuple = ()
    # a response format's JSON: a ```json fence around it is dropped
    json_fence: bool = False
    # where the reply is a run of messages (gpt-oss, Functionary v3.2, Muse)
    # and the prompt ends inside one (a continued turn), that message's header
    # ("assistant<|channel|>final<|message|>", "all\n"): the reply is read as
    # its body
    open_header: str = ""


# What opens a call (ECMAScript regexes), for the syntaxes whose call grammar
# starts with it: a lazy grammar is fed the output from its trigger's match on
# (from its first capture group, if any, hence gpt-oss's (?:...)).  Llama 3's
# calls are left free: its JSON form has no marker, and <|python_tag|> is for
# its built-in tools.
CALL_TRIGGERS = {
    "hermes": re.escape("<tool_call>"),
    "mistral": re.escape("[TOOL_CALLS]"),
    "harmony": r"<\|channel\|>(?:commentary|analysis) to=functions\.",
}


def tool_syntax_of(src):
    """The tool-call syntax a template teaches its model."""
    if "<|channel|>" in src:
        return "harmony"            # gpt-oss: its replies are channels, calls included
    if "<tool_call>" in src:
        return "hermes"
    if "[TOOL_CALLS]" in src:
        return "mistral"
    if "<|python_tag|>" in src or "<|start_header_id|>" in src:
        return "llama3"
    return "generic"


def call_form_of(src, syntax):
    """The grammar's form of a call: the syntax, or for Mistral which of its
    three: a JSON list (Nemo), name[ARGS]{...} (Devstral, Ministral 3), or
    name[CALL_ID]id[ARGS]{...} (Small 3.2)."""
    if syntax == "mistral" and "[ARGS]" in src:
        return "mistral-callid" if "[CALL_ID]" in src else "mistral-args"
    return syntax


def reasoning_markers_of(src):
    # Kimi K3 builds its markers from parts ('<|open|>' ~ 'think' ~ '<|sep|>')
    k3 = "<|open|>" in src and "<|close|>" in src and "'think'" in src
    found = [m for m in REASONING_MARKERS if m[0] in src or m[1] in src
             or (k3 and m[0] == "<|open|>think<|sep|>")]
    if REASONING_MARKERS[0] not in found:
        found.append(REASONING_MARKERS[0])
    return found
