"""The compiled decode step is `moekit run`'s default; `--eager`, and `--kernels reference` without
`--compile`, run the eager reference. The default says what it does before the first token (a note,
then the warm-up's line: compiling or loading the step, and its seconds) and gives the eager run's
fp32 greedy tokens. Where the default meets a configuration the step does not cover, the run stays
eager with one note: tests/dist/test_cli.py (`run --expert-parallel`)."""

from __future__ import annotations

import json

import pytest

from cli_runner import moekit

IDS = ("--prompt-ids", "1,17,42,99,5,63", "--max-new-tokens", "10", "--stop", "")
WARM_UP = ("compiling the decode step", "loading the compiled decode step")


def _json_run(capsys, folder, *flags) -> tuple[list[int], str]:
    code, out, err = moekit(capsys, "run", folder, *IDS, "--json", *flags)
    assert code == 0, err
    return json.loads(out)["token_ids"], err


def _says_compiled(err: str) -> bool:
    return "compiled graph" in err or any(phrase in err for phrase in WARM_UP)


def test_the_default_run_is_the_compiled_step_and_gives_the_eager_tokens(capsys, tiny_checkpoints):
    folder = tiny_checkpoints("qwen3_moe")
    eager, eager_err = _json_run(capsys, folder, "--eager")
    # Streamed (no --json): a folder without tokenizer.json prints the ids, space-separated.
    code, out, err = moekit(capsys, "run", folder, *IDS)
    assert code == 0, err
    assert [int(t) for t in out.split()] == eager and len(eager) == 10
    lines = err.splitlines()
    assert sum(line.startswith("note: decode steps run as one compiled graph") for line in lines) == 1, err
    warm = [i for i, line in enumerate(lines) if any(phrase in line for phrase in WARM_UP)]
    header = [i for i, line in enumerate(lines) if "· greedy · prompt" in line]
    assert len(warm) == 1 and header and warm[0] < header[0], err  # before the first token
    assert lines[warm[0]].endswith(" s"), lines[warm[0]]  # then its time, on the same line
    assert not _says_compiled(eager_err), eager_err


@pytest.mark.parametrize("flags", [("--eager",), ("--kernels", "reference")], ids=["eager", "kernels-reference"])
def test_eager_and_the_reference_kernels_run_the_eager_step(capsys, tiny_checkpoints, flags):
    folder = tiny_checkpoints("mixtral")
    tokens, err = _json_run(capsys, folder, *flags)
    assert len(tokens) == 10 and not _says_compiled(err), err
    if flags != ("--eager",):
        assert tokens == _json_run(capsys, folder, "--eager")[0]


def test_compile_and_eager_are_one_switch(capsys, tiny_checkpoints):
    """--compile stays accepted; the later of --compile and --eager wins (one boolean pair)."""
    folder = tiny_checkpoints("mixtral")
    _, err = _json_run(capsys, folder, "--compile", "--eager")
    assert not _says_compiled(err), err
    code, out, err = moekit(capsys, "run", "--help")
    assert code == 0 and "--compile" in out and "--eager" in out
