"""llama-server command lines, as model cards give them, run on offgrid as they are.

The switches for what offgrid always does (--jinja, -cb, --offline,
--swa-full) are taken; --chat-template-kwargs and --reasoning-effort are the
template's variables under each request's own; --chat-template-file names a
Jinja file (--reasoning-budget: tests/test_reasoning_budget.py).
"""

import pytest

from offgrid.flags import parse_args
from serverproc import ServerProcess

# Qwen3's model card (Unsloth's llama-server line, less its -ngl and download flags)
QWEN3_CARD = ["--jinja", "-c", "40960", "-n", "32768", "--temp", "0.6", "--top-k", "20",
              "--top-p", "0.95", "--min-p", "0", "--presence-penalty", "1.5",
              "--no-context-shift", "-fa", "on", "--reasoning-format", "deepseek",
              "-cb", "--offline", "--swa-full"]


def test_a_model_cards_command_line_parses_to_its_settings():
    args = parse_args(["-m", "x.gguf"] + QWEN3_CARD)
    assert args.sampling == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0,
                             "presence_penalty": 1.5}
    assert (args.ctx_size, args.n_predict, args.flash_attn) == (40960, 32768, "on")
    assert not args.no_swa_full and not args.context_shift


def test_a_reasoning_budget_below_minus_1_is_refused(capsys):
    assert parse_args(["-m", "x.gguf", "--reasoning-budget", "512"]).reasoning_budget == 512
    with pytest.raises(SystemExit):
        parse_args(["-m", "x.gguf", "--reasoning-budget", "-2"])
    assert "--reasoning-budget -2" in capsys.readouterr().err


@pytest.mark.parametrize("value,what", [("{nope", "not JSON"), ("[1]", "JSON object"),
                                        ('{"enable_thinking": "no"}', "true or false")])
def test_chat_template_kwargs_that_are_not_an_object_of_values_are_refused(value, what, capsys):
    with pytest.raises(SystemExit):
        parse_args(["-m", "x.gguf", "--chat-template-kwargs", value])
    assert what in capsys.readouterr().err


def test_a_chat_template_file_must_be_a_file(tmp_path, capsys):
    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0].content }}")
    assert parse_args(["-m", "x.gguf", "--chat-template-file", str(f)]).chat_template == str(f)
    with pytest.raises(SystemExit):
        parse_args(["-m", "x.gguf", "--chat-template-file", str(tmp_path / "missing.jinja")])
    assert "no such file" in capsys.readouterr().err


# a template that shows the variables it is given
SHOWS = ("{% for m in messages %}{{ m.content }}{% endfor %}|thinking={{ enable_thinking }}"
         "|effort={{ reasoning_effort }}|flavour={{ flavour }}|")


@pytest.fixture(scope="module")
def server(tmp_path_factory, plain_model_path):
    template = tmp_path_factory.mktemp("kwargs") / "shows.jinja"
    template.write_text(SHOWS)
    with ServerProcess(plain_model_path, "--chat-template-file", template, "--jinja",
                       "--chat-template-kwargs", '{"flavour": "mint", "enable_thinking": false}',
                       "--reasoning-effort", "high", ctx=256) as s:
        yield s


def rendered(server, **body):
    status, _, out = server.post("/apply-template",
                                 dict({"messages": [{"role": "user", "content": "hi"}]}, **body))
    assert status == 200, out
    return out["prompt"].lower()


def test_the_servers_template_kwargs_reach_the_template(server):
    assert "hi|thinking=false|effort=high|flavour=mint|" in rendered(server)


def test_a_requests_own_template_kwargs_win(server):
    got = rendered(server, chat_template_kwargs={"flavour": "lime", "enable_thinking": True},
                   reasoning_effort="low")
    assert "hi|thinking=true|effort=low|flavour=lime|" in got


def test_cors_origins_is_a_comma_list_of_cors_origin():
    args = parse_args(["-m", "x.gguf", "--cors-origins", "http://a.test, http://b.test",
                       "--cors-origin", "http://c.test", "--no-warmup", "--repack"])
    assert sorted(args.cors_origin) == ["http://a.test", "http://b.test", "http://c.test"]


