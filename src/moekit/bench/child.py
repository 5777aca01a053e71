"""Benchmark runs in child processes: each prints one JSON line, and its peak RSS is its own.

`json_main` is the child's side (the result, or one `error:` line and exit 2); `run_json_child` the
parent's (the parsed result, or a MoekitError carrying the child's last stderr line). No torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Callable, Optional

from moekit.errors import MoekitError


class ChildCrashed(MoekitError):
    """The child died by a signal (a segfault in a baseline's native code, say)."""


def parse_ids(text: str) -> list[int]:
    """'1,2,3' → [1, 2, 3]: the --prompt-ids of a child's command line."""
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise MoekitError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def json_main(produce: Callable[[], dict]) -> int:
    """Print produce()'s result as one JSON line (exit 0), or its MoekitError as one line (exit 2)."""
    try:
        result = produce()
    except MoekitError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def run_json_child(argv: list[str], what: str, timeout_s: Optional[float] = None,
                   env: Optional[dict[str, str]] = None) -> dict:
    """Run argv (with `env` as its whole environment, when given) and return the JSON object on its
    last stdout line."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise MoekitError(f"{what} did not finish within {timeout_s} s") from None
    if done.returncode < 0:  # killed by a signal: a crash, not an error the child reported
        raise ChildCrashed(f"{what} crashed (signal {-done.returncode})")
    if done.returncode != 0:
        raise MoekitError(f"{what} failed: {_last_line(done.stderr) or f'exit status {done.returncode}'}")
    try:
        result = json.loads(_last_line(done.stdout))
    except json.JSONDecodeError:
        raise MoekitError(f"{what} printed no JSON result: {_last_line(done.stdout)[:200]!r}") from None
    if not isinstance(result, dict):
        raise MoekitError(f"{what} printed JSON that is not an object")
    return result
