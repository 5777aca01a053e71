"""The decode roofline and its inverse on a made-up device with round numbers."""

import pytest
from tiny_configs import TINY_MIXTRAL, TINY_MLA, spec

from moekit.calc.hardware import Hardware, get_hardware
from moekit.calc.report import build_report
from moekit.calc.request import parse_request
from moekit.calc.roofline import attention_flops_per_token
from moekit.spec import load_spec


def device(bandwidth=1e6, flops=1e9, memory=10**6):
    return Hardware("toy", "toy device", memory, bandwidth, (("fp32", flops), ("bf16", flops)), "made up")


def tiny_report(hw, batch=1, gpus=1, sla_ms=None, context=100):
    req = parse_request(context=context, batch=batch, hardware="toy", gpus=gpus, sla_ms=sla_ms)
    return build_report(spec(TINY_MIXTRAL), req, hw)


# Hand counts for TINY_MIXTRAL at context 100, bf16 (see test_traffic.py):
DENSE = 3 * (2 * 64 * 64 + 2 * 64 * 32) + 3 * 64 * 4 + (3 * 2 * 64 + 64) + 100 * 64
EXPERTS = 3 * 2 * 3 * 64 * 32
KV = 3 * 2 * 2 * 16 * 100 * 2
ATTENTION_FLOPS = 3 * 2 * 4 * (16 + 16) * 100  # layers × 2 × heads × (qk + v) × tokens


def test_attention_flops():
    assert attention_flops_per_token(spec(TINY_MIXTRAL), 100) == ATTENTION_FLOPS
    # MLA: 2 layers × 2 × 4 heads × ((16 + 8) + 16) × 10 tokens
    assert attention_flops_per_token(spec(TINY_MLA), 10) == 2 * 2 * 4 * 40 * 10


def test_bandwidth_bound_at_batch_one():
    f = tiny_report(device(bandwidth=1e6, flops=1e9)).roofline
    bytes_ = (DENSE + EXPERTS + 64) * 2 + KV
    flops = 2 * (DENSE + EXPERTS) + ATTENTION_FLOPS
    assert f.single.bytes == bytes_ and f.single.flops == flops
    assert f.single.t_bandwidth == pytest.approx(bytes_ / 1e6)
    assert f.single.t_compute == pytest.approx(flops / 1e9)
    assert f.single.binds == "bandwidth"
    assert f.single.tokens_per_s == pytest.approx(1e6 / bytes_)


def test_compute_bound_on_a_slow_core():
    f = tiny_report(device(bandwidth=1e9, flops=1e6)).roofline
    assert f.single.binds == "compute"
    assert f.single.tokens_per_s == pytest.approx(1e6 / (2 * (DENSE + EXPERTS) + ATTENTION_FLOPS))


def test_batching_amortises_the_dense_weights():
    f = tiny_report(device(), batch=3).roofline
    distinct = 4 * (1 - 0.5**3)
    bytes_ = round(DENSE + 3 * 64 + 3 * distinct * 3 * 64 * 32) * 2 + 3 * KV
    assert f.batched.bytes == bytes_
    assert f.batched.tokens_per_s == pytest.approx(3 * 1e6 / bytes_)
    assert f.batched.tokens_per_s > f.single.tokens_per_s


def test_gpus_add_bandwidth_and_capacity():
    one = tiny_report(device(memory=200_000)).roofline
    two = tiny_report(device(memory=200_000), gpus=2).roofline
    assert two.single.step_seconds == pytest.approx(one.single.step_seconds / 2)
    assert (one.fits, two.fits) == (False, True)
    assert two.per_gpu_bytes == -(-two.memory_bytes // 2)


def test_sla_by_hand():
    r = tiny_report(device(bandwidth=1e6, flops=1e9), sla_ms=1000)
    # 1 s × 1e6 B/s − the KV cache, at 2 bytes a parameter, minus the embedding row.
    assert r.sla.max_params == (10**6 - KV) // 2 - 64
    assert r.sla.binds == "bandwidth"
    assert r.sla.max_share == pytest.approx(r.sla.max_params / r.counts.total_params)
    assert r.sla.meets


@pytest.mark.parametrize("hardware, dtype, context", [("h100", "bf16", 4096), ("a100-80gb", "fp8", 32768), ("l40s", "int4", 1024)])
@pytest.mark.parametrize("budget_ms", [3.0, 20.0, 150.0])
def test_sla_inverts_the_forward_roofline(hardware, dtype, context, budget_ms):
    """A model touching exactly the SLA's parameter count decodes in exactly the budget."""
    s = load_spec("qwen3-30b-a3b")
    req = parse_request(dtype=dtype, context=context, hardware=hardware, sla_ms=budget_ms)
    r = build_report(s, req, get_hardware(hardware))
    f, p = r.roofline, r.sla.max_params
    bytes_ = (p + r.single.embedding_row_params) * float(req.dtype.bits) / 8 + r.single.kv_bytes
    flops = 2 * p + f.attention_flops_per_token
    forward = max(bytes_ / f.bandwidth, flops / f.peak_flops)
    assert forward * 1000 == pytest.approx(budget_ms, rel=1e-6)


def test_sla_at_the_models_own_latency_returns_the_model():
    s = load_spec("mixtral-8x7b")
    probe = build_report(s, parse_request(hardware="h100"), get_hardware("h100"))
    ms = probe.roofline.single.step_seconds * 1000
    r = build_report(s, parse_request(hardware="h100", sla_ms=ms), get_hardware("h100"))
    assert r.sla.max_params == pytest.approx(r.counts.active_params_excl_input_embedding, abs=2)
    assert r.sla.max_share == pytest.approx(r.counts.active_params_excl_input_embedding / r.counts.total_params)
