"""The Jinja subset behaves like llama-server's interpreter, construct by construct.

Where llama.cpp's Jinja differs from Python's Jinja2 the tests pin llama.cpp's
behaviour (it is what the goldens in test_chat_templates.py come from):
whitespace control is always on, None prints as nothing, ``split()`` splits on
a single space, filters are looked up by their input's type.
"""

import time

import pytest

from offgrid.chat.jinja import Template, TemplateError, TemplateRaised, TemplateSyntaxError, Unsupported


def render(src, **variables):
    return Template(src).render(variables)


# -- text and whitespace ------------------------------------------------------

def test_plain_text_and_one_trailing_newline_dropped():
    assert render("hello\n") == "hello"
    assert render("hello\n\n") == "hello\n"


def test_blocks_eat_their_newline_and_leading_indent():
    src = "a\n  {% if true %}\n  b\n  {% endif %}\nc"
    assert render(src) == "a\n  b\nc"


def test_dash_strips_all_whitespace_on_its_side():
    assert render("a  \n {{- 'b' -}} \n  c") == "abc"
    assert render("x\n{%- if true -%}\n  y  \n{%- endif %}") == "xy"


def test_expression_blocks_keep_their_newline():
    assert render("{{ 'a' }}\nb") == "a\nb"


def test_comments_vanish():
    assert render("ab{# note #}c{#- x -#}  d") == "abcd"


def test_one_character_before_the_first_block_is_lost_as_in_llama_cpp():
    # llama.cpp's lstrip_blocks loop drops it (a quirk, kept so prompts match)
    assert render("a{% if true %}b{% endif %}") == "b"
    assert render("ab{% if true %}c{% endif %}") == "abc"


def test_crlf_is_normalised():
    assert render("a\r\nb") == "a\nb"


# -- values and printing -------------------------------------------------------

@pytest.mark.parametrize("expr, out", [
    ("none", ""), ("true", "True"), ("1 + 2", "3"), ("7 / 2", "3.5"), ("7 % 3", "1"),
    ("-7 % 3", "-1"), ("2 * 3.0", "6.0"), ("0.1 + 0.2", "0.3"), ("'a' ~ 1 ~ none", "a1"),
    ("'ab' * 3", "ababab"), ("[1, 'x', none]", "1x"), ("{'a': 1}", ""), ("(1, 2)", "12"),
    ("[1, 2] + [3]", "123"), ("'a' + undefined_thing", "a"),
])
def test_expressions_print_like_llama_cpp(expr, out):
    assert render("{{ %s }}" % expr) == out


def test_string_escapes():
    assert render(r"{{ 'a\nb\t\'c\'' }}") == "a\nb\t'c'"


def test_unknown_escape_is_a_syntax_error():
    with pytest.raises(TemplateSyntaxError):
        Template(r"{{ '\u00e9' }}")


def test_operators_on_undefined_fail():
    with pytest.raises(TemplateError, match="undefined"):
        render("{{ nothing - 1 }}")


@pytest.mark.parametrize("expr, out", [
    ("'b' in 'abc'", "True"), ("'x' not in 'abc'", "True"), ("2 in [1, 2]", "True"),
    ("'k' in {'k': 1}", "True"), ("'k' in nothing", "False"), ("1 == 1.0", "True"),
    ("[1, 2] == [1, 2]", "True"), ("'1' == 1", "False"), ("none == none", "True"),
    ("not ''", "True"), ("0 or 'x'", "x"), ("'' and 'x'", ""),
    ("3 > 2 and 2 >= 2", "True"),
])
def test_comparisons_and_logic(expr, out):
    assert render("{{ %s }}" % expr) == out


def test_conditional_expression_and_select():
    assert render("{{ 'y' if x else 'n' }}", x=1) == "y"
    assert render("{{ 'y' if x }}|", x=0) == "|"


# -- statements -----------------------------------------------------------------

def test_if_elif_else():
    src = "{% if n == 1 %}one{% elif n == 2 %}two{% else %}many{% endif %}"
    assert [render(src, n=i) for i in (1, 2, 3)] == ["one", "two", "many"]


def test_for_loop_variables():
    src = ("{% for x in xs %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}"
           "{{ loop.first }}{{ loop.last }}{{ loop.length }}|{% endfor %}")
    assert render(src, xs="ab" and ["a", "b"]) == "102TrueFalse2|211FalseTrue2|"


def test_for_previtem_nextitem():
    src = "{% for x in xs %}{{ loop.previtem }}<{{ x }}>{{ loop.nextitem }};{% endfor %}"
    assert render(src, xs=[1, 2, 3]) == "<1>2;1<2>3;2<3>;"


def test_for_else_break_continue():
    src = "{% for x in xs %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}" \
          "{% break %}{% endif %}{{ x }}{% else %}empty{% endfor %}"
    assert render(src, xs=[1, 2, 3, 4, 5]) == "13"
    assert render(src, xs=[]) == "empty"


def test_for_with_filter_condition():
    src = "{% for m in ms if m.role == 'user' %}{{ m.content }}{{ loop.length }}{% endfor %}"
    ms = [{"role": "user", "content": "a"}, {"role": "x", "content": "b"},
          {"role": "user", "content": "c"}]
    assert render(src, ms=ms) == "a2c2"


