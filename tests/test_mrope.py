"""Images placed by M-RoPE positions (Qwen2-VL and its kin), over HTTP, against libmtmd's own helper.

A Qwen2-VL projector (``qwen2vl_merger``) places an image of r x c tokens by
row and column, all at one temporal position, and the text after it goes on
max(r, c) positions later: fewer positions than tokens.  The model is a tiny
``qwen2vl`` text model built by libllama (tests/archmodels.py) with the real
Qwen2 vocabulary, the projector tests/mmproj.py's (every token of a plain
red image is the embedding of " red", exactly).

The reference is what libmtmd itself does with the same files: its helper
``mtmd_helper_eval_chunks`` decodes the prompt's chunks (text, then the image
at its M-RoPE positions, then text at n_past + n_pos) into a context made
here, and a greedy loop goes on from there.  offgrid's answer over HTTP must
be that text, token for token; a second turn about the same image (its cache
reused) must answer as a cold one, and another image at the same place must
not reuse it.  The same holds for Qwen2.5-VL's projector (window attention in
its tower), for Qwen3-VL's (interleaved M-RoPE, deepstack embeddings twice the
text model's width) on a tiny qwen3vl model, for a prompt that comes back from a kept state or a slot file (in
a server started later), and for speculative drafts taken back after an image.
"""

import base64
import ctypes
import os
import struct
from array import array

import pytest

from offgrid import libllama, libmtmd
from offgrid.engine.model import Model
from offgrid.engine.positions import IDENTITY, Positions

try:
    from . import archmodels, mmproj
    from .serverproc import TEST_THREADS, ServerProcess
except ImportError:  # tests/ on sys.path
    import archmodels
    import mmproj
    from serverproc import TEST_THREADS, ServerProcess

MARKER = "<__media__>"
WORDS = (" red", " green", " blue", " black")
N = 8
MIN_TOKENS = 1          # --image-min-tokens: a 4 x 4 image is one token (libmtmd's
                        # Qwen default is 8 at least)
WIDE = mmproj.png((255, 0, 0), 16, 8)       # 4 x 2 tokens: 8 tokens, 4 positions
SQUARE = mmproj.png((255, 0, 0), 8, 8)      # 2 x 2 tokens: 4 tokens, 2 positions
BLUE_WIDE = mmproj.png((0, 0, 255), 16, 8)


def uri(png):
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def qwen_path(tiny_dir):
    return archmodels.build("qwen2vl", tiny_dir, vocab="qwen2")


@pytest.fixture(scope="module")
def model(qwen_path):
    m = Model.load(str(qwen_path), progress=False)
    yield m
    m.close()


@pytest.fixture(scope="module")
def colour_tokens(model):
    out = []
    for w in WORDS:
        ids = model.tokenize(w, add_special=False)
        assert len(ids) == 1, (w, ids)
        out += ids
    return out


@pytest.fixture(scope="module")
def projector(tiny_dir, qwen_path, colour_tokens):
    return mmproj.write_qwen2vl(tiny_dir, qwen_path, colour_tokens)


@pytest.fixture(scope="module")
def slots(tmp_path_factory):
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def srv(qwen_path, projector, slots):
    with ServerProcess(qwen_path, "--mmproj", projector, "--image-min-tokens", MIN_TOKENS,
                       "--slot-save-path", slots, ctx=512) as s:
        yield s


@pytest.fixture(scope="module")
def projector25(tiny_dir, qwen_path, colour_tokens):
    """Qwen2.5-VL's projector (its colours' tokens in another order)."""
    return mmproj.write_qwen2vl(tiny_dir, qwen_path, colour_tokens[::-1], "qwen2.5vl_merger")


@pytest.fixture(scope="module")
def other(qwen_path, projector25, slots):
    """A server of the same model with Qwen2.5-VL's projector, which takes at most 6
    tokens an image, and drafts from the request's own text (--spec-type
    ngram-simple)."""
    with ServerProcess(qwen_path, "--mmproj", projector25, "--image-min-tokens", 1,
                       "--image-max-tokens", 6, "--slot-save-path", slots,
                       "--spec-type", "ngram-simple", ctx=256) as s:
        yield s


