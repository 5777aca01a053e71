"""`moekit serve` refuses what it cannot serve before any model loads: one line, exit 2."""

from __future__ import annotations

import socket

import pytest

from cli_runner import moekit


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max-context", "5000"], "--max-context must be in 2..1024 (the model's context), got 5000"),
        (["--port", "99999"], "--port must be in 0..65535"),
        (["--dtype", "fp16"], "this command takes fp32 (float32) or bf16 (bfloat16)"),
        (["--max-batch", "0"], "--max-batch must be at least 1"),
        (["--queue-limit", "0"], "--queue-limit must be at least 1"),
        (["--grace", "-1"], "--grace must be >= 0"),
        (["--expert-memory", "25%", "--expert-split", "/nonexistent/t.parquet"], "--expert-split /nonexistent/t.parquet: no such trace file"),
        (["--direct-io"], "need --expert-memory"),
        (["--warm-up", "--eager"], "--warm-up compiles the decode step; with --eager or --kernels reference there is nothing to compile"),
    ],
)
def test_bad_options(args, message, capsys):
    code, out, err = moekit(capsys, "serve", *args)
    assert code == 2 and message in err and "Traceback" not in err


def test_a_port_in_use_is_one_line(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = moekit(capsys, "serve", "--port", str(port))
    assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err


def test_a_folder_that_is_no_checkpoint(tmp_path, capsys):
    code, out, err = moekit(capsys, "serve", tmp_path)
    assert code == 2 and "not a checkpoint folder (no config.json)" in err
