"""LoRA adapters at the front: the flags, GET/POST /lora-adapters, a request's ``lora``.

As llama-server has them (tools/server/README.md, server-context.cpp):

- ``--lora FNAME`` (scale 1) and ``--lora-scaled FNAME:SCALE`` (each a comma
  list, repeatable) load adapters beside ``-m``'s model, numbered in the order
  given; ``--lora-init-without-apply`` starts every global scale at 0.
- ``GET /lora-adapters``: ``[{"id", "path", "scale", "task_name",
  "prompt_prefix"}]``, the global scales.
- ``POST /lora-adapters`` with ``[{"id", "scale"}, ...]`` sets the global
  scales: an adapter left out gets 0, an id the model lacks is ignored; a
  body that is not an array is a 400.  ``{"success": true}``.
- A generation's ``lora`` field (the same list) replaces the global scales
  for that request, adapters left out at 0; an empty list means the global
  ones.

The front keeps the global scales (``ModelEntry.lora``: a restarted worker
keeps them) and puts the scales every generation runs with on its
GenerationParams (``resolve``, called by pipeline.run); the worker turns
them into the adapter key that batching and every cache go by
(engine/adapters.py).  Unlike llama-server, a cache computed at other scales
never serves a request: after a POST that sets every scale to 0, a repeated
prompt gets the base model's text.  ``?model=NAME`` picks the model on a
server of several (an adapter belongs to ``-m``'s model).
"""

import argparse
import math
import os
from urllib.parse import parse_qs

from ..httpd.httperrors import BadRequest


# -- the flags ---------------------------------------------------------------------------

class _InOrder(argparse.Action):
    """Both flags append to one list, so adapters are numbered in the order given
    (llama-server's common_params.lora_adapters)."""

    def __call__(self, parser, namespace, values, option_string=None):
        items = list(getattr(namespace, self.dest, None) or [])
        items.append((option_string, values))
        setattr(namespace, self.dest, items)


def add_flags(p):
    """llama-server's adapter flags, on the argparse parser ``p``."""
    p.add_argument("--lora", action=_InOrder, dest="lora_flags", default=[], metavar="FNAME",
                   help="a LoRA adapter for -m's model, at scale 1 (a comma list, or the "
                   "flag again, for several; docs/cli.md, \"LoRA adapters\")")
    p.add_argument("--lora-scaled", action=_InOrder, dest="lora_flags", default=[], nargs="+",
                   metavar="FNAME:SCALE",
                   help="a LoRA adapter at a scale of its own: FNAME:SCALE (a comma list "
                   "for several), or FNAME SCALE")
    p.add_argument("--lora-init-without-apply", action="store_true",
                   help="load the adapters at scale 0; POST /lora-adapters or a request's "
                   "\"lora\" applies them")


def specs_from(args):
    """[(path, scale)] of the flags, in the order given; ValueError saying what is
    wrong with one."""
    out = []
    for flag, values in args.lora_flags or ():
        if flag == "--lora":
            out += [(item, 1.0) for item in _csv(values)]
            continue
        if len(values) == 2 and ":" not in values[1]:
            out.append((values[0], _scale(values[1], values[0])))
            continue
        if len(values) != 1:
            raise ValueError("--lora-scaled takes FNAME:SCALE (or FNAME SCALE)")
        for item in _csv(values[0]):
            path, sep, scale = item.rpartition(":")
            if not sep or not path:
                raise ValueError("--lora-scaled format: FNAME:SCALE, not %r" % item)
            out.append((path, _scale(scale, path)))
    for path, _ in out:
        if not os.path.isfile(path):
            raise ValueError("LoRA adapter file not found: %s" % path)
    return out


def _csv(value):
    return [item.strip() for item in value.split(",") if item.strip()]


def _scale(text, path):
    try:
        scale = float(text)
    except ValueError:
        scale = math.nan
    if not math.isfinite(scale):
        raise ValueError("--lora-scaled %s: the scale %r is not a number" % (path, text))
    return scale


# -- the scales ------------------------------------------------------------------------

def scales_from(items, what):
    """{id: scale} of a list of ``{"id", "scale"}`` objects (llama-server's
    parse_lora_request: id -1 and scale 0 where absent); BadRequest for a
    malformed one."""
    if not isinstance(items, list):
        raise BadRequest("%s must be an array of objects with 'id' and 'scale' fields" % what)
    out = {}
    for item in items:
        if not isinstance(item, dict):
            raise BadRequest("%s must be an array of objects with 'id' and 'scale' fields"
                             % what)
        i, scale = item.get("id", -1), item.get("scale", 0.0)
        if isinstance(i, bool) or not isinstance(i, int):
            raise BadRequest("%s: an adapter's 'id' must be an integer" % what)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
                or not math.isfinite(scale):
            raise BadRequest("%s: an adapter's 'scale' must be a number" % what)
        out[i] = float(scale)
    return out


def request_lora(raw):
    """A generation's ``lora`` field: [[id, scale]], or None (absent or empty:
    the global scales)."""
    if raw is None:
        return None
    scales = scales_from(raw, "'lora'")
    return [[i, s] for i, s in sorted(scales.items())] or None


def resolve(entry, requested):
    """The [[id, scale]] a generation on ``entry`` runs with: the request's own
    (adapters it leaves out at 0), else the global scales; ids the model lacks
    dropped."""
    n = len(entry.lora)
    if requested:
        given = dict((i, s) for i, s in requested)
        return [[i, given.get(i, 0.0)] for i in range(n)]
    return [[i, s] for i, s in enumerate(entry.lora)]


# -- /lora-adapters ----------------------------------------------------------------------

def adapters(h, body):
    """GET /lora-adapters: the adapters and their global scales; POST: set them."""
    svc = h.service
    query = h.path.partition("?")[2]
    entry = svc.entry_for((parse_qs(query).get("model") or [None])[0])
    if h.command == "POST":
        if not isinstance(body, list):
            raise BadRequest("Request body must be an array")
        scales = scales_from(body, "the request body")
        entry.lora = [scales.get(i, 0.0) for i in range(len(entry.lora))]
        h.send_json(200, {"success": True})
        return
    h.send_json(200, listing(entry))


def listing(entry):
    """llama-server's GET /lora-adapters array for ``entry``."""
    reported = entry.info.lora if entry.info is not None else []
    out = []
    for i, scale in enumerate(entry.lora):
        r = reported[i] if i < len(reported) else {}
        out.append({"id": i, "path": entry.lora_paths[i], "scale": scale,
                    "task_name": r.get("task_name", ""),
                    "prompt_prefix": r.get("prompt_prefix", "")})
    return out
