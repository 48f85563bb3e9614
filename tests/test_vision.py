"""Images in every dialect, over HTTP: a server of the tiny model with the tests' mmproj.

tests/mmproj.py's projector makes a red image exactly the embedding of a
chosen token, so each dialect's image request must answer with the greedy
text of the same prompt with that token in the image's place.  That prompt
is built with llama-server's own tools: /apply-template renders the chat
(the image's marker where it goes), and /completion takes it as a mixed
prompt of text and the token, split where libmtmd splits it (the gemma3
projector's ``<start_of_image>`` and ``<end_of_image>`` are text of their own).
"""

import base64
import io
import struct
import wave

import pytest

try:
    from . import mmproj
    from .serverproc import Call, ServerProcess
    from .test_vision_engine import TOKENS
except ImportError:  # tests/ on sys.path
    import mmproj
    from serverproc import Call, ServerProcess
    from test_vision_engine import TOKENS

MARKER = "<__media__>"
RED = mmproj.png((255, 0, 0))
RED_B64 = base64.b64encode(RED).decode()
RED_URI = "data:image/png;base64," + RED_B64
RED_TOKEN = TOKENS[0]
N = 10
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    """--media-path: a folder with red.png in it."""
    folder = tmp_path_factory.mktemp("media")
    (folder / "red.png").write_bytes(RED)
    return folder


@pytest.fixture(scope="module")
def srv(plain_model_path, tiny_dir, media_dir):
    path = mmproj.write(tiny_dir, plain_model_path, TOKENS)
    with ServerProcess(plain_model_path, "--mmproj", path, "--media-path", media_dir,
                       ctx=512) as s:
        yield s


@pytest.fixture(scope="module")
def text_only(plain_model_path):
    with ServerProcess(plain_model_path, ctx=256) as s:
        yield s


def reference(srv, prompt_text, token=RED_TOKEN, n=N):
    """The greedy text of ``prompt_text`` (one media marker) with ``token`` in its place."""
    before, after = prompt_text.split(MARKER)
    st, _, out = srv.post("/completion", {
        "prompt": [before, "<start_of_image>", token, "<end_of_image>", after],
        "n_predict": n, "temperature": 0, "cache_prompt": False})
    assert st == 200, out
    return out["content"]


def chat_reference(srv, messages):
    st, _, out = srv.post("/apply-template", {"messages": messages})
    assert st == 200, out
    return reference(srv, out["prompt"])


def openai_messages(image_part):
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION}, image_part]}]


def test_openai_chat_image_url_answers_as_its_token(srv):
    messages = openai_messages({"type": "image_url", "image_url": {"url": RED_URI}})
    st, _, out = srv.post("/v1/chat/completions", {"messages": messages, "max_tokens": N,
                                                   "temperature": 0})
    assert st == 200, out
    assert out["choices"][0]["message"]["content"] == chat_reference(srv, messages)


def test_the_openai_client_streams_an_image_answer(srv):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=srv.base + "/v1", api_key="none")
    messages = openai_messages({"type": "image_url", "image_url": {"url": RED_URI}})
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="x", messages=messages, max_tokens=N, temperature=0, stream=True))
    assert text == chat_reference(srv, messages)


def test_a_file_url_under_media_path_answers_as_the_same_image_inline(srv, media_dir):
    def answer(url):
        st, _, out = srv.post("/v1/chat/completions", {"messages": openai_messages(
            {"type": "image_url", "image_url": {"url": url}}), "max_tokens": N, "temperature": 0})
        return st, out
    st, out = answer("file://%s" % (media_dir / "red.png"))
    assert st == 200, out
    assert out["choices"][0]["message"]["content"] == answer(RED_URI)[1]["choices"][0][
        "message"]["content"]
    for outside in ("file://%s/../red.png" % media_dir, "file://%s" % media_dir):
        st, out = answer(outside)
        assert st == 400 and "no such file under --media-path" in out["error"]["message"]


