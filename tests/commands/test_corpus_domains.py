"""A corpus with an empty domain stays usable (issue 42, item 8): `eval` and `report` score the domains
that have text and name the empty ones; `corpus build` installs Debian packages only when asked."""

from __future__ import annotations

import json
import shutil

import pytest

from cli_runner import moekit
from moekit.analysis.sample import SAMPLE
from moekit.engine.default_model import bundled_model_path


@pytest.fixture
def corpus_without_fortunes(tmp_path):
    """The shipped held-out sample as a built corpus (train = held-out) whose `fortunes` came out empty,
    as `corpus build` leaves it when fortune-mod is not installed."""
    folder = tmp_path / "corpus"
    shutil.copytree(SAMPLE / "heldout", folder / "heldout")
    shutil.copytree(SAMPLE / "heldout", folder / "train")
    for split in ("heldout", "train"):
        (folder / split / "fortunes.jsonl").write_text("")
    manifest = json.loads((SAMPLE / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "empty_domains": ["fortunes"]}))
    return folder


def test_report_uses_the_domains_with_text_and_names_the_empty_one(capsys, tmp_path, corpus_without_fortunes):
    code, _, err = moekit(capsys, "report", "--corpus", corpus_without_fortunes, "--per-domain", "1", "--prompt-tokens",
                          "16", "--max-new-tokens", "2", "--policies", "", "--out", tmp_path / "r.html")
    assert code == 0, err
    assert "domain fortunes has no heldout text (skipped; `moekit corpus build --install` fills it)" in err
    assert "4 prompts (chinese, manpages, python, shell)" in (tmp_path / "r.html").read_text()


def test_eval_scores_the_domains_with_text(capsys, corpus_without_fortunes):
    code, out, err = moekit(capsys, "eval", bundled_model_path(), "--corpus", corpus_without_fortunes,
                            "--max-tokens", "64", "--window", "32", "--json")
    assert code == 0, err
    assert "domain fortunes has no heldout text" in err
    scored = json.dumps(json.loads(out))
    assert "manpages" in scored and "fortunes" not in scored


def test_a_corpus_with_no_text_at_all_is_one_line(capsys, corpus_without_fortunes):
    manifest = json.loads((corpus_without_fortunes / "manifest.json").read_text())
    for domain in manifest["domains"]:
        (corpus_without_fortunes / "heldout" / f"{domain}.jsonl").write_text("")
    code, out, err = moekit(capsys, "report", "--corpus", corpus_without_fortunes, "--policies", "")
    assert code == 2 and err.count("\n") == 2 and "no domain has heldout documents" in err  # the note, then the error


def test_corpus_build_installs_nothing_unless_asked(capsys, tmp_path, monkeypatch):
    from moekit.corpus import build as build_module, packages

    installed = []
    monkeypatch.setattr(packages, "missing", lambda names: ["fortune-mod"])
    monkeypatch.setattr(packages, "install", lambda names, echo: installed.append(names))
    # the build itself is not what is under test here: an empty one, as with no packages at all
    monkeypatch.setattr(build_module, "build", lambda out, sources, options, tick: {"domains": {}, "empty_domains": []})
    code, out, _ = moekit(capsys, "corpus", "build", tmp_path / "c")
    assert code == 0 and installed == []
    assert "missing Debian packages: fortune-mod; their domains will be empty (install them with --install" in out
    monkeypatch.setattr("moekit.corpus.sources.is_root", lambda: True)
    assert moekit(capsys, "corpus", "build", tmp_path / "c", "--install")[0] == 0
    assert installed == [["fortune-mod"]]
