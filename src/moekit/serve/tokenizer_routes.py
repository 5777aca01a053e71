"""The server's tokenizer, in vLLM's shapes, for clients that count or build tokens themselves
(lm-eval's `tokenizer_backend=remote`, which `auto` picks when these answer):

  POST /tokenize        {"prompt": str} or {"messages": [...]} → {"count", "max_model_len", "tokens", "token_strs"}
  POST /detokenize      {"tokens": [int]} → {"prompt": str}
  GET  /tokenizer_info  the checkpoint's tokenizer_config.json fields, with the chat template it serves
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError

from moekit.errors import MoekitError
from moekit.serve.errors import ApiError, bad_request
from moekit.serve.protocol import ChatMessage, Integer, from_validation
from moekit.serve.validation import parse_json, read_body


class TokenizeCompletion(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[StrictStr] = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True  # as /v1/completions encodes a prompt
    return_token_strs: StrictBool = False


class TokenizeChat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[StrictStr] = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = False  # the template writes them, as /v1/chat/completions encodes
    return_token_strs: StrictBool = False


class Detokenize(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: Optional[StrictStr] = None
    tokens: list[Integer]


TokenizeRequest = Union[TokenizeCompletion, TokenizeChat]


def _validated(raw: bytes, model: type[BaseModel]):
    try:
        return model.model_validate(parse_json(raw))
    except ValidationError as err:
        raise from_validation(err) from None


def register_tokenizer_routes(app: FastAPI, state) -> None:
    config = state.config

    def tokenizer(body):
        if not state.ready.is_set():
            raise ApiError(503, "the model is loading; retry when /health answers 200")
        if getattr(body, "model", None) not in (None, config.model_name):
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {config.model_name!r}",
                           "model", "model_not_found")
        if state.engine.tokenizer is None:
            raise bad_request("this model has no tokenizer.json")
        return state.engine.tokenizer

    @app.post("/tokenize")
    async def tokenize(http: HttpRequest):
        raw = await read_body(http, config.max_body_bytes)
        body = _validated(raw, TokenizeChat if "messages" in parse_json(raw) else TokenizeCompletion)
        tok = tokenizer(body)
        if isinstance(body, TokenizeChat):
            messages = [{"role": m.role, "content": m.text} for m in body.messages]
            try:
                text = state.template.render(messages, add_generation_prompt=body.add_generation_prompt)
            except MoekitError as err:
                raise bad_request(str(err), "messages") from None
        else:
            text = body.prompt
        encoding = tok.encode(text, add_special_tokens=body.add_special_tokens)
        return JSONResponse({
            "count": len(encoding.ids),
            "max_model_len": state.scheduler.max_len,
            "tokens": list(encoding.ids),
            "token_strs": list(encoding.tokens) if body.return_token_strs else None,
        })

    @app.post("/detokenize")
    async def detokenize(http: HttpRequest):
        body = _validated(await read_body(http, config.max_body_bytes), Detokenize)
        tok = tokenizer(body)
        vocab = state.engine.spec.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", "tokens")
        return JSONResponse({"prompt": tok.decode(body.tokens, skip_special_tokens=False)})

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tokenizer(None)
        info = tokenizer_config(Path(config.checkpoint))
        info.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        info["chat_template"] = state.template.source
        info["model_max_length"] = state.scheduler.max_len
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            info.setdefault(name, None)
        return JSONResponse(info)


def tokenizer_config(folder: Path) -> dict:
    """tokenizer_config.json's fields, with AddedToken forms ({"content": ...}) as their text."""
    path = folder / "tokenizer_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        config = {}
    config.pop("added_tokens_decoder", None)  # the ids' table: tokenizer.json holds it, and it is large
    return {k: (v.get("content") if isinstance(v, dict) and "content" in v else v) for k, v in config.items()}
