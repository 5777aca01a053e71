"""A request body's bytes → a JSON object, or a 400 naming what is wrong with it.

Python's json module accepts what a server must refuse (NaN and Infinity, lone UTF-16 surrogates
that no tokenizer can encode) and raises what is not a 400 (RecursionError on deep nesting,
ValueError on integers past 4300 digits). Each is refused here with one line.

Also here: the OpenAI fields this server does not implement. Each is accepted only at the value
that asks for nothing (a penalty of 0, no logit bias): any other value is a 400 naming the field,
because a client cannot tell a silently ignored field from one that had no effect.
"""

from __future__ import annotations

import json
from typing import Any

from moekit.serve.errors import ApiError, bad_request

MAX_DEPTH = 32  # the deepest request body nests 5 levels (chat content parts); a margin, not a limit users meet


async def read_body(http, limit: int) -> bytes:
    """The body's bytes, or a 413 once it passes `limit` (checked as it arrives, not after)."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the body is {declared} bytes; the limit is {limit}", code="request_too_large")
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the body is over the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw: bytes) -> dict:
    """Bytes → a dict, or the ApiError (400) a client can act on."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise bad_request(f"the body is not valid JSON ({getattr(err, 'msg', err)})") from None
    except RecursionError:
        raise bad_request(f"the body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as err:  # an integer literal past Python's 4300 digits, or NaN/Infinity
        raise bad_request(f"the body is not valid JSON ({str(err).splitlines()[0]})") from None
    if not isinstance(body, dict):
        raise bad_request(f"the body must be a JSON object, got {type(body).__name__}")
    check_tree(body)
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def check_tree(body: dict) -> None:
    """No nesting past MAX_DEPTH, no string with a lone surrogate (walked without recursion)."""
    stack: list[tuple[Any, tuple, int]] = [(body, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad_request(f"the body nests deeper than {MAX_DEPTH} levels", _param(path[:1]))
        if isinstance(value, dict):
            for key, item in value.items():
                if not _encodable(key):
                    raise bad_request("a key holds a lone UTF-16 surrogate (not text)", _param(path))
                stack.append((item, path + (key,), depth + 1))
        elif isinstance(value, list):
            stack.extend((item, path + (i,), depth + 1) for i, item in enumerate(value))
        elif isinstance(value, str) and not _encodable(value):
            raise bad_request(f"{_param(path)}: holds a lone UTF-16 surrogate (not text)", _param(path))


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _param(path: tuple) -> str | None:
    return ".".join(str(p) for p in path) or None


# OpenAI fields moekit does not implement, and the value of each that asks for nothing.
NEUTRAL: dict[str, tuple] = {
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "logit_bias": ({}, None),
    "suffix": ("", None),
    "functions": ([], None),
    "function_call": ("none", None),
    "min_p": (0, 0.0, None),
    "store": (False, None),  # OpenAI keeps the completion for later use; nothing here keeps it
    "best_of": (1, None),  # only as many candidates as returned (`n`)
}

# Accepted and ignored, because ignoring them changes nothing a client gets back.
HARMLESS = {
    "user": "an end-user id for the provider's abuse monitoring; nothing here monitors",
    "metadata": "tags for the provider's dashboard; nothing here stores requests",
    "service_tier": "the provider's latency class; moekit's own budget is `moe.tier`",
}


def drop_neutral(body: dict) -> dict:
    """The body without the fields checked above (unimplemented at their neutral value, or harmless)."""
    return {k: v for k, v in body.items() if k not in NEUTRAL and k not in HARMLESS}


def refuse_unsupported(body: dict) -> None:
    """A 400 naming the first unimplemented field that asks for something."""
    for name, neutral in NEUTRAL.items():
        if name in body and not any(_same(body[name], n) for n in neutral):
            raise ApiError(400, f"{name}: not supported by this server (send {_shown(neutral[0])} or leave it out)",
                           name, "unsupported_field")


def _same(value, neutral) -> bool:
    return type(value) is type(neutral) and value == neutral or (
        isinstance(value, (int, float)) and not isinstance(value, bool) and isinstance(neutral, (int, float)) and value == neutral
    )


def _shown(value) -> str:
    return json.dumps(value)
