"""-C/-Cr, --cpu-strict, --prio, --poll and their -batch twins, and --numa: where a
worker's ggml threads run, read from the worker's own threads in /proc.

A worker's threads are Python's (the lifeline, the frame reader, request
threads) and ggml's: a pool of n threads has n - 1 of its own, and the thread
that leads a decode is its thread 0.  Python's threads keep the process's CPUs
unless they lead a decode, so a thread confined to fewer CPUs than the machine
has is one that ggml or the placement put there.
"""

import os
import subprocess

import pytest

from offgrid.engine.placement import Placement, set_process_priority, usable
from offgrid.flags import parse_args
from conftest import cache_dir
from rawhttp import children
from serverproc import ServerProcess

CPUS = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to place threads apart")
SCHED_OTHER, SCHED_BATCH = os.SCHED_OTHER, os.SCHED_BATCH


def threads_of(pid):
    """[(cpus, policy, nice)] of each thread of ``pid``."""
    out = []
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/status" % (pid, tid)) as fh:
                allowed = next(line.split(":")[1].strip() for line in fh
                               if line.startswith("Cpus_allowed_list:"))
            with open("/proc/%d/task/%s/stat" % (pid, tid)) as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, StopIteration):
            continue        # a thread that ended meanwhile
        cpus = set()
        for part in allowed.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        # stat's fields 19 (nice) and 41 (policy), counted from 3 after the name
        out.append((frozenset(cpus), int(fields[38]), int(fields[16])))
    return out


def served(srv, prompt="one two three four five six seven eight"):
    """A completion: a prompt batch (the batch pool) and single tokens (the generation's)."""
    status, _, body = srv.post("/completion", {"prompt": prompt, "n_predict": 4,
                                            "temperature": 0})
    assert status == 200, body
    return body


def worker(srv):
    (pid,) = children(srv.proc.pid)
    return pid


# -- the flags, as llama-server reads them --------------------------------------------


def test_a_mask_and_a_range_add_up_and_the_batch_takes_what_it_is_not_given():
    args = parse_args(["-m", "x.gguf", "-C", "0x1", "-Cr", "1-1", "--cpu-strict", "1",
                       "--prio", "-1", "--poll", "7", "--prio-batch", "2"])
    assert args.cpu_placement == {"cpus": [0, 1], "strict": True, "prio": -1, "poll": 7}
    assert args.cpu_placement_batch == {"cpus": [0, 1], "strict": True, "prio": 2, "poll": 7}
    args = parse_args(["-m", "x.gguf", "-Cb", "1", "--cpu-strict-batch", "1",
                       "--poll-batch", "0"])
    assert args.cpu_placement == {"cpus": [], "strict": False, "prio": 0, "poll": None}
    assert args.cpu_placement_batch == {"cpus": [0], "strict": True, "prio": 0, "poll": 0}


def test_ranges_open_at_either_end():
    assert parse_args(["-m", "x.gguf", "-Cr", "-0"]).cpu_placement["cpus"] == [0]
    # "LO-": to the last CPU this process may run on (llama-server's runs to 511)
    assert parse_args(["-m", "x.gguf", "-Crb", "0-"]).cpu_placement_batch["cpus"] == CPUS


@pytest.mark.parametrize("flags,says", [
    (["-C", "0xz1"], "argument -C/--cpu-mask: a hexadecimal CPU mask"),
    (["-C", "0"], "argument -C/--cpu-mask: mask 0 names no CPU"),
    (["-Cb", "0x%x" % (1 << 300)], "argument -Cb/--cpu-mask-batch: mask 0x1000"),
    (["-Cb", "1" + "0" * 128], "past 511, the most ggml can place"),
    (["-C", "0x%x" % (1 << len(CPUS))], "names CPU %d, which this machine" % len(CPUS)),
    (["-Cr", "3"], "argument -Cr/--cpu-range: a range of CPUs such as 0-3"),
    (["-Cr", "1-0"], "range 1-0 names no CPU"),
    (["-Crb", "0-512"], "range 0-512 goes past CPU 511"),
    (["-Cr", "0-%d" % len(CPUS)], "names CPU %d, which this machine" % len(CPUS)),
    (["--cpu-strict", "2"], "argument --cpu-strict: 0 or 1, 0 to 1, not '2'"),
    (["--prio", "4"], "argument --prio: a priority"),
    (["--prio-batch", "-2"], "argument --prio-batch: a priority"),
    (["--poll", "101"], "argument --poll: a polling level, 0 to 100"),
    (["--numa", "mirror"], "argument --numa: distribute, isolate or numactl"),
])
def test_what_ggml_cannot_do_is_refused_at_the_start_naming_the_flag(flags, says, capsys):
    with pytest.raises(SystemExit):
        parse_args(["-m", "x.gguf"] + flags)
    assert says in capsys.readouterr().err


def test_more_threads_than_the_mask_names_is_a_warning(capsys):
    parse_args(["-m", "x.gguf", "-t", "3", "-C", "0x1"])
    assert "-t 3: more threads than the 1 CPUs their mask names" in capsys.readouterr().err


