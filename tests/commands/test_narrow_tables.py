"""Tables at a 100-column terminal (issue 42, item 12): no row name or figure is cut to "…"; the
optional columns are left out and named, and `--wide` shows them all."""

from __future__ import annotations

import pytest

from cli_runner import moekit
from moekit.commands.fitted_table import Col, fit_columns, needed_width

SIMULATE = ("simulate", "--uniform", "deepseek-v3", "--tokens", "64", "--forwards", "2", "--ranks", "2,64",
            "--hardware", "h100", "--dtype", "fp8")


@pytest.fixture
def columns_100(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")


def test_the_optional_columns_go_first_and_the_essential_ones_stay():
    cols = [Col("name"), Col("a"), Col("b", essential=False), Col("c", essential=False)]
    rows = [["x" * 20, "1" * 20, "2" * 20, "3" * 20]]
    assert fit_columns(cols, rows, 200, wide=False) == [0, 1, 2, 3]
    assert fit_columns(cols, rows, needed_width(cols[:3], [r[:3] for r in rows]), wide=False) == [0, 1, 2]
    assert fit_columns(cols, rows, 10, wide=False) == [0, 1]
    assert fit_columns(cols, rows, 10, wide=True) == [0, 1, 2, 3]


def test_simulate_fits_100_columns_without_cutting(capsys, columns_100):
    code, out, _ = moekit(capsys, *SIMULATE)
    assert code == 0 and "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "left out at this width: intra-node, inter-node, of which all-to-all" in out
    code, out, _ = moekit(capsys, *SIMULATE, "--wide")
    assert code == 0 and "…" not in out and "inter-node" in out and "left out" not in out


def test_eval_routing_names_every_policy_whole(capsys, columns_100):
    code, out, err = moekit(capsys, "eval-routing", "--policies", "adaptive:0.6,adaptive:0.85", "--max-tokens", "64",
                            "--window", "32", "--agree-prompts", "1", "--agree-tokens", "2")
    assert code == 0, err
    assert "…" not in out and "adaptive:0.6 " in out and "adaptive:0.85 " in out
    assert max(len(line) for line in out.splitlines()) <= 100
