"""bench/ is not run by `make test` (it needs an idle machine), so this checks
that its modules still import, its command line parses, its phases are the
ones its --help lists, and its figures and goals come out of samples as the
table says: a broken merge once left `make bench` failing at import for a
whole session.  No server is started here."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

try:
    from . import tinymodels
except ImportError:  # tests/ is on sys.path rather than a package
    import tinymodels

ROOT = Path(__file__).resolve().parent.parent


def _bench_module(name, filename):
    """bench/<filename> loaded as a module, with bench/ on sys.path as running it has."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / filename)
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "bench"))
    # a bench script's `from run import ...` means bench/run.py, not another
    # test's module of that name (tests/conformance/run.py) in this process
    other = sys.modules.pop("run", None)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "bench"))
        sys.modules.pop("run", None)
        if other is not None:
            sys.modules["run"] = other
    return mod


@pytest.fixture(scope="module")
def bench():
    return _bench_module("bench_run", "run.py")


def test_bench_help_runs():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "run.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in ("--rounds", "--only", "--code-model", "--stock-bin", "--no-busy",
                 "--busy-hogs", "--servers"):
        assert flag in out.stdout, flag
    for phase in ("single", "continuation", "batched", "stall", "editor-gemma", "busy"):
        assert phase in out.stdout, phase


def test_rpc_bench_help_runs():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "rpc.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--servers" in out.stdout and "--rounds" in out.stdout


def test_fleet_bench_help_runs():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "fleet.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in ("--replicas", "--clients", "--seconds", "--rounds"):
        assert flag in out.stdout, flag


def test_fleet_bench_runs_docs_haproxy_config_on_its_own_ports():
    fleet = _bench_module("bench_fleet", "fleet.py")
    text = fleet.haproxy_config(9000, [9101, 9102])
    servers = [line.split() for line in text.splitlines() if line.strip().startswith("server ")]
    assert [s[2] for s in servers] == ["127.0.0.1:9101", "127.0.0.1:9102"], servers
    assert "bind 127.0.0.1:9000" in text and "balance hash" in text and "810" not in text


def test_every_phase_can_run_alone(bench):
    for name in bench.PHASES:
        args = bench.parse_args(["--only", name])
        chosen = bench.selected_phases(args, fim=Path("/nonexistent/fim.gguf"))
        assert all(ph.name == name for ph in chosen)
        assert chosen or name == "busy"     # busy runs after the rounds (busy.py)


def test_the_stock_server_is_a_default_server_of_the_single_phase_only(bench):
    args = bench.parse_args([])
    assert args.servers == ["offgrid", "llama_server", "llama_server_stock"]
    by_label = {ph.label: ph for ph in bench.phases(args, None)}
    assert "llama_server_stock" in by_label["single"].variants
    for label in ("batched-np4-unified", "batched-np8-split", "stall", "editor"):
        assert "llama_server_stock" not in by_label[label].servers


def test_batched_phases_are_np4_and_np8_in_both_kv_layouts(bench):
    """Like for like (issue #52): both servers with one KV cache (offgrid's
    default, llama-server's -kvu), then both with a stream per session
    (llama-server's default with -np N, offgrid's --no-kv-unified)."""
    args = bench.parse_args(["--only", "batched"])
    chosen = bench.selected_phases(args, None)
    assert [ph.cfg.parallel for ph in chosen] == [4, 8, 4, 8]
    flags = {(ph.label, name): bench.server_config(ph, name, args).extra
             for ph in chosen for name in ("offgrid", "llama_server")}
    for n in (4, 8):
        assert flags["batched-np%d-unified" % n, "offgrid"] == ()
        assert flags["batched-np%d-unified" % n, "llama_server"] == ("-kvu",)
        assert flags["batched-np%d-split" % n, "offgrid"] == ("--no-kv-unified",)
        assert flags["batched-np%d-split" % n, "llama_server"] == ()