def test_for_over_dict_and_items():
    assert render("{% for k in d %}{{ k }}{% endfor %}", d={"a": 1, "b": 2}) == "ab"
    assert render("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}",
                  d={"a": 1, "b": 2}) == "a=1;b=2;"


def test_loop_scope_does_not_leak_but_namespace_does():
    src = ("{% set x = 1 %}{% set ns = namespace(y=1) %}{% for i in [1, 2] %}"
           "{% set x = x + i %}{% set ns.y = ns.y + i %}{% endfor %}{{ x }} {{ ns.y }}")
    assert render(src) == "1 4"


def test_set_block_and_tuple_unpacking():
    assert render("{% set a, b = [1, 2] %}{{ b }}{{ a }}") == "21"
    assert render("{% set s %}in {{ 'block' }}{% endset %}[{{ s }}]") == "[in block]"


def test_macros_with_defaults_and_keywords():
    src = ("{% macro greet(name, greeting='Hello') %}{{ greeting }}, {{ name }}!{% endmacro %}"
           "{{ greet('Ann') }} {{ greet('Bob', 'Hi') }} {{ greet('Cy', greeting='Yo') }}")
    assert render(src) == "Hello, Ann! Hi, Bob! Yo, Cy!"


def test_macro_sees_the_callers_variables():
    # llama.cpp gives a macro its caller's scope (Jinja2 would give the definition's)
    src = "{% macro show() %}{{ v }}{% endmacro %}{% set v = 'late' %}{{ show() }}"
    assert render(src) == "late"


def test_call_block_and_caller():
    src = ("{% macro box() %}[{{ caller() }}]{% endmacro %}"
           "{% call box() %}inside{% endcall %}")
    assert render(src) == "[inside]"


def test_filter_block():
    assert render("{% filter upper %}abc{% endfilter %}") == "ABC"


def test_generation_markers_are_ignored():
    assert render("ab{% generation %}c{% endgeneration %}d") == "abcd"


def test_raise_exception_carries_the_templates_message():
    with pytest.raises(TemplateRaised) as e:
        render("{{ raise_exception('roles must alternate') }}")
    assert e.value.message == "roles must alternate"


def test_strftime_now_formats_the_given_time():
    t = time.mktime((2024, 7, 26, 12, 0, 0, 0, 0, -1))
    assert Template("{{ strftime_now('%d %b %Y') }}").render({}, now=t) == "26 Jul 2024"


# -- members, indexing, slicing -------------------------------------------------

def test_member_and_index_access():
    v = {"m": {"content": "hi", "list": [1, 2, 3]}}
    assert render("{{ m.content }}{{ m['content'] }}{{ m.list[0] }}{{ m.list[-1] }}", **v) == \
        "hihi13"
    assert render("{{ m.missing }}|{{ m.missing.deeper }}|", **v) == "||"


def test_methods_win_over_keys_with_dot_but_not_brackets():
    assert render("{{ d['items'] }}", d={"items": 5}) == "5"
    assert render("{% for k, v in d.items() %}{{ k }}{% endfor %}", d={"items": 5}) == "items"


@pytest.mark.parametrize("expr, out", [
    ("xs[1:]", "234"), ("xs[:-1]", "123"), ("xs[::-1]", "4321"), ("xs[::2]", "13"),
    ("s[1:3]", "bc"), ("s[::-1]", "dcba"),
])
def test_slices(expr, out):
    assert render("{{ %s }}" % expr, xs=[1, 2, 3, 4], s="abcd") == out


# -- filters and methods ---------------------------------------------------------

@pytest.mark.parametrize("expr, out", [
    ("'  x  ' | trim", "x"), ("'ab' | upper", "AB"), ("'hELLO wORLD' | title", "Hello World"),
    ("'hELLO' | capitalize", "Hello"), ("[1, 2, 3] | length", "3"), ("'abc' | length", "3"),
    ("{'a': 1} | length", "1"), ("[3, 1, 2] | sort | join(',')", "1,2,3"),
    ("['a', 'b'] | join", "ab"), ("xs | map(attribute='n') | join('-')", "1-2"),
    ("xs | selectattr('n', 'equalto', 2) | map(attribute='n') | first", "2"),
    ("xs | rejectattr('n', 'equalto', 2) | list | length", "1"),
    ("[1, 2] | first", "1"), ("[1, 2] | last", "2"), ("[1, 2] | reverse | join", "21"),
    ("none | default('d')", "d"), ("'' | default('d')", ""), ("'' | default('d', true)", "d"),
    ("nothing | default('d')", "d"), ("'a-b-c' | replace('-', '+')", "a+b+c"),
    ("'42' | int + 1", "43"), ("'x' | int", "0"), ("'2.5' | float", "2.5"),
    ("3 | string", "3"), ("true | string", "True"), 
    ("[3, 5, 1] | max", "5"), ("[3, 5, 1] | min", "1"), ("nothing | length", "0"),
    ("none | items | length", "0"), ("'a\nb' | indent(2)", "a\n  b"),
    ("'a\nb' | indent(2, first=true)", "  a\n  b"),
])
def test_filters(expr, out):
    assert render("{{ %s }}" % expr, xs=[{"n": 1}, {"n": 2}]) == out


