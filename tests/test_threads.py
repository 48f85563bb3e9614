"""The adaptive thread count (engine/threads.py): its decisions on simulated
decode histories, and a real server that moves off a core a hog takes.

The simulations drive ThreadChoice with its own clock: each decode takes
1/rate seconds, where the rate depends on the thread count and on whether a
competing load runs, with the numbers measured on this 2-core machine with
llama-bench on gemma-3-270m (idle: 98 tok/s at -t 2, 55 at -t 1; with a
competing load of 1.5 cores: 1.29 at -t 2, 54 at -t 1).
"""

import random

from offgrid.engine.threads import ThreadChoice, shape_of

IDLE = {2: 98.0, 1: 55.0}
BUSY = {2: 1.29, 1: 54.0}


def simulate(rates_at, until, choice=None, n_tokens=1, seed=0):
    """Decode until simulated time ``until``; [(start, threads, settled count)]."""
    rng = random.Random(seed)
    choice = choice or ThreadChoice(2, now=0.0)
    now, log = 0.0, []
    while now < until:
        k = choice.choose(n_tokens, now)
        rate = rates_at(now)[k] * rng.uniform(0.95, 1.05)     # a few per cent of noise
        secs = n_tokens / rate
        log.append((now, k, choice.current(shape_of(n_tokens))))
        now += secs
        choice.observe(n_tokens, k, secs, now)
    return choice, log


def tokens_per_s(log, rates_at, t0, t1):
    """Tokens decoded per second of simulated time in [t0, t1)."""
    steps = [(t, k) for t, k, _ in log if t0 <= t < t1]
    return len(steps) / (t1 - t0)


def test_idle_machine_keeps_every_core():
    choice, log = simulate(lambda t: IDLE, 300.0)
    assert choice.switches == 0
    # routine down-probes lose after one decode: nearly every token at 2 threads
    at_two = sum(1 for _, k, _ in log if k == 2) / len(log)
    assert at_two > 0.999
    assert tokens_per_s(log, lambda t: IDLE, 0, 300) > 0.99 * IDLE[2]


def _hog_and_back(idle, busy, until):
    """A hog from 20 s to 80 s: down to 1 thread soon, near -t 1's speed while
    it runs, and back to both cores within 35 s of its end."""
    hog = (20.0, 80.0)

    def rates(t):
        return busy if hog[0] <= t < hog[1] else idle
    choice, log = simulate(rates, until)
    # down within a few seconds of the hog starting: 2 slow decodes (1.5 s) and a probe
    settled_one = [t for t, _, cur in log if t >= hog[0] and cur == 1]
    assert settled_one and settled_one[0] - hog[0] < 3.0
    # while it runs: at least 0.9 of what a pinned -t 1 would do (the goal is 0.8)
    busy_rate = tokens_per_s(log, rates, hog[0] + 3.0, hog[1])
    assert busy_rate > 0.9 * busy[1], busy_rate
    # back to both cores once it ends: the up-probes back off to 32 s at most
    back = [t for t, _, cur in log if t >= hog[1] and cur == 2]
    assert back and back[0] - hog[1] < 35.0, choice.snapshot()
    assert tokens_per_s(log, rates, hog[1] + 35.0, until) > 0.97 * idle[2]


def test_a_hog_moves_it_to_one_thread_and_back():
    _hog_and_back(IDLE, BUSY, 140.0)


# A machine whose second core adds little to a single token (measured with a
# real server on a 2-core EPYC VM: 93 tok/s at 1 thread, 104 at 2; 12 to 64 at
# 2 threads beside a hog): a 12% gain, under the 25% an up-probe needs to beat
# a contended count by
NARROW_IDLE = {2: 104.0, 1: 93.0}
NARROW_BUSY = {2: 12.0, 1: 88.0}


def test_a_small_gain_is_taken_back_once_the_hog_ends():
    # the up-probes that find the idle machine's speed at 2 threads win
    _hog_and_back(NARROW_IDLE, NARROW_BUSY, 160.0)


