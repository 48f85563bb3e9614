"""A multipart/form-data body (RFC 7578), read into its fields and files.

OpenAI's file uploads come this way (``/v1/audio/transcriptions``: the audio
and the text fields beside it), and llama-server turns such a body into a
JSON object of its fields, each a string (a repeated one a list), with the
files apart.  ``parse`` does the same, on the bytes ``reader.read_body``
read within ``--max-body``: exact bytes for the files, strict framing, and a
bounded count of parts.
"""

import email.message

from .httperrors import BadRequest

# parts one form may hold: a transcription sends a handful
MAX_PARTS = 64


def boundary_of(content_type):
    """The boundary of a multipart/form-data Content-Type, or None for another type."""
    msg = email.message.Message()
    msg["content-type"] = content_type or ""
    if msg.get_content_type() != "multipart/form-data":
        return None
    boundary = msg.get_param("boundary")
    if not isinstance(boundary, str) or not 1 <= len(boundary) <= 70:
        raise BadRequest("a multipart/form-data body needs a boundary of 1 to 70 characters")
    return boundary.encode("latin-1", "replace")


class File:
    """An uploaded file: its bytes, and the name and type its part gave."""

    def __init__(self, data, filename, content_type):
        self.data, self.filename, self.content_type = data, filename, content_type


def parse(data, content_type):
    """(fields, files) of a multipart/form-data body: {name: str, or a list of them where
    a name repeats} and {name: File}.  BadRequest where it is not well formed."""
    boundary = boundary_of(content_type)
    if boundary is None:
        raise BadRequest("the request body must be multipart/form-data")
    delimiter = b"--" + boundary
    if not data.startswith(delimiter):
        raise BadRequest("the multipart body does not start with its boundary")
    chunks = data[len(delimiter):].split(b"\r\n" + delimiter)
    if len(chunks) < 2 or not chunks[-1].startswith(b"--"):
        raise BadRequest("the multipart body does not end with its closing boundary")
    if len(chunks) - 1 > MAX_PARTS:
        raise BadRequest("a multipart body may hold at most %d parts" % MAX_PARTS)
    fields, files = {}, {}
    for chunk in chunks[:-1]:
        if not chunk.startswith(b"\r\n"):
            raise BadRequest("a multipart boundary must end its line")
        head, sep, content = chunk[2:].partition(b"\r\n\r\n")
        if not sep:
            raise BadRequest("a multipart part has no blank line after its headers")
        part = email.message.Message()
        for line in head.decode("utf-8", "replace").split("\r\n"):
            name, colon, value = line.partition(":")
            if not colon:
                raise BadRequest("a multipart part has a header line without a colon")
            part[name.strip()] = value.strip()
        if part.get_content_disposition() != "form-data":
            raise BadRequest("a multipart part must be Content-Disposition: form-data")
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str) or not name:
            raise BadRequest("a multipart part has no name")
        filename = part.get_filename()
        if filename is not None:
            files[name] = File(content, filename, part.get_content_type())
            continue
        try:
            text = content.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest("the form field %r is not UTF-8 text" % name[:64])
        if name in fields:
            if not isinstance(fields[name], list):
                fields[name] = [fields[name]]
            fields[name].append(text)
        else:
            fields[name] = text
    return fields, files
