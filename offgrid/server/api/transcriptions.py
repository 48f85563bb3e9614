"""OpenAI's speech to text, ``POST /v1/audio/transcriptions``, as llama-server serves it.

The request is a multipart/form-data upload (httpd/form.py): the audio in
``file``, and text fields beside it, each a string.  As llama-server's
convert_transcriptions_to_chatcmpl, it becomes one chat turn: the template's
transcription prompt (``ModelInfo.asr_prompt``: "Transcribe audio to text",
or LFM2's system turn), `` (language: X)`` where ``language`` is given, then the
audio; the reply's text is the transcript.  The model needs an mmproj with an
audio encoder (``--mmproj``).

    file                the audio: WAV, MP3 or FLAC (what libmtmd decodes)
    model, prompt, language, temperature, max_tokens (llama-server's), stream
    response_format     json (the default) or text; llama-server takes json only

The answer: ``{"type": "transcript.text.done", "text", "usage"}`` (llama-server's
shape: OpenAI's ``text`` and ``usage`` with its event type), or the text alone
for ``text``; streamed, ``transcript.text.delta`` events with each piece of text,
then the done event and ``[DONE]``.
"""

import base64

from ...request import MAX_MEDIA_BYTES, Message
from ..httpd.httperrors import BadRequest, NotImplementedByModel
from . import pipeline
from .fields import Fields, generation_from, text_tokenizer
from .media import MARKER
from .openai_chat import apply_plan, prepare
from .pipeline import Format, Generation, Prompt

RESPONSE_FORMATS = ("json", "text")


def _typed(form):
    """The form's strings as the types generation_from reads: llama-server converts
    stream, max_tokens and temperature, and so does this."""
    f = Fields(form)
    out = {}
    for name, kind in (("max_tokens", int), ("temperature", float)):
        text = f.str(name)
        if text is not None:
            try:
                out[name] = kind(text)
            except ValueError:
                raise BadRequest("'%s' must be a number, not %r" % (name, text[:40]))
    out["stream"] = f.str("stream") == "true"
    return out


def transcriptions(h, form):
    """POST /v1/audio/transcriptions (and /audio/transcriptions)."""
    svc = h.service
    f = Fields(form)
    upload = h.files.get("file")
    if upload is None:
        raise BadRequest("No input file found for transcription: send the audio as the "
                         "form's 'file' part (multipart/form-data)")
    response_format = f.str("response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        raise BadRequest("'response_format' must be json or text, not %r"
                         % response_format[:40])
    if len(upload.data) > MAX_MEDIA_BYTES:
        raise BadRequest("file: an audio clip may be at most %d MiB" % (MAX_MEDIA_BYTES >> 20))
    entry = svc.entry_for(f.str("model"))
    info = entry.info
    if info is not None and "audio" not in info.modalities:
        raise NotImplementedByModel("The current model does not support audio input: serve "
                                    "it with an mmproj that has an audio encoder (--mmproj)")
    system, user = info.asr_prompt if info is not None else ("", "Transcribe audio to text")
    user = f.str("prompt") or user
    if f.str("language"):
        user += " (language: %s)" % f.str("language")
    messages = [Message("system", system)] if system else []
    messages.append(Message("user", user + MARKER,
                            media=[base64.b64encode(upload.data).decode("ascii")]))
    plan = prepare(entry, messages, what="POST /v1/audio/transcriptions")
    typed = _typed(form)
    gen = generation_from(Fields(typed), entry.n_vocab, svc.generation_default,
                          sampling_default=entry.sampling, tokenize=text_tokenizer(entry))
    apply_plan(gen, plan)
    g = Generation(entry, gen, [Prompt(plan["tokens"], plan["text"])],
                   "v1/audio/transcriptions", "POST /v1/audio/transcriptions",
                   stream=typed["stream"], chat=plan["chat"])
    pipeline.run(h, g, TranscriptionFormat(response_format))


def _usage(c):
    u = c.usage
    return {"type": "tokens", "input_tokens": u.prompt_tokens,
            "output_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens}}


class TranscriptionFormat(Format):
    """The transcript: its text pieces as delta events, then the done event."""

    def __init__(self, response_format):
        self.response_format = response_format

    def piece(self, out, job, d, probs):
        # the reply's text only: a reasoning model's thinking is no part of a transcript
        if not d.get("content"):
            return True
        return out.send({"type": "transcript.text.delta", "delta": d["content"]})

    def end(self, out, done):
        out.send(self._done(done[0]))
        out.send(b"[DONE]")

    def body(self, jobs, done):
        if self.response_format == "text":
            return done[0].reply["content"]
        return self._done(done[0])

    @staticmethod
    def _done(c):
        return {"type": "transcript.text.done", "text": c.reply["content"], "usage": _usage(c)}
