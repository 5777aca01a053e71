"""One dtype vocabulary for every command (issue 42, item 10): `bf16` and `bfloat16` (and `fp32` /
`float32`) name the same dtype in run, serve, bench, profile, simulate, calc and pack, and a name
outside it is refused in one line that lists what the command takes."""

from __future__ import annotations

import json

import pytest

from cli_runner import moekit, refused
from moekit.calc.dtypes import ALIASES, canonical_dtype, dtype_choice, engine_dtype

RUN = ("run", "--eager", "def f(x):", "--max-new-tokens", "3", "--json")


def test_every_alias_names_a_dtype_of_the_vocabulary():
    from moekit.calc.dtypes import DTYPES

    assert all(canonical_dtype(alias) in DTYPES for alias in ALIASES)
    assert engine_dtype(" BF16 ") == engine_dtype("bfloat16") == "bfloat16"
    assert engine_dtype("fp32") == engine_dtype("float32") == "float32"


def test_a_dtype_a_command_does_not_take_is_named_with_the_choices():
    from moekit.errors import MoekitError

    with pytest.raises(MoekitError, match=r"--dtype 'int4': this command takes fp32 \(float32\) or bf16 \(bfloat16\)"):
        engine_dtype("int4")
    with pytest.raises(MoekitError, match="--precision 'fp64'"):
        dtype_choice("fp64", ("bf16",), "--precision")


@pytest.mark.parametrize("short, long", [("bf16", "bfloat16"), ("fp32", "float32")])
def test_run_takes_both_spellings_and_generates_the_same_tokens(capsys, short, long):
    code_a, out_a, err_a = moekit(capsys, *RUN, "--dtype", short)
    code_b, out_b, _ = moekit(capsys, *RUN, "--dtype", long)
    assert code_a == code_b == 0, err_a
    assert json.loads(out_a)["token_ids"] == json.loads(out_b)["token_ids"]


def test_run_refuses_a_dtype_outside_the_vocabulary_in_one_line(capsys):
    assert "--dtype 'fp64': this command takes fp32 (float32) or bf16 (bfloat16)" in refused(capsys, *RUN, "--dtype", "fp64")


def test_serve_takes_bf16_before_it_opens_a_port(capsys):
    # An impossible port is refused after the dtype is checked: reaching that refusal proves bf16 passed.
    assert "--port must be in 0..65535" in refused(capsys, "serve", "--dtype", "bf16", "--port", "70000")
    assert "--dtype 'half-ish'" in refused(capsys, "serve", "--dtype", "half-ish", "--port", "70000")


def test_bench_decode_takes_bf16(capsys):
    code, out, err = moekit(capsys, "bench", "decode", "--eager", "--dtype", "bf16", "--batch", "1", "--tokens", "2",
                            "--prompt-len", "4", "--repeats", "1", "--warmup", "0", "--json")
    assert code == 0, err
    assert json.loads(out)["dtype"] == "bfloat16"


def test_profile_takes_bf16(capsys, tmp_path):
    from moekit.engine.default_model import bundled_model_path

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n")
    code, _, err = moekit(capsys, "profile", bundled_model_path(), "--prompts", prompts, "--out", tmp_path / "p.json",
                          "--max-new-tokens", "2", "--dtype", "bf16")
    assert code == 0, err


@pytest.mark.parametrize("command", [
    ("simulate", "--uniform", "deepseek-v3", "--tokens", "64", "--forwards", "2", "--ranks", "8", "--json"),
    ("calc", "deepseek-v3", "--json"),
])
def test_simulate_and_calc_read_both_spellings_alike(capsys, command):
    short = moekit(capsys, *command, "--dtype", "bf16")
    long = moekit(capsys, *command, "--dtype", "bfloat16")
    assert short[0] == long[0] == 0, short[2]
    assert short[1] == long[1]


def test_pack_takes_bfloat16_as_bf16(capsys, tmp_path):
    from moekit.engine.default_model import bundled_model_path

    code, out, err = moekit(capsys, "pack", bundled_model_path(), "--precision", "bfloat16", "--out", tmp_path / "p")
    assert code == 0, err
    assert "bf16" in out + err
