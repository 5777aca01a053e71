"""`moekit bench serve --price-per-hour --api-price`: each measured load level priced, the break-even
concurrency, and bad prices refused before any request is sent."""

from __future__ import annotations

import subprocess
import sys

import pytest

from moekit.bench.serve import LevelResult
from moekit.commands.bench_serve import _costs, _prices
from moekit.calc.cost import ApiPrice


def level(concurrency, tok_s):
    empty = {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    return LevelResult(concurrency, None, 8, 0, 1.0, 100, tok_s, empty, empty, empty, None)


def test_each_level_is_priced_and_the_break_even_is_the_least_concurrency_that_pays():
    # $3.60/h = $0.001/s: 100 tok/s costs $10/M, 500 tok/s $2/M, 2000 tok/s $0.5/M.
    costs = _costs([level(1, 100.0), level(4, 500.0), level(16, 2000.0)], (3.6, ApiPrice(0.2, 2.0)))
    assert [c.usd_per_m_output for c in costs] == [pytest.approx(10.0), pytest.approx(2.0), pytest.approx(0.5)]
    assert {c.break_even_batch for c in costs} == {4}
    assert "concurrency 4" in costs[0].line() and costs[2].as_dict()["self_over_api"] == pytest.approx(0.25)
    assert _costs([level(1, 100.0)], (3.6, None))[0].api is None


def test_prices_are_checked():
    assert _prices(None, None) is None and _prices("2", "0.1,0.4")[1] == ApiPrice(0.1, 0.4)
    for args, needle in ((["--price-per-hour", "free"], "--price-per-hour"), (["--api-price", "1,2"], "needs --price-per-hour"),
                         (["--price-per-hour", "1", "--api-price", "1"], "--api-price")):
        # Port 9 (discard) on loopback: the refusal must come before any request is sent.
        proc = subprocess.run([sys.executable, "-m", "moekit", "bench", "serve", "http://127.0.0.1:9", *args],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
