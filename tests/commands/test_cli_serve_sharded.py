"""`moekit serve --expert-parallel` refusals, each one line and exit 2, before any rank starts."""

from __future__ import annotations

import pytest

from cli_runner import refused


@pytest.mark.parametrize("args, says", [
    (("--expert-parallel", "2", "--admin-token", "t", "--expert-memory", "50%"), "--admin-token with --expert-memory"),
    (("--expert-parallel", "auto"), "without torchrun give the count"),
    (("--expert-parallel", "two"), "rank count or auto"),
    (("--expert-parallel", "9"), "9 ranks but only 8 routed experts"),
    (("--expert-parallel", "2", "--ep-timeout", "0"), "--ep-timeout must be positive"),
    (("--placement", "plan.json"), "--placement needs --expert-parallel"),
    (("--expert-parallel", "2", "--placement", "missing.json"), "no such file"),
    (("--port", "0", "--expert-parallel"), "--expert-parallel needs a value: a rank count (--expert-parallel 2"),
])
def test_sharded_serving_refuses_what_it_cannot_do(capsys, tiny_checkpoints, args, says):
    line = refused(capsys, "serve", tiny_checkpoints("qwen3_moe"), *args)
    assert says in line, line


def test_a_bare_expert_parallel_under_run_says_to_use_auto(capsys, tiny_checkpoints):
    line = refused(capsys, "run", tiny_checkpoints("qwen3_moe"), "--prompt-ids", "1,2", "--expert-parallel")
    assert "--expert-parallel auto" in line, line
