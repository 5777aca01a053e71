"""Structured output and tools through a real `moekit serve`, driven by the official OpenAI client.

A tiny random checkpoint (its chat template has tool support) and the bundled demo model (the
plain template: the fallback). Random weights make this a real test of the constraint: left free,
such a model writes noise; constrained, every answer must parse and validate (jsonschema is the
oracle), and a free request decoding beside constrained ones must get its solo tokens.
"""

from __future__ import annotations

import json
import threading

import httpx
import jsonschema
import pytest

from hf_tiny import train_tokenizer, write_checkpoint
from moekit.engine.default_model import bundled_model_path
from moekit.engine.loader import load_engine
from moekit.serve.chat import load_chat_template
from moekit.serve.protocol import ChatRequest
from moekit.serve.tools import parse_tool_calls, render_prompt
from server_process import start_server
from chat_templates import QWEN_TOOLS

openai = pytest.importorskip("openai")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "size": {"enum": ["S", "M", "L"]},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "maxItems": 3},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "member", "size", "scores", "home"],
    "additionalProperties": False,
}
CHOICE = {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5}, {"type": "null"}, {"const": "none"}]}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather now", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["a", "b"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: arguments must be {}
]
SCHEMAS = {tool["function"]["name"]: tool["function"].get("parameters", {"type": "object", "maxProperties": 0}) for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory):
    folder = write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("random_tools"), seed=7, vocab_size=320,
                              max_position_embeddings=4096)
    train_tokenizer(folder / "tokenizer.json", vocab_size=300)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": QWEN_TOOLS}))
    return folder


@pytest.fixture(scope="module")
def random_server(random_checkpoint):
    server = start_server("--eager", random_checkpoint, "--max-batch", "4")
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def demo_server(server):
    """The bundled model's server: conftest's, which the session's other modules share."""
    return server


def _client(server):
    return openai.OpenAI(base_url=server.v1, api_key="unused", timeout=120.0, max_retries=0)


def _sampling(seed):
    return {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}


def _json_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.mark.parametrize("schema", [PERSON, CHOICE], ids=["object", "anyOf"])
@pytest.mark.parametrize("seed", [None, 1, 2, 3])
def test_chat_json_schema_output_always_parses_and_validates(random_server, schema, seed):
    out = _client(random_server).chat.completions.create(
        model=_model(random_server), messages=ASK, max_tokens=400,
        response_format=_json_format(schema), **_sampling(seed),
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.parametrize("seed", [None, 4])
def test_completions_take_response_format_too_and_stream_it(random_server, seed):
    client = _client(random_server)
    kwargs = dict(model=_model(random_server), prompt="person:", max_tokens=400, extra_body={"response_format": _json_format(PERSON)},
                  **_sampling(seed))
    whole = client.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "stop"
    jsonschema.validate(json.loads(whole.text), PERSON)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_json_object_is_one_json_object_on_chat_and_completions(demo_server, seed):
    client = _client(demo_server)
    chat = client.chat.completions.create(model="moekit-demo", messages=[{"role": "user", "content": "Answer in JSON."}],
                                          max_tokens=300, response_format={"type": "json_object"}, **_sampling(seed))
    assert chat.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    text = client.completions.create(model="moekit-demo", prompt="def parse(x):", max_tokens=300,
                                     extra_body={"response_format": {"type": "json_object"}}, **_sampling(seed))
    assert text.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(text.choices[0].text), dict)


@pytest.mark.parametrize("seed", [None, 10])
def test_the_official_clients_parse_helpers_get_typed_objects(random_server, seed):
    """openai's chat.completions.parse sends pydantic's strict schemas ($defs, anyOf with null,
    additionalProperties false) and reads the reply back into the models."""
    from typing import Literal, Optional

    from pydantic import BaseModel, Field

    class Address(BaseModel):
        city: str = Field(max_length=8)
        zip_code: str = Field(pattern=r"^[0-9]{5}$")

    class Person(BaseModel):
        name: str = Field(max_length=10)
        age: int = Field(ge=0, le=120)
        role: Literal["admin", "user"]
        address: Address
        nickname: Optional[str] = Field(default=None, max_length=6)

    class GetWeather(BaseModel):
        city: str = Field(max_length=10)
        unit: Literal["c", "f"]

    client = _client(random_server)
    model = _model(random_server)
    out = client.chat.completions.parse(model=model, messages=ASK, response_format=Person, max_tokens=400, **_sampling(seed))
    assert out.choices[0].finish_reason == "stop" and isinstance(out.choices[0].message.parsed, Person)
    out = client.chat.completions.parse(model=model, messages=ASK, tools=[openai.pydantic_function_tool(GetWeather)],
                                        tool_choice="required", max_tokens=200, **_sampling(seed))
    assert out.choices[0].finish_reason == "tool_calls"
    assert isinstance(out.choices[0].message.tool_calls[0].function.parsed_arguments, GetWeather)


def _assert_valid_calls(calls, names):
    assert calls, "no tool_calls"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("which", ["random", "demo"])  # a template with tool support; the plain fallback
