"""Labelled prompts for `moekit report`: a JSONL file of {"text": ..., "domain": ...} (domain
optional), or the first held-out documents of every domain of a corpus folder (by default the
held-out sample shipped with moekit, moekit.analysis.sample)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from moekit.analysis.sample import SAMPLE
from moekit.analysis.trace_data import UNLABELLED
from moekit.errors import MoekitError


@dataclass(frozen=True)
class Prompt:
    text: str
    domain: str = UNLABELLED


def read_prompts(path: Path) -> list[Prompt]:
    path = Path(path)
    if not path.is_file():
        raise MoekitError(f"{path}: no such prompts file (one JSON object per line: {{\"text\": ..., \"domain\": ...}})")
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            text = doc["text"]
            domain = doc.get("domain", UNLABELLED)
            if not isinstance(text, str) or not isinstance(domain, str):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise MoekitError(f"{path}:{n}: not a prompt line (expected JSON with a string 'text' and an "
                              f"optional string 'domain')") from None
        if text.strip():
            out.append(Prompt(text, domain))
    if not out:
        raise MoekitError(f"{path}: no prompts in the file (one JSON object per line with a 'text')")
    return out


def corpus_prompts(corpus: Optional[Path] = None, per_domain: int = 8) -> list[Prompt]:
    """The first `per_domain` held-out documents of each domain of `corpus` (None: the shipped sample)."""
    from moekit.corpus.reader import read_split

    held = read_split(SAMPLE if corpus is None else Path(corpus), "heldout")
    return [Prompt(text, domain) for domain, docs in held.items() for text in docs[:per_domain]]
