"""The bindings tokenize exactly as llama.cpp's own tokenizer tests expect.

The pinned source keeps vocab-only GGUF files with test vectors beside them:
``models/ggml-vocab-NAME.gguf.inp`` holds the cases, separated by a line
``__ggml_vocab_test__`` (the file ends with one), and ``.gguf.out`` holds one
line of space-separated token ids per case, made by the reference (Hugging
Face) tokenizer.  llama.cpp's tests/test-tokenizer-0.cpp tokenizes each case
with ``add_special=false, parse_special=false``: no BOS, no leading space
added, special-token text left as text.  This does the same through
``Model.tokenize``, so a wrong argument order or type in ``llama_tokenize``'s
binding, or a mangled string, shows up here.
"""

import pytest

from offgrid.errors import ContextError
from offgrid.engine.model import Model
from offgrid.engine.session import ChatSession

# The vocabs the pinned llama.cpp runs test-tokenizer-0 on (tests/CMakeLists.txt).
# Listed, not discovered, so that a missing file fails rather than vanishes.
VOCABS = ("bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2",
          "llama-bpe", "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder")

SEPARATOR = "\n__ggml_vocab_test__\n"


def read_cases(inp, out):
    """[(text, expected ids)] from a .inp/.out pair, as test-tokenizer-0 reads them."""
    texts = inp.read_bytes().decode("utf-8").split(SEPARATOR)
    if texts[-1] == "":
        texts.pop()         # the separator after the last case
    expected = [[int(t) for t in line.split()]
                for line in out.read_text(encoding="utf-8").split("\n")]
    if expected and expected[-1] == [] and len(expected) == len(texts) + 1:
        expected.pop()      # the final newline
    assert len(texts) == len(expected), "%s and %s disagree on the number of cases" % (inp, out)
    return list(zip(texts, expected))


def test_every_vocab_with_vectors_is_tested(llama_src):
    found = {p.name[len("ggml-vocab-"):-len(".gguf.inp")]
             for p in (llama_src / "models").glob("ggml-vocab-*.gguf.inp")}
    assert found == set(VOCABS)


@pytest.mark.parametrize("name", VOCABS)
def test_tokenizing_each_case_gives_the_reference_ids(name, llama_src, lib):
    vocab = llama_src / "models" / ("ggml-vocab-%s.gguf" % name)
    cases = read_cases(vocab.with_name(vocab.name + ".inp"), vocab.with_name(vocab.name + ".out"))
    model = Model.load(str(vocab), progress=False, vocab_only=True)
    wrong = []
    try:
        for text, want in cases:
            got = model.tokenize(text, add_special=False, parse_special=False)
            if got != want:
                wrong.append((text, want, got))
    finally:
        model.close()

    assert len(cases) >= 40
    assert not wrong, "%d of %d cases differ, e.g. %r: expected %s, got %s" % (
        (len(wrong), len(cases)) + wrong[0])


def test_a_vocab_only_model_cannot_back_a_session(llama_src, lib):
    # libllama would create the context and abort the process at the first decode
    model = Model.load(str(llama_src / "models" / "ggml-vocab-starcoder.gguf"), progress=False,
                       vocab_only=True)
    try:
        assert model.vocab_only
        with pytest.raises(ContextError, match="vocab-only"):
            ChatSession(model, n_ctx=256)
    finally:
        model.close()