def test_a_different_image_gives_a_different_answer(srv):
    red = openai_messages({"type": "image_url", "image_url": {"url": RED_URI}})
    blue = openai_messages({"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(mmproj.png((0, 0, 255))).decode()}})
    answers = []
    for messages in (red, blue):
        st, _, out = srv.post("/v1/chat/completions", {"messages": messages, "max_tokens": N,
                                                       "temperature": 0})
        assert st == 200, out
        answers.append(out["choices"][0]["message"]["content"])
    assert answers[0] != answers[1]
    st, _, out = srv.post("/apply-template", {"messages": blue})
    assert answers[1] == reference(srv, out["prompt"], TOKENS[2])


def test_anthropic_base64_image_answers_as_its_token(srv):
    body = {"model": "x", "max_tokens": N, "temperature": 0, "messages": [{
        "role": "user", "content": [
            {"type": "text", "text": QUESTION},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": RED_B64}}]}]}
    st, _, out = srv.post("/v1/messages", body)
    assert st == 200, out
    # Anthropic's text blocks join with a newline, as the OpenAI parts do
    expected = chat_reference(srv, [{"role": "user", "content": QUESTION + "\n" + MARKER}])
    assert out["content"][0]["text"] == expected


def test_responses_input_image_answers_as_its_token(srv):
    body = {"model": "x", "max_output_tokens": N, "temperature": 0, "input": [{
        "role": "user", "content": [{"type": "input_text", "text": QUESTION},
                                    {"type": "input_image", "image_url": RED_URI}]}]}
    st, _, out = srv.post("/v1/responses", body)
    assert st == 200, out
    text = out["output"][-1]["content"][0]["text"]
    assert text == chat_reference(srv, [{"role": "user", "content": QUESTION + "\n" + MARKER}])


def test_ollama_chat_and_generate_images_answer_as_their_token(srv):
    # Ollama puts a message's images before its text
    expected = chat_reference(srv, [{"role": "user", "content": MARKER + QUESTION}])
    st, _, out = srv.post("/api/chat", {"model": "x", "stream": False, "messages": [
        {"role": "user", "content": QUESTION, "images": [RED_B64]}],
        "options": {"num_predict": N, "temperature": 0}})
    assert st == 200, out
    assert out["message"]["content"] == expected
    st, _, out = srv.post("/api/generate", {"model": "x", "stream": False, "prompt": QUESTION,
                                            "images": [RED_B64],
                                            "options": {"num_predict": N, "temperature": 0}})
    assert st == 200, out
    assert out["response"] == expected


def test_completion_multimodal_data_answers_as_its_token(srv):
    prompt = "A picture: " + MARKER + " shows"
    st, _, out = srv.post("/completion", {
        "prompt": {"prompt_string": prompt, "multimodal_data": [RED_B64]},
        "n_predict": N, "temperature": 0})
    assert st == 200, out
    assert out["content"] == reference(srv, prompt)


def test_props_and_models_report_vision(srv, text_only):
    assert srv.get("/props")[2]["modalities"] == {"vision": True, "audio": False}
    assert text_only.get("/props")[2]["modalities"] == {"vision": False, "audio": False}
    model = srv.get("/v1/models")[2]["data"][0]
    assert model["architecture"]["input_modalities"] == ["text", "image"]
    st, _, show = srv.post("/api/show", {"model": model["id"]})
    assert st == 200 and "vision" in show["capabilities"]


def test_a_model_without_an_mmproj_refuses_an_image_saying_so(text_only):
    st, _, out = text_only.post("/v1/chat/completions", {
        "messages": openai_messages({"type": "image_url", "image_url": {"url": RED_URI}}),
        "max_tokens": 4})
    assert st == 400 and "mmproj" in out["error"]["message"]
    st, _, out = text_only.post("/api/chat", {"model": "x", "stream": False, "messages": [
        {"role": "user", "content": "hi", "images": [RED_B64]}]})
    assert st == 400 and "mmproj" in out["error"]
    # and without --media-path, no file:// URL at all
    st, _, out = text_only.post("/v1/chat/completions", {
        "messages": openai_messages({"type": "image_url", "image_url": {
            "url": "file:///etc/hostname"}}), "max_tokens": 4})
    assert st == 400 and "unless the server was started with --media-path" in \
        out["error"]["message"]


def _wav():
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\x00\x01" * 1600)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("part, says", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "network"),
    ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "--media-path"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                         + base64.b64encode(RED[:40]).decode()}}, "decoded"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "base64"),
    ({"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}, "text/plain"),
    ({"type": "input_audio", "input_audio": {"data": _wav(), "format": "wav"}},
     "no audio encoder"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
        RED[:16] + struct.pack(">II", 100000, 100000) + RED[24:]).decode()}}, "megapixels"),
], ids=["http", "file", "truncated", "not-base64", "wrong-type", "audio-to-vision-only",
        "huge"])
