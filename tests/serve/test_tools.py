"""Tools rendered as transformers renders them, and calls parsed back into OpenAI's tool_calls."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moekit.serve.chat import load_chat_template
from moekit.serve.protocol import ChatRequest
from moekit.serve.tools import OPEN, ToolStream, call_block, message_dict, parse_tool_calls, render_prompt
from chat_templates import QWEN_TOOLS, template_checkpoint

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "now"}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "user", "content": "And Oslo?"},
]


def _body(**fields) -> ChatRequest:
    return ChatRequest.model_validate({"messages": CONVERSATION, "tools": [WEATHER, CLOCK], **fields})


def test_a_template_with_tool_support_renders_as_transformers_renders_it(tmp_path):
    from transformers import AutoTokenizer

    folder = template_checkpoint(tmp_path / "qwen", QWEN_TOOLS)
    template = load_chat_template(folder)
    assert template.takes_tools
    body = _body()
    messages = [message_dict(m) for m in body.messages]
    # arguments reach the template as an object, as vLLM hands them to transformers' templates
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    want = AutoTokenizer.from_pretrained(folder).apply_chat_template(messages, tools=[WEATHER, CLOCK], tokenize=False,
                                                                       add_generation_prompt=True)
    assert render_prompt(template, body) == want
    assert '"name": "get_weather"' in want and "<tool_response>\n18 C, sunny" in want


def test_tool_choice_none_leaves_the_tools_out_of_the_prompt(tmp_path):
    template = load_chat_template(template_checkpoint(tmp_path / "qwen", QWEN_TOOLS))
    assert "get_weather" in render_prompt(template, _body(tool_choice="auto"))
    assert "# Tools" not in render_prompt(template, _body(tool_choice="none"))


def test_without_tool_support_the_tools_are_described_in_a_system_message(tmp_path):
    template = load_chat_template(template_checkpoint(tmp_path / "plain", None))
    assert not template.takes_tools
    text = render_prompt(template, _body())
    lines = text.splitlines()
    assert lines[0] == "system: Be brief."  # the caller's system message comes first, the tools after it
    assert json.dumps(WEATHER) in text and json.dumps(CLOCK) in text
    assert OPEN in text and '{"name": <function-name>, "arguments": <arguments-json-object>}' in text
    # the earlier call is written in the format the model is asked to use
    assert "assistant: " + call_block("get_weather", {"city": "Paris"}) in text
    assert text.endswith("user: And Oslo?\nassistant:")


def test_calls_are_parsed_and_everything_else_stays_text():
    text = (
        "Let me check.\n"
        + call_block("get_weather", {"city": "Oslo"})
        + "\n<tool_call>\nnot json\n</tool_call>\n"
        + call_block("unknown_fn", {})
        + "\n<tool_call>{\"name\": \"now\", \"arguments\": \"{}\"}</tool_call>"
    )
    content, calls = parse_tool_calls(text, ["get_weather", "now"])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("now", {}),
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert content.startswith("Let me check.\n") and "not json" in content and "unknown_fn" in content
    assert "Oslo" not in content


OUTPUTS = [
    "plain text, no call at all",
    "Sure.\n" + call_block("get_weather", {"city": "Paris"}) + "\ndone",
    call_block("now", {}) + call_block("get_weather", {"city": "Zürich"}),
    "an unfinished <tool_call>\n{\"name\": \"now\"",
    "<tool_ca is not a tag <tool_callx> either",
]


@settings(max_examples=60, deadline=None)
@given(output=st.sampled_from(OUTPUTS), cuts=st.lists(st.integers(min_value=0, max_value=120), max_size=12))
def test_streamed_content_and_calls_equal_the_whole_parse(output, cuts):
    stream = ToolStream(["get_weather", "now"])
    bounds = sorted({c for c in cuts if c < len(output)} | {0})
    pieces = [output[a:b] for a, b in zip(bounds, bounds[1:] + [len(output)])]
    sent = "".join(stream.push(p) for p in pieces[:-1])
    sent += stream.finish(pieces[-1]) if pieces else stream.finish("")
    content, calls = parse_tool_calls(output, ["get_weather", "now"])
    assert sent == content
    assert [c["function"] for c in stream.calls] == [c["function"] for c in calls]


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tool_choice": "required", "tools": []}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ],
)
def test_tool_fields_that_cannot_be_honoured_name_themselves(fields, param):
    from moekit.serve.errors import ApiError
    from moekit.serve.protocol import parse_body

    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], **fields}
    with pytest.raises(ApiError) as err:
        parse_body(json.dumps(body).encode(), ChatRequest)
    assert err.value.status == 400 and err.value.param == param
