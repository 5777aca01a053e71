"""The README's requests a user copies (issue 42, item 14): the first `curl` completion is greedy (so it
matches `moekit run`), any other is seeded, and the README says why a sampled one differs."""

from __future__ import annotations

import json
import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _curl_completion_bodies() -> list[dict]:
    text = README.read_text()
    bodies = re.findall(r"curl -s \S+/v1/completions .*?\\\n\s+-d '(\{.*?\})'", text)
    return [json.loads(b) for b in bodies]


def test_the_first_completion_is_greedy_and_every_other_is_seeded():
    bodies = _curl_completion_bodies()
    assert bodies, "no curl completion in the README"
    assert bodies[0].get("temperature") == 0 and "moe" not in bodies[0]
    assert all(b.get("temperature") == 0 or "seed" in b for b in bodies)


def test_the_readme_says_why_a_sampled_answer_differs_from_run():
    text = " ".join(README.read_text().split())
    assert "The API samples at temperature 1 unless a request says otherwise" in text
    assert "its text differs from `moekit run`'s" in text
