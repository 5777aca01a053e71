"""A rank that dies, hangs or loaded other weights stops every rank with one clear line, in
bounded time."""

from __future__ import annotations

import time

import pytest

from hf_tiny import write_checkpoint
from ranks import run_ranks

# Rank processes; tests/conftest.py keeps such tests from overlapping.
pytestmark = pytest.mark.processes

PROMPT = [1, 17, 42, 9]


def _run(tiny_checkpoints):
    return [{"checkpoint": str(tiny_checkpoints("mixtral")), "prompts": [PROMPT], "max_new_tokens": 6}]


def test_a_dead_rank_fails_the_others_at_once(tiny_checkpoints, tmp_path):
    began = time.monotonic()
    results = run_ranks(2, _run(tiny_checkpoints), tmp_path, timeout_s=30,
                        fault={"rank": 1, "kind": "die", "at_forward": 3})
    code, err, _ = results[0]
    assert results[1][0] == 3  # the injected death
    assert code == 2
    assert "rank 0: expert-parallel" in err and "a peer rank died, hung or was stopped" in err
    assert time.monotonic() - began < 30  # the peer's closed connection, not the 30 s timeout


def test_a_hung_rank_fails_the_others_within_the_timeout(tiny_checkpoints, tmp_path):
    began = time.monotonic()
    results = run_ranks(2, _run(tiny_checkpoints), tmp_path, timeout_s=3, wall_s=60,
                        fault={"rank": 1, "kind": "hang", "at_forward": 3})
    code, err, _ = results[0]
    assert code == 2
    assert "failed after at most 3s" in err, err[-800:]
    assert time.monotonic() - began < 60


def test_ranks_with_different_checkpoints_refuse_to_run(tiny_checkpoints, tmp_path):
    other = write_checkpoint("mixtral", tmp_path / "other", seed=1)  # same config, other weights
    results = run_ranks(2, _run(tiny_checkpoints), tmp_path, timeout_s=20, checkpoint_of_rank={1: str(other)})
    for rank, (code, err, _) in enumerate(results):
        assert code == 2
        assert f"rank {rank}: rank 1 loaded a different checkpoint than rank 0" in err
