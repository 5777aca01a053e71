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
