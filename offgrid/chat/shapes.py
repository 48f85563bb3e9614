"""Tool calls written between markers: each family's shape, declared or derived.

Most families write a call as markers around a name and its arguments;
they differ only in which markers and in how the arguments are written.
A ``Shape`` says both, and chat/calls.py reads any of them, whole or (a
streamed reply) so far:

    section   markers around all the calls of a reply   <|tool_calls_section_begin|> ...
    call      markers around each call                   <tool_call> ... </tool_call>
    body      how a call is written inside them:
      json        {"name": ..., "arguments": {...}} (or a list of them;
                  "tool_name"/"parameters", or {"NAME": {...}})
      name-json   NAME, then its arguments as one JSON object
      name-tagged NAME, then each argument between tags (KEY, then VALUE)
      xml         NAME, then <KEY>VALUE</KEY> with nested elements (MiniMax-M3)
      python      [NAME(key=value, ...), ...], Python literals (LFM2)
      gemma4      call:NAME{key:value,...} with <|"|>strings<|"|> (gemma-4)
    name      markers around NAME (name-json, name-tagged, xml)
    key, value  markers around an argument's name and its value (name-tagged)
    close     what ends a call's arguments (</function>)

Where each family's shape comes from: ``shape_of`` reads the template's
source for the markers llama.cpp keys its families on, and the table SHAPES
holds what the source cannot tell (which markers go where, the argument
encodings).  A template in no entry gets its shape derived from its own
renderings (chat/derive.py), as llama.cpp's auto-parser does.
"""

import re
from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class Shape:
    body: str = "json"
    section: Tuple[str, str] = ("", "")
    call: Tuple[str, str] = ("", "")
    name: Tuple[str, str] = ("", "")
    key: Tuple[str, str] = ("", "")
    value: Tuple[str, str] = ("", "")
    close: str = ""
    # name-json: the name is "functions.NAME:INDEX", which is also the call's id (Kimi K2)
    indexed_name: bool = False
    # name-json: the JSON may sit in a ```json fence (DeepSeek R1)
    fenced: bool = False
    # a call may come without its call markers (Qwen3-Coder writes <function=...>
    # alone at times)
    loose_call: bool = False
    # name-tagged: the template writes each value on lines of its own, so the
    # newline after its opening tag and the one before its closing tag are markup
    value_lines: bool = False
    # xml: the namespace token before each tag (MiniMax-M3's "]<]minimax[>[")
    ns: str = ""
    # a call may come without the section's markers and its own end marker
    # (Kimi K2 Thinking writes calls so, in its reasoning too)
    sectionless: bool = False
    # recipients: the reply is a run of messages, each to a recipient
    # (separator, what ends the recipient's name, what may end a message):
    # a message to the user is content, to itself reasoning, to a tool a call
    # whose body is in this shape (or, with no markers, its JSON arguments)
    recipients: Tuple[str, ...] = ()
    # name-tagged, where a marker opens an attribute (name="): the attributes
    # the template writes after the key's closing quote, {string} "true" or
    # "false" (DSML), {type} the value's JSON type (Kimi K3); and after the
    # name's, {index} the call's number (Kimi K3).  Written by forced calls.
    key_attr: str = ""
    name_attr: str = ""

    @property
    def openers(self):
        """What may open the calls of a reply, the first one the usual."""
        first = [m for m in (self.section[0], self.call[0], self.name[0]) if m][:1]
        return first + ([self.name[0]] if self.loose_call else []) \
            + ([self.call[0]] if self.sectionless else [])


_MM = "]<]minimax[>["

