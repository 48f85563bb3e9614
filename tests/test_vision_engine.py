"""Images in a prompt, in the engine: libmtmd's chunks as runs of media tokens (engine/media.py).

The mmproj is the tests' own (tests/mmproj.py): a red, green, blue or black
image becomes exactly the embedding of a chosen token, so a prompt with the
image must give the greedy text of the same prompt with that token.
"""

import struct

import pytest

from offgrid import libmtmd
from offgrid.engine.media import MediaStore
from offgrid.engine.session import ChatSession, decode_turn
from offgrid.errors import InvalidRequest, InvalidToken, LibraryError
from offgrid.request import GenerationParams, SamplingParams

try:
    from . import mmproj, tinymodels
    from .serverproc import TEST_THREADS
except ImportError:  # tests/ on sys.path
    import mmproj
    import tinymodels
    from serverproc import TEST_THREADS

# ordinary tokens of the tiny model's vocabulary (StarCoder's), one per colour, whose
# greedy continuations of the prompt below differ (picked by trying)
TOKENS = (3382, 4176, 5764, 6558)


def marker_prompt(text_after=" and what it shows is"):
    return "Here is a picture: <__media__>" + text_after


@pytest.fixture(scope="module")
def store(plain_model, plain_model_path, tiny_dir):
    path = mmproj.write(tiny_dir, plain_model_path, TOKENS)
    ctx = libmtmd.MtmdContext(libmtmd.load(), path, plain_model.handle.ptr,
                              n_threads=TEST_THREADS, use_gpu=False)
    s = MediaStore(ctx, plain_model.n_embd, 64, decode_turn)
    yield s
    s.close()


@pytest.fixture
def session(plain_model, store):
    made = []

    def make():
        s = ChatSession(plain_model, n_ctx=512, n_batch=64, n_threads=TEST_THREADS)
        s.media = store
        made.append(s)
        return s
    yield make
    for s in made:
        s.close()


def greedy(n=12):
    return GenerationParams(n_predict=n, sampling=SamplingParams(temperature=0.0))


def as_token(tokens, token):
    """``tokens`` with each media id replaced by ``token``."""
    return [token if t < 0 else t for t in tokens]


def test_a_plain_colour_becomes_exactly_its_tokens_embedding(store, plain_model_path):
    _, rows = mmproj.token_embeddings(plain_model_path, TOKENS)
    for colour, row in zip(mmproj.ORDER, rows):
        tokens = store.tokenize(marker_prompt(), [mmproj.png(mmproj.COLOURS[colour])])
        (start, end, span), = store.layout(tokens)
        assert end - start == 1
        assert store.embeddings(span) == struct.pack("<%df" % len(row), *row), colour


def test_an_image_prompt_gives_the_text_of_the_same_prompt_with_its_token(session, store):
    texts = set()
    for colour, token in zip(mmproj.ORDER, TOKENS):
        tokens = store.tokenize(marker_prompt(), [mmproj.png(mmproj.COLOURS[colour])])
        seen = session().complete(tokens, greedy()).text
        assert seen == session().complete(as_token(tokens, token), greedy()).text, colour
        texts.add(seen)
    assert len(texts) == 4      # each colour its own answer: the image is looked at


def test_the_pinned_sources_jpeg_decodes_to_the_mmprojs_token_count(store, plain_model,
                                                                    plain_model_path, tiny_dir):
    jpeg = (tinymodels.llama_cpp_source() / "tools" / "mtmd" / "test-1.jpeg").read_bytes()
    tokens = store.tokenize(marker_prompt(), [jpeg])
    assert [end - start for start, end, _ in store.layout(tokens)] == [1]
    # a projector of 2 x 2 tokens an image
    path = mmproj.write(tiny_dir, plain_model_path, TOKENS, tokens_per_side=2)
    ctx = libmtmd.MtmdContext(libmtmd.load(), path, plain_model.handle.ptr,
                              n_threads=TEST_THREADS, use_gpu=False)
    four = MediaStore(ctx, plain_model.n_embd, 64, decode_turn)
    try:
        tokens = four.tokenize(marker_prompt(" beside <__media__>"),
                               [jpeg, mmproj.png((255, 0, 0), 33, 17)])
        assert [end - start for start, end, _ in four.layout(tokens)] == [4, 4]
    finally:
        four.close()


def test_a_second_turn_about_the_same_image_reuses_it_and_another_image_does_not(session, store):
    s = session()
    red, blue = mmproj.png((255, 0, 0)), mmproj.png((0, 0, 255))
    first = store.tokenize(marker_prompt(), [red])
    s.complete(first, greedy(4))
    again = store.tokenize(marker_prompt(" and again, what is it?"), [red])
    encoded = store.n_encoded
    assert s.evaluate(again) >= first.index(min(first)) + 1     # past the image
    assert store.n_encoded == encoded                            # not even encoded again
    other = store.tokenize(marker_prompt(" and again, what is it?"), [blue])
    assert s.evaluate(other) == other.index(min(other))          # up to the image only


