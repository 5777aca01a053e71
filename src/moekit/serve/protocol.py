"""Request bodies of the OpenAI routes as typed models: what each field may hold, and why not.

Unknown fields are ignored, as vLLM ignores them (clients send presence_penalty, user, logprobs…);
a known field of the wrong type or out of range is a 400 naming it. `moe` is moekit's own:
`{"tier": "S"|"A"|"B"}`, `{"top_k": k}` or `{"routing": "adaptive:0.85"}`, the expert budget of the request.
"""

from __future__ import annotations

import json
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, field_validator

from moekit.serve.errors import ApiError, bad_request


class MoeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt budget must not silently run at full K

    tier: Optional[Literal["S", "A", "B"]] = None
    top_k: Optional[StrictInt] = Field(None, ge=1)
    routing: Optional[StrictStr] = None  # a routing policy (moekit.model.routing.parse_policy's forms)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: StrictBool = False


class Sampled(BaseModel):
    """The fields both routes share."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[StrictStr] = None
    max_tokens: Optional[StrictInt] = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default; 0 is greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt = Field(-1, ge=-1)  # vLLM's: -1 (or 0) means no top-k filter
    seed: Optional[StrictInt] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: StrictBool = False
    n: StrictInt = Field(1, ge=1, le=1)  # one choice per request
    return_token_ids: StrictBool = False
    moe: Optional[MoeOptions] = None

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


class CompletionRequest(Sampled):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("one prompt per request (a batch of prompts is not supported)")
            value = value[0]
        if len(value) == 0:
            raise ValueError("the prompt is empty")
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[TextPart], None] = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(Sampled):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = None  # the newer name of max_tokens

    @property
    def output_limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def parse_body(raw: bytes, model: type[BaseModel]):
    """Bytes → a validated request, or the ApiError (400) a client can act on."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise bad_request(f"the body is not valid JSON ({err.msg if hasattr(err, 'msg') else err})") from None
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise _from_validation(err) from None


def _from_validation(err: ValidationError) -> ApiError:
    first = err.errors()[0]
    # Union members add their own step to the path ("prompt.str"): keep the field's own path.
    loc = [str(p) for p in first["loc"] if not _is_type_step(p)]
    param = ".".join(loc) or None
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        message = "is required"
    elif loc[:1] == ["prompt"] and first["type"].endswith("_type"):
        param, message = "prompt", "must be a string or a list of token ids"
    return bad_request(f"{param}: {message}" if param else message, param=param)


def _is_type_step(part) -> bool:
    return isinstance(part, str) and (part.startswith(("list[", "str", "int", "function-")) or part in ("str", "int"))
