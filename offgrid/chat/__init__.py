"""Chat: templates, the Jinja subset, reply parsing, tool-call grammars, JSON schema.

Pure Python; it runs in a model's worker process beside the engine and
never imports libllama (a model is passed in where tokens are needed).

    prompt.py       a chat request made ready: prompt text, grammar, how to read the reply
    template.py     ChatTemplate: messages and tools to prompt text, per family
    caps.py         what a template reads (llama-server's capability probes)
    adjust.py       the message changes llama-server makes per family
    replyformat.py  how a reply looks: reasoning markers, tool-call syntax
    forced.py       grammars that force a call, in the family's own form
    shapes.py       each family's call shape (derive.py: one from the template's renderings)
    calls.py        a shape's calls read, whole or so far
    select.py       which template a model uses (its own, --chat-template, a built-in)
    reply.py        model text back to content, reasoning and tool calls (streamed too)
    jsonschema.py   JSON schema to GBNF
    gbnf.py         the GBNF check every grammar passes before libllama sees it
    jinja/          the Jinja subset chat templates are written in
"""
