"""Chat messages → one prompt string, with the checkpoint's own `chat_template` when it has one.

Rendered as transformers renders it (`apply_chat_template`): a sandboxed jinja2 environment with
trim_blocks and lstrip_blocks, `raise_exception`, a `tojson` that keeps non-ASCII, `strftime_now`,
and the tokenizer's special tokens as variables. A checkpoint without a template gets PLAIN_TEMPLATE:
one "role: content" line per message, then "assistant:" to prompt the reply.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Optional

from moekit.errors import CheckpointError, MoekitError

PLAIN_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


class TemplateError(MoekitError):
    """The template refused the conversation (its own raise_exception) or could not render."""


def _raise(message: str):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(value) -> Optional[str]:
    if isinstance(value, dict):  # tokenizer_config's AddedToken form
        return value.get("content")
    return value


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]):
        from jinja2 import meta
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self.template = env.from_string(source)
        except Exception as err:  # jinja2's TemplateSyntaxError and friends
            raise CheckpointError(f"chat_template does not parse: {err}") from None
        self.special_tokens = special_tokens
        self.source = source
        # Whether the template reads a `tools` variable (as Qwen's, Llama 3.1's, Mistral's do):
        # if not, moekit.serve.tools describes the tools in a system message instead.
        self.takes_tools = "tools" in meta.find_undeclared_variables(env.parse(source))

    def render(self, messages: list[dict], tools: Optional[list[dict]] = None, add_generation_prompt: bool = True) -> str:
        """tools: OpenAI's tool list, passed as transformers passes it (the `tools` variable, None if none)."""
        try:
            return self.template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        **self.special_tokens)
        except TemplateError:
            raise
        except Exception as err:
            raise TemplateError(f"the chat template failed on these messages: {err}") from None


def gguf_chat_template(path: Path) -> ChatTemplate:
    """A GGUF's own `tokenizer.chat_template` (llama.cpp's key), with its bos/eos token texts."""
    from moekit.weights.gguf_file import read_gguf

    meta = read_gguf(path).metadata
    tokens = meta.get("tokenizer.ggml.tokens") or []
    specials = {
        name: tokens[index]
        for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        if isinstance(index := meta.get(f"tokenizer.ggml.{name}_id"), int) and 0 <= index < len(tokens)
    }
    return ChatTemplate(meta.get("tokenizer.chat_template") or PLAIN_TEMPLATE, specials)


def load_chat_template(folder: Path) -> ChatTemplate:
    """tokenizer_config.json's chat_template (or chat_template.jinja beside it), else PLAIN_TEMPLATE;
    a .gguf file's from its metadata."""
    if folder.suffix.lower() == ".gguf" and folder.is_file():
        return gguf_chat_template(folder)
    config: dict = {}
    path = folder / "tokenizer_config.json"
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: not valid JSON") from None
    source = config.get("chat_template")
    if isinstance(source, list):  # the named-templates form: take "default"
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    jinja_file = folder / "chat_template.jinja"
    if source is None and jinja_file.is_file():
        source = jinja_file.read_text()
    specials = {
        name: text
        for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        if (text := _token_text(config.get(name))) is not None
    }
    return ChatTemplate(source or PLAIN_TEMPLATE, specials)