def test_a_small_gain_started_busy_is_found_once_the_machine_frees():
    """The best seen at 2 threads is the collapsed one; the first up-probe on
    the freed machine teaches it the real one, and a later probe switches."""
    def rates(t):
        return NARROW_BUSY if t < 20.0 else NARROW_IDLE
    choice, log = simulate(rates, 140.0)
    assert [t for t, _, cur in log if t < 20.0 and cur == 1]
    back = [t for t, _, cur in log if t >= 20.0 and cur == 2]
    assert back and back[0] - 20.0 < 70.0, choice.snapshot()


def test_lucky_decodes_beside_a_hog_seldom_win_an_up_probe():
    """Now and then a decode at 2 threads beside a hog runs near the idle
    speed (here 3 in 10, more than seen): a probe wins on the idle machine's
    speed only when all three of its decodes do, and a wrong switch up costs
    two slow decodes before a probe takes it down again."""
    for seed in range(8):
        rng = random.Random(seed)

        def rates(t):
            if t < 20.0:
                return NARROW_IDLE
            return {2: 100.0 if rng.random() < 0.3 else 12.0, 1: 88.0}
        choice, log = simulate(rates, 200.0, seed=seed)
        assert choice.switches <= 5, (seed, choice.snapshot())  # down, then two round trips
        assert tokens_per_s(log, rates, 25.0, 200.0) > 0.98 * 88.0


# This 2-core Xeon VM, from a real server's decodes under the real-hog test
# below: 45 tok/s at 2 threads and 30 at 1 when idle; beside the hog one thread
# runs at 25-29 and two at 23-31, bar one decode in eight that is descheduled
# (5-7 tok/s).  Two threads are then as fast as one, with a wider spread.
XEON_IDLE = {2: 45.0, 1: 30.0}


def test_two_threads_as_fast_as_one_beside_a_hog_do_not_win_an_up_probe():
    """Started beside the hog, so the best seen at 2 threads is a lucky
    contended decode a little above 1 thread's: an up-probe whose decodes all
    beat the current count then wins by _free_again, about one probe in ten
    with three decodes.  Once the hog ends the probes win on the real speed."""
    false_ups = 0
    for seed in range(20):
        rng = random.Random(seed)

        def rates(t):
            if t >= 60.0:
                return XEON_IDLE
            return {2: 6.0 if rng.random() < 0.12 else 27.5 * rng.uniform(0.85, 1.13), 1: 27.5}
        choice, log = simulate(rates, 120.0, seed=seed)
        false_ups += sum(1 for (_, _, cur), (t, _, cur2) in zip(log, log[1:])
                         if cur2 > cur and t < 60.0)
        back = [t for t, _, cur in log if t >= 60.0 and cur == 2]
        assert back and back[0] - 60.0 < 35.0, (seed, choice.snapshot())
    assert false_ups <= 1, false_ups


def test_started_on_a_busy_machine():
    """Its first 'best' at 2 threads is the collapsed one; the early down-probe finds 1."""
    choice, log = simulate(lambda t: BUSY, 60.0)
    settled = [t for t, _, cur in log if cur == 1]
    assert settled and settled[0] < 5.0
    assert tokens_per_s(log, lambda t: BUSY, 5.0, 60.0) > 0.8 * BUSY[1]


def test_a_machine_that_gets_slower_all_over_does_not_flap():
    """Both counts 3x slower (a VM's neighbours): fewer threads do not help, so stay."""
    def rates(t):
        return IDLE if t < 30 else {k: r / 3 for k, r in IDLE.items()}
    choice, log = simulate(rates, 200.0)
    assert choice.current() == 2
    assert choice.switches == 0
    at_one = sum(1 for t, k, _ in log if t >= 30 and k == 1)
    assert at_one < 10      # a probe's single decode each time, then none


def test_fixed_count_never_changes():
    choice, log = simulate(lambda t: BUSY, 30.0, choice=ThreadChoice(2, fixed=True))
    assert {k for _, k, _ in log} == {2}
    assert choice.switches == 0