class Helper:
    """libmtmd's own way: mtmd_helper_eval_chunks into a context of one sequence, then
    a greedy loop (test-only ctypes: offgrid binds no eval_chunks)."""

    def __init__(self, model, projector, max_tokens=-1):
        self.model = model
        self.mtmd = libmtmd.MtmdContext(libmtmd.load(), projector, model.handle.ptr,
                                        n_threads=TEST_THREADS, use_gpu=False,
                                        image_min_tokens=MIN_TOKENS,
                                        image_max_tokens=max_tokens)
        assert self.mtmd.mrope
        self.ctx = libllama.ContextHandle(model.lib, model.handle, 512, 64, 64, TEST_THREADS,
                                          TEST_THREADS)
        lib = ctypes.CDLL(libmtmd.load().path)
        self.eval_chunks = lib.mtmd_helper_eval_chunks
        self.eval_chunks.restype = ctypes.c_int32
        self.eval_chunks.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                                     ctypes.c_bool, ctypes.POINTER(ctypes.c_int32)]

    def tokens(self, prompt, images, n=N):
        """The greedy token ids after ``prompt`` (its markers standing for ``images``),
        and the position the text after the prompt starts at."""
        self.ctx.memory.seq_rm(-1, -1, -1)
        bitmaps = [self.mtmd.bitmap(png, "k%d" % i) for i, png in enumerate(images)]
        chunks = self.mtmd.tokenize(prompt, bitmaps, True, True)
        try:
            n_past = ctypes.c_int32(0)
            assert self.eval_chunks(self.mtmd.ptr, self.ctx.ptr, chunks.ptr, 0, 0, 64, True,
                                    ctypes.byref(n_past)) == 0
        finally:
            chunks.close()
            for b in bitmaps:
                b.close()
        start, pos, out = n_past.value, n_past.value, []
        n_vocab = self.model.n_vocab
        for _ in range(n):
            logits = array("f", ctypes.string_at(self.ctx.logits(-1), 4 * n_vocab))
            token = max(range(n_vocab), key=logits.__getitem__)
            out.append(token)
            assert self.ctx.decode_parts([([token], pos, (0,), self.ctx.OUT_LAST)]) == 0
            pos += 1
        return out, start

    def text(self, prompt, images, n=N):
        ids, _ = self.tokens(prompt, images, n)
        return b"".join(self.model.token_bytes(t) for t in ids).decode("utf-8", "replace")

    def close(self):
        self.ctx.close()
        self.mtmd.close()


@pytest.fixture(scope="module")
def helper(model, projector):
    h = Helper(model, projector)
    yield h
    h.close()


def complete(srv, prompt, png, n=N, **extra):
    st, _, out = srv.post("/completion", dict({
        "prompt": {"prompt_string": prompt, "multimodal_data": [base64.b64encode(png).decode()]},
        "n_predict": n, "temperature": 0, "return_tokens": True}, **extra))
    assert st == 200, out
    return out


def test_positions_of_tokens_around_m_rope_images():
    # text 0..2, an image of 8 tokens (3..10) in 4 positions, text, another image
    # of 4 tokens (13..16) in 2 positions, text: what libmtmd's helper makes
    p = Positions([(3, 11, 4), (13, 17, 2)])
    assert [p.at(i) for i in range(20)] == [0, 1, 2] + [3] * 8 + [7, 8] + [9] * 4 + [11, 12, 13]
    assert p.last(0) == -1 and p.last(3) == 2 and p.last(11) == 3 and p.last(13) == 8
    assert p.index(13, 18) == 19 and p.index(8, 11) == 12
    assert not IDENTITY and IDENTITY.at(5) == 5 and IDENTITY.last(5) == 4


def test_the_projector_makes_a_red_image_tokens_of_red_at_fewer_positions(model, projector,
                                                                         colour_tokens):
    ctx = libmtmd.MtmdContext(libmtmd.load(), projector, model.handle.ptr,
                              n_threads=TEST_THREADS, use_gpu=False,
                              image_min_tokens=MIN_TOKENS)
    try:
        bm = ctx.bitmap(WIDE, "wide")
        chunks = ctx.tokenize("Look: " + MARKER + " it is", [bm], True, True)
        bm.close()
        (kind, _, n_tokens, n_pos, ptr), = [c for c in chunks.items() if c[0] != "text"]
        assert (kind, n_tokens, n_pos) == ("image", 8, 4)
        embd = ctx.encode(ptr, n_tokens, model.n_embd)
        chunks.close()
    finally:
        ctx.close()
    _, rows = mmproj.token_embeddings(model.path, colour_tokens[:1])
    assert embd == struct.pack("<%df" % len(rows[0]), *rows[0]) * 8


