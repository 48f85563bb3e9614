"""llama-server's slot API: POST /slots/{id}?action=save|restore|erase (--slot-save-path).

A saved session's cache restores into any session of the model, and the
request after it evaluates only what differs, with the same greedy text.
File names stay inside the folder; a file that is not a slot file is a 400
and leaves the session empty and usable.
"""

import os

import pytest

from offgrid.engine import slotfile

try:
    from .serverproc import ServerProcess
except ImportError:
    from serverproc import ServerProcess

QWEN = "models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
SMOLLM = "models/smollm2-135m-instruct-q4_1.gguf"
PROMPT = "What is the capital of France? " + "Answer in one word, please. " * 6


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(tmp_path_factory.mktemp("slots"))


@pytest.fixture(scope="module")
def server(folder):
    with ServerProcess(QWEN, "-np", "2", "--slot-save-path", folder, "--cache-ram", "0") as s:
        yield s


def complete(server, prompt, id_slot):
    status, _, body = server.post("/completion", {
        "prompt": prompt, "id_slot": id_slot, "n_predict": 8, "temperature": 0,
        "cache_prompt": True})
    assert status == 200, body
    return body


def test_a_saved_slot_restores_into_another_with_the_same_text(server, folder):
    first = complete(server, PROMPT, 1)
    status, _, saved = server.post("/slots/1?action=save", {"filename": "france.bin"})
    assert status == 200, saved
    assert saved["id_slot"] == 1 and saved["filename"] == "france.bin"
    n = first["timings"]["prompt_n"] + first["tokens_predicted"] - 1
    assert saved["n_saved"] == n
    assert saved["n_written"] == os.path.getsize(os.path.join(folder, "france.bin"))
    assert saved["timings"]["save_ms"] >= 0
    # slot 0 holds something else first
    complete(server, "def main():\n    pass\n" * 5, 0)
    status, _, restored = server.post("/slots/0?action=restore", {"filename": "france.bin"})
    assert status == 200, restored
    assert restored["n_restored"] == n and restored["n_read"] == saved["n_written"]
    assert restored["timings"]["restore_ms"] >= 0
    again = complete(server, PROMPT, 0)
    assert again["timings"]["prompt_n"] == 1 and again["timings"]["cache_n"] == len(
        server.post("/tokenize", {"content": PROMPT, "add_special": True})[2]["tokens"]) - 1
    assert again["content"] == first["content"]


def test_erase_empties_the_slot(server):
    complete(server, PROMPT, 1)
    status, _, body = server.request("POST", "/slots/1?action=erase")
    assert status == 200 and body["id_slot"] == 1 and body["n_erased"] > 0
    assert complete(server, PROMPT, 1)["timings"]["cache_n"] == 0


@pytest.mark.parametrize("name", ["../outside.bin", "a/b.bin", "..", ".", "x.", " x",
                                  "a\\b", "c:d", "", "tab\there"])
def test_a_file_name_outside_the_folder_is_refused(server, name):
    for action in ("save", "restore"):
        status, _, body = server.post("/slots/0?action=%s" % action, {"filename": name})
        assert status == 400 and body["error"]["message"] == "Invalid filename", (name, body)


@pytest.mark.parametrize("path, message", [
    ("/slots/7?action=erase", "Invalid slot ID"),
    ("/slots/-1?action=erase", "Invalid slot ID"),
    ("/slots/one?action=erase", "Invalid slot ID"),
    ("/slots/0?action=frobnicate", "Invalid action"),
    ("/slots/0", "Invalid action"),
])
def test_a_bad_slot_or_action_is_a_400(server, path, message):
    status, _, body = server.request("POST", path)
    assert status == 400 and body["error"]["message"] == message
    assert body["error"]["type"] == "invalid_request_error"


def test_a_file_that_is_not_a_slot_file_is_a_400_and_leaves_the_slot_usable(server, folder):
    complete(server, PROMPT, 0)
    status, _, _ = server.post("/slots/0?action=save", {"filename": "good.bin"})
    assert status == 200
    good = open(os.path.join(folder, "good.bin"), "rb").read()
    broken = {
        "missing.bin": None,
        "short.bin": good[:10],
        "magic.bin": b"xxxx" + good[4:],
        "truncated.bin": good[:len(good) // 2],
        "tokens.bin": good[:12] + b"\x7f" * 64 + good[76:],
    }
    for name, data in broken.items():
        if data is not None:
            with open(os.path.join(folder, name), "wb") as f:
                f.write(data)
        status, _, body = server.post("/slots/0?action=restore", {"filename": name})
        assert status == 400, (name, body)
        assert body["error"]["message"].startswith("Unable to restore slot"), body
        # the slot is empty and works
        c = complete(server, PROMPT, 0)
        assert c["timings"]["cache_n"] == 0
    assert server.post("/slots/0?action=restore", {"filename": "good.bin"})[0] == 200


def test_without_a_slot_save_path_the_actions_are_refused():
    with ServerProcess(SMOLLM, "-c", "512") as s:
        for action in ("save", "restore", "erase"):
            status, _, body = s.post("/slots/0?action=%s" % action, {"filename": "x.bin"})
            assert status == 501
            assert body["error"]["message"] == ("This server does not support slots action. "
                                                "Start it with `--slot-save-path`")
            assert body["error"]["type"] == "not_supported_error"


def test_llama_servers_older_plain_token_list_is_read(tmp_path):
    """Older llama-servers wrote the tokens as a plain list, not the packed payload."""
    import struct
    tokens = [1, 2, 3]
    path = tmp_path / "old.bin"
    path.write_bytes(struct.pack("<III", slotfile.MAGIC, slotfile.VERSION, 3)
                     + struct.pack("<3i", *tokens) + b"STATE")
    got, state, n = slotfile.read(str(path), n_vocab=100)
    assert got == tokens and bytes(state) == slotfile.IO_HEADER + b"STATE"
    with pytest.raises(slotfile.SlotFileError, match="Invalid tokens"):
        slotfile.read(str(path), n_vocab=3)
