"""`moekit ops build` and `moekit ops status`: what is built here, and a failed build in one line."""

from __future__ import annotations

import json

from cli_runner import moekit, refused

from moekit.ops import load


def test_status_shows_the_builds_their_cpu_and_the_choices(capsys):
    assert load().ok
    code, out, _ = moekit(capsys, "ops", "status", "--json")
    report = json.loads(out)
    assert code == 0 and report["variants"][0]["namespace"] == "moekit" and report["variants"][0]["built"]
    assert report["cpu_flags"] and report["key"].startswith("torch")
    code, out, _ = moekit(capsys, "ops", "status")
    assert code == 0 and "moekit (" in out and "built in" in out


def test_build_portable_also_builds_the_scalar_variant_the_operator_tests_use(capsys):
    code, out, _ = moekit(capsys, "ops", "build", "--portable")
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("moekit: built")
    assert any(line.startswith("moekit_scalar: built") for line in lines)


def test_a_build_the_compiler_refuses_is_one_line_naming_the_log(capsys, tmp_path):
    code, out, err = moekit(capsys, "ops", "build", "--cache", str(tmp_path), "--extra-cflag=-mno-such-isa-flag")
    line = err.splitlines()[-1]  # after the note that a build starts
    assert code == 2 and out == "" and err.count("\n") == 2 and line.startswith("error: ")
    assert "could not be built" in line and "build.log" in line and str(tmp_path) in line


def test_kernels_takes_auto_or_reference(capsys):
    line = refused(capsys, "run", "--kernels", "fast", "hello", "--max-new-tokens", "1")
    assert "--kernels must be one of auto, reference" in line


def test_status_names_the_load_each_choice_was_measured_at_and_warns_of_busy_ones(capsys, tmp_path):
    from moekit.ops.select import LOADS, choices_path

    choices_path(tmp_path).parent.mkdir(parents=True, exist_ok=True)
    key = "variant float32 moekit threads=2"
    choices_path(tmp_path).write_text(json.dumps({key: {"namespace": "moekit", "grouped": True}, LOADS: {key: 250.0}}))
    code, out, err = moekit(capsys, "ops", "status", "--cache", str(tmp_path))
    assert code == 0 and f"kernel choice: {key}" in out and "measured at load average 250" in out
    assert "measured while the machine was busy" in err and "moekit ops build --remeasure" in err
    code, out, _ = moekit(capsys, "ops", "status", "--cache", str(tmp_path), "--json")
    report = json.loads(out)
    assert report["choices"] == {key: {"namespace": "moekit", "grouped": True}} and report["measured_at_load"] == {key: 250.0}


def test_remeasure_applies_only_to_the_default_cache(capsys, tmp_path):
    line = refused(capsys, "ops", "build", "--remeasure", "--cache", str(tmp_path))
    assert "--remeasure applies to the default cache" in line
