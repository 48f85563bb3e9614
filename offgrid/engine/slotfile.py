"""llama-server's slot files: POST /slots/ID?action=save|restore (--slot-save-path).

The file is what ``llama_state_seq_save_file`` writes, with llama-server's
token payload, so a file saved by either server restores in the other:

    u32 magic 'ggsq' (LLAMA_STATE_SEQ_MAGIC)   u32 version 3 (LLAMA_STATE_SEQ_VERSION)
    u32 n                                       n x i32 payload
    the sequence's state (llama_state_seq_get_data less its 8-byte header)

The payload is llama-server's ``server_tokens::serialize``: LLAMA_TOKEN_NULL
(-1), its version 1, the token count and the tokens, then the count of media
chunks (0: offgrid has none).  Older servers wrote the plain token list; both
are read.  Python writes and reads the file (not libllama's file functions,
which throw through C on a short file): every size is checked against the
file's before anything is allocated or handed to libllama.
"""

import array
import json
import os
import struct
import sys

from ..protocol import valid_filename  # noqa: F401  (the front checks names the same way)

MAGIC = 0x67677371          # 'ggsq'
VERSION = 3
TOKENS_NULL = -1            # LLAMA_TOKEN_NULL: llama-server's packed payload follows
TOKENS_VERSION = 1          # SERVER_TOKENS_STATE_VERSION
# llama_state_seq_get_data's own header, which the file does not hold:
# its io magic and the sequence id (read and discarded by set_data)
IO_HEADER = struct.pack("<Ii", 0xaf143cd8, 0)


class SlotFileError(ValueError):
    """A slot file that is not one, or not for this model (the message says why)."""


def _i32(values):
    a = array.array("i", values)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def write(path, tokens, state):
    """Write ``tokens`` and ``state`` (a ContextHandle.seq_state) to ``path``;
    returns the bytes written.  Written beside it first, then renamed: a
    failure leaves no half file under the name."""
    payload = [TOKENS_NULL, TOKENS_VERSION, len(tokens)] + list(tokens) + [0]
    head = struct.pack("<III", MAGIC, VERSION, len(payload)) + _i32(payload)
    tmp = path + ".tmp%d" % os.getpid()
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            f.write(memoryview(state)[len(IO_HEADER):])
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return len(head) + len(state) - len(IO_HEADER)


