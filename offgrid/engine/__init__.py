"""The inference engine: a model, its sessions, sampling and prompt-cache reuse.

Everything here runs in a model's worker process (``offgrid.engine.worker``)
and reaches libllama only through the named handle classes of
``offgrid.libllama``.  The HTTP front (``offgrid.server``) never imports it.

    model.py        Model: a loaded GGUF, its vocabulary and metadata
    session.py      ChatSession: one llama_context, prompt evaluation and generation
    sampling.py     SamplingParams and the libllama sampler chain built from them
    cachereuse.py   which cached runs of tokens a new prompt can keep (pure Python)
    textstream.py   bytes to text: whole characters, stop strings, indentation stops
    infill.py       the fill-in-the-middle prompt layout (llama-server's)
"""