@pytest.mark.parametrize("seed", [None, 5, 6])
def test_required_and_named_tool_choice_give_calls_valid_for_the_schema(which, seed, random_server, demo_server):
    server = random_server if which == "random" else demo_server
    client = _client(server)
    names = [t["function"]["name"] for t in TOOLS]
    for choice, allowed in [("required", names), ({"type": "function", "function": {"name": "add"}}, ["add"]),
                            ({"type": "function", "function": {"name": "now"}}, ["now"])]:
        out = client.chat.completions.create(model=_model(server), messages=ASK, tools=TOOLS, tool_choice=choice,
                                             max_tokens=200, **_sampling(seed))
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls"
        assert message.content is None
        _assert_valid_calls(message.tool_calls, allowed)
        assert len(message.tool_calls) == 1


def test_a_streamed_tool_call_is_the_call_the_whole_reply_gives(random_server):
    client = _client(random_server)
    kwargs = dict(model=_model(random_server), messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    deltas = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    streamed = [tc for d in deltas if d.delta.tool_calls for tc in d.delta.tool_calls]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [(c.function.name, c.function.arguments) for c in whole]
    assert [c.index for c in streamed] == list(range(len(whole)))
    assert deltas[-1].finish_reason == "tool_calls"


@pytest.mark.parametrize("seed", [None, 8, 9])
def test_auto_renders_the_tools_and_parses_what_the_model_wrote(random_server, random_checkpoint, seed):
    """auto decodes freely: the reply is exactly what the parser makes of the generated text."""
    engine = load_engine(random_checkpoint, compile=False)
    raw = httpx.post(random_server.v1 + "/chat/completions", timeout=120, json={
        "messages": ASK, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 60, "return_token_ids": True, **_sampling(seed),
    }).json()
    choice = raw["choices"][0]
    prompt = render_prompt(load_chat_template(random_checkpoint), ChatRequest.model_validate({"messages": ASK, "tools": TOOLS}))
    assert '"name": "get_weather"' in prompt
    assert raw["usage"]["prompt_tokens"] == len(engine.tokenizer.encode(prompt, add_special_tokens=False).ids)
    content, calls = parse_tool_calls(engine.decode(choice["token_ids"]), list(SCHEMAS))
    assert [c["function"] for c in choice["message"].get("tool_calls") or []] == [c["function"] for c in calls]
    assert choice["finish_reason"] == ("tool_calls" if calls else "length")
    if not calls:
        assert choice["message"]["content"] == content


def test_a_free_greedy_request_gets_its_solo_tokens_beside_constrained_ones(demo_server):
    engine = load_engine(bundled_model_path(), compile=False)
    prompt = "def parse_args(argv):"
    solo = engine.generate([engine.encode(prompt)], max_new_tokens=40, stop_ids=()).token_ids[0]
    long_json = {"type": "array", "items": {"type": "boolean"}, "minItems": 60, "maxItems": 60}
    client = _client(demo_server)
    started = threading.Barrier(4)
    results: dict = {}

    def constrained(i):
        stream = client.chat.completions.create(model="moekit-demo", messages=ASK, max_tokens=400, temperature=1.0, seed=i,
                                                response_format=_json_format(long_json), stream=True)
        chunks = iter(stream)
        text = next(chunks).choices[0].delta.content or ""
        started.wait()
        text += "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        results[i] = text

    threads = [threading.Thread(target=constrained, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    started.wait()  # three constrained rows are decoding: the free one joins their batch
    free = client.completions.create(model="moekit-demo", prompt=prompt, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    for t in threads:
        t.join(120)
    assert free.choices[0].model_extra["token_ids"] == solo
    for i in range(3):
        value = json.loads(results[i])
        jsonschema.validate(value, long_json)


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"response_format": _json_format({"type": "string", "pattern": "(?<=a)b"})}, "response_format.json_schema.schema", "look-around"),
        ({"response_format": _json_format({"type": "frobnicate"})}, "response_format.json_schema.schema", "frobnicate"),
        ({"response_format": _json_format({"type": "string", "format": "shoe-size"})}, "response_format.json_schema.schema", "shoe-size"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, "response_format.json_schema.schema", "dictionary"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is required"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_object"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "a": {"type": "string", "pattern": "(?!x)"}}}}}]}, "tools[0].function.parameters", "look-around"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "tool_choice"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(random_server, extra, param, words):
    reply = httpx.post(random_server.v1 + "/chat/completions", timeout=60,
                       json={"messages": ASK, "max_tokens": 8, **extra})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"] and error["type"] == "invalid_request_error"
    assert "\n" not in error["message"] and "Traceback" not in reply.text
    # the server goes on serving
    assert httpx.post(random_server.v1 + "/completions", timeout=60, json={"prompt": "x", "max_tokens": 2}).status_code == 200


def _model(server) -> str:
    return httpx.get(server.v1 + "/models", timeout=30).json()["data"][0]["id"]


def test_a_model_without_a_tokenizer_refuses_constrained_decoding_by_name():
    from moekit.engine.constraints import json_schema_grammar
    from moekit.serve.errors import ApiError
    from moekit.serve.structured import Grammars

    with pytest.raises(ApiError) as err:
        Grammars(None, 160, (2,)).constraint(json_schema_grammar({"type": "object"}), "response_format")
    assert err.value.status == 400 and err.value.param == "response_format" and "tokenizer" in err.value.message