def test_a_cut_inside_an_image_falls_back_to_its_start(session, store, tiny_dir,
                                                       plain_model, plain_model_path):
    path = mmproj.write(tiny_dir, plain_model_path, TOKENS, tokens_per_side=2)
    ctx = libmtmd.MtmdContext(libmtmd.load(), path, plain_model.handle.ptr,
                              n_threads=TEST_THREADS, use_gpu=False)
    four = MediaStore(ctx, plain_model.n_embd, 64, decode_turn)
    s = session()
    s.media = four
    try:
        tokens = four.tokenize(marker_prompt(), [mmproj.png((0, 255, 0))])
        (start, end, _), = four.layout(tokens)
        s.evaluate(tokens)
        # a prompt whose last token is the image's third: the cache keeps up to its start
        s.cached = tokens[:start + 2] + [7] * 3       # as if cut in the middle
        assert s.evaluate(tokens) == start
    finally:
        s.media = store
        four.close()


def test_undecodable_files_are_a_clear_invalid_request(store):
    png = mmproj.png((255, 0, 0))
    with pytest.raises(InvalidRequest, match="could not be decoded"):
        store.tokenize(marker_prompt(), [png[:len(png) // 2]])      # its header is whole
    for bad in (b"not an image at all", b"\x00" * 64, b"GIF8"):
        with pytest.raises(InvalidRequest, match="not an image offgrid takes"):
            store.tokenize(marker_prompt(), [bad])


def test_an_image_too_large_is_refused_from_its_header_before_decoding(store):
    png = bytearray(mmproj.png((255, 0, 0)))
    png[16:24] = struct.pack(">II", 100000, 100000)     # 10 gigapixels, 30 GB decoded
    with pytest.raises(InvalidRequest, match="100000 x 100000 pixels"):
        store.tokenize(marker_prompt(), [bytes(png)])


def test_a_bmp_becomes_what_the_same_png_becomes(store):
    embeddings = []
    for data in (mmproj.png((0, 0, 255), 5, 3), mmproj.bmp((0, 0, 255), 5, 3)):
        (_, _, span), = store.layout(store.tokenize(marker_prompt(), [data]))
        embeddings.append(store.embeddings(span))
    assert embeddings[0] == embeddings[1]


def test_markers_and_files_must_agree_in_number(store):
    with pytest.raises(InvalidRequest, match="media markers"):
        store.tokenize(marker_prompt(), [mmproj.png((1, 2, 3))] * 2)


def test_a_media_id_the_worker_does_not_hold_is_refused_before_libllama(session):
    with pytest.raises(InvalidToken):
        session().evaluate([1, 2, -12345, 3])


def test_a_prompt_may_not_end_with_its_image(session, store):
    tokens = store.tokenize("Look: <__media__>", [mmproj.png((0, 0, 0))])
    if tokens[-1] < 0:
        with pytest.raises(InvalidRequest, match="ends with an image"):
            session().evaluate(tokens)
    else:       # gemma3's projector puts <end_of_image> after it
        assert session().evaluate(tokens) == 0


def test_a_file_that_is_no_mmproj_for_this_model_is_refused_not_aborted(plain_model, tmp_path,
                                                                        plain_model_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    for path in (junk, plain_model_path):       # noise; a text model, not a projector
        with pytest.raises(LibraryError, match="could not load the mmproj"):
            libmtmd.MtmdContext(libmtmd.load(), path, plain_model.handle.ptr,
                                n_threads=TEST_THREADS, use_gpu=False)


def test_an_image_in_use_outlives_its_trim_from_the_store(plain_model, plain_model_path,
                                                          tiny_dir):
    path = mmproj.write(tiny_dir, plain_model_path, TOKENS)
    ctx = libmtmd.MtmdContext(libmtmd.load(), path, plain_model.handle.ptr,
                              n_threads=TEST_THREADS, use_gpu=False)
    small = MediaStore(ctx, plain_model.n_embd, 64, decode_turn)
    small.max_spans = 1
    try:
        red = small.tokenize(marker_prompt(), [mmproj.png((255, 0, 0))])
        spans = small.layout(red, hold=True)        # as a session evaluating it
        small.tokenize(marker_prompt(), [mmproj.png((0, 0, 255))])     # trims red's
        span = spans[0][2]
        _, rows = mmproj.token_embeddings(plain_model_path, TOKENS[:1])
        assert small.embeddings(span) == struct.pack("<%df" % len(rows[0]), *rows[0])
        small.release(spans)
        assert span.chunk is None                   # freed once no one used it
        with pytest.raises(InvalidToken):
            small.layout(red)                       # and no longer known
    finally:
        small.close()


def test_a_wav_clip_becomes_one_whisper_chunk_of_750_tokens(plain_model, plain_model_path,
                                                            tiny_dir):
    path = mmproj.write_audio(tiny_dir, plain_model_path)
    ctx = libmtmd.MtmdContext(libmtmd.load(), path, plain_model.handle.ptr,
                              n_threads=TEST_THREADS, use_gpu=False)
    audio = MediaStore(ctx, plain_model.n_embd, 512, decode_turn)
    try:
        assert (audio.vision, audio.audio) == (False, True)
        tokens = audio.tokenize("Listen: <__media__> now", [mmproj.wav(2.5)])
        (start, end, span), = audio.layout(tokens)
        assert (end - start, span.kind) == (750, "audio")      # 30 s of log-mel, halved twice
        assert len(audio.embeddings(span)) == 4 * 750 * plain_model.n_embd
    finally:
        audio.close()