def test_batches_choose_apart_from_single_tokens():
    """A prompt batch that scales with threads keeps them while single tokens do not."""
    choice = ThreadChoice(2, now=0.0)
    # single tokens: 1 thread is faster (say, memory-bound and a busy sibling core)
    _, _ = simulate(lambda t: {2: 20.0, 1: 50.0}, 20.0, choice=choice)
    # 512-token batches: 2 threads twice as fast
    _, log = simulate(lambda t: {2: 1000.0, 1: 520.0}, 60.0, choice=choice, n_tokens=512)
    assert choice.current(shape_of(1)) == 1
    assert choice.current(shape_of(512)) == 2
    snap = choice.snapshot()
    assert snap["generation"] == 1 and snap["batch"] == 2 and snap["mode"] == "auto"


# -- a real server under a real hog ------------------------------------------

import os           # noqa: E402
import re           # noqa: E402
import statistics   # noqa: E402
import subprocess   # noqa: E402
import sys          # noqa: E402
import threading    # noqa: E402
import time         # noqa: E402

import pytest       # noqa: E402

from offgrid.engine.threads import usable_cores   # noqa: E402

try:
    from .rawhttp import children
    from .serverproc import ServerProcess
except ImportError:  # tests/ is on sys.path rather than a package
    from rawhttp import children
    from serverproc import ServerProcess

HOG = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end:\n    pass\n"


class OtherLoad:
    """Cores used by everything but the server's process tree and this one, since creation."""

    def __init__(self, pid):
        self.pid = pid
        self.start = self._sample()

    def _tree(self):
        total = 0
        for pid in [self.pid] + children(self.pid):
            try:
                with open("/proc/%d/stat" % pid) as f:
                    rest = f.read().rsplit(")", 1)[1].split()
                total += int(rest[11]) + int(rest[12])
            except (OSError, ValueError, IndexError):
                pass
        return total

    def _sample(self):
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        busy = sum(fields[i] for i in (0, 1, 2, 5, 6, 7) if i < len(fields))
        me = os.times()
        hz = os.sysconf("SC_CLK_TCK")
        return time.monotonic(), busy / hz, self._tree() / hz, me.user + me.system

    def cores(self):
        t1, b1, s1, m1 = self._sample()
        t0, b0, s0, m0 = self.start
        return max(0.0, ((b1 - b0) - (s1 - s0) - (m1 - m0)) / max(t1 - t0, 1e-9))