def read(path, n_vocab, media=False):
    """(tokens, state for ContextHandle.set_seq_state, bytes read) of a slot file;
    SlotFileError if it is not one (or names a token outside the vocabulary; with
    ``media``, a worker's of --mmproj, an image's media id too: engine/media.py),
    OSError if it cannot be read."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 12:
        raise SlotFileError("the file is too short for a slot file")
    magic, version, n = struct.unpack_from("<III", data, 0)
    if magic != MAGIC or version != VERSION:
        raise SlotFileError("unknown (magic, version) for a sequence state file: %08x, %08x"
                            % (magic, version))
    if n > (len(data) - 12) // 4:
        raise SlotFileError("token count in sequence state file exceeds the file size")
    packed = array.array("i")
    packed.frombytes(data[12:12 + 4 * n])
    if sys.byteorder != "little":
        packed.byteswap()
    tokens = _unpack(list(packed))
    for t in tokens:
        if not (0 <= t < n_vocab or (media and t <= -2)):
            raise SlotFileError("Invalid tokens in slot save file")
    state = data[12 + 4 * n:]
    if not state:
        raise SlotFileError("the file holds no sequence state")
    return tokens, bytearray(IO_HEADER + state), len(data)


# The LoRA adapter key a slot's cache was computed with (engine/adapters.py), which
# llama-server's format has no room for: in a file beside it, named so, only where
# the key is not empty.  A slot file without one is the base model's.
ADAPTERS_SUFFIX = ".lora.json"


def write_adapters(path, key):
    """Write (or, for the base model's empty key, remove) the adapter key of the
    slot file ``path``."""
    _write_side(path + ADAPTERS_SUFFIX, [[i, s] for i, s in key] if key else None)


def _write_side(side, value):
    """Write ``value`` as JSON to the side file ``side`` whole (through a
    temporary file), or remove it where ``value`` is None."""
    if value is None:
        try:
            os.unlink(side)
        except FileNotFoundError:
            pass
        return
    tmp = side + ".tmp%d" % os.getpid()
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, side)


def read_adapters(path, n_adapters):
    """The adapter key of the slot file ``path`` (() without a file beside it);
    SlotFileError where it names adapters this model does not have."""
    try:
        with open(path + ADAPTERS_SUFFIX) as f:
            raw = json.load(f)
    except FileNotFoundError:
        return ()
    except (OSError, ValueError) as e:
        raise SlotFileError("unreadable LoRA adapter list beside the slot file: %s" % e)
    if not isinstance(raw, list) or not all(
            isinstance(x, list) and len(x) == 2 and isinstance(x[0], int)
            and isinstance(x[1], (int, float)) and 0 <= x[0] < n_adapters for x in raw):
        raise SlotFileError("the slot was saved with LoRA adapters this server has not loaded")
    return tuple(sorted((i, float(s)) for i, s in raw if s != 0))


# The identity of the control vector a slot's cache was computed under
# (engine/controlvector.py), in a file beside it as the adapter key; a slot file
# without one was computed with none (llama-server's are).
CONTROL_SUFFIX = ".cvec.json"


def write_control_vector(path, identity):
    """Write (or, without a control vector, remove) the control vector identity of
    the slot file ``path``."""
    _write_side(path + CONTROL_SUFFIX, {"control_vector": identity} if identity else None)


def check_control_vector(path, identity):
    """SlotFileError unless the slot file ``path`` was saved under the control vector
    of identity ``identity`` (None: none): its cells hold what that vector added."""
    try:
        with open(path + CONTROL_SUFFIX) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raw = {"control_vector": None}
    except (OSError, ValueError) as e:
        raise SlotFileError("unreadable control vector identity beside the slot file: %s" % e)
    saved = raw.get("control_vector") if isinstance(raw, dict) else "?"
    if saved == identity:
        return
    if saved is None:
        why = "without a control vector, and this server runs one"
    elif identity is None:
        why = "under a control vector, and this server runs none"
    else:
        why = "under another control vector than this server's"
    raise SlotFileError("the slot was saved %s" % why)


MEDIA_SUFFIX = ".media.json"


def write_media(path, projector, placed):
    """Write (or, for a slot of text only, remove) what the slot file ``path``'s
    images need: ``projector`` (the MediaStore's identity of its mmproj: another
    projector made other cells of the same picture) and ``placed``, the
    [media id, n_tokens, n_pos] of its images placed by M-RoPE positions (a
    server started later knows them only from here)."""
    _write_side(path + MEDIA_SUFFIX,
                None if projector is None else {"mmproj": projector, "placed": placed})


def read_media(path, projector):
    """The [media id, n_tokens, n_pos] the slot file ``path`` records (none without
    a file beside it: a slot of text, or one saved before offgrid wrote them);
    SlotFileError where it was saved under another mmproj than ``projector``
    (None: this server has none)."""
    try:
        with open(path + MEDIA_SUFFIX) as f:
            raw = json.load(f)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise SlotFileError("unreadable image list beside the slot file: %s" % e)
    if not isinstance(raw, dict) or not isinstance(raw.get("placed"), list) or not all(
            isinstance(x, list) and len(x) == 3 and all(type(v) is int for v in x)
            and x[0] < -1 and 0 < x[2] <= x[1] for x in raw["placed"]):
        raise SlotFileError("unreadable image list beside the slot file")
    saved = raw.get("mmproj")
    if projector is None or saved != projector:
        name = saved.get("name", "?") if isinstance(saved, dict) else "?"
        raise SlotFileError("the slot holds images encoded by the mmproj %s, which this "
                            "server has not loaded" % name)
    return raw["placed"]


def _unpack(packed):
    """The tokens of llama-server's payload (or of an older plain list)."""
    if not packed or packed[0] != TOKENS_NULL:
        return packed
    if len(packed) < 3 or packed[1] != TOKENS_VERSION:
        raise SlotFileError("Unsupported server tokens state version")
    n = packed[2]
    if n < 0 or 3 + n > len(packed):
        raise SlotFileError("Unexpected end of server tokens state")
    tokens = packed[3:3 + n]
    rest = packed[3 + n:]
    if rest and rest[0] != 0:
        raise SlotFileError("Cannot restore media tokens without an mmproj")
    if len(rest) > 1:
        raise SlotFileError("Trailing data in server tokens state")
    return tokens
