"""Request bodies of the OpenAI routes as typed models: what each field may hold, and why not.

Typed as OpenAI's API and JSON Schema type them: an integer field takes 7 or 7.0 (JSON has one
number type) but not 7.5, "7" or true; a number field takes 0 or 0.5 but not "0.5" or true. A field
these models do not name is a 400 (`extra="forbid"`), except the unimplemented OpenAI fields that
moekit.serve.validation accepts at their neutral value and the harmless ones it lists: nothing a
client asks for is silently ignored. `moe` is moekit's own: `{"tier": "S"|"A"|"B"}` or
`{"top_k": k}` or `{"routing": "adaptive:0.85"}`, the expert budget of the request.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal, Optional, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictStr, ValidationError,
                      field_validator, model_validator)

from moekit.engine.logprobs import MAX_TOP
from moekit.engine.sampling import SEED_MAX, SEED_MIN
from moekit.serve.errors import ApiError, bad_request
from moekit.serve.validation import drop_neutral, parse_json, refuse_unsupported


class FieldError(ValueError):
    """A check across fields, raised in a model validator, that names the field to blame."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def _integral(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"must be an integer, got {value}")
        return int(value)
    return value


def _number(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be a number")
    if not math.isfinite(value):
        raise ValueError(f"must be a finite number, got {value}")
    return float(value)


Integer = Annotated[int, BeforeValidator(_integral)]  # JSON Schema's "integer": 7 and 7.0
Number = Annotated[float, BeforeValidator(_number)]  # JSON Schema's "number": no strings, no booleans


def integer(ge: Optional[int] = None, le: Optional[int] = None):
    """An Integer with bounds, written where Optional[...] keeps them in the schema's integer branch."""
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_integral)]


def _seed(value):
    value = _integral(value)
    if not SEED_MIN <= value <= SEED_MAX:
        raise ValueError(f"must be a 64-bit integer, between -2**63 and 2**64 - 1, got {value}")
    return value


Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX), BeforeValidator(_seed)]  # what torch.Generator takes
MAX_PROMPTS = 256  # prompts (times n) of one request: each is a row of the batch and waits in its queue


class MoeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt budget must not silently run at full K

    tier: Optional[Literal["S", "A", "B"]] = None
    top_k: Optional[integer(ge=1)] = None
    routing: Optional[StrictStr] = None  # a routing policy (moekit.model.routing.parse_policy's forms)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: every chunk carries the usage so far (GuideLLM asks)


class Lenient(BaseModel):
    """A part of a body whose unknown fields are ignored (OpenAI adds fields; clients send them)."""

    model_config = ConfigDict(extra="ignore")