@pytest.mark.parametrize("item", ["nokey", "k=int", "k=int:x", "k=bool:yes", "k=list:1",
                                  "k=str:" + "x" * 128, "=int:1"])
def test_an_override_kv_that_does_not_read_is_refused(item, capsys):
    with pytest.raises(SystemExit):
        parse_args(["-m", "x.gguf", "--override-kv", item])
    assert "--override-kv" in capsys.readouterr().err


def test_override_kv_puts_a_value_in_place_of_the_files(gemma_path):
    """The classic use: a file whose tokenizer adds a BOS a client's prompt already has."""
    args = parse_args(["-m", "x.gguf", "--override-kv",
                       "tokenizer.ggml.add_bos_token=bool:false,gemma3.block_count=int:18",
                       "--override-kv", "general.name=str:renamed"])
    assert args.override_kv == [["tokenizer.ggml.add_bos_token", "bool", False],
                                ["gemma3.block_count", "int", 18],
                                ["general.name", "str", "renamed"]]
    with ServerProcess(gemma_path, "--override-kv", "tokenizer.ggml.add_bos_token=bool:false",
                       ctx=256) as s:
        _, _, show = s.post("/api/show", {"model": "x"})
        assert show["model_info"]["tokenizer.ggml.add_bos_token"] is True  # the file's
        with_special = s.post("/tokenize", {"content": "hi", "add_special": True})[2]
        without = s.post("/tokenize", {"content": "hi", "add_special": False})[2]
    assert with_special["tokens"] == without["tokens"] == [2202]


def test_an_override_kv_of_another_type_than_the_files_key_fails_the_load(plain_model_path):
    # libllama would read the file's value and say so only in its log (-v)
    server = ServerProcess(plain_model_path, "--override-kv", "general.name=int:3", ctx=256)
    with pytest.raises(RuntimeError) as e:
        server.start()
    assert server.stop() == 1
    assert "--override-kv general.name=int:...: the file's general.name is a str" \
        in str(e.value), e.value


def test_the_lazy_mode_reads_gemma4s_per_layer_embeddings_on_demand(tiny_dir):
    """-lzm on: libllama reads the per-layer embeddings gemma4 marks from the file as
    it needs them (its own line says so), and the text is the same as with them held."""
    import archmodels
    path = archmodels.build("gemma4", tiny_dir)
    body = {"prompt": "Once upon a time", "n_predict": 8, "temperature": 0}
    texts = {}
    for mode in ("on", "off"):
        with ServerProcess(path, "-lzm", mode, "-v", ctx=256) as s:
            status, _, out = s.post("/completion", body)
            assert status == 200, out
            texts[mode] = out["content"]
        lazy = [line for line in s.output if "lazy read enabled" in line]
        assert bool(lazy) == (mode == "on"), "".join(s.output)[-2000:]
    assert texts["on"] == texts["off"]
    assert parse_args(["-m", "x.gguf"]).lazy_mode == "auto"


def test_the_load_mode_reaches_libllama(smollm_path):
    assert parse_args(["-m", "x.gguf", "--mlock"]).load_mode == "mmap+mlock"
    assert parse_args(["-m", "x.gguf", "--no-mmap"]).load_mode == "none"
    assert parse_args(["-m", "x.gguf"]).load_mode == "auto"
    with ServerProcess(smollm_path, "-lm", "none", "-v", ctx=256) as s:
        status, _, out = s.post("/completion", {"prompt": "Hello", "n_predict": 2})
        assert status == 200 and out["tokens_predicted"] == 2, out
    # libllama's own line: the file was read into memory, not mapped
    assert any("(load_mode = none)" in line for line in s.output), "".join(s.output)[-2000:]


