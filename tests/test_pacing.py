"""StreamPacer (engine/pacing.py) on a fake clock, and burst.gathered (server/httpd/burst.py)."""

from offgrid.engine.pacing import StreamPacer
from offgrid.server.httpd import burst


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_pieces_faster_than_the_interval_go_out_together_in_order():
    clock, writes = Clock(), []
    pacer = StreamPacer(writes.append, 0.025, clock)
    pacer.send("a")                 # the first goes at once
    for name in "bcd":
        clock.t += 0.010
        pacer.send(name)            # b, c held; d comes 30 ms after a
    assert writes == [["a"], ["b", "c", "d"]]
    clock.t += 0.005
    pacer.send("e")
    pacer.flush()                   # the end of the stream
    pacer.flush()                   # nothing left: no empty write
    assert writes == [["a"], ["b", "c", "d"], ["e"]]


def test_slow_pieces_and_urgent_frames_are_not_held():
    clock, writes = Clock(), []
    pacer = StreamPacer(writes.append, 0.025, clock)
    for name in "abc":
        pacer.send(name)
        clock.t += 0.040            # a slow model: each piece on its own
    pacer.send("p", now=True)       # a prompt progress report: with what is held, now
    assert writes == [["a"], ["b"], ["c"], ["p"]]
    zero = StreamPacer(writes.append, 0.0, clock)
    zero.send("x")
    zero.send("y")                  # same instant, interval 0: no holding
    assert writes[-2:] == [["x"], ["y"]]


def test_a_burst_writes_each_stream_once_at_its_end():
    out_a, out_b = [], []

    def write_a(data):
        out_a.append(data)
        return True

    def write_b(data):
        out_b.append(data)
        return True
    assert burst.write(write_a, b"0") is True and out_a == [b"0"]     # no burst: at once
    with burst.gathered():
        burst.write(write_a, b"1")
        burst.write(write_b, b"x")
        with burst.gathered():      # nested: the outer one writes
            burst.write(write_a, b"2")
        assert out_a == [b"0"] and out_b == []
    assert out_a == [b"0", b"12"] and out_b == [b"x"]


def test_a_paced_stream_carries_the_same_events(gemma_path):
    """Default pacing and --stream-interval-ms 0: the same events, one per token, in order."""
    import json
    try:
        from .serverproc import ServerProcess
    except ImportError:
        from serverproc import ServerProcess
    body = {"prompt": "Once upon a time", "n_predict": 40, "ignore_eos": True,
            "temperature": 0, "stream": True, "cache_prompt": False}
    seen = []
    for args in ((), ("--stream-interval-ms", "0")):
        with ServerProcess(gemma_path, *args) as server:
            c = server.conn()
            c.request("POST", "/completion", body=json.dumps(body),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            events = [json.loads(line[6:]) for line in r.read().decode().splitlines()
                      if line.startswith("data: ")]
            c.close()
        pieces = [(e["content"], e["tokens_predicted"]) for e in events if not e["stop"]]
        assert [n for _, n in pieces] == list(range(1, 41))
        assert events[-1]["stop"] and events[-1]["tokens_predicted"] == 40
        seen.append(pieces)
    assert seen[0] == seen[1]