def test_completion_with_an_image_of_fewer_positions_than_tokens_equals_libmtmds(srv, helper):
    prompt = "Look at this: " + MARKER + " The colour of it is"
    # 4 x 2 tokens in 4 positions, 2 x 2 in 2: the text after them that much nearer
    for png, lag in ((WIDE, 4), (SQUARE, 2)):
        want, n_past = helper.tokens(prompt, [png])
        out = complete(srv, prompt, png, cache_prompt=False)
        assert out["tokens"] == want
        assert out["tokens_evaluated"] - n_past == lag


def test_the_positions_matter_so_the_comparison_can_fail(helper, model):
    # the same tokens of red, one position each (a one-token image per token),
    # give another text: an engine that put the image's tokens one a position
    # would not pass the test above
    red_one = mmproj.png((255, 0, 0), 4, 4)
    prompt = "Look at this: " + MARKER + " The colour of it is"
    wide = helper.tokens(prompt, [WIDE])[0]
    assert helper.tokens(prompt.replace(MARKER, MARKER * 8), [red_one] * 8)[0] != wide


def test_openai_chat_image_url_equals_libmtmds_answer(srv, helper):
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "What colour is this?"},
        {"type": "image_url", "image_url": {"url": uri(WIDE)}}]}]
    st, _, out = srv.post("/v1/chat/completions", {"messages": messages, "max_tokens": N,
                                                   "temperature": 0, "cache_prompt": False})
    assert st == 200, out
    st, _, rendered = srv.post("/apply-template", {"messages": messages})
    assert st == 200, rendered
    assert out["choices"][0]["message"]["content"] == helper.text(rendered["prompt"], [WIDE])


def test_anthropic_image_equals_libmtmds_answer(srv, helper):
    st, _, out = srv.post("/v1/messages", {"model": "x", "max_tokens": N, "temperature": 0,
                                           "messages": [{"role": "user", "content": [
                                               {"type": "text", "text": "What colour is this?"},
                                               {"type": "image", "source": {
                                                   "type": "base64", "media_type": "image/png",
                                                   "data": base64.b64encode(SQUARE).decode()}}]}]})
    assert st == 200, out
    st, _, rendered = srv.post("/apply-template", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What colour is this?"},
        {"type": "image_url", "image_url": {"url": uri(SQUARE)}}]}]})
    assert st == 200, rendered
    assert out["content"][0]["text"] == helper.text(rendered["prompt"], [SQUARE])


def test_a_second_turn_reuses_the_image_and_answers_as_a_cold_one(srv):
    prompt = "Look at this: " + MARKER + " The colour of it is"
    first = complete(srv, prompt, WIDE, id_slot=0)
    turn2 = prompt + first["content"] + ". And its shape is"
    warm = complete(srv, turn2, WIDE, id_slot=0)
    # the first prompt's image and text came from the cache (all but its last
    # token's logits: the answer's first token follows it)
    assert warm["timings"]["cache_n"] >= first["tokens_evaluated"]
    cold = complete(srv, turn2, WIDE, id_slot=0, cache_prompt=False)
    assert warm["tokens"] == cold["tokens"]
    # and once more from the cache, after the cold one
    assert complete(srv, turn2, WIDE, id_slot=0)["tokens"] == cold["tokens"]


def test_a_kept_state_of_an_image_prompt_comes_back_at_its_positions(srv):
    # the slot's cache goes to another prompt (the image prompt kept as a state,
    # --cache-ram), then the image prompt comes back: restored, its cells checked
    # at the image's positions, and the answer a cold one's
    prompt = ("Here is a long description of a picture, written so that the prompt "
              "is worth keeping: " + MARKER + " The colour of it is")
    first = complete(srv, prompt, WIDE, id_slot=0, n=2)
    st, _, other = srv.post("/completion", {
        "prompt": "Something else entirely, with no picture in it at all: a list of "
                  "numbers, one two three four five six seven eight nine ten eleven.",
        "n_predict": 2, "temperature": 0, "id_slot": 0})
    assert st == 200, other
    back = complete(srv, prompt, WIDE, id_slot=0)
    assert back["timings"]["cache_n"] == first["tokens_evaluated"] - 1
    assert back["tokens"] == complete(srv, prompt, WIDE, id_slot=0,
                                      cache_prompt=False)["tokens"]


