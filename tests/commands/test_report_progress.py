"""`moekit report` says what it is doing (issue 42, item 13): a line per stage on stderr, readable in a
pipe or a log, and torch's own thread count unless --threads says otherwise, as `moekit run`."""

from __future__ import annotations

import pytest

from cli_runner import moekit

SMALL = ("--per-domain", "1", "--prompt-tokens", "16", "--max-new-tokens", "2", "--policies", "")


@pytest.fixture
def two_threads():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_each_stage_is_a_line_on_stderr_and_threads_stay_torchs(capsys, tmp_path, two_threads):
    import torch

    code, _, err = moekit(capsys, "report", *SMALL, "--out", tmp_path / "r.html")
    assert code == 0, err
    stages = [line for line in err.splitlines() if line.startswith("report [")]
    assert [s.split("] ", 1)[1].split("…")[0] for s in stages] == ["running prompts", "analysing the trace", "drawing"]
    assert torch.get_num_threads() == 2  # not pinned to 1


def test_threads_when_asked(capsys, tmp_path, two_threads):
    import torch

    code, _, err = moekit(capsys, "report", *SMALL, "--threads", "1", "--out", tmp_path / "r.html")
    assert code == 0, err
    assert torch.get_num_threads() == 1
