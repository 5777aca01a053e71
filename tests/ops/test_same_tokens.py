"""Two fresh processes running the same command give the same tokens: the kernel each uses is the
one measured once and kept beside the build (moekit.ops.select), not a new timing per process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "models" / "moekit-demo"


def _run(dtype: str, *extra: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "moekit", "run", "--eager", str(DEMO), "The history of", "--max-new-tokens", "12",
                           "--dtype", dtype, "--weights", "int8", "--json", *extra], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return done


def _tokens(dtype: str) -> list[int]:
    return json.loads(_run(dtype).stdout)["token_ids"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_processes_give_the_same_tokens(machine_builds, dtype):
    # Two suffice: a kernel timed anew per process would differ between any two (a third cost 17 s a dtype)
    runs = [_tokens(dtype) for _ in range(2)]
    assert len(runs[0]) == 12 and runs[0] == runs[1]


def test_kernels_reference_runs_without_the_operators():
    """--kernels reference never loads them: int8 products are the plain dequantize-and-matmul."""
    done = _run("float32", "--kernels", "reference")
    assert len(json.loads(done.stdout)["token_ids"]) == 12 and "the q8 operator is not loaded" in done.stderr
