"""Token logprobs in the shapes clients parse: the legacy completions object (as vLLM returns it,
echo's prompt tokens first, the first one null) and chat's `logprobs.content` list (OpenAI's).

A token's text is its own decoded text (a byte-level piece of a multi-byte character decodes to
U+FFFD, as in vLLM); without a tokenizer it is "token_id:N" (vLLM's return_tokens_as_token_ids).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from moekit.engine.logprobs import TokenLogprob

FLOOR = -9999.0  # JSON has no -Infinity: a token of probability 0 gets this (vLLM's floor too)

TokenText = Callable[[int], str]


def token_text(tokenizer) -> TokenText:
    if tokenizer is None:
        return lambda token: f"token_id:{token}"
    return lambda token: tokenizer.decode([token], skip_special_tokens=False)


def _lp(value: float) -> float:
    return max(value, FLOOR)


def completion_logprobs(entries: Sequence[Optional[TokenLogprob]], tokens: Sequence[int], text: TokenText,
                        offset: int = 0) -> dict:
    """The legacy object: tokens, token_logprobs, top_logprobs ({text: logprob}, the chosen token
    included, as vLLM does) and text_offset, one entry per token; an entry None (echo's first
    prompt token) gives null logprobs."""
    out: dict = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for entry, token in zip(entries, tokens):
        piece = text(token)
        out["tokens"].append(piece)
        out["text_offset"].append(offset)
        offset += len(piece)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_lp(entry.logprob))
        top = {text(t): _lp(lp) for t, lp in entry.top}
        top.setdefault(piece, _lp(entry.logprob))
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(entries: Sequence[TokenLogprob], text: TokenText) -> dict:
    """OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}], "refusal": null}."""
    return {"content": [_chat_entry(e.token, e.logprob, text, e.top) for e in entries], "refusal": None}


def _chat_entry(token: int, logprob: float, text: TokenText, top=None) -> dict:
    piece = text(token)
    entry = {"token": piece, "logprob": _lp(logprob), "bytes": list(piece.encode("utf-8"))}
    if top is not None:
        entry["top_logprobs"] = [_chat_entry(t, lp, text) for t, lp in top]
    return entry
