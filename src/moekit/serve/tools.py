"""Tools on chat: rendered into the prompt, forced by a grammar when asked, parsed back into `tool_calls`.

The call format is Hermes' (Qwen's templates and many fine-tunes use it), one call per block:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- Rendering: a template that reads the `tools` variable gets OpenAI's tool list in it, as
  transformers' apply_chat_template passes it. A template that does not (and the plain fallback
  template) gets the tools and this format described in a system message, first in the conversation.
- tool_choice "required" or a named function: decoding is constrained to one such block whose JSON
  is {"name": one of the tools (or the named one), "arguments": valid for that function's schema}.
- tool_choice "auto": decoding is free; each block of the output whose JSON has a known "name" and
  an object "arguments" becomes a call, the text around the blocks is the message's content.
  A block that does not parse stays in the content, as text.
- tool_choice "none": the tools are not shown to the model and nothing is parsed.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Optional

from moekit.engine.constraints import lark_grammar
from moekit.serve.protocol import ChatMessage, ChatRequest, FunctionDef, NamedToolChoice

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}

FALLBACK_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query. "
    "The functions, one JSON object a line:\n{tools}\n"
    "To call a function, answer with its name and arguments as JSON inside tool_call tags:\n"
    + OPEN + '\n{{"name": <function-name>, "arguments": <arguments-json-object>}}\n' + CLOSE
)


def _tool_dicts(body: ChatRequest) -> list[dict]:
    return [tool.model_dump(exclude_none=True, by_alias=True) for tool in body.tools or []]


def _arguments(text: str):
    """An earlier call's arguments as the object templates expect (vLLM parses them too); kept as
    text if they are not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def message_dict(message: ChatMessage) -> dict:
    out: dict = {"role": message.role, "content": message.text}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def call_block(name: str, arguments) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def _spelled_out(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The fallback for a template without tool support: tools described in a system message, and
    earlier calls written into their assistant turns in the format the model is asked to use."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    instructions = FALLBACK_INSTRUCTIONS.format(tools=listed)
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            blocks = [call_block(c["function"]["name"], c["function"]["arguments"]) for c in calls]
            m["content"] = "\n".join(([m["content"]] if m["content"] else []) + blocks)
        out.append(m)
    if out and out[0]["role"] == "system":
        out[0]["content"] = out[0]["content"] + "\n\n" + instructions
    else:
        out.insert(0, {"role": "system", "content": instructions})
    return out


def render_prompt(template, body: ChatRequest) -> str:
    """The conversation (and its tools, unless tool_choice is none) through the chat template."""
    messages = [message_dict(m) for m in body.messages]
    if body.tool_mode == "none":
        return template.render(messages)
    tools = _tool_dicts(body)
    if template.takes_tools:
        return template.render(messages, tools=tools)
    return template.render(_spelled_out(messages, tools))


def call_schema(function: FunctionDef) -> dict:
    """The JSON of one call to `function`: its name, and arguments valid for its parameters."""
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": function.parameters or NO_ARGUMENTS},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_functions(body: ChatRequest) -> list[FunctionDef]:
    """The functions a constrained call may name: the named one, or any for "required"."""
    functions = [t.function for t in body.tools or []]
    if isinstance(body.tool_choice, NamedToolChoice):
        return [f for f in functions if f.name == body.tool_choice.function.name]
    return functions


def tool_call_grammar(functions: list[FunctionDef]) -> str:
    """One call block to one of `functions` (compact JSON, like moekit.serve.structured)."""
    schema = {"x-guidance": {"whitespace_flexible": False}, "anyOf": [call_schema(f) for f in functions]}
    return lark_grammar(f'start: {json.dumps(OPEN + chr(10))} call {json.dumps(chr(10) + CLOSE)}\ncall: %json {json.dumps(schema)}')


def parameters_grammars(body: ChatRequest) -> list[tuple[str, str]]:
    """(grammar of one function's call, its field) for each tool: each is checked on its own, so a
    schema the library refuses is named by its place in the request."""
    return [(tool_call_grammar([t.function]), f"tools[{i}].function.parameters") for i, t in enumerate(body.tools or [])]


def _new_call(name: str, arguments) -> dict:
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def parse_tool_calls(text: str, names: list[str]) -> tuple[str, list[dict]]:
    """Output text → (content without the blocks that were calls, OpenAI's tool_calls)."""
    calls: list[dict] = []

    def take(match: re.Match) -> str:
        try:
            obj = json.loads(match.group(1))
        except ValueError:
            return match.group(0)
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return match.group(0)
        arguments = obj.get("arguments", {})
        if isinstance(arguments, str):
            arguments = _arguments(arguments)
        if not isinstance(arguments, dict):
            return match.group(0)
        calls.append(_new_call(obj["name"], arguments))
        return ""

    content = _BLOCK.sub(take, text)
    return content, calls


@dataclass
class ToolStream:
    """Streamed content with calls held back: text is released up to where a call block may begin;
    from there on it is held until the end, when the blocks become tool_calls."""

    names: list[str]
    sent: str = ""
    held: str = ""
    calls: list[dict] = field(default_factory=list)

    def push(self, piece: str) -> str:
        self.held += piece
        start = self.held.find(OPEN)
        if start < 0:
            start = _partial_open(self.held)
        out, self.held = self.held[:start], self.held[start:]
        self.sent += out
        return out

    def finish(self, rest: str) -> str:
        """The end: the content not yet sent; self.calls holds the calls."""
        content, self.calls = parse_tool_calls(self.sent + self.held + rest, self.names)
        # What was sent comes before any block, so it is a prefix of the content.
        return content[len(self.sent) :]


def _partial_open(text: str) -> int:
    """Where a tail of `text` that may grow into OPEN begins (len(text) if none)."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return len(text) - size
    return len(text)


def content_or_none(content: str, calls: list[dict]) -> Optional[str]:
    """A message with calls and only whitespace around them has no content (null), as OpenAI sends it."""
    return None if calls and not content.strip() else content
