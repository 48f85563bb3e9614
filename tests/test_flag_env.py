"""llama-server's LLAMA_ARG_* environment variables, for the flags offgrid takes.

The table (offgrid/flagenv.py) is held to the pinned source's common/arg.cpp:
every option there with a variable whose flag offgrid takes is in it, with
that variable and its negative form.  Then the rules, as arg.cpp reads them,
and a server configured by variables alone.
"""

import re

import pytest

from offgrid import flagenv
from offgrid.flags import parse_args
from serverproc import ServerProcess


def arg_cpp_options(llama_src):
    """{variable: (option strings, negative option strings)} of common/arg.cpp."""
    src = (llama_src / "common" / "arg.cpp").read_text()
    out = {}
    for chunk in src.split("add_opt(common_arg(")[1:]:
        chunk = chunk.split("add_opt(")[0]
        env = re.search(r'\.set_env\("([A-Z0-9_]+)"\)', chunk)
        if not env:
            continue
        lists = [re.findall(r'"([^"]*)"', x)
                 for x in re.findall(r'\{((?:\s*"[^"]*"\s*,?)+)\}', chunk[:600])]
        pos = lists[0]
        neg = lists[1] if len(lists) > 1 and all(x.startswith("-") for x in lists[1]) else []
        out[env.group(1)] = (pos, neg)
    return out


def our_options():
    import argparse
    captured = {}

    def grab(self, *a, **k):
        captured["parser"] = self
        raise SystemExit(0)
    real = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = grab
    try:
        with pytest.raises(SystemExit):
            parse_args(["-m", "x.gguf"])
    finally:
        argparse.ArgumentParser.parse_args = real
    return captured["parser"]._option_string_actions


def test_every_variable_of_a_flag_offgrid_takes_is_read_as_arg_cpp_names_it(llama_src):
    theirs, ours = arg_cpp_options(llama_src), our_options()
    table = {env: (flag, rest[0] if rest else None) for env, flag, *rest in flagenv.ENV}
    wanted = {env for env, (pos, _) in theirs.items() if any(o in ours for o in pos)}
    assert sorted(wanted - set(table)) == [], "variables of flags offgrid takes, not read"
    assert sorted(set(table) - set(theirs)) == [], "variables llama-server does not have"
    for env, (flag, negative) in table.items():
        pos, neg = theirs[env]
        assert flag in pos and flag in ours, (env, flag, pos)
        if ours[flag].nargs == 0 and any(o in ours for o in neg):
            # a switch with a negative form offgrid takes: "off" reads as that form
            assert negative in neg and negative in ours, (env, neg)
        else:
            assert negative is None, env


@pytest.fixture
def clean_env(monkeypatch):
    for env, *_ in flagenv.ENV:
        monkeypatch.delenv(env, raising=False)
        monkeypatch.delenv(env.replace("LLAMA_ARG_", "LLAMA_ARG_NO_", 1), raising=False)
    return monkeypatch


def test_a_variable_stands_for_its_flag_under_the_command_line(clean_env):
    clean_env.setenv("LLAMA_ARG_CTX_SIZE", "512")
    clean_env.setenv("LLAMA_ARG_CONTEXT_SHIFT", "on")
    clean_env.setenv("LLAMA_ARG_KV_UNIFIED", "disabled")
    clean_env.setenv("LLAMA_ARG_EMBEDDINGS", "0")             # a switch: only on counts
    clean_env.setenv("LLAMA_ARG_TEMPERATURE", "0.25")
    clean_env.setenv("LLAMA_ARG_ALIAS", "from-env")
    args = parse_args(["-m", "x.gguf", "-a", "given"])
    assert (args.ctx_size, args.context_shift, args.kv_unified) == (512, True, False)
    assert args.embeddings is True and args.sampling["temperature"] == 0.25
    assert args.alias == ["given"]                             # the command line wins
    assert {"ctx_size", "context_shift", "alias"} <= args.explicit
    assert parse_args(["-m", "x.gguf", "-c", "1024", "--no-context-shift"]).ctx_size == 1024
    clean_env.setenv("LLAMA_ARG_NO_CONTEXT_SHIFT", "1")
    assert parse_args(["-m", "x.gguf"]).context_shift is False
    clean_env.setenv("LLAMA_ARG_MODEL", "from-env.gguf")
    assert parse_args([]).model == "from-env.gguf"


@pytest.mark.parametrize("env,value,words", [
    ("LLAMA_ARG_CONTEXT_SHIFT", "maybe", "$LLAMA_ARG_CONTEXT_SHIFT=maybe"),
    ("LLAMA_ARG_CTX_SIZE", "big", "--ctx-size"),
    ("LLAMA_ARG_FLASH_ATTN", "sometimes", "--flash-attn"),
])
def test_a_variable_that_does_not_read_stops_the_start(clean_env, capsys, env, value, words):
    clean_env.setenv(env, value)
    with pytest.raises(SystemExit) as e:
        parse_args(["-m", "x.gguf"])
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_a_server_configured_by_variables(clean_env, plain_model_path):
    clean_env.setenv("LLAMA_ARG_ALIAS", "configured")
    clean_env.setenv("LLAMA_ARG_N_PREDICT", "3")
    clean_env.setenv("LLAMA_API_KEY", "sesame")
    with ServerProcess(plain_model_path, ctx=256) as s:
        status, _, out = s.get("/v1/models")
        assert status == 401, out
        auth = {"Authorization": "Bearer sesame"}
        status, _, out = s.get("/v1/models", headers=auth)
        assert status == 200 and out["data"][0]["id"] == "configured", out
        status, _, out = s.post("/completion", {"prompt": "Once upon", "temperature": 0},
                                headers=auth)
        assert status == 200 and out["tokens_predicted"] == 3, out
