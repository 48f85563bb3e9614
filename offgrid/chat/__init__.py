"""Chat: templates, the Jinja subset, reply parsing, tool-call grammars, JSON schema.

Pure Python; it runs in a model's worker process beside the engine and
never imports libllama (a model is passed in where tokens are needed).

    prompt.py       a chat request made ready: prompt text, grammar, how to read the reply
    template.py     ChatTemplate: messages and tools to prompt text, per family
    select.py       which template a model uses (its own, --chat-template, a built-in)
    reply.py        model text back to content, reasoning and tool calls (streamed too)
    jsonschema.py   JSON schema to GBNF
    gbnf.py         the GBNF check every grammar passes before libllama sees it
    jinja/          the Jinja subset chat templates are written in
"""
