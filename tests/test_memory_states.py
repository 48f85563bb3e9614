"""Kept prompt states of every memory class: RAM, --cache-dir and slot files
restored give the live answer; and a state belongs to its model's weights.

Each architecture's tiny model (archmodels.py) on -np 1, two conversations
taking turns, against a fresh reference server (memclass.Fresh).
"""

import os

import pytest

import archmodels
from memclass import (CLASSES, answered, complete, fresh, reference_server, text,
                      tokens_of)
from serverproc import ServerProcess


@pytest.fixture(scope="module", params=sorted(CLASSES))
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def model(arch, tiny_dir):
    return archmodels.build(arch, tiny_dir)


@pytest.fixture(scope="module")
def reference(model):
    with reference_server(model, ctx=4096) as s:
        yield s


def test_a_kept_state_restored_goes_on_as_the_live_one(model, reference, arch, tmp_path):
    """-np 1 and two conversations taking turns: the first's state is kept in RAM
    when the second takes the session, and restored when it comes back (with
    its checkpoints, for a prompt that diverges inside it); after a restart,
    from --cache-dir; and from a slot file."""
    a, b = text(120, 6), text(120, 7)
    states, slots = tmp_path / "states", tmp_path / "slots"
    with ServerProcess(model, "--cache-dir", states, "--slot-save-path", slots,
                       ctx=4096) as srv:
        n_a = len(tokens_of(srv, a))
        held = answered(srv, a)
        complete(srv, b)
        a1 = held + tokens_of(srv, " " + text(8, 9))[1:]     # a chat's next turn
        again = complete(srv, a1)
        assert again["timings"]["cache_n"] == len(held) - 1  # restored, not re-evaluated
        assert again == fresh(reference, a1)
        if CLASSES[arch] in ("hybrid", "recurrent"):
            # a prompt that diverges inside the kept state: its checkpoints go with it
            complete(srv, b)
            a2 = a + " " + text(15, 8)
            again = complete(srv, a2)
            assert again["timings"]["cache_n"] >= n_a - 4
            assert again == fresh(reference, a2)
        held = answered(srv, a1)
        status, _, saved = srv.post("/slots/0?action=save", {"filename": "a.bin"})
        assert status == 200, saved
        complete(srv, b)
        status, _, restored = srv.post("/slots/0?action=restore", {"filename": "a.bin"})
        assert status == 200, restored
        assert restored["n_restored"] == len(held) - 1
        a3 = held + tokens_of(srv, " " + text(10, 9))[1:]
        body = complete(srv, a3)
        assert body["timings"]["cache_n"] == len(held) - 1
        assert body == fresh(reference, a3)
        held = answered(srv, a3)
    with ServerProcess(model, "--cache-dir", states, ctx=4096) as srv:
        a4 = held + tokens_of(srv, " " + text(12, 11))[1:]
        body = complete(srv, a4)
        assert body["timings"]["cache_n"] == len(held) - 1      # read back from disk
        assert body == fresh(reference, a4)


def test_two_models_alike_but_for_their_weights_never_share_a_state(tiny_dir, tmp_path):
    """Same size, same first MiB (metadata, tensor index), other weights: a state
    the first wrote to --cache-dir is never restored into the second."""
    first = archmodels.build("llama", tiny_dir)
    second = tmp_path / "second.gguf"
    data = bytearray(first.read_bytes())
    for i in range(len(data) - 4096, len(data) - 64, 97):    # tensor data, near the end
        data[i] ^= 0x5A
    second.write_bytes(bytes(data))
    assert os.path.getsize(second) == os.path.getsize(first)
    states = tmp_path / "states"
    prompt = text(100, 12)
    with ServerProcess(first, "--cache-dir", states, ctx=4096) as srv:
        complete(srv, prompt)
    with ServerProcess(first, "--cache-dir", states, ctx=4096) as srv:
        assert complete(srv, prompt)["timings"]["cache_n"] > 0      # its own state, back
    with ServerProcess(second, "--cache-dir", states, ctx=4096) as srv:
        assert complete(srv, prompt)["timings"]["cache_n"] == 0
