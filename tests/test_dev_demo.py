"""`./dev demo`'s own setting (issue 15): the bundled model's text must not loop, and the output
states how it was sampled. The arguments are read from the dev script itself, then run in-process
(running ./dev could start a pip install). The demo runs the default, compiled decode step; these
tests add --eager, the reference, so that the suite does not compile the bundled model (that the
default run gives the eager run's tokens is tests/commands/test_cli_compile_default.py's)."""

from __future__ import annotations

import re
import shlex
from collections import Counter
from pathlib import Path

from cli_runner import moekit

DEV = Path(__file__).resolve().parents[1] / "dev"


def demo_args() -> list[str]:
    match = re.search(r"^demo_args=\((.*)\)$", DEV.read_text(), re.MULTILINE)
    assert match, "dev defines demo_args=(...)"
    return shlex.split(match.group(1))


def repeated_lines(text: str, at_least: int = 20) -> list[str]:
    counts = Counter(line.strip() for line in text.splitlines() if len(line.strip()) >= at_least)
    return [line for line, n in counts.items() if n > 1]


def test_the_loop_check_catches_greedy_decoding_of_the_bundled_model(capsys):
    args = [a for a in demo_args() if a != "--show-activation"]
    greedy = args[: args.index("--temperature")]
    code, out, _ = moekit(capsys, *greedy, "--eager")
    assert code == 0 and repeated_lines(out)  # "The default value is a string to the given string." twice


def test_the_demo_does_not_loop_and_states_its_setting(capsys):
    code, out, err = moekit(capsys, *demo_args(), "--eager")
    assert code == 0, err
    text = out.split("activation per generated token")[0]
    assert not repeated_lines(text), text
    assert "moekit-demo · sampling at temperature 0.7, top-p 0.9, seed 0 · prompt 'def parse_args(argv):'" in err
    assert "distinct experts: running total" in " ".join(out.split())
