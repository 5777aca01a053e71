"""Reading a built corpus back: its manifest and each domain's documents, with one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

from moekit.corpus.build import MANIFEST
from moekit.errors import MoekitError


class CorpusError(MoekitError):
    """A corpus folder that is missing, unbuilt, or has a domain with no documents."""


def read_manifest(folder: Path) -> dict:
    path = Path(folder) / MANIFEST
    if not Path(folder).is_dir():
        raise CorpusError(f"{folder}: no such corpus folder (build it: moekit corpus build {folder})")
    if not path.is_file():
        raise CorpusError(f"{folder}: no {MANIFEST}; not a built corpus (moekit corpus build {folder})")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CorpusError(f"{path}: not valid JSON ({err.msg})") from None


def domains(folder: Path) -> list[str]:
    return list(read_manifest(folder)["domains"])


def read_texts(folder: Path, split: str, domain: str) -> list[str]:
    """The documents of one split and domain; an empty or missing domain is an error, not a silent skip."""
    path = Path(folder) / split / f"{domain}.jsonl"
    if not path.is_file():
        raise CorpusError(f"{path}: missing; the corpus has no {split} split for domain {domain!r}")
    texts = []
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            try:
                texts.append(json.loads(line)["text"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CorpusError(f"{path}:{n}: not a corpus line (expected JSON with a 'text' field)") from None
    if not texts:
        raise CorpusError(f"{path}: domain {domain!r} has no {split} documents (is its package installed?)")
    return texts


def empty_domains(folder: Path, split: str) -> list[str]:
    """The domains with no text in `split`: built empty (their package was not installed) or an empty file."""
    manifest = read_manifest(folder)
    built_empty = set(manifest.get("empty_domains", []))
    return [d for d in manifest["domains"]
            if d in built_empty or ((p := Path(folder) / split / f"{d}.jsonl").is_file() and p.stat().st_size == 0)]


def empty_domains_note(folder: Path, split: str) -> str | None:
    """The line `eval` and `report` print when a corpus has domains without text (None: none)."""
    empty = empty_domains(folder, split)
    if not empty:
        return None
    return (f"note: {folder}: domain{'s' if len(empty) > 1 else ''} {', '.join(empty)} ha{'ve' if len(empty) > 1 else 's'} "
            f"no {split} text (skipped; `moekit corpus build --install` fills {'them' if len(empty) > 1 else 'it'})")


def read_split(folder: Path, split: str, only: list[str] | None = None) -> dict[str, list[str]]:
    """domain → documents for every domain of the manifest that has text (or `only` those, which must):
    one empty domain (a package not installed) leaves the others usable; `empty_domains` names it."""
    empty = empty_domains(folder, split) if only is None else []
    names = [d for d in domains(folder) if d not in empty]
    if empty and not names:
        raise CorpusError(f"{folder}: no domain has {split} documents ({', '.join(empty)} built empty)")
    if only is not None:
        unknown = [d for d in only if d not in names]
        if unknown:
            raise CorpusError(f"{folder}: no domain {unknown[0]!r} (domains: {', '.join(names)})")
        names = list(only)
    if not names:
        raise CorpusError(f"{folder}: the corpus has no domains")
    return {d: read_texts(folder, split, d) for d in names}
