"""Sampling: greedy is argmax; top-k / top-p keep what transformers' warpers keep; a seed repeats."""

from __future__ import annotations

import pytest
import torch

from moekit.engine.sampling import (
    SamplingParams,
    check_sampling,
    filter_top_k,
    filter_top_p,
    make_generator,
    next_tokens,
    sampling_probs,
)
from moekit.errors import MoekitError

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper  # noqa: E402


def _logits(seed: int, batch: int = 4, vocab: int = 50) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_picks_the_largest_logit():
    logits = _logits(0)
    assert next_tokens(logits, SamplingParams(), None).tolist() == logits.argmax(-1).tolist()


def test_greedy_is_torch_argmax_with_the_operators_registered_too():
    from moekit import ops

    assert ops.load().ok, ops.load().failures()  # from here greedy takes moekit::rows_argmax
    logits = torch.cat((_logits(1, vocab=32000), torch.zeros(1, 32000)))  # the last row: all tied
    logits[1, 7] = float("nan")
    assert next_tokens(logits, SamplingParams(), None).tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("k", [1, 3, 17, 50, 80])
def test_top_k_keeps_what_transformers_keeps(k):
    logits = _logits(k)
    ours = filter_top_k(logits, k)
    theirs = TopKLogitsWarper(top_k=k)(None, logits.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))


@pytest.mark.parametrize("p", [0.05, 0.3, 0.7, 0.9, 0.999])
def test_top_p_keeps_what_transformers_keeps(p):
    logits = _logits(int(p * 1000))
    ours = filter_top_p(logits, p)
    theirs = TopPLogitsWarper(top_p=p)(None, logits.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert (~torch.isinf(ours)).sum(-1).min() >= 1


def test_top_p_on_a_known_distribution():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert (~torch.isinf(filter_top_p(logits, 0.7))).nonzero()[:, 1].tolist() == [0, 1]
    assert (~torch.isinf(filter_top_p(logits, 0.85))).nonzero()[:, 1].tolist() == [0, 1, 2]


def test_temperature_scales_before_softmax():
    logits = _logits(1)
    probs = sampling_probs(logits, SamplingParams(temperature=0.5))
    torch.testing.assert_close(probs, torch.softmax(logits / 0.5, dim=-1))


@pytest.mark.parametrize("temperature", [1e-308, 5e-324, 1e-6])
def test_a_vanishing_temperature_is_greedy_not_nan(temperature):
    """logits / 1e-308 overflow to inf and softmax of inf - inf is NaN: such a request once failed
    with 'probability tensor contains inf or nan' (found by schemathesis)."""
    logits = _logits(4)
    params = SamplingParams(temperature=temperature, seed=0)
    assert params.greedy
    assert next_tokens(logits, params, make_generator(params, "cpu")).tolist() == logits.argmax(-1).tolist()


def _draws(params: SamplingParams, logits: torch.Tensor, n: int) -> list[list[int]]:
    gen = make_generator(params, "cpu")
    return [next_tokens(logits, params, gen).tolist() for _ in range(n)]


def test_a_seed_repeats_and_another_seed_differs():
    logits = _logits(2)
    a = _draws(SamplingParams(temperature=1.0, seed=7), logits, 30)
    b = _draws(SamplingParams(temperature=1.0, seed=7), logits, 30)
    c = _draws(SamplingParams(temperature=1.0, seed=8), logits, 30)
    assert a == b
    assert a != c


def test_samples_stay_inside_top_k_and_top_p():
    logits = _logits(3, batch=1, vocab=40)
    draws = {t[0] for t in _draws(SamplingParams(temperature=1.5, top_k=4, seed=0), logits, 400)}
    assert draws == set(torch.topk(logits[0], 4).indices.tolist())

    allowed = set((~torch.isinf(filter_top_p(logits, 0.6)))[0].nonzero()[:, 0].tolist())
    draws = {t[0] for t in _draws(SamplingParams(temperature=1.0, top_p=0.6, seed=0), logits, 400)}
    assert draws <= allowed and len(allowed) > 1 and len(draws) > 1


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(temperature=-1), r"temperature must be >= 0 \(0 is greedy\), got -1$"),
        (SamplingParams(top_k=-2), r"top-k must be >= 1 \(or 0 for none\), got -2$"),
        (SamplingParams(top_p=0.0), r"top-p must be in \(0, 1\], got 0.0$"),
        (SamplingParams(top_p=1.5), r"top-p must be in \(0, 1\], got 1.5$"),
    ],
)
def test_bad_settings_are_refused(params, message):
    with pytest.raises(MoekitError, match=message):
        check_sampling(params)
