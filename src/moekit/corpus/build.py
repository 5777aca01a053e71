"""`moekit corpus build`: find → clean → dedupe → cap → split → write, per domain.

Layout written:
  <out>/train/<domain>.jsonl, <out>/heldout/<domain>.jsonl   one {"origin", "text"} per line
  <out>/manifest.json   seed, split fraction, per-domain counts/bytes/sources, empty domains
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from moekit.corpus.clean import Document, cap, cap_per_family, clean, dedupe, split
from moekit.corpus.sources import Source

MANIFEST = "manifest.json"
SPLITS = ("train", "heldout")
CODE_DOMAINS = ("python", "shell")  # licence headers are stripped from these


@dataclass(frozen=True)
class BuildOptions:
    seed: int = 1234
    heldout_fraction: float = 0.05
    max_bytes_per_domain: int = 12_000_000  # what an hour of CPU training can use, and then some


def domain_documents(source: Source, seed: int, on_doc: Callable[[], None] = lambda: None) -> tuple[list[Document], dict]:
    """Cleaned, deduplicated documents of one source, and the counts of what was dropped."""
    found, kept = 0, []
    for origin, raw in source.find():
        found += 1
        on_doc()
        doc = clean(source.domain, origin, raw, source.min_chars, source.max_chars, source.domain in CODE_DOMAINS)
        if doc is not None:
            kept.append(doc)
    unique, duplicates = dedupe(kept)
    capped, over = (unique, 0) if source.family is None else cap_per_family(
        unique, source.family, source.max_docs_per_family, seed)
    return capped, {"found": found, "dropped_size": found - len(kept), "dropped_duplicate": duplicates,
                    "dropped_family_cap": over}


def _write_jsonl(path: Path, docs: list[Document]) -> int:
    """Atomically write one JSON object per document; returns bytes of text written."""
    tmp = path.with_suffix(".tmp")
    total = 0
    with tmp.open("w", encoding="utf-8") as fh:
        for doc in docs:
            fh.write(json.dumps({"origin": doc.origin, "text": doc.text}, ensure_ascii=False) + "\n")
            total += len(doc.text.encode("utf-8"))
    os.replace(tmp, path)
    return total


def build(out: Path, sources: list[Source], options: BuildOptions, progress=None) -> dict:
    """Write the corpus under `out`; returns the manifest. `progress(domain, n_found)` is called per doc."""
    for name in SPLITS:
        (out / name).mkdir(parents=True, exist_ok=True)
    manifest = {
        "seed": options.seed,
        "heldout_fraction": options.heldout_fraction,
        "max_bytes_per_domain": options.max_bytes_per_domain,
        "python": sys.version.split()[0],
        "domains": {},
        "empty_domains": [],
    }
    dedupe_across: set[str] = set()
    for source in sources:
        tick = (lambda d=source.domain: progress(d)) if progress else (lambda: None)
        docs, counts = domain_documents(source, options.seed, tick)
        # The same text in two domains (a script also shipped as a man page example) stays in the first.
        docs = [d for d in docs if d.hash not in dedupe_across]
        dedupe_across.update(d.hash for d in docs)
        docs = cap(docs, options.max_bytes_per_domain, options.seed)
        train, heldout = split(docs, options.seed, options.heldout_fraction)
        entry = {"description": source.description, "packages": list(source.packages), **counts}
        for name, part in (("train", train), ("heldout", heldout)):
            entry[f"{name}_docs"] = len(part)
            entry[f"{name}_bytes"] = _write_jsonl(out / name / f"{source.domain}.jsonl", part)
        manifest["domains"][source.domain] = entry
        if not train:
            manifest["empty_domains"].append(source.domain)
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, out / MANIFEST)
    return manifest