def test_bad_images_are_a_clear_400_and_the_server_goes_on(srv, part, says):
    st, _, out = srv.post("/v1/chat/completions", {"messages": openai_messages(part),
                                                   "max_tokens": 4})
    assert st == 400, out
    assert says in out["error"]["message"]
    st, _, out = srv.post("/completion", {"prompt": "Hello", "n_predict": 2})
    assert st == 200 and out["content"]


def test_too_many_images_are_refused_in_each_dialects_shape(srv):
    images = [RED_B64] * 17
    st, _, out = srv.post("/api/chat", {"model": "x", "stream": False, "messages": [
        {"role": "user", "content": "hi", "images": images}]})
    assert st == 400 and "at most 16" in out["error"]
    st, _, out = srv.post("/v1/messages", {"model": "x", "max_tokens": 4, "messages": [{
        "role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": RED_B64}}] * 17}]})
    assert st == 400 and out["type"] == "error" and "at most 16" in out["error"]["message"]


def test_a_second_turn_about_the_same_image_reuses_its_cache_and_another_image_does_not(srv):
    def turn_two(uri):
        messages = openai_messages({"type": "image_url", "image_url": {"url": uri}})
        body = {"messages": messages, "max_tokens": 4, "temperature": 0, "id_slot": 0}
        st, _, first = srv.post("/v1/chat/completions", body)
        assert st == 200
        turn = messages + [first["choices"][0]["message"], {"role": "user", "content": "And?"}]
        st, _, second = srv.post("/v1/chat/completions", dict(body, messages=turn))
        assert st == 200
        return first["usage"]["prompt_tokens"], \
            second["usage"]["prompt_tokens_details"]["cached_tokens"]

    n_first, cached = turn_two(RED_URI)
    # the first prompt, image and all, but the generation prompt's last token (the
    # template renders the turn's end anew)
    assert cached >= n_first - 1
    blue = "data:image/png;base64," + base64.b64encode(mmproj.png((0, 0, 255))).decode()
    st, _, out = srv.post("/v1/chat/completions", {
        "messages": openai_messages({"type": "image_url", "image_url": {"url": blue}}),
        "max_tokens": 4, "temperature": 0, "id_slot": 0})
    assert st == 200
    # the slot held the red conversation: only the text before the image is reused
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] < n_first - 10