def test_numa_reads_as_llama_servers_and_from_its_variable(monkeypatch):
    assert parse_args(["-m", "x.gguf"]).numa is None
    assert parse_args(["-m", "x.gguf", "--numa", ""]).numa == "distribute"
    monkeypatch.setenv("LLAMA_ARG_NUMA", "numactl")
    assert parse_args(["-m", "x.gguf"]).numa == "numactl"
    assert parse_args(["-m", "x.gguf", "--numa", "isolate"]).numa == "isolate"


def test_llama_server_takes_the_same_numa_values(tmp_path):
    # the pinned llama-server (scripts/build_lib.sh --server), where it was built
    built = sorted(cache_dir().glob("llama-server-*/bin/llama-server"))
    if not built:
        pytest.skip("the pinned llama-server is not built (scripts/build_lib.sh --server)")
    llama_server_bin = built[0]
    missing = str(tmp_path / "none.gguf")
    for value in ("distribute", "isolate", "numactl", "mirror"):
        out = subprocess.run([str(llama_server_bin), "-m", missing, "--numa", value],
                             capture_output=True, text=True, timeout=60)
        refused = "invalid value" in out.stderr
        assert refused == (value == "mirror"), (value, out.stderr[-500:])


# -- in the worker ---------------------------------------------------------------------


@needs_two
def test_generation_and_batch_threads_run_on_their_own_masks(plain_model_path):
    with ServerProcess(plain_model_path, "-tb", "2", "-C", "0x2", "-Cb", "0x1",
                       threads=2) as srv:
        served(srv)
        placed = [cpus for cpus, _, _ in threads_of(worker(srv))]
    # each pool's second thread, and the thread that led the last decode (the generation's)
    assert placed.count({1}) >= 2, placed
    assert placed.count({0}) >= 1, placed
    assert all(cpus in ({0}, {1}, set(CPUS)) for cpus in placed), placed


@needs_two
def test_strict_gives_each_thread_one_cpu_and_prio_sets_the_scheduling(plain_model_path):
    with ServerProcess(plain_model_path, "-Cr", "0-1", "--cpu-strict", "1", "--prio", "-1",
                       "--prio-batch", "0", threads=2) as srv:
        served(srv)
        pid = worker(srv)
        threads = threads_of(pid)
    # ggml's order: thread 1 on the mask's first CPU, thread 0 (the decode's caller) next
    assert (frozenset({0}), SCHED_BATCH) in [(c, p) for c, p, _ in threads], threads
    assert (frozenset({1}), SCHED_BATCH) in [(c, p) for c, p, _ in threads], threads
    # the batch pool's thread 1: the same CPU, its own (normal) priority
    assert (frozenset({0}), SCHED_OTHER) in [(c, p) for c, p, _ in threads], threads
    # --prio -1 is also llama-server's nice 5, for the threads made after the start
    assert all(nice == 5 for cpus, _, nice in threads if cpus != set(CPUS)), threads


def test_threads_keep_the_machine_without_placement(plain_model_path):
    with ServerProcess(plain_model_path, threads=2) as srv:
        served(srv)
        threads = threads_of(worker(srv))
    assert {(cpus, policy, nice) for cpus, policy, nice in threads} == {
        (frozenset(CPUS), SCHED_OTHER, 0)}


def test_numa_loads_and_serves(plain_model_path):
    # one node here: ggml finds it and changes nothing, as llama-server's would
    with ServerProcess(plain_model_path, "--numa", "isolate", threads=1) as srv:
        assert served(srv)["content"] is not None


# -- the pools ----------------------------------------------------------------------


def test_the_poll_reaches_the_pool_and_pools_are_told_apart_by_placement(lib):
    from offgrid.engine.session import shared_pool
    default = shared_pool(lib, 1)
    assert default.poll == 1, "offgrid's own poll, not ggml's 50"
    polled = shared_pool(lib, 1, Placement(poll=7))
    assert polled is not default and polled.poll == 7
    assert shared_pool(lib, 1, Placement(poll=7)) is polled
    placed = shared_pool(lib, 1, Placement(cpus=(CPUS[-1],), strict=True))
    assert placed.cpus == (CPUS[-1],) and placed.strict and placed.poll == 1


def test_real_time_priority_this_process_may_not_take_is_one_warning(monkeypatch, caplog):
    def refused(*a):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(os, "sched_setscheduler", refused)
    assert usable(Placement(prio=2), "--prio") == Placement(prio=0)
    assert "--prio 2: this process may not use real-time scheduling" in caplog.text
    assert usable(Placement(prio=-1), "--prio-batch") == Placement(prio=-1)
    monkeypatch.setattr(os, "setpriority", refused)
    set_process_priority(3)
    assert "--prio 3: could not set the worker's nice value to -20" in caplog.text


def test_auto_threads_stay_within_the_cpus_named():
    from offgrid.engine.threads import DecodeThreads, usable_cores
    threads = DecodeThreads(lambda n, placement: None,
                            placements=(Placement(cpus=(CPUS[0],)), Placement()))
    assert threads.generation.max_threads == 1
    assert threads.batch.max_threads == usable_cores()
