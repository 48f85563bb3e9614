"""Chat messages to a prompt, with the model's template.

This is the basic path: libllama's built-in templates
(``llama_chat_apply_template``), which recognise the common template
families by name or by the text of the model's own template.  A model with no
template (the default gemma-3-270m base) gets its architecture's built-in
template where libllama has one, else ChatML.
"""

from .errors import BadRequest

# general.architecture -> libllama built-in template name, for models that
# carry no template of their own
_ARCH_TEMPLATES = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3n": "gemma",
                   "llama": "llama3", "qwen2": "chatml", "qwen3": "chatml", "phi3": "phi3",
                   "mistral": "mistral-v7"}


def template_name(model, override=None):
    """The template to render with: an override, the model's own text, or a name."""
    if override:
        return override
    if model.chat_template:
        return model.chat_template
    arch = model.meta.get("general.architecture", "")
    name = _ARCH_TEMPLATES.get(arch, "chatml")
    return name if name in model.builtin_template_names() else "chatml"


def render(model, messages, add_generation_prompt=True, override=None):
    """The prompt text for a list of ChatMessage."""
    pairs = [(m.role, m.content) for m in messages]
    tmpl = template_name(model, override)
    prompt = model.builtin_template(tmpl, pairs, add_generation_prompt)
    if prompt is None:
        # the model's own template is not one libllama recognises
        prompt = model.builtin_template("chatml", pairs, add_generation_prompt)
    if prompt is None:
        raise BadRequest("could not apply a chat template to these messages")
    return prompt
