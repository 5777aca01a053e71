"""A latency budget the whole model fits in: said so, with the headroom and the largest batch it serves."""

import pytest

from moekit.calc.hardware import get_hardware
from moekit.calc.report import build_report
from moekit.calc.request import parse_request
from moekit.calc.roofline import largest_batch
from moekit.spec import load_spec


@pytest.mark.parametrize("last", [1, 2, 3, 37, 64, 65, 1000])
def test_largest_batch_finds_the_last_that_fits(last):
    assert largest_batch(lambda b: b <= last) == last


def test_largest_batch_is_zero_when_one_does_not_fit_and_stops_at_the_cap():
    assert largest_batch(lambda b: False) == 0
    assert largest_batch(lambda b: True, cap=100) == 100


def _report(preset, hardware, budget_ms, batch=1, context=4096):
    req = parse_request(hardware=hardware, sla_ms=budget_ms, batch=batch, context=context)
    return build_report(load_spec(preset), req, get_hardware(hardware))


def test_a_budget_beyond_the_whole_model_says_so():
    s = _report("qwen3-30b-a3b", "a100-80gb", 50).sla
    assert s.max_share > 1 and s.whole_model_fits  # 166%: no routing can use that share
    assert s.headroom == pytest.approx(50 / s.model_ms)
    tight = _report("qwen3-30b-a3b", "a100-80gb", 5).sla
    assert not tight.whole_model_fits and tight.max_share < 1


@pytest.mark.parametrize("preset, hardware, budget_ms", [("qwen3-30b-a3b", "a100-80gb", 50), ("qwen3-30b-a3b", "h100", 5),
                                                          ("mixtral-8x7b", "mi300x", 30)])
def test_max_batch_is_the_last_batch_whose_step_meets_the_budget_and_fits(preset, hardware, budget_ms):
    s = _report(preset, hardware, budget_ms).sla
    assert s.max_batch >= 1

    def ok(batch):
        f = _report(preset, hardware, None, batch=batch).roofline
        return f.batched.step_seconds * 1000 <= budget_ms and f.fits

    assert ok(s.max_batch) and not ok(s.max_batch + 1)
    f = _report(preset, hardware, None, batch=s.max_batch + 1).roofline
    assert s.max_batch_binds == ("memory" if not f.fits else "latency")


def test_a_missed_budget_serves_no_batch():
    s = _report("deepseek-v3", "h100", 20).sla
    assert not s.meets and s.max_batch == 0