class JsonSchemaFormat(Lenient):
    """response_format.json_schema: OpenAI's {name, schema, strict, description}."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: Optional[dict] = Field(None, alias="schema")  # None: any JSON object
    strict: Optional[StrictBool] = None  # the schema is always enforced, strict or not
    description: Optional[StrictStr] = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is 'json_schema'")
        return self


class Sampled(BaseModel):
    """The fields both routes share."""

    model_config = ConfigDict(extra="forbid")

    model: Optional[StrictStr] = None
    max_tokens: Optional[integer(ge=0)] = None
    temperature: Number = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default; 0 is greedy
    top_p: Number = Field(1.0, gt=0.0, le=1.0)
    top_k: Integer = Field(-1, ge=-1)  # vLLM's: -1 (or 0) means no top-k filter
    seed: Optional[Seed] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: StrictBool = False
    n: Integer = Field(1, ge=1, le=MAX_PROMPTS)  # continuations of each prompt, sharing its prefill
    return_token_ids: StrictBool = False
    moe: Optional[MoeOptions] = None
    response_format: Optional[ResponseFormat] = None  # constrained decoding (moekit.serve.structured)
    priority: Integer = 0  # vLLM's: within the request's tier, lower is served first

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > 4:
            raise ValueError("at most 4 stop strings")
        return stops

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(Sampled):
    prompt: Union[StrictStr, list[Integer], list[StrictStr], list[list[Integer]]]
    max_completion_tokens: Optional[integer(ge=0)] = None  # the newer name, as on chat
    logprobs: Optional[integer(ge=0, le=MAX_TOP)] = None  # each token's logprob and this many top ones
    echo: StrictBool = False  # the prompt comes back before the completion (with its logprobs)

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value):
        """One prompt (a string or token ids) or a list of them → a list of prompts."""
        if isinstance(value, str) or not value or not isinstance(value[0], (str, list)):
            value = [value]
        if not value:
            raise ValueError("the prompt list is empty")
        if len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request, got {len(value)}")
        for i, prompt in enumerate(value):
            if len(prompt) == 0:
                raise ValueError("the prompt is empty" if len(value) == 1 else f"prompt {i} is empty")
        return value

    @model_validator(mode="after")
    def _limits(self):
        if len(self.prompt) * self.n > MAX_PROMPTS:
            raise FieldError("n", f"{len(self.prompt)} prompts × n={self.n} is over {MAX_PROMPTS} choices per request")
        return self

    @property
    def prompts(self) -> list:
        return self.prompt

    @property
    def output_limit(self) -> Optional[int]:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: StrictStr


class FunctionCall(Lenient):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(Lenient):
    """An earlier assistant turn's call, sent back in the conversation."""

    id: Optional[StrictStr] = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[TextPart], None] = None
    tool_calls: Optional[list[ToolCall]] = None  # an assistant's earlier calls
    tool_call_id: Optional[StrictStr] = None  # a tool message: which call it answers
    name: Optional[StrictStr] = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDef(Lenient):
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Optional[StrictStr] = None
    parameters: Optional[dict] = None  # a JSON Schema of the arguments; None: no arguments
    strict: Optional[StrictBool] = None  # the schema is always enforced when a call is constrained


class Tool(Lenient):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Lenient):
    name: StrictStr


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: FunctionName


class ChatRequest(Sampled):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[integer(ge=1)] = None  # the newer name of max_tokens
    logprobs: StrictBool = False  # each token's logprob in choices[].logprobs.content
    top_logprobs: Optional[integer(ge=0, le=MAX_TOP)] = None  # and this many top ones
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[StrictBool] = None  # auto may parse several; a constrained call is one

    @model_validator(mode="after")
    def _logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self):
        names = [t.function.name for t in self.tools or []]
        choice = self.tool_choice
        if choice in ("required",) or isinstance(choice, NamedToolChoice):
            if not names:
                raise FieldError("tool_choice", "requires a non-empty tools list")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise FieldError("tool_choice", f"the function {choice.function.name!r} is not in tools")
        if len(set(names)) != len(names):
            raise FieldError("tools", "function names must be unique")
        return self

    @property
    def tool_mode(self) -> str:
        """"none", "auto", "required" or "named": OpenAI's default is auto when tools are given."""
        if not self.tools:
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def output_limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_body(raw: bytes, model: type[BaseModel]):
    """Bytes → a validated request, or the ApiError (400) a client can act on."""
    body = parse_json(raw)
    refuse_unsupported(body)
    try:
        return model.model_validate(drop_neutral(body))
    except ValidationError as err:
        raise from_validation(err) from None


def from_validation(err: ValidationError) -> ApiError:
    first = err.errors()[0]
    # Union members add their own step to the path ("prompt.str"): keep the field's own path.
    loc = [str(p) for p in first["loc"] if not _is_type_step(p)]
    param = ".".join(loc) or None
    message = first["msg"].removeprefix("Value error, ")
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        return bad_request(str(cause), param=cause.param)
    if first["type"] == "missing":
        message = "is required"
    elif first["type"] == "extra_forbidden":
        message = "unknown field (this server does not implement it)"
    elif loc[:1] == ["prompt"] and first["type"].endswith("_type"):
        param, message = "prompt", "must be a string or a list of token ids"
    return bad_request(f"{param}: {message}" if param else message, param=param)


def _is_type_step(part) -> bool:
    # pydantic's union steps: "str", "list[int]", "function-before[_integral(), int]", "literal['none','auto']",
    # a model's class name (not a field like "stream": fields are lower case)
    return isinstance(part, str) and (
        part in ("str", "int", "float", "bool") or part.startswith(("list[", "dict[", "function-", "literal[")) or part[:1].isupper()
    )
