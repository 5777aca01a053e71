"""Cleaning steps, each a small pure function: normalise, strip licence headers, filter, dedupe, split."""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass
from typing import Callable

_LICENCE_WORDS = re.compile(r"copyright|licen[cs]e|spdx|all rights reserved|warranty", re.IGNORECASE)
_BLANK_RUNS = re.compile(r"\n{3,}")


def normalise(text: str) -> str:
    """NFC, Unix newlines, no trailing spaces, at most one blank line in a row, no outer blank lines."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return _BLANK_RUNS.sub("\n\n", text).strip("\n")


def strip_licence_header(text: str) -> str:
    """Drop a leading #-comment block (after any shebang) or module docstring that is a licence notice.

    Only a block that mentions copyright/licence words goes; a block that merely documents the
    file stays, and so does the shebang.
    """
    lines = text.split("\n")
    start = 1 if lines and lines[0].startswith("#!") else 0
    end = start
    while end < len(lines) and lines[end].startswith("#"):
        end += 1
    if end > start and _LICENCE_WORDS.search("\n".join(lines[start:end])):
        return "\n".join(lines[:start] + lines[end:]).lstrip("\n")
    body = "\n".join(lines[start:])
    doc = re.match(r'\s*("""|\'\'\')(.*?)\1\n?', body, re.DOTALL)
    if doc and _LICENCE_WORDS.search(doc.group(2)) and len(_LICENCE_WORDS.findall(doc.group(2))) >= 2:
        return "\n".join(lines[:start] + [body[doc.end():].lstrip("\n")])
    return text


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass
class Document:
    domain: str
    origin: str
    text: str

    @property
    def hash(self) -> str:
        return text_hash(self.text)


def clean(domain: str, origin: str, raw: str, min_chars: int, max_chars: int, code: bool) -> Document | None:
    """One raw document → a cleaned Document, or None when it is too small or too large to keep."""
    text = normalise(strip_licence_header(raw) if code else raw)
    if not (min_chars <= len(text) <= max_chars):
        return None
    return Document(domain, origin, text)


def dedupe(docs: list[Document]) -> tuple[list[Document], int]:
    """Keep the first of each exact (normalised) text; returns (kept, number dropped)."""
    seen: set[str] = set()
    kept = []
    for doc in docs:
        h = doc.hash
        if h not in seen:
            seen.add(h)
            kept.append(doc)
    return kept, len(docs) - len(kept)


def is_heldout(doc: Document, seed: int, fraction: float) -> bool:
    """A document's split follows from its text and the seed alone: stable under reordering."""
    digest = hashlib.sha256(f"{seed}:{doc.hash}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split(docs: list[Document], seed: int, fraction: float) -> tuple[list[Document], list[Document]]:
    """(train, heldout) by document; a domain with ≥ 2 documents always gets one of each, a lone one trains."""
    if len(docs) < 2:
        return list(docs), []
    train = [d for d in docs if not is_heldout(d, seed, fraction)]
    heldout = [d for d in docs if is_heldout(d, seed, fraction)]
    if len(docs) >= 2 and not heldout:
        heldout, train = train[-1:], train[:-1]
    if len(docs) >= 2 and not train:
        train, heldout = heldout[:1], heldout[1:]
    return train, heldout


def man_page_family(origin: str) -> str:
    """The command family of a man page's path: `gcloud_compute_ssh.1.gz` and `gcloud_alpha.1.gz` → `gcloud`."""
    stem = origin.rsplit("/", 1)[-1].split(".", 1)[0]
    return re.split(r"[_\-]", stem, maxsplit=1)[0].lower()


def cap_per_family(docs: list[Document], family: Callable[[str], str], max_docs: int, seed: int) -> tuple[list[Document], int]:
    """At most `max_docs` documents of each family (a seeded, order-independent choice); returns (kept, dropped).

    One installed SDK can ship thousands of templated pages of one command; uncapped, they crowd
    out the rest of the domain and flatter its held-out perplexity.
    """
    if max_docs <= 0:
        return list(docs), 0
    ranked = sorted(docs, key=lambda d: hashlib.sha256(f"family:{seed}:{d.hash}".encode()).digest())
    counts: dict[str, int] = {}
    keep: set[int] = set()
    for doc in ranked:
        name = family(doc.origin)
        if counts.get(name, 0) < max_docs:
            counts[name] = counts.get(name, 0) + 1
            keep.add(id(doc))
    kept = [d for d in docs if id(d) in keep]
    return kept, len(docs) - len(kept)


def cap(docs: list[Document], max_bytes: int, seed: int) -> list[Document]:
    """At most `max_bytes` of text: a seeded, order-independent choice of whole documents."""
    ranked = sorted(docs, key=lambda d: hashlib.sha256(f"cap:{seed}:{d.hash}".encode()).digest())
    kept, total = [], 0
    for doc in ranked:
        size = len(doc.text.encode("utf-8"))
        if total + size > max_bytes:
            continue
        kept.append(doc)
        total += size
    order = {id(d): i for i, d in enumerate(docs)}
    return sorted(kept, key=lambda d: order[id(d)])