def test_batched_figures_and_goals_compare_like_for_like_and_defaults(bench):
    args = bench.parse_args(["--only", "batched"])
    unified, _, split, _ = bench.selected_phases(args, None)

    def server(name, uni, spl):
        # as Rounds.one_by_one merges them: each phase's samples, and its
        # default layout's again under the plain names
        s = {}
        for ph, tps in ((unified, uni), (split, spl)):
            prefix = ph.default_for[0]
            got = {prefix + "_1": {"tps": [20.0]}, prefix + "_8": {"tps": [tps]}}
            got.update(bench.defaults(ph, name, got))
            bench.merge(s, got)
        return bench.figures(s)
    off, llama = server("offgrid", 150.0, 140.0), server("llama_server", 145.0, 159.0)
    assert off["batched_8_tok_s"] == 150.0 and llama["batched_8_tok_s"] == 159.0
    assert off["batched_unified_8_gain"] == 7.5 and llama["batched_split_8_gain"] == 159.0 / 20
    sc = {k: {"offgrid": off[k], "llama_server": llama[k], "ratio": off[k] / llama[k]}
          for k in ("batched_8_tok_s", "batched_unified_8_tok_s", "batched_split_8_tok_s")}
    got = {what: (round(value, 3), met) for what, value, bound, met
           in bench.goals({"scenarios": sc})}
    assert got["#52 batched 8 clients, offgrid / llama-server, both one KV cache "
               "(offgrid's default; -kvu)"] == (round(150 / 145, 3), True)
    assert got["#52 batched 8 clients, offgrid / llama-server, both a KV stream per "
               "session (llama-server's default)"] == (round(140 / 159, 3), False)
    assert got["#20 batched 8 clients, offgrid / llama-server, each its default "
               "(one KV cache; a stream per slot)"] == (round(150 / 159, 3), False)


