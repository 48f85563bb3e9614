"""OpenAI's speech to text, POST /v1/audio/transcriptions, as llama-server serves it.

The upload is multipart/form-data; the audio and the template's transcription
prompt become one chat turn (llama-server's convert_transcriptions_to_chatcmpl),
so the transcript is what /completion gives for that turn's prompt and clip.
Served on the tiny model with tests/mmproj.py's audio encoder (seeded weights:
not words, but a real encoder libmtmd runs on a real clip), through the OpenAI
SDK's own upload.
"""

import base64
import json
import uuid

import openai
import pytest

import mmproj
from offgrid.chat.adjust import asr_prompt
from offgrid.server.httpd import form
from offgrid.server.httpd.httperrors import BadRequest
from serverproc import ServerProcess

N = 8
MARKER = "<__media__>"


@pytest.fixture(scope="module")
def clip():
    return mmproj.wav(1.0)


@pytest.fixture(scope="module")
def served(plain_model_path, tiny_dir):
    path = mmproj.write_audio(tiny_dir, plain_model_path)
    with ServerProcess(plain_model_path, "--mmproj", path, "-np", "1", ctx=1024) as server:
        yield server


def sdk(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0)


def completion_of(server, content, clip):
    """/completion's greedy text for a user turn of ``content`` (text and the marker)."""
    status, _, out = server.post("/apply-template", {
        "messages": [{"role": "user", "content": content}]})
    assert status == 200, out
    status, _, out = server.post("/completion", {
        "prompt": {"prompt_string": out["prompt"],
                   "multimodal_data": [base64.b64encode(clip).decode()]},
        "n_predict": N, "temperature": 0})
    assert status == 200, out
    return out["content"], out["tokens_evaluated"]


def test_the_sdk_transcribes_what_the_chat_turn_of_llama_server_gives(served, clip):
    client = sdk(served)
    got = client.audio.transcriptions.create(model="tiny", file=("clip.wav", clip),
                                             temperature=0, extra_body={"max_tokens": N})
    want, n_prompt = completion_of(served, "Transcribe audio to text" + MARKER, clip)
    assert want and got.text == want
    usage = got.usage
    assert (usage.type, usage.input_tokens, usage.output_tokens) == ("tokens", n_prompt, N)
    assert usage.total_tokens == n_prompt + N
    # as text, the transcript alone
    text = client.audio.transcriptions.create(model="tiny", file=("clip.wav", clip),
                                              temperature=0, response_format="text",
                                              extra_body={"max_tokens": N})
    assert text.strip() == want.strip()


def test_a_prompt_and_a_language_go_into_the_turn(served, clip):
    got = sdk(served).audio.transcriptions.create(
        model="tiny", file=("clip.wav", clip), prompt="Write down what is said",
        language="fr", temperature=0, extra_body={"max_tokens": N})
    want, _ = completion_of(served, "Write down what is said (language: fr)" + MARKER, clip)
    assert got.text == want


def test_a_stream_is_delta_events_then_the_done_event(served, clip):
    events = list(sdk(served).audio.transcriptions.create(
        model="tiny", file=("clip.wav", clip), temperature=0, stream=True,
        extra_body={"max_tokens": N}))
    types = [e.type for e in events]
    assert types == ["transcript.text.delta"] * (len(types) - 1) + ["transcript.text.done"]
    assert len(types) > 2
    done = events[-1]
    assert "".join(e.delta for e in events[:-1]) == done.text
    assert done.text == completion_of(served, "Transcribe audio to text" + MARKER, clip)[0]
    assert done.usage.output_tokens == N


def multipart(fields, files=()):
    boundary = uuid.uuid4().hex
    out = b""
    for name, value in fields.items():
        out += ("--%s\r\nContent-Disposition: form-data; name=\"%s\"\r\n\r\n%s\r\n"
                % (boundary, name, value)).encode()
    for name, filename, data in files:
        out += ("--%s\r\nContent-Disposition: form-data; name=\"%s\"; filename=\"%s\"\r\n"
                "Content-Type: application/octet-stream\r\n\r\n"
                % (boundary, name, filename)).encode() + data + b"\r\n"
    return out + ("--%s--\r\n" % boundary).encode(), \
        "multipart/form-data; boundary=%s" % boundary


