"""Help as a person reads it: flags shown as flags, and prose that wraps at the terminal.

typer's rich help keeps every newline of a help string after its first paragraph, so a sentence
broken in the source breaks on screen too (mid-line at any width but the author's), and it shows a
boolean flag's type (`<bool>`) as if the flag took a value. `readable` fixes both on the click
command typer builds, before it runs.
"""

from __future__ import annotations

import re

# A line that starts a new line on screen as in the source: indented (an example), a list item, a
# `moekit` command line, or one after a line that ends a heading ("Examples:").
_KEEPS_ITS_LINE = re.compile(r"^(\s|[-•*]\s|moekit\s|\$ )")


def unwrap(text: str) -> str:
    """Join the lines of each prose paragraph of TEXT (paragraphs are separated by a blank line),
    keeping examples, list items and lines after a heading on lines of their own."""
    paragraphs = []
    for para in text.split("\n\n"):
        lines = para.split("\n")
        out = [lines[0]]
        for line in lines[1:]:
            if not line.strip() or _KEEPS_ITS_LINE.match(line) or out[-1].rstrip().endswith(":") \
                    or _KEEPS_ITS_LINE.match(out[-1]):
                out.append(line)
            else:
                out[-1] = out[-1].rstrip() + " " + line.strip()
        paragraphs.append("\n".join(out))
    return "\n\n".join(paragraphs)


def readable(command) -> None:
    """Every command under COMMAND (a click command typer built): help prose unwrapped, and no type
    shown for a boolean flag."""
    todo = [command]
    while todo:
        cmd = todo.pop()
        if cmd.help:
            cmd.help = unwrap(cmd.help)
        for param in cmd.params:
            flag_without_type(param)
            if getattr(param, "help", None):
                param.help = unwrap(param.help)
        cmd.get_help_option = _flag_help_option(cmd.get_help_option)
        todo += list(getattr(cmd, "commands", {}).values())


def flag_without_type(param):
    if getattr(param, "is_flag", False) and param.metavar is None:
        param.metavar = ""  # typer shows a metavar instead of the type: an empty one shows nothing
    return param


def _flag_help_option(make):
    """-h/--help is made per call by click, outside the command's params."""
    return lambda ctx: None if (option := make(ctx)) is None else flag_without_type(option)