# What the source of a template cannot tell: its family's markers and encodings.
SHAPES = {
    "gemma4": Shape("gemma4", call=("<|tool_call>", "<tool_call|>")),
    "lfm2": Shape("python", section=("<|tool_call_start|>", "<|tool_call_end|>")),
    "kimi-k2": Shape("name-json", section=("<|tool_calls_section_begin|>",
                                           "<|tool_calls_section_end|>"),
                     call=("<|tool_call_begin|>", "<|tool_call_end|>"),
                     name=("", "<|tool_call_argument_begin|>"), indexed_name=True,
                     sectionless=True),
    "deepseek-v3.1": Shape("name-json", section=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
                           call=("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"),
                           name=("", "<｜tool▁sep｜>")),
    "deepseek-r1": Shape("name-json", section=("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
                         call=("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"),
                         name=("function<｜tool▁sep｜>", "\n"), fenced=True),
    "dsml-v3.2": Shape("name-tagged", section=("<｜DSML｜function_calls>", "</｜DSML｜function_calls>"),
                       name=('<｜DSML｜invoke name="', '">'),
                       key=('<｜DSML｜parameter name="', '>'),
                       value=("", "</｜DSML｜parameter>"), close="</｜DSML｜invoke>",
                       key_attr=' string="{string}"'),
    "dsml-v4": Shape("name-tagged", section=("<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>"),
                     name=('<｜DSML｜invoke name="', '">'),
                     key=('<｜DSML｜parameter name="', '>'),
                     value=("", "</｜DSML｜parameter>"), close="</｜DSML｜invoke>",
                     key_attr=' string="{string}"'),
    "glm": Shape("name-tagged", call=("<tool_call>", "</tool_call>"),
                 key=("<arg_key>", "</arg_key>"), value=("<arg_value>", "</arg_value>")),
    "minimax-m2": Shape("name-tagged", section=("<minimax:tool_call>", "</minimax:tool_call>"),
                        name=('<invoke name="', '">'), key=('<parameter name="', '">'),
                        value=("", "</parameter>"), close="</invoke>"),
    "minicpm5": Shape("name-tagged", name=('<function name="', '">'),
                      key=('<param name="', '">'), value=("", "</param>"),
                      close="</function>"),
    # ">>>NAME\n{...}" messages, "all" the user's (the prompt wrote the first ">>>")
    "functionary-v3.2": Shape("json", recipients=(">>>", "\n")),
    # " to=NAME<|message|>...<|eom|>" messages, "<|start|>assistant" between them
    "muse": Shape("name-tagged", section=("<atem:function_calls>", "</atem:function_calls>"),
                  recipients=("<|start|>assistant", "<|message|>", "<|eom|>", "<|eot|>"),
                  name=('<atem:invoke name="', '">'), key=('<atem:parameter name="', '">'),
                  value=("", "</atem:parameter>"), close="</atem:invoke>"),
    "qwen3-coder": Shape("name-tagged", call=("<tool_call>", "</tool_call>"),
                         name=("<function=", ">"), key=("<parameter=", ">"),
                         value=("", "</parameter>"), close="</function>", loose_call=True,
                         value_lines=True),
    # <invoke name="NAME"> then <KEY>VALUE</KEY>, a value nested elements
    # (an object) or <item>s (a list), every tag after the namespace token
    "minimax-m3": Shape("xml", section=(_MM + "<tool_call>", _MM + "</tool_call>"),
                        name=(_MM + '<invoke name="', '">'), close=_MM + "</invoke>", ns=_MM),
    "kimi-k3": Shape("name-tagged", section=("<|open|>tools<|sep|>", "<|close|>tools<|sep|>"),
                     name=('<|open|>call tool="', "<|sep|>"),
                     key=('<|open|>argument key="', "<|sep|>"),
                     value=("", "<|close|>argument<|sep|>"), close="<|close|>call<|sep|>",
                     key_attr=' type="{type}"', name_attr=' index="{index}"'),
    "seed-oss": Shape("name-tagged", call=("<seed:tool_call>", "</seed:tool_call>"),
                      name=("<function=", ">"), key=("<parameter=", ">"),
                      value=("", "</parameter>"), close="</function>"),
    "functionary-v3.1": Shape("name-json", name=("<function=", ">"), close="</function>"),
    "command-r7b": Shape("json", section=("<|START_ACTION|>", "<|END_ACTION|>")),
    "apertus": Shape("json", section=("<|tools_prefix|>", "<|tools_suffix|>")),
    "nemotron-v2": Shape("json", section=("<TOOLCALL>", "</TOOLCALL>")),
    "apriel": Shape("json", section=("<tool_calls>", "</tool_calls>")),
    "firefunction": Shape("json", section=("functools", "")),
    "gigachat3.1": Shape("json", call=("<|function_call|>", "")),
}


def shape_of(src, family):
    """The name of the template's call shape in SHAPES, or "" (the older readers)."""
    has = src.__contains__
    if family == "gemma4":
        return "gemma4"
    if family in ("lfm2", "lfm2.5"):
        return "lfm2"
    if family == "kimi-k2":
        return "kimi-k2"
    if family == "deepseek-v3.2":
        return "dsml-v3.2" if has("function_calls") else "dsml-v4"
    if family == "minicpm5":
        return "minicpm5"
    if family == "muse-glimmer":
        return "muse"
    if family == "functionary-v3.2":
        return "functionary-v3.2"
    if family == "qwen3-coder":
        return "qwen3-coder"
    if family in ("minimax-m3", "kimi-k3"):
        return family
    if has("<｜tool▁calls▁begin｜>") or has("<｜tool▁call▁begin｜>"):
        return "deepseek-r1" if has("```json") else "deepseek-v3.1"
    if has("<arg_key>") and has("<arg_value>"):
        return "glm"
    if has("<minimax:tool_call>"):
        return "minimax-m2"
    if has("<seed:tool_call>"):
        return "seed-oss"
    if has("<|START_ACTION|>"):
        return "command-r7b"
    if has("<|tools_prefix|>"):
        return "apertus"
    if has("<TOOLCALL>"):
        return "nemotron-v2"
    if has("<tool_calls>") and has("</tool_calls>"):
        return "apriel"
    if has(" functools["):
        return "firefunction"
    if has("<function=") and has("</function>") and not has("<tool_call>"):
        return "functionary-v3.1"
    if has("<|function_call|>"):
        return "gigachat3.1"
    return ""


def stray_markers_of(src, family):
    """Markup some families put around an answer, which is no part of it."""
    if "<|START_RESPONSE|>" in src:
        return ("<|START_RESPONSE|>", "<|END_RESPONSE|>")       # Command-R7B
    if family == "cohere2moe":
        return ("<|START_TEXT|>", "<|END_TEXT|>")
    if family == "gemma4":
        # an empty thought block, and the channel markers left of one
        return ("<|channel>thought\n<channel|>", "<|channel>", "<channel|>")
    if family == "kimi-k3":
        return ("<|open|>response<|sep|>", "<|close|>response<|sep|>",
                "<|close|>message<|sep|>")
    if family == "ling3":
        return ("<|role_end|>",)
    if "<|CHATBOT_TOKEN|>" in src:
        return ("<|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>")     # Command-R+
    return ()


def shape_markers(shape):
    """Every marker a reply in ``shape`` is read by, and the bracketed pieces
    of each (Kimi K3's "<|open|>tools<|sep|>" is three tokens, two of them
    control tokens): what the reply's text must show (prompt.preserved_tokens)."""
    found = [shape.close, shape.ns] + [m for pair in (shape.section, shape.call, shape.name,
                                                      shape.key, shape.value) for m in pair]
    found += list(shape.recipients)
    if shape.body == "gemma4":
        found.append('<|"|>')               # its strings' quote
    out = []
    for m in found:
        if m:
            out.append(m)
            out += re.findall(r"<[^<>]*>|\[[^\[\]]*\]", m)
    return list(dict.fromkeys(out))

