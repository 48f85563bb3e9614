"""FileTurns: the decode turn a server's workers share, and its hand-off.

Two FileTurns on one file stand for two workers (flock is per open file, so
they contend as two processes would).  A worker that has to wait marks the
file; the holder sees the mark as it lets go and calls on_handoff first,
where a worker puts its ggml threads to sleep (engine/session.pause_pools).
"""

import threading
import time

from offgrid.engine.worker import FileTurns


def _turns(tmp_path, log):
    path = tmp_path / "decode.lock"
    path.write_bytes(b"")
    return [FileTurns(str(path), on_handoff=lambda n=n: log.append("handoff " + n))
            for n in ("a", "b")], path


def test_a_turn_nobody_waits_for_hands_nothing_off(tmp_path):
    log = []
    (a, b), _ = _turns(tmp_path, log)
    for _ in range(3):
        with a:
            log.append("a")
        with b:
            log.append("b")
    assert log == ["a", "b"] * 3


def test_the_holder_hands_off_to_a_waiter_before_it_lets_go(tmp_path):
    log = []
    (a, b), path = _turns(tmp_path, log)

    def second():
        with b:
            log.append("b decodes")

    with a:
        log.append("a decodes")
        th = threading.Thread(target=second)
        th.start()
        deadline = time.monotonic() + 10
        while path.read_bytes()[:1] != FileTurns.WAITING:
            assert time.monotonic() < deadline, "the waiter never marked the file"
            time.sleep(0.01)
        assert log == ["a decodes"], "the waiter got the turn while it was held"
    th.join(10)
    assert log == ["a decodes", "handoff a", "b decodes"]
    # the mark was taken back: b's own turn, with nobody waiting, hands nothing off
    assert path.read_bytes()[:1] == FileTurns.FREE
    with b:
        pass
    assert log[-1] == "b decodes"
