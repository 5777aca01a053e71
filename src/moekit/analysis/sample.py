"""The held-out sample shipped with moekit: a few held-out documents of every domain of the corpus
the bundled model was trained on, so `moekit report` and `moekit eval-routing` work on a fresh
clone without `moekit corpus build`. It is a corpus folder (manifest.json + heldout/<domain>.jsonl)
that moekit.corpus.reader reads like any other; it has no train split.

Re-made from a built corpus with:  python -m moekit.analysis.sample data/corpus
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SAMPLE = Path(__file__).resolve().parent / "heldout_sample"
BYTES_PER_DOMAIN = 16_000
CHARS_PER_DOC = 2_000


def _cut(text: str, limit: int) -> str:
    """At most `limit` characters, ending at a line break when there is one."""
    if len(text) <= limit:
        return text
    head = text[:limit]
    return head[: head.rfind("\n")] if "\n" in head[limit // 2 :] else head


def write_sample(corpus: Path, out: Path = SAMPLE) -> dict[str, int]:
    """The first held-out documents of each domain (in file order, each cut to CHARS_PER_DOC) up to
    BYTES_PER_DOMAIN; returns the documents kept per domain."""
    from moekit.corpus.reader import read_manifest, read_texts

    manifest = read_manifest(corpus)
    (out / "heldout").mkdir(parents=True, exist_ok=True)
    kept = {}
    for domain in manifest["domains"]:
        docs, size = [], 0
        for text in read_texts(corpus, "heldout", domain):
            if size >= BYTES_PER_DOMAIN:
                break
            doc = _cut(text, CHARS_PER_DOC)
            docs.append(doc)
            size += len(doc.encode("utf-8"))
        with (out / "heldout" / f"{domain}.jsonl").open("w", encoding="utf-8") as fh:
            for doc in docs:
                fh.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
        kept[domain] = len(docs)
    about = {"domains": {d: {"heldout_docs": n} for d, n in kept.items()}, "sample_of": str(corpus),
             "seed": manifest.get("seed"), "bytes_per_domain": BYTES_PER_DOMAIN, "chars_per_doc": CHARS_PER_DOC}
    (out / "manifest.json").write_text(json.dumps(about, indent=2) + "\n")
    return kept


if __name__ == "__main__":
    print(write_sample(Path(sys.argv[1] if len(sys.argv) > 1 else "data/corpus")))