def test_continuation_runs_each_speculation_variant_on_the_code_model(bench):
    args = bench.parse_args(["--only", "continuation"])
    (ph,) = bench.selected_phases(args, None)
    flags = {k: cfg.extra for k, (server, cfg) in ph.variants.items()}
    assert flags == {
        "offgrid": ("--spec-type", "none"), "offgrid+ngram-simple": ("--spec-type", "ngram-simple"),
        "llama_server": (), "llama_server+ngram-mod": ("--spec-type", "ngram-mod"),
        "llama_server+ngram-simple": ("--spec-type", "ngram-simple"),
        "llama_server+ngram-map-k": ("--spec-type", "ngram-map-k")}
    assert all(cfg.model.endswith("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
               for _, cfg in ph.variants.values())


def test_rounds_given_apply_to_every_phase(bench):
    args = bench.parse_args(["--rounds", "1"])
    rounds = bench.Rounds(args, bins={})
    assert {rounds.rounds(ph) for ph in bench.phases(args, None)} == {1}
    default = bench.Rounds(bench.parse_args([]), bins={})
    assert default.rounds(bench.phases(args, None)[0]) == 3


@pytest.mark.parametrize("argv", [["--servers", "offgrid,vllm"], ["--rounds", "0"],
                                  ["--keys", "10"], ["--only", "parallel"]])
def test_bad_arguments_are_refused(bench, argv):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2


def test_figures_give_gains_and_llama_servers_best_ngram(bench):
    llama = {"batched_1": {"tps": [20.0]}, "batched_4": {"tps": [50.0]},
             "continuation": {"client_tps": [30.0]},
             "continuation_ngram-mod": {"client_tps": [40.0, 42.0]},
             "continuation_ngram-simple": {"client_tps": [35.0]},
             "stall": {"alone_tps": [40.0], "during_tps": [10.0], "max_gap_ms": [900.0],
                       "prompt_alone_s": [2.0], "prompt_during_s": [2.5]}}
    f = bench.figures(llama)
    assert f["batched_4_gain"] == 2.5
    assert f["continuation_spec_tok_s"] == 41.0
    assert f["stall_kept"] == 0.25
    assert "batched_8_gain" not in f
    assert bench.best_spec_type(llama) == "ngram-mod"


def test_the_batched_limit_counts_the_prompts_the_server_evaluated(bench):
    # eight clients: 4096 tokens generated and 944 prompt tokens evaluated, at
    # llama-batched-bench's 660 tok/s of prompt and 176 of generation: 1.43 s
    # + 23.27 s, 165.8 tok/s of generation for the same work
    samples = {"offgrid": {"batched_unified_8": {"tps": [160.0], "tokens": [4096],
                                                  "prompt_tokens": [944]}}}
    result = {"samples": samples,
              "scenarios": {"batched_unified_8_tok_s": {"offgrid": 160.0}},
              "llama_bench": {"batched": {"unified": {"8": {"tg": 176.0, "pp": 660.0,
                                                             "all": 220.0}}}}}
    limit = 4096 / (944 / 660.0 + 4096 / 176.0)
    assert bench.same_work_limit(result, "batched_unified_8",
                                 result["llama_bench"]["batched"]["unified"]["8"]) == limit
    got = {what: (value, met) for what, value, bound, met in bench.goals(result)}
    assert got["#52 batched 8 clients, unified KV: offgrid / llama-batched-bench's "
               "generation (tok/s)"] == (160.0 / 176.0, False)
    assert got["#52 batched 8 clients, unified KV: offgrid / llama-batched-bench's rates "
               "for the same prompt and generated tokens (tok/s)"] == (160.0 / limit, False)
    # results from before the prompts were counted: the generation line alone
    del samples["offgrid"]["batched_unified_8"]["prompt_tokens"]
    assert not [what for what, *_ in bench.goals(result) if "same prompt" in what]


def test_goals_say_which_are_met(bench):
    result = {"llama_server_best_spec_type": "ngram-mod", "scenarios": {
        "continuation_tok_s": {"offgrid": 40.0, "llama_server": 30.0},
        "continuation_spec_tok_s": {"offgrid": 60.0, "llama_server": 50.0},
        "prompt_tok_s": {"ratio": 0.99, "ratio_stock": 0.97}}}
    got = {what: met for what, value, bound, met in bench.goals(result)}
    assert got["#18 continuation, offgrid's best / llama-server without speculation"]
    assert got["#18 continuation, offgrid's best / llama-server's best n-gram (ngram-mod)"]
    assert got["#18 prompt, offgrid / llama-server"]
    assert not got["#18 prompt, offgrid / llama-server-stock"]
    assert not any("editor" in what for what in got)       # no figure, no line


def test_table_has_a_stock_column_when_the_stock_server_ran(bench):
    row = {"offgrid": 40.0, "llama_server": 39.0, "ratio": 40 / 39,
           "llama_server_stock": 38.0, "ratio_stock": 40 / 38}
    result = {"settings": {"threads": 2}, "scenarios": {"generation_tok_s": row}}
    head, line = bench.table(result).splitlines()[:2]
    assert head.split()[1:6] == ["offgrid", "llama-server", "ratio", "stock", "ratio"]
    assert line.split()[1:6] == ["40.0", "39.0", "1.03", "38.0", "1.05"]
    assert "| llama-server (stock) | offgrid / stock |" in bench.markdown(result)
    del row["llama_server_stock"], row["ratio_stock"]
    assert "stock" not in bench.table(result).splitlines()[0]


@pytest.fixture(scope="module")
def spec_bound():
    return _bench_module("spec_bound", "spec_bound.py")


def test_spec_bound_finds_the_drafts_that_come_true(spec_bound):
    # the prompt repeats "1 2 3 4 5"; after "1 2" the lookup drafts "3 4 5"
    prompt = [1, 2, 3, 4, 5, 9, 9]
    runs = spec_bound.true_runs(prompt, [1, 2, 3, 4, 7, 8], k_max=3)
    # at step 1 ("... 1 2" just sampled) the draft 3 4 5 meets 3 4 7: two come true
    assert runs[1] == 2 and runs[2] == 1 and runs[5] == 0


def test_spec_bound_oracle_is_plain_decoding_where_no_draft_comes_true(spec_bound):
    cost = {n: 1.0 + 0.5 * (n - 1) for n in range(1, 17)}
    runs = [0] * 20
    plain = spec_bound.fixed_time(runs, cost, 0)
    assert plain == 20.0
    assert spec_bound.oracle_time(runs, cost, range(0, 16)) == plain
    assert spec_bound.fixed_time(runs, cost, 3) == 20 * cost[4]    # every draft wasted


def test_spec_bound_oracle_drafts_only_where_it_pays(spec_bound):
    # one run of 8 true tokens at step 0, nothing after: draft 8 there (cost 4.5
    # for 9 tokens), then plain decoding for the other 11
    cost = {n: 1.0 + 0.5 * (n - 1) for n in range(1, 17)}
    runs = [8] + [0] * 19
    assert spec_bound.oracle_time(runs, cost, range(0, 16)) == cost[9] + 11 * cost[1]
    # with verify decodes as dear as their tokens, no draft ever pays
    dear = {n: float(n) for n in range(1, 17)}
    assert spec_bound.oracle_time(runs, dear, range(0, 16)) == 20.0


@pytest.fixture(scope="module")
def steps():
    return _bench_module("bench_steps", "steps.py")


def test_steps_pairs_each_decode_entry_with_its_return(steps):
    # perf script lines as perf 6 prints them; a return whose entry was not
    # recorded (perf attached mid-decode) is dropped, other events ignored;
    # the entry's b and e are the batch's token vector (96 bytes a token)
    text = "\n".join([
        "python 3306 [001] 18666.040000: offgrid_steps:leave__return: (7fc3 <- 7fc4)",
        "python 3306 [001] 18666.048756:        offgrid_steps:enter: (7fc338dec010) "
        "b=0x557fffc91f10 e=0x557fffc91f70",
        "python 3306 [001] 18666.101322: offgrid_steps:leave__return: (7fc3 <- 7fc4)",
        "python 3306 [001] 18666.102000:     sched:sched_switch: prev_comm=python",
        "python 3306 [001] 18666.104605:        offgrid_steps:enter: (7fc338dec010) "
        "b=0x557fffc95580 e=0x557fffc95be0",
        "python 3306 [001] 18666.147832: offgrid_steps:leave__return: (7fc3 <- 7fc4)",
        "python 3306 [001] 18666.150000:        offgrid_steps:enter: (7fc338dec010)",
        "python 3306 [001] 18666.171000: offgrid_steps:leave__return: (7fc3 <- 7fc4)",
    ])
    got = steps.parse_steps(text)
    assert [(round(a, 6), round(b, 6), n) for a, b, n in got] == [
        (18666.048756, 18666.101322, 1), (18666.104605, 18666.147832, 17),
        (18666.150000, 18666.171000, None)]
    s = steps.summary(got)
    assert s["steps"] == 3 and s["steps_over_40ms"] == 2
    assert abs(s["decode_s"] - (0.052566 + 0.043227 + 0.021)) < 1e-6
    assert abs(s["gaps_s"] - (0.003283 + 0.002168)) < 1e-6
    assert abs(s["span_s"] - (18666.171 - 18666.048756)) < 1e-6
    assert [n for n in s["by_tokens"]] == [None, 1, 17]
    assert s["by_tokens"][17][0] == 1 and s["by_tokens"][17][3] == 1


def test_steps_reads_the_batch_as_the_pinned_source_lays_it_out(steps, tmp_path):
    """TOKENS_AT and TOKEN_SIZE against a C++ compile of src/llama-batch.h."""
    src = tinymodels.llama_cpp_source()
    prog = tmp_path / "batch.cpp"
    prog.write_text('#include "llama-batch.h"\n#include <cstdio>\n#include <cstddef>\n'
                    'int main() { printf("%zu %zu\\n", offsetof(llama_batch_ext, tokens),'
                    ' sizeof(llama_batch_ext::token)); }\n')
    built = subprocess.run(["g++", "-std=c++17", "-Wno-invalid-offsetof", "-I", str(src / "src"),
                            "-I", str(src / "include"), "-I", str(src / "ggml" / "include"),
                            "-o", str(tmp_path / "batch"), str(prog)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    out = subprocess.run([str(tmp_path / "batch")], capture_output=True, text=True, check=True)
    assert [int(x) for x in out.stdout.split()] == [steps.TOKENS_AT, steps.TOKEN_SIZE]


def test_steps_finds_the_decode_symbol_in_our_libllama(steps):
    lib = ROOT / "lib" / "libllama.so"
    assert lib.exists(), "no lib/libllama.so: run `make lib`"
    assert steps.symbol_address(lib.resolve()) > 0


def test_copies_phase_gives_the_out_of_order_gain_and_its_goal(bench):
    args = bench.parse_args(["--only", "copies"])
    (ph,) = bench.selected_phases(args, None)
    assert ph.variants["offgrid+none"][1].extra == ("--spec-type", "none")
    s = {"edit_out_of_order": {"tps": [60.0, 80.0], "lines_copied": [0.9], "lines_moved": [0.7],
                               "draft_n": [100], "draft_n_accepted": [80], "draft_steps": [10]},
         "edit_out_of_order_plain": {"tps": [40.0]}}
    f = bench.figures(s)
    assert f["out_of_order_gain"] == 70.0 / 40.0
    assert f["out_of_order_accept"] == 0.8 and f["out_of_order_mean_len"] == 9.0
    got = {what: met for what, value, bound, met in bench.goals(
        {"scenarios": {"out_of_order_gain": {"offgrid": f["out_of_order_gain"]}}})}
    assert got == {"#52 out-of-order copy, offgrid's default drafts / its --spec-type none "
                   "(tok/s)": True}


def test_copies_case_counts_lines_copied_and_moved():
    copies = _bench_module("bench_copies", "copies.py")
    prompt = "```\na\nb\nc\nd\n```"
    # c, a: moved (their line before differs); b after a: in order; x: its own
    assert copies.lines_from(prompt, "```\nc\na\nb\nx\n```") == (4, 3, 2)
    text = copies.out_of_order_text()
    assert all(f[1] in text and f[2] in text for f in copies.FUNCS)