def _wait_for(server, want, timeout, context=None):
    """Poll /props until its generation thread count is ``want``; the counts seen.
    ``context``: a callable whose words a failure adds (what else went on)."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, _, props = server.get("/props")
        assert status == 200
        seen.append(props["threads"]["generation"])
        if seen[-1] == want:
            return seen
        time.sleep(0.5)
    pytest.fail("threads never reached %d in %.0f s: %d polls, the last %s%s" % (
        want, timeout, len(seen), seen[-10:], "; " + context() if context else ""))


@pytest.mark.slow
@pytest.mark.serial     # another test's server beside it would be a second hog
@pytest.mark.skipif(usable_cores() < 2, reason="needs two cores to give one away")
def test_server_gives_a_busy_core_back_and_takes_it_again(gemma_path):
    cores = usable_cores()
    stop = threading.Event()
    # -v: the worker logs each switch and each losing up-probe, for a failure's message
    with _NicedServer(gemma_path, "-v", threads="auto", ctx=1024) as server:
        status, _, props = server.get("/props")
        assert props["threads"]["mode"] == "auto"
        assert props["threads"]["generation"] == cores

        def generate():
            while not stop.is_set():
                try:
                    server.post("/completion", {"prompt": "Once upon a time", "n_predict": 48,
                                                "ignore_eos": True, "temperature": 0,
                                                "cache_prompt": False})
                except OSError:
                    return      # the server is stopping: the test is over
        gen = threading.Thread(target=generate, daemon=True)
        gen.start()
        try:
            # the idle machine's speed first: a count's best learned beside the
            # hog is its collapsed speed, and coming back up then takes a probe
            # more (test_a_small_gain_started_busy_is_found_once_the_machine_frees)
            # (where one thread fewer runs as fast here, a routine down-probe
            # may already have taken it: the hog then holds it there)
            _wait_decodes(server, 100)
            back = _busy_and_free(server, cores)
        finally:
            stop.set()
            gen.join(timeout=120)
        m = server.metrics()
        switches = m['offgrid_thread_switches_total{model="%s"}' % os.path.basename(str(gemma_path))]
        assert switches >= (2 if back == cores else 1)
        status, _, slots = server.get("/slots")
        assert slots[0]["n_threads"] == back


class _NicedServer(ServerProcess):
    """The server at nice 5, so the hog (nice 0) holds its core.  At equal
    priority some hosts' schedulers let ggml's woken thread preempt the hog
    (CI's 2-core VM, 2026-12-06: an up-probe beside the hog won and two
    threads then ran on at over 60% of their idle best), and there switching
    up is right: the test needs a core that is taken.  Alone on the machine
    once the hog ends, the nice value changes nothing."""

    def launch(self):
        argv, cwd, env = super().launch()
        return ["nice", "-n", "5"] + argv, cwd, env


def _busy_and_free(server, cores):
    """A hog on all cores but one: down to cores - 1, and back once the hog ends."""
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(cores - 1)]
    try:
        _wait_for(server, cores - 1, timeout=30)
        # and it stays there while the hog runs: up-probes lose and back off
        held = []
        for _ in range(10):
            time.sleep(0.5)
            held.append(server.get("/props")[2]["threads"]["generation"])
        assert held.count(cores - 1) >= 8, "counts beside the hog %s; the worker's thread log:\n%s" % (
            held, _thread_log(server))
    finally:
        for p in hogs:
            p.kill()
            p.wait()
    # the cores are free again: an up-probe finds them (probes back off to 32 s),
    # or, where the freed core buys less than an up-probe must win by, a probe
    # of full length whose decodes ran about as fast as one thread fewer (not
    # collapsed, as beside a hog) rightly keeps the count: seen on this EPYC VM
    # with gemma, 82-88 tok/s at 1 thread against 83-92 at 2.  Another program
    # that keeps a core busy meanwhile makes staying down right and this test
    # fail, not skip: its message says how busy the machine was.
    others = OtherLoad(server.proc.pid)
    mark = len(server.output)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.get("/props")[2]["threads"]["generation"] == cores:
            return cores
        if any(_fair_loss(line) for line in server.output[mark:]):
            return cores - 1
        time.sleep(0.5)
    pytest.fail("threads never reached %d in 60 s, and no up-probe ran as fast as the "
                "count it tried to leave: other programs kept %.1f cores busy after the hog "
                "ended; the worker's thread log:\n%s"
                % (cores, others.cores(), _thread_log(server)))


def _thread_log(server):
    """The worker's -v lines on thread switches and losing up-probes, the last 4,000 characters."""
    return "".join(line for line in server.output if "threads:" in line)[-4000:]


_LOSS = re.compile(r"threads: \d+ lost to \d+ \(([\d., ]+) vs ([\d.]+) tokens/s")


def _fair_loss(line):
    """A logged up-probe that lost over its whole length at about the current
    count's speed: the more threads are free but add less than the margin."""
    m = _LOSS.search(line)
    if not m:
        return False
    rates = [float(r) for r in m.group(1).split(",")]
    base = float(m.group(2))
    return (len(rates) >= ThreadChoice.probe_len
            and 0.8 * base <= statistics.median(rates) <= ThreadChoice.win_up * base)


def _wait_decodes(server, n, timeout=60):
    """Until the server has generated n tokens."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = server.metrics()
        if sum(v for k, v in m.items() if k.startswith("llamacpp:tokens_predicted_total")) >= n:
            return
        time.sleep(0.2)
    pytest.fail("fewer than %d tokens generated in %d s" % (n, timeout))


def test_large_batches_are_not_probed_on_an_idle_machine():
    """A 512-token batch at half the threads costs as much as a short request:
    large shapes probe down only when they run slow (or a small shape found
    the machine busy), never as routine."""
    choice, log = simulate(lambda t: {2: 1000.0, 1: 520.0}, 300.0, n_tokens=512)
    assert {k for _, k, _ in log} == {2}
    # single tokens on the same choice do run their cheap routine probes
    _, log1 = simulate(lambda t: IDLE, 130.0, choice=ThreadChoice(2, now=0.0))
    assert 1 in {k for _, k, _ in log1}