def test_images_and_text_at_once_on_several_sessions_each_get_their_solo_answer(
        plain_model_path, tiny_dir):
    # an image's decode is a step of its own beside the other sessions' steps
    path = mmproj.write(tiny_dir, plain_model_path, TOKENS)
    colours = [(255, 0, 0), (0, 255, 0), None, (0, 0, 255)]

    def body(colour):
        content = [{"type": "text", "text": QUESTION}]
        if colour is not None:
            content.append({"type": "image_url", "image_url": {
                "url": "data:image/png;base64," + base64.b64encode(mmproj.png(colour)).decode()}})
        return {"messages": [{"role": "user", "content": content}], "max_tokens": 12,
                "temperature": 0}

    with ServerProcess(plain_model_path, "--mmproj", path, "-np", 4, "--no-kv-unified",
                       ctx=256) as s:
        solo = []
        for colour in colours:
            st, _, out = s.post("/v1/chat/completions", body(colour))
            assert st == 200, out
            solo.append(out["choices"][0]["message"]["content"])
        calls = [Call(s, "/v1/chat/completions", dict(body(c), cache_prompt=False))
                 for c in colours]
        for c in calls:
            c.start()
        for c in calls:
            c.join(120)
        together = [c.result[1]["choices"][0]["message"]["content"] for c in calls]
    assert together == solo
    assert len(set(solo)) == 4


def test_a_slot_file_holds_the_image_for_another_server_and_only_that_image(
        plain_model_path, tiny_dir, tmp_path):
    # the media ids in a slot file's tokens come from the image's bytes, so a server
    # started later reuses the file for the same picture, and not for another
    path = mmproj.write(tiny_dir, plain_model_path, TOKENS)
    blue = "data:image/png;base64," + base64.b64encode(mmproj.png((0, 0, 255))).decode()

    def ask(s, uri):
        st, _, out = s.post("/v1/chat/completions", {
            "messages": openai_messages({"type": "image_url", "image_url": {"url": uri}}),
            "max_tokens": 4, "temperature": 0, "id_slot": 0})
        assert st == 200, out
        return out["usage"]["prompt_tokens"], out["usage"]["prompt_tokens_details"]["cached_tokens"]

    flags = ("--mmproj", path, "--slot-save-path", tmp_path, "--cache-ram", 0, "--no-cache-disk")
    with ServerProcess(plain_model_path, *flags, ctx=256) as s:
        n_prompt, _ = ask(s, RED_URI)
        assert s.post("/slots/0?action=save", {"filename": "red.bin"})[0] == 200
    with ServerProcess(plain_model_path, *flags, ctx=256) as s:
        assert s.post("/slots/0?action=restore", {"filename": "red.bin"})[0] == 200
        assert ask(s, RED_URI)[1] == n_prompt - 1      # all but the last, for its logits
        assert s.post("/slots/0?action=restore", {"filename": "red.bin"})[0] == 200
        assert ask(s, blue)[1] < n_prompt - 10         # the text before the picture only


def test_audio_in_openai_chat_and_completion_to_an_audio_encoder(plain_model_path, tiny_dir):
    # tests/mmproj.py's qwen2a encoder (seeded weights): a clip is 750 tokens a 30 s chunk
    path = mmproj.write_audio(tiny_dir, plain_model_path)
    clip = base64.b64encode(mmproj.wav(1.0)).decode()
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Listen:"},
        {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}}]}]
    with ServerProcess(plain_model_path, "--mmproj", path, ctx=1024) as s:
        assert s.get("/props")[2]["modalities"] == {"vision": False, "audio": True}
        st, _, out = s.post("/v1/chat/completions", {"messages": messages, "max_tokens": N,
                                                     "temperature": 0})
        assert st == 200, out
        assert out["usage"]["prompt_tokens"] > 750
        # the same prompt through llama.cpp's /completion gives the same text
        prompt = s.post("/apply-template", {"messages": messages})[2]["prompt"]
        st, _, raw = s.post("/completion", {
            "prompt": {"prompt_string": prompt, "multimodal_data": [clip]},
            "n_predict": N, "temperature": 0})
        assert st == 200 and raw["content"] == out["choices"][0]["message"]["content"]
        # a picture to an encoder of sound
        st, _, out = s.post("/v1/chat/completions", {"messages": openai_messages(
            {"type": "image_url", "image_url": {"url": RED_URI}}), "max_tokens": 2})
        assert st == 400 and "no image encoder" in out["error"]["message"]
