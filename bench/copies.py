"""The out-of-order copy (issue #52): an answer whose lines are the prompt's,
in another order.

Ten function stubs, then their docstrings in another order, each under the
name of its function, and a chat request to put each docstring into its
function.  Qwen2.5-Coder-0.5B answers (greedy) with the stubs' lines and the
docstrings' lines interleaved: 92% of its lines are lines of the prompt,
and a line's predecessor is seldom the line before it there (the docstrings
come from the other block, in another order, and the model's matching of
names is its own).  Copy drafts that follow the prompt in order fail at
nearly every line end here; bench/run.py's ``copies`` phase measures offgrid
with its default drafts against ``--spec-type none`` on it (goal: 1.5x).
"""

from edits import run_one as _run_one

# (name, signature, docstring)
FUNCS = [
    ("read_header", "def read_header(f: BinaryIO) -> Header:",
     "Read the magic, the version and the two counts, and check them."),
    ("read_metadata", "def read_metadata(f: BinaryIO, count: int) -> Dict[str, Value]:",
     "Read count key/value pairs; a key seen twice is an error."),
    ("read_tensor_infos", "def read_tensor_infos(f: BinaryIO, count: int) -> List[TensorInfo]:",
     "Read count tensor descriptions: name, shape, type and offset."),
    ("tensor_data_offset", "def tensor_data_offset(header_end: int, alignment: int) -> int:",
     "Where the tensor data starts: the end of the header, aligned up."),
    ("write_header", "def write_header(f: BinaryIO, n_tensors: int, n_kv: int) -> None:",
     "Write the magic, the version, the tensor count and the key count."),
    ("write_metadata", "def write_metadata(f: BinaryIO, metadata: Dict[str, Value]) -> None:",
     "Write every key/value pair in the order they were added."),
    ("write_tensor_infos",
     "def write_tensor_infos(f: BinaryIO, tensors: List[TensorInfo]) -> int:",
     "Write each tensor's description; return the bytes of data they need."),
    ("pad_to_alignment", "def pad_to_alignment(f: BinaryIO, alignment: int) -> None:",
     "Write zero bytes until the file's position is a multiple of alignment."),
    ("read_string", "def read_string(f: BinaryIO) -> str:",
     "A length-prefixed UTF-8 string; bytes that are not UTF-8 survive a round trip."),
    ("write_string", "def write_string(f: BinaryIO, s: str) -> None:",
     "The length as a little-endian u64, then the string's UTF-8 bytes."),
]
ORDER = [5, 2, 8, 0, 7, 3, 9, 6, 1, 4]      # the docstrings' order in the prompt
N_PREDICT = {"out_of_order": 450}


def out_of_order_text(funcs=FUNCS, order=ORDER):
    """The user's message: the stubs, the docstrings in ``order``, the request."""
    stubs = "\n\n".join("%s\n    pass" % f[1] for f in funcs)
    docs = "\n".join('# %s\n    """%s"""' % (funcs[i][0], funcs[i][2]) for i in order)
    return ("Here are some functions:\n\n```python\n%s\n```\n\nTheir docstrings, each under "
            "the name of its function:\n\n```python\n%s\n```\n\nPut each docstring into its "
            "function, above the `pass`. Reply with all the functions in one code block and "
            "nothing else." % (stubs, docs))


def bodies(model="model"):
    return {"out_of_order": ("/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": out_of_order_text()}],
        "temperature": 0, "max_tokens": N_PREDICT["out_of_order"], "cache_prompt": False})}


def lines_from(prompt, answer):
    """(answer's lines, those that are lines of the prompt, those of them whose
    line before in the answer is not their line before in the prompt): blank
    lines and code fences left out."""
    def lines(text):
        return [ln.strip() for ln in text.split("\n")
                if ln.strip() and not ln.strip().startswith("```")]
    pl = lines(prompt)
    where = {}
    for i, ln in enumerate(pl):
        where.setdefault(ln, []).append(i)
    al = lines(answer)
    copied = moved = 0
    for j, ln in enumerate(al):
        if ln not in where:
            continue
        copied += 1
        if j == 0 or not any(i > 0 and pl[i - 1] == al[j - 1] for i in where[ln]):
            moved += 1
    return len(al), copied, moved


def run_one(port, name="out_of_order", model="model"):
    return _run_one(port, name, model, bodies=bodies(model))