@pytest.mark.parametrize("expr, out", [
    ("s.strip()", "a b"), ("s.lstrip()", "a b "), ("s.rstrip()", " a b"),
    ("s.split()|length", "4"), ("'a,b'.split(',')[1]", "b"), ("'a b c'.split(' ', 1)[1]", "b c"),
    ("'a,b,c'.rsplit(',', 1)[0]", "a,b"), ("'abc'.startswith('ab')", "True"),
    ("'abc'.endswith('bc')", "True"), ("'AbC'.lower()", "abc"), ("'x{}y{}'.format(1, 2)", "x1y2"),
    ("'<think>a</think>b'.split('</think>')[-1]", "b"), ("d.get('k')", "1"),
    ("d.get('z', 'none')", "none"), ("d.keys()|list|length", "1"), ("'ab'.upper()", "AB"),
])
def test_string_and_object_methods(expr, out):
    assert render("{{ %s }}" % expr, s=" a b ", d={"k": 1}) == out


def test_dictsort():
    src = "{% for k, v in d | dictsort %}{{ k }}{{ v }}{% endfor %}"
    assert render(src, d={"b": 2, "a": 1}) == "a1b2"


def test_list_append_and_pop_mutate():
    assert render("{% set xs = [1] %}{% set _ = xs.append(2) %}{{ xs }}") == "12"
    assert render("{% set xs = [1, 2, 3] %}{{ xs.pop() }}{{ xs }}") == "312"


@pytest.mark.parametrize("value, out", [
    ({"a": [1, "x"], "b": None}, '{"a": [1, "x"], "b": null}'),
    ("é\n\"", '"é\\n\\""'), (1.5, "1.5"), (True, "true"),
])
def test_tojson(value, out):
    assert render("{{ v | tojson }}", v=value) == out


def test_tojson_indent_and_ensure_ascii():
    assert render("{{ v | tojson(indent=2) }}", v={"a": [1]}) == '{\n  "a": [\n    1\n  ]\n}'
    assert render("{{ v | tojson(ensure_ascii=true) }}", v="é😀") == '"\\u00e9\\ud83d\\ude00"'
    assert render("{{ v | tojson(separators=(',', ':')) }}", v={"a": 1, "b": 2}) == '{"a":1,"b":2}'


# -- tests (is ...) ----------------------------------------------------------------

@pytest.mark.parametrize("expr, out", [
    ("x is defined", "True"), ("nothing is defined", "False"), ("nothing is undefined", "True"),
    ("none is none", "True"), ("x is none", "False"), ("'s' is string", "True"),
    ("{} is mapping", "True"), ("[] is iterable", "True"), ("1 is number", "True"),
    ("1.5 is float", "True"), ("1 is integer", "True"), ("true is boolean", "True"),
    ("true is true", "True"), ("0 is false", "False"), ("4 is even", "True"),
    ("3 is odd", "True"), ("9 is divisibleby 3", "True"), ("9 is divisibleby(2)", "False"),
    ("x is equalto 1", "True"), ("x is not none", "True"), ("'a' is in 'abc'", "True"),
    ("'ab' is lower", "True"), ("x is sameas 1", "True"),
])
def test_tests(expr, out):
    assert render("{{ %s }}" % expr, x=1) == out


# -- what is outside the subset says so ----------------------------------------------

@pytest.mark.parametrize("src, named", [
    ("{% include 'x.jinja' %}", "include"),
    ("{% raw %}x{% endraw %}", "raw"),
    ("{% with a = 1 %}{% endwith %}", "with"),
    ("{{ 'a' | wordwrap }}", "wordwrap"),
    ("{{ 1 is prime }}", "prime"),
    ("{{ ['a'] | map('upper') | list }}", "map"),
    ("{{ [1, 1] | unique | list }}", "unique"),
    ("{{ frobnicate() }}", "frobnicate"),
])
def test_unsupported_constructs_name_themselves(src, named):
    with pytest.raises(Unsupported) as e:
        render(src)
    assert named in str(e.value)


def test_syntax_errors_say_where():
    with pytest.raises(TemplateSyntaxError) as e:
        Template("line one\n{% if x %}\nno end")
    assert "endif" in str(e.value)
    with pytest.raises(TemplateSyntaxError) as e:
        Template("a\n{{ x ) }}")
    assert "line 2" in str(e.value)


def test_runtime_errors_say_where():
    with pytest.raises(TemplateError) as e:
        render("ok\n\n{{ 1 - 'a' }}")
    assert "line 3" in str(e.value)


def test_templates_are_reusable_and_do_not_keep_state():
    t = Template("{% set ns = namespace(n=0) %}{% for x in xs %}{% set ns.n = ns.n + x %}"
                 "{% endfor %}{{ ns.n }}")
    assert t.render({"xs": [1, 2]}) == "3"
    assert t.render({"xs": [5]}) == "5"
