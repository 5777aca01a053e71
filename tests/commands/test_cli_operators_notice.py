"""The note a command prints before it builds moekit's CPU operators on a new machine (a silent
minute otherwise), and only then."""

from __future__ import annotations


import pytest

from cli_runner import moekit
from hf_tiny import train_tokenizer, write_checkpoint

from moekit.commands.operators_notice import BUILDING, announce_operator_build, operators_to_build
from moekit.model import gemv


@pytest.fixture
def new_machine(tmp_path, monkeypatch):
    """torch's extension cache pointed at an empty folder (torch's own variable): no build here yet."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))


def test_a_machine_with_this_versions_build_is_told_nothing(capsys):
    assert gemv.operators() is not None, gemv.status()
    assert gemv.built_here() and not operators_to_build(True)
    announce_operator_build(True)
    assert capsys.readouterr().err == ""


def test_a_new_machine_is_told_of_the_build_before_it_starts(capsys, new_machine):
    assert not gemv.built_here()
    announce_operator_build(True)
    assert capsys.readouterr().err == f"note: {BUILDING}...\n"
    assert not operators_to_build(False)  # a run that never uses them builds nothing


def test_an_eager_run_on_a_new_machine_says_nothing_of_a_build(capsys, tmp_path, new_machine):
    folder = write_checkpoint("qwen3_moe", tmp_path / "ckpt", vocab_size=300)
    train_tokenizer(folder / "tokenizer.json", vocab_size=300)
    code, _, err = moekit(capsys, "run", str(folder), "hello", "--max-new-tokens", "1")
    assert code == 0 and "building moekit's CPU operators" not in err
