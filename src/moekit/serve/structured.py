"""Structured output: a request's `response_format` or forced tool call → the grammar its tokens follow.

`{"type": "json_object"}` is any JSON object, `{"type": "json_schema", "json_schema": {"schema": ...}}`
that schema, compiled by llguidance (moekit.engine.constraints) into a per-row token mask. The JSON
is compact (no whitespace between tokens of JSON), so a model cannot pad it forever. A schema the
library refuses is a 400 naming the field, with the library's reason.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional

from moekit.engine.constraints import (
    ConstraintError,
    TokenConstraint,
    check_grammar,
    grammar_tokenizer,
    json_schema_grammar,
    new_constraint,
)
from moekit.serve.errors import bad_request
from moekit.serve.protocol import Sampled

ANY_OBJECT = {"type": "object"}


@dataclass
class Grammars:
    """One server's grammar side: llguidance's view of the tokenizer, built on first use (a large
    vocabulary takes about a second), and fresh matchers for requests."""

    tokenizer: Optional[object]  # tokenizers.Tokenizer
    vocab_size: int
    eos_ids: tuple[int, ...]
    _built: Optional[object] = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def grammar_tokenizer(self, param: str):
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer.json, which constrained decoding needs", param)
        with self._lock:
            if self._built is None:
                try:
                    self._built = grammar_tokenizer(self.tokenizer, self.vocab_size, self.eos_ids)
                except ConstraintError as err:
                    raise bad_request(str(err), param) from None
            return self._built

    def check(self, grammar: str, param: str) -> None:
        """A 400 naming `param` if the library refuses this grammar."""
        try:
            check_grammar(grammar, self.grammar_tokenizer(param))
        except ConstraintError as err:
            raise bad_request(f"{param}: {err}", param) from None

    def constraint(self, grammar: str, param: str) -> TokenConstraint:
        self.check(grammar, param)
        try:
            return new_constraint(grammar, self.grammar_tokenizer(param), self.vocab_size)
        except ConstraintError as err:
            raise bad_request(f"{param}: {err}", param) from None


def response_grammar(body: Sampled) -> Optional[tuple[str, str]]:
    """(grammar, the field it came from) for a body's response_format; None for free text."""
    if _free_text(body):
        return None
    fmt = body.response_format
    if fmt.type == "json_object":
        return json_schema_grammar(ANY_OBJECT), "response_format"
    param = "response_format.json_schema.schema"
    schema = fmt.json_schema.schema_
    return _schema_grammar(ANY_OBJECT if schema is None else schema, param), param


def _schema_grammar(schema: dict, param: str) -> str:
    try:
        return json_schema_grammar(schema)
    except ValueError as err:  # the library's own refusal of a value that is no schema at all
        raise bad_request(f"{param}: {err}", param) from None


def _free_text(body: Sampled) -> bool:
    """No response_format, or the text one."""
    return body.response_format is None or body.response_format.type == "text"


def _calls_tools(body: Sampled) -> bool:
    """A chat request whose tools the model may call (tool_choice other than 'none')."""
    from moekit.serve.protocol import ChatRequest

    return isinstance(body, ChatRequest) and body.tool_mode != "none"


def asks_for_grammar(body: Sampled) -> bool:
    """Whether request_constraint has anything to compile or check for this body (a free-text
    request skips the worker thread that compiling takes)."""
    return _calls_tools(body) or not _free_text(body)


def request_constraint(grammars: Grammars, body: Sampled) -> Optional[TokenConstraint]:
    """The grammar a request's tokens must follow, or None for free decoding; a 400 naming the
    field for what cannot be honoured."""
    from moekit.serve.tools import forced_functions, parameters_grammars, tool_call_grammar

    if _calls_tools(body):
        for grammar, param in parameters_grammars(body):
            grammars.check(grammar, param)
        if response_grammar(body) is not None:
            raise bad_request("response_format: cannot be combined with tools unless tool_choice is 'none'", "response_format")
        if body.tool_mode in ("required", "named"):
            return grammars.constraint(tool_call_grammar(forced_functions(body)), "tool_choice")
        return None  # auto: free text, calls parsed from it (moekit.serve.tools)
    found = response_grammar(body)
    return None if found is None else grammars.constraint(*found)
