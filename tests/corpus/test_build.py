import json
from pathlib import Path

from moekit.corpus.build import BuildOptions, build
from moekit.corpus.reader import CorpusError, read_split, read_texts
from moekit.corpus.sources import Source, fortunes, man_pages, python_stdlib, shell_scripts

import pytest


def _sources(tree: Path) -> list[Source]:
    stdlib = lambda: (doc for doc, _ in zip(python_stdlib(), range(30)))  # the real stdlib, first 30 files
    return [
        Source("manpages", "man", (), lambda: man_pages([tree / "man"]), 20, 10_000),
        Source("python", "stdlib", (), stdlib, 200, 150_000),
        Source("shell", "scripts", (), lambda: shell_scripts([tree / "bin"]), 20, 10_000),
        Source("fortunes", "fortunes", ("fortunes",), lambda: fortunes(tree / "fortunes"), 5, 1000),
        Source("chinese", "absent", ("manpages-zh",), lambda: man_pages([tree / "zh"]), 20, 10_000),
    ]


def test_build_writes_labelled_deduplicated_splits_and_a_manifest(fixture_tree, tmp_path):
    out = tmp_path / "corpus"
    manifest = build(out, _sources(fixture_tree), BuildOptions(seed=3, heldout_fraction=0.2))
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk == manifest
    d = manifest["domains"]
    assert d["shell"]["found"] == 2 and d["shell"]["dropped_duplicate"] == 1  # script and its copy
    assert d["fortunes"]["found"] == 4 and d["fortunes"]["dropped_size"] == 1 and d["fortunes"]["dropped_duplicate"] == 1
    assert d["manpages"]["found"] == 1  # the .so alias page is not a document
    assert manifest["empty_domains"] == ["chinese"]
    python = read_texts(out, "train", "python") + read_texts(out, "heldout", "python")
    assert len(python) == d["python"]["train_docs"] + d["python"]["heldout_docs"] >= 25
    assert d["python"]["heldout_docs"] >= 1
    lines = [json.loads(x) for x in (out / "train" / "python.jsonl").read_text().splitlines()]
    assert all(x["origin"].endswith(".py") for x in lines)


def test_build_twice_gives_the_same_files(fixture_tree, tmp_path):
    build(tmp_path / "a", _sources(fixture_tree), BuildOptions(seed=3))
    build(tmp_path / "b", _sources(fixture_tree), BuildOptions(seed=3))
    for name in ("train/python.jsonl", "heldout/python.jsonl", "train/fortunes.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_an_empty_domain_is_skipped_and_named_and_a_missing_corpus_is_a_clear_error(fixture_tree, tmp_path):
    from moekit.corpus.reader import empty_domains

    out = tmp_path / "corpus"
    build(out, _sources(fixture_tree), BuildOptions())
    assert "chinese" not in read_split(out, "train") and empty_domains(out, "train") == ["chinese"]
    with pytest.raises(CorpusError, match="'chinese' has no train documents"):
        read_split(out, "train", only=["chinese"])  # asked for by name, it must have text
    with pytest.raises(CorpusError, match="no such corpus folder"):
        read_split(tmp_path / "nowhere", "train")
