"""`moekit bench` as a new user meets it (issue 15): bad arguments refused before any run, a table
that fits the terminal with the reason for a bound that cannot hold, progress while it measures."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest

from cli_runner import moekit, refused
from hf_tiny import write_checkpoint
from moekit.commands.bench_view import COLUMNS, offload_notes, offload_table, print_wide_or_fitted


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("bench_newcomer"))


@pytest.fixture
def unrunnable(ckpt, tmp_path) -> Path:
    """The checkpoint with its weights cut in half: any run of it fails, reading its config does not.
    An error about the arguments, not the weights, proves the arguments were checked before a run."""
    folder = shutil.copytree(ckpt, tmp_path / "cut")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return folder


def test_a_bad_budget_is_refused_before_the_first_run(capsys, unrunnable):
    err = refused(capsys, "bench", "offload", unrunnable, "--expert-memory", "25%,abc")
    assert "--expert-memory 'abc'" in err and "truncated" not in err


def test_a_budget_below_the_minimum_is_refused_before_the_first_run(capsys, unrunnable):
    assert "below the minimum" in refused(capsys, "bench", "offload", unrunnable, "--expert-memory", "50%,1%")


def test_an_unknown_cache_policy_is_refused_before_the_first_run(capsys, unrunnable):
    assert "fifo" in refused(capsys, "bench", "offload", unrunnable, "--expert-memory", "50%", "--cache", "fifo")


def test_a_baseline_that_is_not_installed_is_refused_before_the_first_run(capsys, unrunnable, monkeypatch):
    monkeypatch.setitem(sys.modules, "accelerate", None)  # how Python marks a module as not importable
    err = refused(capsys, "bench", "offload", unrunnable, "--expert-memory", "50%", "--vs", "accelerate")
    assert "--vs accelerate needs accelerate" in err and "truncated" not in err


def _row(budget: str, rss_ok: bool, bound: float) -> dict:
    return {
        "budget": budget, "tokens_per_s": 123.4, "vs_resident": 0.61, "vs_no_cache": 12.3,
        "accelerate_tokens_per_s": 3.21, "vs_accelerate": 38.4, "hit_rate": 0.456, "disk_bytes_per_token": 412_000.0,
        "stall_share": 0.123, "rss_growth_bytes": 75_000_000, "rss_bound_bytes": bound, "rss_ok": rss_ok,
        "prefetch_tokens_per_s": 99.9, "prefetch_hit_rate": 0.5, "prefetch_recall": 0.87, "prefetch_precision": 0.33,
        "same_tokens": True,
    }


ROWS = [_row(b, False, 8e6 * (i + 1)) for i, b in enumerate(("12.5%", "25%", "50%", "100%"))]


def _render(rows, vs_accelerate, wide, width=110) -> str:
    from rich.console import Console

    out = io.StringIO()
    console = Console(file=out, width=width, color_system=None)
    print_wide_or_fitted(console, offload_table("t", rows, vs_accelerate, wide), wide)
    return out.getvalue()


def _header_words(text: str) -> str:
    """The words of the header cells, wrapped over several lines or not, joined per column."""
    lines = text.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("┃"))
    rows = [line.strip("┃").split("┃") for line in lines[top:] if line.startswith("┃")]
    return " | ".join(" ".join(" ".join(r[c].split()) for r in rows).strip() for c in range(len(rows[0])))


@pytest.mark.parametrize("vs_accelerate", [False, True])
def test_the_default_table_fits_110_columns_one_line_per_budget(vs_accelerate):
    text = _render(ROWS, vs_accelerate, wide=False)
    assert max(len(line) for line in text.splitlines()) <= 110 and "…" not in text
    body = [line for line in text.splitlines() if line.startswith("│")]
    assert len(body) == len(ROWS)  # no cell wrapped onto a second line
    header = _header_words(text)
    assert "peak RSS" in header and "same tokens" in header and "hit rate" in header
    assert ("× accelerate" in header) == vs_accelerate
    assert "OVER" in text


def test_wide_shows_every_column_whole():
    text = _render(ROWS, True, wide=True)
    header = _header_words(text)
    assert all(c.name in header for c in COLUMNS if c.wide) and "…" not in text
    assert "71.53 MiB / 7.63 MiB OVER" in text
    assert len([line for line in text.splitlines() if line.startswith("│")]) == len(ROWS)


def test_a_bound_that_cannot_hold_on_a_tiny_model_says_why():
    notes = offload_notes(ROWS, wide=False)
    assert any("peak RSS OVER at 12.5%, 25%, 50%, 100%" in n and "fixed working memory" in n for n in notes)
    assert any("--wide" in n for n in notes)
    big = [_row("25%", False, 2e9)]
    (note, _) = offload_notes(big, wide=False)
    assert "fixed working memory" not in note and "peak RSS OVER at 25%" in note
    assert offload_notes([_row("25%", True, 2e9)], wide=True) == []


def test_bench_decode_shows_progress_batch_by_batch(capsys, ckpt):
    code, out, err = moekit(capsys, "bench", "decode", "--eager", ckpt, "--batch", "1,2", "--tokens", "4", "--prompt-len", "4",
                            "--repeats", "1", "--warmup", "0", "--json")
    assert code == 0, err
    assert [r["batch"] for r in json.loads(out)["results"]] == [1, 2]
    lines = [line for line in err.splitlines() if line.startswith("[bench decode]")]
    assert [line.split(":")[0] for line in lines[:2]] == ["[bench decode] batch 1 (1 of 2)", "[bench decode] batch 2 (2 of 2)"]
    assert lines[-1].startswith("[bench decode] done in")