def test_tensor_overrides_read_as_llama_servers(capsys):
    args = parse_args(["-m", "x.gguf", "-ot", r"blk\.1\.=CPU,exps=Vulkan0", "--cpu-moe",
                       "--n-cpu-moe", "2"])
    exps = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
    assert args.override_tensor == [[r"blk\.1\.", "CPU"], ["exps", "Vulkan0"], [exps, "CPU"],
                                    [r"blk\.0" + exps, "CPU"], [r"blk\.1" + exps, "CPU"]]
    for bad in (["-ot", "noequals"], ["-ot", "(=CPU"], ["--n-cpu-moe", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(["-m", "x.gguf"] + bad)
        assert "-ot" in capsys.readouterr().err or "n-cpu-moe" in bad[0]


def test_a_tensor_override_serves_and_a_buffer_type_not_there_is_a_load_error(smollm_path):
    with ServerProcess(smollm_path, "-ot", r"blk\.1\.=CPU", "--cpu-moe", ctx=256) as s:
        status, _, out = s.post("/completion", {"prompt": "Hello", "n_predict": 2})
        assert status == 200 and out["tokens_predicted"] == 2, out
    s = ServerProcess(smollm_path, "-ot", "ffn=Vulkan0", ctx=256)
    with pytest.raises(RuntimeError) as e:
        s.start()
    assert "-ot ffn=Vulkan0: no such buffer type in this library; it has CPU" in str(e.value)


def test_the_logging_and_http_thread_flags_are_taken_and_lv_4_is_verbose():
    args = parse_args(["-m", "x.gguf", "--log-disable", "--log-colors", "--log-timestamps",
                       "--no-log-prefix", "--threads-http", "4", "-lv", "1"])
    assert not args.verbose
    assert parse_args(["-m", "x.gguf", "--verbosity", "4"]).verbose
    assert parse_args(["-m", "x.gguf", "--log-verbose", "--log-colors", "off"]).verbose


def test_check_tensors_refuses_a_file_with_a_nan(tmp_path, plain_model_path):
    """--check-tensors: libllama reads every tensor's data as it loads and fails on a NaN
    (here one value of the output norm); without it the same file loads."""
    import struct
    import gguf
    src = gguf.read(plain_model_path)
    info = next(t for t in src.tensors if t.type == gguf.TensorType.F32)
    data = bytearray(src.tensor_bytes(info))
    data[:4] = struct.pack("<f", float("nan"))
    bad = tmp_path / "nan.gguf"
    gguf.rewrite(plain_model_path, bad, {info.name: bytes(data)})
    server = ServerProcess(bad, "--check-tensors", ctx=256)
    with pytest.raises(RuntimeError) as e:
        server.start()
    assert server.stop() == 1
    assert "a tensor of NaN or infinity (--check-tensors)" in str(e.value), e.value
    with ServerProcess(bad, ctx=256) as s:
        assert s.get("/health")[0] == 200


def test_reuse_port_lets_two_servers_share_a_port(plain_model_path):
    """--reuse-port (SO_REUSEPORT): a second server listens on the first one's port, and
    the kernel spreads new connections over both."""
    with ServerProcess(plain_model_path, "--reuse-port", "--instance-name", "one",
                       ctx=256) as a:
        b = ServerProcess(plain_model_path, "--reuse-port", "--instance-name", "two", ctx=256)
        b.port_tries = 1
        b.args[b.args.index("--port") + 1] = str(a.port)
        b.port = a.port
        with b:
            seen = {a.get("/health")[1].get("X-Offgrid-Instance") for _ in range(40)}
    assert seen == {"one", "two"}, seen


def test_rope_flags_read_as_llama_servers(capsys):
    args = parse_args(["-m", "x.gguf", "--rope-scaling", "yarn", "--rope-scale", "4",
                       "--yarn-orig-ctx", "32768", "--yarn-beta-fast", "32"])
    assert args.rope == {"rope_scaling_type": "yarn", "rope_freq_scale": 0.25,
                         "yarn_orig_ctx": 32768, "yarn_beta_fast": 32.0}
    assert parse_args(["-m", "x.gguf"]).rope == {}
    for bad in (["--rope-scale", "0"], ["--rope-freq-base", "-1"], ["--yarn-orig-ctx", "-5"],
                ["--yarn-ext-factor", "nan"]):
        with pytest.raises(SystemExit):
            parse_args(["-m", "x.gguf"] + bad)
        assert bad[0] in capsys.readouterr().err


@pytest.mark.parametrize("meta,rope,want", [
    ({}, {}, 4096),
    ({}, {"rope_freq_scale": 0.5}, 8192),
    ({}, {"rope_freq_scale": 0.25, "yarn_orig_ctx": 2048}, 8192),
    # a file that carries Qwen's YaRN: its context_length is the original one
    ({"x.rope.scaling.type": "yarn", "x.rope.scaling.factor": "4.000000",
      "x.rope.scaling.original_context_length": "4096"}, {}, 16384),
    # ... and one whose context_length holds the stretch already (DeepSeek-V2's kind)
    ({"x.rope.scaling.type": "yarn", "x.rope.scaling.factor": "40.000000",
      "x.rope.scaling.original_context_length": "100"}, {}, 4096),
    ({"x.rope.scaling.type": "yarn", "x.rope.scaling.factor": "4.000000"},
     {"rope_scaling_type": 0}, 4096),
])
def test_the_context_a_model_is_meant_for_stretches_with_rope_scaling(meta, rope, want):
    from offgrid.engine.model import stretched_context
    assert stretched_context(4096, dict(meta, **{"general.architecture": "x"}), rope) == want


def test_rope_scaling_reaches_libllama_and_lets_the_context_past_the_trained_one(
        plain_model_path, smollm_path):
    """The tiny model was trained on 4,096 positions: -c 8192 alone is held to them, and
    with --rope-scale 2 it is 8,192.  On SmolLM2 the positions are placed otherwise, so
    its greedy text is another (the tiny model's random weights barely look at them)."""
    for flags, n_ctx in (((), 4096), (("--rope-scaling", "linear", "--rope-scale", "2"), 8192)):
        with ServerProcess(plain_model_path, *flags, "-np", "1", ctx=8192) as s:
            assert s.get("/props")[2]["default_generation_settings"]["n_ctx"] == n_ctx
    body = {"prompt": "The three primary colours are", "n_predict": 24, "temperature": 0}
    texts = {}
    for flags in ((), ("--rope-scaling", "linear", "--rope-scale", "2")):
        with ServerProcess(smollm_path, *flags, "-np", "1", ctx=256) as s:
            status, _, out = s.post("/completion", body)
            assert status == 200, out
            texts[flags] = out["content"]
    assert len(set(texts.values())) == 2, texts


def test_log_file_gets_what_the_server_and_its_worker_write(tmp_path, plain_model_path):
    """--log-file: every line the front and the model's worker (libllama in it, -v) write
    goes to the file as well as to the console, to the last one at exit."""
    log = tmp_path / "server.log"
    log.write_text("a line of an earlier run\n")
    with ServerProcess(plain_model_path, "--log-file", log, "-v", ctx=256) as s:
        assert s.post("/completion", {"prompt": "Hi", "n_predict": 2})[0] == 200
    console = "".join(s.output)
    text = log.read_text()
    assert "earlier run" not in text
    for line in ("listening on ", "llama_model_loader: ", "POST /completion",
                 "offgrid: shutting down"):
        assert line in console and line in text, (line, text)
    assert text.splitlines()[-1] in console
    # stdout and stderr went to one pipe here: their lines stay whole and in order
    assert [line for line in text.splitlines() if line.startswith("listening on ")] == \
        [line.rstrip("\n") for line in s.output if line.startswith("listening on ")]
    bad = ServerProcess(plain_model_path, "--log-file", tmp_path / "no" / "such.log", ctx=256)
    with pytest.raises(RuntimeError) as e:
        bad.start()
    assert bad.stop() == 2
    assert "cannot write --log-file %s" % (tmp_path / "no" / "such.log") in str(e.value)


def test_post_props_is_a_501_unless_props_is_given(plain_model_path):
    """llama-server's POST /props: with --props it answers success (and changes nothing,
    as there); without it, its 501 in its words."""
    with ServerProcess(plain_model_path, ctx=256) as s:
        status, _, out = s.post("/props", {})
        assert (status, out["error"]["type"]) == (501, "not_supported_error")
        assert "Start it with `--props`" in out["error"]["message"]
        assert s.get("/props")[0] == 200
    with ServerProcess(plain_model_path, "--props", ctx=256) as s:
        assert s.post("/props", {})[::2] == (200, {"success": True})
        assert s.request("POST", "/props")[::2] == (200, {"success": True})   # no body
