"""A chat template is code from a model file: each rendering has a budget (issue 37, item 7).

Steps, the size of any string or list (the output included), and time.  Every
way a template can spin or grow past it -- loops with or without a body,
doubling strings, repetition, huge ranges, integers squared without end,
join/replace/indent/tojson blowing a value up, recursion -- ends in
BudgetExceeded (a TemplateError) quickly, and the templates of real models,
with tools and a long conversation, stay far inside it.
"""

import json
import time
from pathlib import Path

import pytest

from offgrid.chat import jinja
from offgrid.chat.template import ChatTemplate, TemplateBudgetError

# what one of these may take before it is refused (the budget's own clock is
# 10 s; the point is that none runs for good, and most end at once)
QUICK = 12.0

HOSTILE = {
    "nested empty loops": "{% for i in range(100000) %}{% for j in range(100000) %}"
                          "{% endfor %}{% endfor %}",
    "nested loops with a body": "{% for i in range(100000) %}{% for j in range(100000) %}"
                                "{{ i }}{% endfor %}{% endfor %}",
    "doubling a string": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
                         "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "repeating a string": "{{ 'x' * 600000000 }}",
    "a huge range": "{{ range(1000000000) | length }}",
    "squaring an integer": "{% set ns = namespace(x=3) %}{% for i in range(64) %}"
                           "{% set ns.x = ns.x * ns.x %}{% endfor %}{{ ns.x }}",
    "adding lists": "{% set ns = namespace(l=[1]) %}{% for i in range(64) %}"
                    "{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l | length }}",
    "join of one string many times": "{% set ns = namespace(l=[]) %}"
                                     "{% for i in range(100000) %}{% set _ = ns.l.append("
                                     "'y' * 1000) %}{% endfor %}{{ ns.l | join(',') }}",
    "tojson of one string many times": "{% set ns = namespace(l=[]) %}"
                                       "{% for i in range(100000) %}{% set _ = ns.l.append("
                                       "'y' * 1000) %}{% endfor %}{{ ns.l | tojson }}",
    "replace with an empty needle": "{{ ('a' * 100000) | replace('', 'b' * 1000) }}",
    "indent by a huge width": "{{ 'a\\nb' | indent(1000000000) }}",
    "tojson with a huge indent": "{{ messages | tojson(indent=100000000) }}",
    "output from many statements": "{% for i in range(2000) %}{{ 'z' * 10000 }}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_template_ends_past_its_budget(name):
    t = jinja.Template(HOSTILE[name])
    t0 = time.monotonic()
    with pytest.raises(jinja.TemplateError) as e:
        t.render({"messages": [{"role": "user", "content": "hi"}]})
    took = time.monotonic() - t0
    assert took < QUICK, (name, took)
    assert isinstance(e.value, jinja.BudgetExceeded) or "recurses" in str(e.value), e.value


def test_recursion_without_end_is_an_error_not_a_crash():
    t = jinja.Template("{% macro f(n) %}{{ f(n) }}{{ f(n) }}{% endmacro %}{{ f(1) }}")
    with pytest.raises(jinja.TemplateError):
        t.render({})


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_model_whose_template_runs_past_its_budget_cannot_be_loaded(name):
    """At load the probes share one smaller budget: the template is refused within
    seconds, with the reason, instead of the load spinning."""
    t0 = time.monotonic()
    with pytest.raises(TemplateBudgetError) as e:
        ChatTemplate(HOSTILE[name])
    assert time.monotonic() - t0 < QUICK
    assert "budget" in str(e.value) or "memory" in str(e.value)


def test_a_budget_counts_steps_and_time():
    t = jinja.Template("{% for i in range(1000) %}{{ i }}{% endfor %}")
    with pytest.raises(jinja.BudgetExceeded, match="100 steps"):
        t.render({}, budget=jinja.Budget(max_steps=100, seconds=60))
    b = jinja.Budget(seconds=0.0)
    with pytest.raises(jinja.BudgetExceeded, match="seconds"):
        jinja.Template("{% for i in range(100000) %}{% endfor %}").render({}, budget=b)


def real_templates():
    src = sorted(Path(__file__).resolve().parent.joinpath("golden", "chat").glob("*.json"))
    return src


def _templates_dir():
    try:
        from .tinymodels import llama_cpp_source
    except ImportError:
        from tinymodels import llama_cpp_source
    return llama_cpp_source() / "models" / "templates"


def test_real_templates_with_tools_and_a_long_conversation_stay_inside_the_budget():
    """llama.cpp's templates, 101 messages and 10 tools: far inside the default budget."""
    try:
        folder = _templates_dir()
    except Exception as e:      # the pinned source is part of the build
        pytest.fail("no llama.cpp source: %s" % e)
    tools = [{"type": "function", "function": {
        "name": "f%d" % i, "description": "tool %d" % i,
        "parameters": {"type": "object", "properties": {"a": {"type": "string"}},
                       "required": ["a"]}}} for i in range(10)]
    msgs = [{"role": "system", "content": "You are helpful."}]
    for i in range(50):
        msgs += [{"role": "user", "content": "question %d" % i},
                 {"role": "assistant", "content": "answer %d" % i}]
    most = 0
    rendered = 0
    for case in real_templates():
        d = json.loads(case.read_text())
        path = folder / d["template"]
        if not path.exists():
            continue
        try:
            t = jinja.Template(path.read_text())
        except jinja.TemplateError:
            continue
        b = jinja.Budget()
        try:
            t.render({"messages": json.loads(json.dumps(msgs)),
                      "tools": json.loads(json.dumps(tools)), "add_generation_prompt": True,
                      "bos_token": "", "eos_token": ""}, budget=b)
        except jinja.BudgetExceeded as e:
            pytest.fail("%s: %s" % (d["template"], e))
        except jinja.TemplateError:
            continue        # it refuses these messages (a system role, ...): not the budget
        rendered += 1
        most = max(most, b.steps)
    assert rendered >= 40, rendered
    # the most any of them took, against the budget: a margin of a hundred
    assert most * 100 < jinja.Budget().max_steps, most
