"""Which of our registry models stands in for each Hugging Face model of llama-server's tests.

Copied beside the suite's ``utils.py`` (see suite.py) and imported by it, so it
runs inside the suite's pytest with the suite's own ``ServerProcess``.  The
models folder comes from ``$OFFGRID_CONFORMANCE_MODELS`` (the runner sets it
to this checkout's ``models/``).

The suite's presets are tiny test models (stories260K, a 260K-parameter toy);
ours are real small models, so tests that assert the toy's exact words fail
on both servers.  The choice follows what each preset is for:

- chat and completion presets (stories260K and its split copy): SmolLM2-135M,
  the smallest instruct model we have;
- infill, tool-call and instruct-model presets (Qwen, Phi, Llama, DeepSeek):
  Qwen2.5-Coder-0.5B-Instruct, which has FIM tokens and a tool-call template;
- base-model presets (stories15M MoE, its draft, tinygemma3): gemma-3-270m,
  one vocabulary for a model and its draft;
- embedding and rerank presets (bert-bge-small, jina-reranker): none of ours
  is one; SmolLM2 stands in so the servers start, and those tests fail.
"""

import os

SMOLLM2 = "smollm2-135m-instruct-q4_1.gguf"
QWEN_CODER = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
GEMMA = "gemma-3-270m-q4_k_m.gguf"

# (substring of "repo/file" or url, our model), first match wins
MODEL_MAP = [
    ("stories260K-infill", QWEN_CODER),
    ("stories260K", SMOLLM2),
    ("stories15M_MOE", GEMMA),
    ("stories15M", SMOLLM2),          # the split-file test of test_basic
    ("tinygemma3", GEMMA),
    ("bert-bge-small", SMOLLM2),
    ("jina-reranker", SMOLLM2),
    ("Qwen", QWEN_CODER),
    ("Phi-3", QWEN_CODER),
    ("Llama-3", QWEN_CODER),
    ("DeepSeek", QWEN_CODER),
]

# download_file() URLs: the speculative draft; anything else (LoRA) is not offline
FILE_MAP = [
    ("stories15M-q4_0.gguf", GEMMA),
]


def models_dir():
    return os.environ.get("OFFGRID_CONFORMANCE_MODELS") or os.path.join(os.getcwd(), "models")


def _path(name):
    return os.path.join(models_dir(), name)


def map_model(ref):
    """Our model file for a Hugging Face reference (``repo/file`` or a URL); None if none."""
    for needle, model in MODEL_MAP:
        if needle in ref:
            return _path(model)
    return None


def use_local_model(server):
    """Rewrite a ServerProcess's model to a local file (called first thing in start())."""
    refs = [r for r in (server.model_url,
                        "/".join(x for x in (server.model_hf_repo, server.model_hf_file) if x))
            if r]
    if server.model_file or not refs:
        return      # a local file already, or the router preset (no model at all)
    mapped = map_model(refs[0]) or _path(QWEN_CODER)
    print("offgrid conformance: %s -> %s" % (refs[0], mapped))
    server.model_file = mapped
    server.model_url = server.model_hf_repo = server.model_hf_file = None


def local_file(url):
    """download_file(url), offline: a mapped local model, or a failure that says why."""
    for needle, model in FILE_MAP:
        if needle in url:
            return _path(model)
    raise RuntimeError("offgrid conformance: %s is not available offline" % url)
