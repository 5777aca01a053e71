"""The note a command prints before it builds moekit's CPU operators on a new machine (a silent
minute otherwise), and only then."""

from __future__ import annotations


import pytest

from cli_runner import moekit
from hf_tiny import train_tokenizer, write_checkpoint

from moekit import ops
from moekit.commands.operators_notice import BUILDING, announce_operator_build, operators_to_build


@pytest.fixture
def new_machine(tmp_path):
    """An empty cache: no build here yet."""
    return tmp_path / "ops"


def test_a_machine_with_this_versions_build_is_told_nothing(capsys):
    assert ops.load().ok, ops.load().failures()
    assert not operators_to_build(True)
    announce_operator_build(True)
    assert capsys.readouterr().err == ""


def test_a_new_machine_is_told_of_the_build_before_it_starts(capsys, new_machine):
    assert operators_to_build(True, cache=new_machine)
    announce_operator_build(True, cache=new_machine)
    assert capsys.readouterr().err == f"note: {BUILDING}...\n"
    assert not operators_to_build(False, cache=new_machine)  # a run that never uses them builds nothing
    assert not operators_to_build(True, "reference", cache=new_machine)  # nor one told to run the reference


def test_an_eager_run_says_nothing_of_a_build(capsys, tmp_path):
    folder = write_checkpoint("qwen3_moe", tmp_path / "ckpt", vocab_size=300)
    train_tokenizer(folder / "tokenizer.json", vocab_size=300)
    code, _, err = moekit(capsys, "run", "--eager", str(folder), "hello", "--max-new-tokens", "1")
    assert code == 0 and "building moekit's CPU operators" not in err
