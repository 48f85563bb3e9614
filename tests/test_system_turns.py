"""System messages after the first one (Claude Code's mid-conversation system turns).

A template that writes a later system message where it stands gets it there;
one that refuses or drops it gets it joined to the leading system text; and a
system message that ends the conversation after the user's turn goes just
before that turn, so the reply answers the user (offgrid/chat/adjust.py).
"""

from offgrid.chat.template import ChatTemplate
from offgrid.request import Message

# ChatML as Qwen writes it: any role, anywhere
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Gemma's rule: a system message first or not at all, then strict alternation
STRICT = ("{% if messages[0].role == 'system' %}{% set sys = messages[0].content + '\n\n' %}"
          "{% set rest = messages[1:] %}{% else %}{% set sys = '' %}{% set rest = messages %}"
          "{% endif %}{% for m in rest %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
          "<start_of_turn>{{ 'model' if m.role == 'assistant' else 'user' }}\n"
          "{{ (sys if loop.first else '') + m.content }}<end_of_turn>\n{% endfor %}"
          "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def render(src, messages):
    return ChatTemplate(src).render(messages)


def test_a_template_that_can_writes_a_later_system_message_where_it_stands():
    t = ChatTemplate(CHATML)
    assert t.renders_later_system
    text = t.render([Message("system", "S"), Message("user", "U1"), Message("assistant", "A"),
                     Message("system", "NOTE"), Message("user", "U2")])
    assert text.index("U1") < text.index("A") < text.index("NOTE") < text.index("U2")
    assert text.count("<|im_start|>system") == 2


def test_a_template_that_refuses_gets_it_joined_to_the_leading_system_text():
    t = ChatTemplate(STRICT)
    assert not t.renders_later_system
    text = t.render([Message("system", "S"), Message("user", "U1"), Message("assistant", "A"),
                     Message("system", "NOTE"), Message("user", "U2")])
    assert text.startswith("<start_of_turn>user\nS\n\nNOTE\n\nU1")
    assert text.count("NOTE") == 1


def test_a_later_system_message_with_no_leading_one_becomes_the_leading_one():
    text = render(STRICT, [Message("user", "U1"), Message("assistant", "A"),
                           Message("system", "NOTE"), Message("user", "U2")])
    assert text.startswith("<start_of_turn>user\nNOTE\n\nU1")


def test_a_system_message_after_the_users_turn_goes_before_it():
    """Claude Code's first request: [user request, system environment note]."""
    text = render(CHATML, [Message("system", "S"), Message("user", "Read the file"),
                           Message("system", "# Environment")])
    assert text.index("# Environment") < text.index("Read the file")
    assert text.endswith("Read the file<|im_end|>\n<|im_start|>assistant\n")


def test_a_system_message_before_the_assistants_reply_to_a_tool_stays():
    """Only a note after the user's own turn moves; the rest keeps its place."""
    msgs = [Message("user", "U"), Message("system", "NOTE"), Message("assistant", "A"),
            Message("user", "U2")]
    text = render(CHATML, msgs)
    assert text.index("U") < text.index("NOTE") < text.index("A") < text.index("U2")
