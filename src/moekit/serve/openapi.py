"""The OpenAPI 3.1 document the server publishes at /openapi.json, built from the request models the
routes validate with (moekit.serve.protocol, moekit.serve.tokenizer_routes), so that it cannot say
other than what the server accepts. Routes read their bodies themselves (to answer in OpenAI's error
shape), so FastAPI's own generator would see no bodies: this one is written from the models.
"""

from __future__ import annotations

from pydantic.json_schema import models_json_schema

from moekit.serve.protocol import ChatRequest, CompletionRequest
from moekit.serve.tokenizer_routes import Detokenize, TokenizeChat, TokenizeCompletion

BODIES = (CompletionRequest, ChatRequest, TokenizeCompletion, TokenizeChat, Detokenize)

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}


def request_schemas() -> tuple[dict, dict]:
    """(model → its schema, a $ref into components), components' schemas."""
    keys, defs = models_json_schema([(m, "validation") for m in BODIES], ref_template="#/components/schemas/{model}")
    return {model: keys[(model, "validation")] for model in BODIES}, defs.get("$defs", {})


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def _answers(ok: dict, *errors: int) -> dict:
    out = {"200": {"description": "OK", "content": ok}}
    for status in errors:
        out[str(status)] = {"description": "an error in OpenAI's shape", "content": _json({"$ref": "#/components/schemas/Error"})}
    return out


def _post(schema: dict, summary: str, ok: dict, *errors: int) -> dict:
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": _json(schema)},
                     "responses": _answers(ok, 400, 413, *errors)}}


def _get(summary: str, ok: dict, *errors: int, parameters: list | None = None) -> dict:
    op = {"summary": summary, "responses": _answers(ok, *errors)}
    if parameters:
        op["parameters"] = parameters
    return {"get": op}


def openapi_document(version: str) -> dict:
    refs, schemas = request_schemas()
    schemas["Error"] = ERROR
    obj = _json({"type": "object"})
    events = {**obj, "text/event-stream": {"schema": {"type": "string"}}}
    model_id = [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    return {
        "openapi": "3.1.0",
        "info": {"title": "moekit", "version": version},
        "paths": {
            "/v1/completions": _post(refs[CompletionRequest], "Complete prompts (OpenAI's legacy completions)", events, 404, 429, 500, 503),
            "/v1/chat/completions": _post(refs[ChatRequest], "Answer a conversation", events, 404, 429, 500, 503),
            "/tokenize": _post({"oneOf": [refs[TokenizeCompletion], refs[TokenizeChat]]}, "Text or messages → token ids", obj, 404, 503),
            "/detokenize": _post(refs[Detokenize], "Token ids → text", obj, 404, 503),
            "/tokenizer_info": _get("The tokenizer's configuration and chat template", obj, 400, 503),
            "/v1/models": _get("The model this server serves", obj),
            "/v1/models/{model_id}": _get("One model", obj, 404, parameters=model_id),
            "/health": _get("200 once the model has loaded", obj, 503),
            "/metrics": _get("Prometheus metrics", {"text/plain": {"schema": {"type": "string"}}}),
        },
        "components": {"schemas": schemas},
    }
