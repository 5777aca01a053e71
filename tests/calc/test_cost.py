"""Cost per token: the arithmetic against hand computation, the break-even batch, the CLI's refusals."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from moekit.calc.cost import (ApiPrice, break_even_batch, cost_at, measured_break_even, parse_api_price, parse_price,
                              roofline_cost, usd_per_million)
from moekit.calc.hardware import get_hardware
from moekit.calc.report import build_report
from moekit.calc.request import parse_request
from moekit.errors import MoekitError
from moekit.spec import load_spec


def test_dollars_per_million_by_hand():
    # $3.60/h is $0.001/s; at 1000 tok/s a token costs $1e-6, a million $1.
    assert usd_per_million(3.6, 1000.0) == pytest.approx(1.0)
    assert usd_per_million(2.49, 1624.8) == pytest.approx(2.49 / 3600 / 1624.8 * 1e6)
    assert usd_per_million(1.0, 0.0) == math.inf


def test_break_even_is_the_smallest_batch_that_pays():
    # 100 tok/s per sequence, linear: $3.60/h costs $10/M at batch 1, $10/b at batch b.
    rate = lambda b: 100.0 * b  # noqa: E731
    assert break_even_batch(rate, 3.6, 0.80, largest=64) == 13  # 10/13 = 0.77 <= 0.80 < 10/12 = 0.83
    assert break_even_batch(rate, 3.6, 0.80, largest=12) is None  # memory stops it first
    assert break_even_batch(rate, 3.6, 20.0, largest=64) == 1
    assert measured_break_even([(16, 900.0), (1, 60.0), (4, 300.0)], 3.6, 4.0) == 4  # 3.33 <= 4 < 16.7


def test_a_cost_line_states_price_rate_ratio_and_break_even():
    cost = cost_at("measured", 3.6, 4, 300.0, ApiPrice(0.2, 4.0), 4)
    assert cost.usd_per_m_output == pytest.approx(10 / 3)
    assert cost.api_ratio == pytest.approx(10 / 3 / 4.0)
    line = cost.line()
    assert "$3.333 per million output tokens" in line and "breaks even at concurrency 4" in line
    assert cost.as_dict()["break_even_batch"] == 4


def test_roofline_cost_is_the_reports_rate_priced():
    spec = load_spec("qwen3-30b-a3b")
    request = parse_request("bf16", None, "4096", "32", "h100", "1", None)
    report = build_report(spec, request, get_hardware("h100"))
    cost = roofline_cost(report, 2.49, ApiPrice(0.20, 0.80))
    assert cost.tokens_per_s == report.roofline.batched.tokens_per_s and cost.batch == 32
    assert cost.usd_per_m_output == pytest.approx(2.49 / 3600 / report.roofline.batched.tokens_per_s * 1e6)
    even = cost.break_even_batch
    assert even is not None and even > 1
    before = build_report(spec, parse_request("bf16", None, "4096", str(even - 1), "h100", "1", None), get_hardware("h100"))
    at = build_report(spec, parse_request("bf16", None, "4096", str(even), "h100", "1", None), get_hardware("h100"))
    assert usd_per_million(2.49, at.roofline.batched.tokens_per_s) <= 0.80 < usd_per_million(2.49, before.roofline.batched.tokens_per_s)


@pytest.mark.parametrize("text", ["0", "-1", "nan", "two", "inf"])
def test_bad_prices_are_refused(text):
    with pytest.raises(MoekitError, match="--price-per-hour"):
        parse_price(text)


@pytest.mark.parametrize("text", ["0.2", "0.2,0.8,1", "a,b", "0.2,0"])
def test_bad_api_prices_are_refused(text):
    with pytest.raises(MoekitError, match="--api-price"):
        parse_api_price(text)


def calc(*args):
    return subprocess.run([sys.executable, "-m", "moekit", "calc", *args], capture_output=True, text=True, timeout=120)


def test_calc_cost_on_the_command_line():
    proc = calc("qwen3-30b-a3b", "--hardware", "h100", "--batch", "32", "--cost", "--price-per-hour", "2.49",
                "--api-price", "0.20,0.80", "--json")
    assert proc.returncode == 0, proc.stderr
    cost = json.loads(proc.stdout)["cost"]
    assert cost["usd_per_m_output_tokens"] == pytest.approx(2.49 / 3600 / cost["tokens_per_s"] * 1e6)
    for args, needle in ((["--cost"], "--hardware"), (["--price-per-hour", "2"], "go with --cost"),
                         (["--hardware", "h100", "--cost", "--price-per-hour", "x"], "--price-per-hour")):
        proc = calc("qwen3-30b-a3b", *args)
        assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr


def test_calc_stays_torch_free():
    code = "import sys, moekit.calc.cost, moekit.commands.calc; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