def test_another_image_at_the_same_place_is_not_reused(srv, helper):
    prompt = "Look at this: " + MARKER + " The colour of it is"
    complete(srv, prompt, WIDE, id_slot=0)
    red = complete(srv, prompt, WIDE, id_slot=0)
    blue = complete(srv, prompt, BLUE_WIDE, id_slot=0)
    # the text before the image, as libmtmd splits it (ending in "<|vision_start|>")
    bm = helper.mtmd.bitmap(BLUE_WIDE, "blue")
    chunks = helper.mtmd.tokenize(prompt, [bm], True, True)
    n_before = chunks.items()[0][2]
    chunks.close()
    bm.close()
    assert red["timings"]["cache_n"] > n_before + 8     # red after red: image and all
    assert blue["timings"]["cache_n"] == n_before       # the text before the image only
    assert blue["tokens"] != red["tokens"]
    assert blue["tokens"] == complete(srv, prompt, BLUE_WIDE, id_slot=0,
                                      cache_prompt=False)["tokens"]


def test_a_one_token_image_answers_as_its_token(srv, colour_tokens):
    # a 4 x 4 image is one token at one position: the token " red" itself, so the
    # prompt answers as the same text with " red" in the image's place (libmtmd
    # wraps an image in <|vision_start|> ... <|vision_end|>, tokenized apart from the
    # text before it: text of its own here)
    prompt = "Look at this: " + MARKER + " The colour of it is"
    out = complete(srv, prompt, mmproj.png((255, 0, 0), 4, 4), cache_prompt=False)
    before, after = prompt.split(MARKER)
    st, _, ref = srv.post("/completion", {
        "prompt": [before, "<|vision_start|>", colour_tokens[0], "<|vision_end|>" + after],
        "n_predict": N, "temperature": 0, "cache_prompt": False, "return_tokens": True})
    assert st == 200, ref
    assert out["tokens"] == ref["tokens"]
    assert out["tokens_evaluated"] == ref["tokens_evaluated"]


def test_props_say_keys_are_not_moved_for_m_rope_images(srv):
    st, _, props = srv.get("/props")
    assert st == 200, props
    memory = props["memory"]
    assert memory["mrope_media"] is True and memory["chunk_reuse"] is False
    assert "M-RoPE" in memory["description"]


def test_image_max_tokens_bounds_an_images_token_count(srv, other):
    # Qwen's dynamic resolution: the token count follows --image-min/max-tokens.
    # srv takes a 16 x 8 image as 4 x 2 tokens (and, with --image-min-tokens 1, a
    # 4 x 4 one as one token: test_a_one_token_image_answers_as_its_token); other
    # at most 6: 3 x 1 tokens of 16 x 12 pixels (libmtmd's smart resize)
    prompt = "See " + MARKER + " here"
    eight = complete(srv, prompt, WIDE, n=1)["tokens_evaluated"]
    three = complete(other, prompt, WIDE, n=1)["tokens_evaluated"]
    assert eight - three == 5


def test_a_slot_file_with_an_image_restores_where_its_projector_is_and_only_there(
        srv, other, qwen_path, projector, slots):
    prompt = "Look at this: " + MARKER + " The colour of it is"
    first = complete(srv, prompt, WIDE, id_slot=0, cache_prompt=False)
    assert srv.post("/slots/0?action=save", {"filename": "wide.bin"})[0] == 200
    # a server started later knows the image's positions from the file alone
    with ServerProcess(qwen_path, "--mmproj", projector, "--image-min-tokens", MIN_TOKENS,
                       "--slot-save-path", slots, ctx=512) as fresh:
        st, _, out = fresh.post("/slots/0?action=restore", {"filename": "wide.bin"})
        assert st == 200, out
        again = complete(fresh, prompt, WIDE, id_slot=0)
    assert again["timings"]["cache_n"] == first["tokens_evaluated"] - 1
    assert again["tokens"] == first["tokens"]
    # the same picture's cells from another projector: refused, saying why
    st, _, out = other.post("/slots/0?action=restore", {"filename": "wide.bin"})
    assert st == 400 and "mmproj" in out["error"]["message"], out


def test_drafts_after_an_image_are_checked_and_taken_back_at_its_positions(other):
    # the tiny model repeats itself, so drafts from its own text come, and some
    # are wrong: each wrong one is cut at its position, which an image of 2 x 2
    # tokens in 2 positions puts 2 before its index
    prompt = "Look at this: " + MARKER + " The colour of it is"
    drafted = complete(other, prompt, SQUARE, n=24, cache_prompt=False)
    plain = complete(other, prompt, SQUARE, n=24, cache_prompt=False,
                     **{"speculative.n_max": 0})
    assert drafted["tokens"] == plain["tokens"]
    timings = drafted["timings"]
    assert timings.get("draft_n", 0) > timings.get("draft_n_accepted", 0), timings


