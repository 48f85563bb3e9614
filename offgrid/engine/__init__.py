"""The inference engine: a model, its sessions, sampling and prompt-cache reuse.

Everything here runs in a model's worker process (``offgrid.engine.worker``)
and reaches libllama only through the named handle classes of
``offgrid.libllama``.  The HTTP front (``offgrid.server``) never imports it,
but for the pure-Python prefix measure of ``cachereuse``.

    worker.py       the worker process: its frames and its calls
    loaded.py       Loaded: the model, its sessions, embedder and state cache, as
                    the worker's settings ask; what it reports of them
    model.py        Model: a loaded GGUF, its vocabulary and metadata (rpc.py: --rpc)
    batch.py        BatchDecoder: the sessions' one llama_context and shared decode steps
    session.py      ChatSession: one session's cache and prompt evaluation
    generate.py     its generation: sampling, drafts checked, text released
    sampling.py     the libllama sampler chain of a request's SamplingParams
    cachereuse.py   which cached runs of tokens a new prompt can keep (pure Python)
    textstream.py   bytes to text: whole characters, stop strings, indentation stops
    infill.py       the fill-in-the-middle prompt layout (llama-server's)
    promptfit.py    a FIM prompt fitted into t_max_prompt_ms; fill.py: what it
                    dropped, evaluated while the worker is idle
    lookup.py       speculative drafts from the request's own text
    threads.py      -t auto: thread counts from measured decode speed
    pacing.py       streamed pieces gathered over --stream-interval-ms
    embed.py        embeddings and rerank scores, in a context of their own
"""
