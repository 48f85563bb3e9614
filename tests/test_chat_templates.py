"""Every pinned chat template renders exactly as llama-server renders it.

tests/golden/chat/*.json hold what the pinned llama-server's /apply-template
returned for the requests in tests/golden/chat_cases.json (system
prompts, several turns, text parts, thinking on and off, tools, tool calls
and their results, reasoning in the history), with gemma-3-270m's BOS and EOS.
Each case is rendered here with offgrid's interpreter and must match byte for
byte; where llama-server refused the messages, offgrid must refuse them too.

Regenerate the goldens with `python3 scripts/make_chat_goldens.py` after the
pinned llama.cpp changes.
"""

import json
from pathlib import Path

import pytest

from offgrid.chat import template as chat
from offgrid.server.httpd.httperrors import HTTPError
from offgrid.server.api.fields import Fields, chat_messages_from, tools_from

GOLDEN = Path(__file__).resolve().parent / "golden" / "chat"
FILES = sorted(GOLDEN.glob("*.json"))
CASES = json.loads((GOLDEN.parent / "chat_cases.json").read_text(encoding="utf-8"))


def _load(path):
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


@pytest.fixture(scope="module")
def templates_dir(llama_src):
    return llama_src / "models" / "templates"


_cache = {}


def _template(templates_dir, golden):
    name = golden["template"]
    if name not in _cache:
        src = (templates_dir / name).read_text(encoding="utf-8")
        _cache[name] = chat.ChatTemplate(src, golden["bos_token"], golden["eos_token"],
                                         add_bos=True, add_eos=False)
    return _cache[name]


def _render(tmpl, name, case):
    f = Fields(CASES[name])
    messages = chat_messages_from(f.raw("messages"))
    tools = tools_from(f.raw("tools"))
    kwargs = f.raw("chat_template_kwargs") or {}
    return tmpl.apply(messages, tools, add_generation_prompt=f.bool("add_generation_prompt", True),
                      kwargs=kwargs, now=case["now"]).text


def test_all_pinned_templates_have_goldens(templates_dir):
    names = sorted(p.name for p in templates_dir.glob("*.jinja"))
    assert len(names) == 70
    assert sorted(_load(p)["template"] for p in FILES) == names


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_template_matches_llama_server(templates_dir, path):
    golden = _load(path)
    assert "cases" in golden, "llama-server could not load %s: %s" % (
        golden["template"], golden.get("server_error"))
    tmpl = _template(templates_dir, golden)
    assert tmpl.caps.as_dict() == golden["caps"]
    failures = []
    for name, case in golden["cases"].items():
        try:
            got = _render(tmpl, name, case)
        except (chat.ChatTemplateError, HTTPError) as e:
            got = e
        if "prompt" in case:
            if got != case["prompt"]:
                failures.append("%s: expected\n%r\ngot\n%r" % (name, case["prompt"], got))
        elif not isinstance(got, Exception):
            failures.append("%s: llama-server refused (%s) but offgrid rendered\n%r"
                            % (name, case["error"], got))
    assert not failures, "\n\n".join(failures)


# -- choosing the template on the server -----------------------------------------------

try:
    from .serverproc import ServerProcess
except ImportError:
    from serverproc import ServerProcess


@pytest.mark.slow
def test_chat_template_flag_takes_a_file_a_name_or_chatml(gemma_path, templates_dir, tmp_path):
    msgs = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "hi"}]}
    with ServerProcess(gemma_path, "--chat-template", templates_dir / "Qwen3-Coder.jinja") as s:
        status, _, body = s.post("/apply-template", msgs)
    assert status == 200
    assert body["prompt"] == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi"
                              "<|im_end|>\n<|im_start|>assistant\n")
    with ServerProcess(gemma_path, "--chat-template", "llama3") as s:      # libllama's built-in
        _, _, body = s.post("/apply-template", msgs)
    assert body["prompt"].startswith("<|start_header_id|>system<|end_header_id|>\n\nBe brief.")


def test_model_without_template_uses_its_architectures_builtin(gemma_path):
    with ServerProcess(gemma_path) as s:
        _, _, body = s.post("/apply-template", {"messages": [{"role": "user", "content": "hi"}]})
    assert body["prompt"] == "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"


def test_inline_template_text_is_rendered_as_llama_server_renders_it(smollm_path):
    msgs = {"messages": [{"role": "system", "content": "Book"},
                         {"role": "user", "content": "What is the best book"}]}
    # llama-server --jinja takes --chat-template as the template's text: text with no
    # tags is the whole prompt (test_chat_completion's "This is not a chat template")
    text = "This is not a chat template, it is"
    with ServerProcess(smollm_path, "--chat-template", text, threads=1, ctx=512) as s:
        assert s.post("/apply-template", msgs)[2]["prompt"] == text
        status, _, body = s.post("/v1/chat/completions", dict(msgs, max_tokens=2))
        n = len(s.post("/tokenize", {"content": text, "add_special": True})[2]["tokens"])
        assert status == 200 and body["usage"]["prompt_tokens"] == n
    inline = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}> "
    with ServerProcess(smollm_path, "--chat-template", inline, threads=1, ctx=512) as s:
        assert s.post("/apply-template", msgs)[2]["prompt"] == \
            "[system] Book\n[user] What is the best book\n> "


def test_unusable_chat_template_stops_startup(gemma_path, tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }}")
    for spec in (bad, "no-such-template", tmp_path / "missing.jinja"):
        proc = ServerProcess(gemma_path, "--chat-template", spec, startup_timeout=60)
        with pytest.raises(RuntimeError) as e:
            proc.start()
        assert "chat template" in str(e.value)
