"""Chat templates render exactly as transformers' apply_chat_template renders them."""

from __future__ import annotations

import pytest

from chat_templates import template_checkpoint
from moekit.errors import CheckpointError, MoekitError
from moekit.serve.chat import PLAIN_TEMPLATE, load_chat_template

# Qwen's ChatML template (abridged: no tools), which uses loop variables, whitespace control and
# a raise_exception for a conversation it refuses.
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{% if message['role'] == 'tool' %}{{ raise_exception('tools are not supported') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# One with block tags, tojson and the special-token variables.
BLOCKS = """{{ bos_token }}
{% for m in messages %}
  {% if m.role == 'user' %}
[INST] {{ m.content | tojson }} [/INST]
  {% else %}
{{ m.content }}{{ eos_token }}
  {% endif %}
{% endfor %}
"""
MESSAGES = [
    [{"role": "user", "content": "  list files  "}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße, 日本"}, {"role": "assistant", "content": "ok"},
     {"role": "user", "content": "again"}],
]


@pytest.mark.parametrize("template", [CHATML, BLOCKS])
@pytest.mark.parametrize("messages", MESSAGES)
def test_rendering_equals_transformers(tmp_path, template, messages):
    from transformers import AutoTokenizer

    folder = template_checkpoint(tmp_path / "ckpt", template)
    want = AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert load_chat_template(folder).render(messages) == want


def test_the_templates_own_refusal_is_a_clear_error(tmp_path):
    folder = template_checkpoint(tmp_path / "ckpt", CHATML)
    with pytest.raises(MoekitError, match="tools are not supported"):
        load_chat_template(folder).render([{"role": "tool", "content": "x"}])


def test_without_a_template_the_plain_one_is_used_and_a_broken_one_is_refused(tmp_path):
    plain = load_chat_template(template_checkpoint(tmp_path / "plain", None))
    assert plain.source == PLAIN_TEMPLATE
    assert plain.render([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"
    with pytest.raises(CheckpointError, match="chat_template does not parse"):
        load_chat_template(template_checkpoint(tmp_path / "broken", "{% for m in messages %}"))