def test_qwen25_vls_projector_answers_as_libmtmds_helper(other, model, projector25):
    # the projector the issue names: window attention and RMS norms in the vision
    # tower, the same M-RoPE placement in the text model
    h = Helper(model, projector25, max_tokens=6)
    try:
        prompt = "Look at this: " + MARKER + " The colour of it is"
        # 2 x 2 tokens in 2 positions; 3 x 1 (at most 6 tokens here) in 3
        for png, lag in ((SQUARE, 2), (BLUE_WIDE, 0)):
            want, n_past = h.tokens(prompt, [png])
            out = complete(other, prompt, png, cache_prompt=False,
                           **{"speculative.n_max": 0})
            assert out["tokens"] == want
            assert out["tokens_evaluated"] - n_past == lag
    finally:
        h.close()


def test_qwen3_vls_deepstack_projector_answers_as_libmtmds_helper(tiny_dir, colour_tokens):
    # Qwen3-VL: interleaved M-RoPE, and an image's embedding twice the text
    # model's width (its second half feeds the first layer: deepstack), which
    # libmtmd's helper reads as llama_model_n_embd_inp floats a token
    path = archmodels.build("qwen3vl", tiny_dir, vocab="qwen2")
    projector = mmproj.write_qwen2vl(tiny_dir, path, colour_tokens, "qwen3vl_merger")
    m = Model.load(str(path), progress=False)
    h = Helper(m, projector)
    try:
        assert m.handle.n_embd_inp() == 2 * m.n_embd
        prompt = "Look at this: " + MARKER + " The colour of it is"
        with ServerProcess(path, "--mmproj", projector, "--image-min-tokens", MIN_TOKENS,
                           ctx=256) as s:
            for png, lag in ((WIDE, 4), (BLUE_WIDE, 4)):
                want, n_past = h.tokens(prompt, [png])
                out = complete(s, prompt, png, cache_prompt=False)
                assert out["tokens"] == want
                assert out["tokens_evaluated"] - n_past == lag
    finally:
        h.close()
        m.close()


def test_a_hybrid_models_m_rope_images_answer_as_libmtmds_helper_and_come_back(
        tiny_dir, colour_tokens):
    # Qwen3.5's kind: attention beside a recurrent state (engine/recurrent.py),
    # whose cuts, checkpoints and kept states read positions back as well
    path = archmodels.build("qwen35", tiny_dir)
    m = Model.load(str(path), progress=False)
    tokens = [m.tokenize(w, add_special=False)[0] for w in WORDS]
    projector = mmproj.write_qwen2vl(tiny_dir, path, tokens, "qwen3vl_merger",
                                     deepstack=False)
    h = Helper(m, projector)
    try:
        prompt = ("Here is a long description of a picture, written so that the prompt "
                  "is worth keeping: " + MARKER + " The colour of it is")
        with ServerProcess(path, "--mmproj", projector, "--image-min-tokens", MIN_TOKENS,
                           ctx=512) as s:
            want, n_past = h.tokens(prompt, [WIDE])
            first = complete(s, prompt, WIDE, id_slot=0)
            assert first["tokens"] == want
            assert first["tokens_evaluated"] - n_past == 4
            # a second turn goes on from the cache
            turn2 = prompt + first["content"] + ". And its shape is"
            warm = complete(s, turn2, WIDE, id_slot=0)
            assert warm["timings"]["cache_n"] >= first["tokens_evaluated"]
            assert warm["tokens"] == complete(s, turn2, WIDE, id_slot=0,
                                              cache_prompt=False)["tokens"]
            # another prompt, then the first again: from a kept state or checkpoint
            st, _, other = s.post("/completion", {
                "prompt": "Something else entirely, with no picture in it at all: a list "
                          "of numbers, one two three four five six seven.",
                "n_predict": 2, "temperature": 0, "id_slot": 0})
            assert st == 200, other
            back = complete(s, prompt, WIDE, id_slot=0)
            assert back["tokens"] == want
            assert back["timings"]["cache_n"] > 0
    finally:
        h.close()
        m.close()
