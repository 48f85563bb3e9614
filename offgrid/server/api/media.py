"""Images and audio in a request, read at the edge: every dialect's shapes in one place.

A dialect's parser turns each image or audio part of a message into the
media marker (``MARKER``, libmtmd's default, which the chat template renders
as text) among the message's text parts, and the file's bytes (checked
base64) onto ``Message.media``, one per marker in order.  The worker
decodes the files (libmtmd: JPEG, PNG, BMP, GIF; WAV, MP3, FLAC) and turns
each into its run of media tokens (engine/media.py); a model served without
``--mmproj`` answers such a request with a 400 saying so.

Where images come from: inline base64 (a ``data:`` URI, Anthropic's base64
source, Ollama's ``images``, llama.cpp's ``multimodal_data``), or a
``file://`` URL under ``--media-path`` (``allow_files_under``); an
``http(s)://`` URL is refused with a 400: offgrid fetches nothing from the
network.  Caps (docs/api.md): MAX_MEDIA files a request, MAX_MEDIA_BYTES
each, and the request body's own limit (--max-body).
"""

import base64
import binascii
import os
from urllib.parse import unquote, urlparse

from ...request import MAX_MEDIA, MAX_MEDIA_BYTES
from ..httpd.httperrors import BadRequest

MARKER = "<__media__>"          # mtmd_default_marker() of the pinned libmtmd

_media_path = None              # --media-path, resolved (allow_files_under)


def allow_files_under(path):
    """Let file:// URLs name files under ``path`` (--media-path); None: refuse them all."""
    global _media_path
    _media_path = os.path.realpath(path) if path else None


def checked_b64(data, where):
    """``data`` (a str of base64) checked: decodable, within the caps; returned as it is."""
    if not isinstance(data, str) or not data:
        raise BadRequest("%s must be a non-empty string of base64" % where)
    if len(data) > (MAX_MEDIA_BYTES // 3 + 1) * 4 + 4:
        raise BadRequest("%s: an image or audio clip may be at most %d MiB"
                         % (where, MAX_MEDIA_BYTES >> 20))
    try:
        base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest("%s is not valid base64" % where) from None
    return data


def from_url(url, where, kind="image"):
    """The base64 of the file an ``image_url`` (or Responses' ``image_url``) names."""
    if not isinstance(url, str) or not url:
        raise BadRequest("%s must be a non-empty string: a data: URI" % where)
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        head, sep, payload = url[5:].partition(",")
        if not sep or not head.endswith(";base64"):
            raise BadRequest("%s: a data: URI must be base64 (data:%s/png;base64,...)"
                             % (where, kind))
        mime = head[:-len(";base64")].lower()
        if mime and not (mime.startswith(kind + "/") or mime == "application/octet-stream"):
            raise BadRequest("%s: a data: URI of type %s where an %s is expected"
                             % (where, mime, kind))
        return checked_b64(payload, where)
    if scheme in ("http", "https"):
        raise BadRequest("%s: offgrid fetches nothing from the network; send the %s inline "
                         "as a data: URI (data:%s/png;base64,...)" % (where, kind, kind))
    if scheme == "file":
        return _from_file(url, where)
    raise BadRequest("%s: an %s URL must be a data: URI" % (where, kind))


def _from_file(url, where):
    if _media_path is None:
        raise BadRequest("%s: file:// URLs are refused unless the server was started with "
                         "--media-path" % where)
    path = os.path.realpath(unquote(urlparse(url).path))
    if os.path.commonpath([path, _media_path]) != _media_path or not os.path.isfile(path):
        raise BadRequest("%s: no such file under --media-path" % where)
    if os.path.getsize(path) > MAX_MEDIA_BYTES:
        raise BadRequest("%s: an image or audio clip may be at most %d MiB"
                         % (where, MAX_MEDIA_BYTES >> 20))
    with open(path, "rb") as f:
        return base64.b64encode(f.read()).decode("ascii")


def openai_part(part, where):
    """An OpenAI chat content part that is media: (its base64), or None for another
    type.  ``image_url``: {"url": ...} (or the URL itself); ``input_audio``:
    {"data": base64, "format": "wav" | "mp3" | ...}."""
    kind = part.get("type")
    if kind == "image_url":
        v = part.get("image_url")
        return from_url(v.get("url") if isinstance(v, dict) else v, where + ".image_url.url")
    if kind == "input_audio":
        v = part.get("input_audio")
        if not isinstance(v, dict):
            raise BadRequest("%s.input_audio must be {\"data\": base64, \"format\": ...}" % where)
        return checked_b64(v.get("data"), where + ".input_audio.data")
    return None


def anthropic_image(block, where):
    """The base64 of Anthropic's ``{"type": "image", "source": {"type": "base64",
    "media_type": "image/png", "data": ...}}`` (a "url" source is refused: offline)."""
    src = block.get("source")
    if not isinstance(src, dict):
        raise BadRequest("%s.source: must be an object" % where)
    if src.get("type") == "url":
        raise BadRequest("%s.source: offgrid fetches nothing from the network; send the "
                         "image as a base64 source" % where)
    if src.get("type") != "base64":
        raise BadRequest("%s.source.type: must be \"base64\"" % where)
    mime = src.get("media_type")
    if mime is not None and (not isinstance(mime, str) or not mime.startswith("image/")):
        raise BadRequest("%s.source.media_type: must be an image type (image/png, ...)" % where)
    return checked_b64(src.get("data"), where + ".source.data")


def native_prompts(v):
    """llama-server's multimodal ``prompt``: ``{"prompt_string": "...<__media__>...",
    "multimodal_data": [base64, ...]}``, alone or in an array beside plain prompts.
    Returns (the prompt with each such object as its string, [files of each prompt]);
    a prompt without objects gives itself and []."""
    def one(p, where):
        if not isinstance(p, dict):
            return p, []
        text, files = p.get("prompt_string"), p.get("multimodal_data", [])
        if not isinstance(text, str):
            raise BadRequest("%s.prompt_string must be a string" % where)
        if not isinstance(files, list) or len(files) > MAX_MEDIA:
            raise BadRequest("%s.multimodal_data must be an array of at most %d base64 "
                             "strings" % (where, MAX_MEDIA))
        return text, [checked_b64(x, "%s.multimodal_data[%d]" % (where, j))
                      for j, x in enumerate(files)]
    if isinstance(v, dict):
        text, files = one(v, "prompt")
        return text, [files]
    if isinstance(v, list) and any(isinstance(p, dict) for p in v):
        pairs = [one(p, "prompt[%d]" % i) for i, p in enumerate(v)]
        return [p for p, _ in pairs], [files for _, files in pairs]
    return v, []


def count_check(messages):
    """Every Message's media together within MAX_MEDIA."""
    n = sum(len(m.media) for m in messages)
    if n > MAX_MEDIA:
        raise BadRequest("a request may hold at most %d images and audio clips, not %d"
                         % (MAX_MEDIA, n))