def post_form(server, body_and_type, path="/v1/audio/transcriptions"):
    body, content_type = body_and_type
    return server.request("POST", path, raw=body, headers={"Content-Type": content_type})


@pytest.mark.parametrize("fields,files,status,words", [
    ({"model": "x"}, [], 400, "No input file found"),
    ({"response_format": "srt"}, [("file", "a.wav", None)], 400, "json or text"),
    ({"max_tokens": "many"}, [("file", "a.wav", None)], 400, "'max_tokens' must be a number"),
    ({}, [("file", "a.png", mmproj.png((255, 0, 0)))], 400, "no image encoder"),
    ({}, [("file", "a.txt", b"just some text")], 400, "takes audio only"),
])
def test_a_transcription_it_cannot_do_gets_an_openai_error(served, clip, fields, files,
                                                           status, words):
    files = [(n, f, clip if d is None else d) for n, f, d in files]
    got, _, out = post_form(served, multipart(fields, files))
    assert got == status, out
    assert words in out["error"]["message"], out
    # and the server goes on
    assert sdk(served).audio.transcriptions.create(
        model="tiny", file=("clip.wav", clip), extra_body={"max_tokens": 1}).text is not None


def test_a_json_body_or_a_broken_form_is_a_400(served):
    status, _, out = served.post("/v1/audio/transcriptions", {"model": "x"})
    assert status == 400 and "No input file" in out["error"]["message"], out
    status, _, out = served.request("POST", "/v1/audio/transcriptions", raw=b"--b\r\nnope",
                                    headers={"Content-Type": "multipart/form-data; boundary=b"})
    assert status == 400 and "closing boundary" in out["error"]["message"], out
    # a form to a route that reads JSON is not JSON
    status, _, out = post_form(served, multipart({"prompt": "hi"}), path="/completion")
    assert status == 400 and "JSON" in out["error"]["message"], out


def test_a_model_without_an_audio_encoder_says_so(plain_model_path, clip):
    with ServerProcess(plain_model_path, "-np", "1", ctx=256) as server:
        status, _, out = post_form(server, multipart({}, [("file", "a.wav", clip)]))
    assert status == 501 and "does not support audio input" in out["error"]["message"], out
    assert out["error"]["type"] == "not_supported_error"


def test_the_form_reader_keeps_a_files_bytes_and_repeated_fields():
    data = bytes(range(256)) * 8 + b"\r\n--almost"
    body, content_type = multipart({"include[]": "logprobs"}, [("file", "x y.bin", data)])
    fields, files = form.parse(body, content_type)
    assert fields == {"include[]": "logprobs"}
    assert files["file"].data == data and files["file"].filename == "x y.bin"
    _, content_type = multipart({})
    boundary = content_type.split("=", 1)[1].encode()
    body = (b"--" + boundary + b"\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\n1\r\n"
            b"--" + boundary + b"\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\n2\r\n"
            b"--" + boundary + b"--\r\n")
    assert form.parse(body, content_type) == ({"a": ["1", "2"]}, {})
    with pytest.raises(BadRequest):
        form.parse(body.replace(b"Content-Disposition", b"Content-Dispositio"), content_type)
    assert form.boundary_of("application/json") is None


def test_the_transcription_turn_follows_the_template(llama_src):
    templates = llama_src / "models" / "templates"
    assert asr_prompt((templates / "LFM2-8B-A1B.jinja").read_text()) == ("Perform ASR.", "")
    chatml = (templates / "LFM2.5-Instruct.jinja").read_text()
    assert asr_prompt(chatml) == ("", "Transcribe audio to text")
    assert json.dumps(asr_prompt(""))
