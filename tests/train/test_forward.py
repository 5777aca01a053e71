"""The training forward against the engine: same logits without dropping, and dropping drops exactly."""

import tomllib

import torch

from moekit.model.experts import experts_reference
from moekit.model.moe import MoE
from moekit.model.routing import RoutingDecision
from moekit.train.aux_losses import capacity_keep
from moekit.train.config import model_config
from moekit.train.forward import RoutingOptions, experts_dispatch, train_forward
from moekit.train.init import build_decoder

from train_fixtures import TINY_MODEL


def _decoder(seed=0):
    return build_decoder(model_config(tomllib.loads(TINY_MODEL)["model"], "tiny"), seed)


def test_without_dropping_training_logits_equal_the_engine_forward():
    decoder = _decoder()
    ids = torch.randint(3, 320, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, routings = train_forward(decoder, ids, RoutingOptions())
        cache = decoder.new_cache(2, 20)
        engine = decoder(ids, cache, torch.arange(20)[None].expand(2, 20))
    assert len(routings) == 2 and all(bool(r.kept.all()) for r in routings)
    torch.testing.assert_close(ours, engine, rtol=1e-5, atol=1e-5)


def test_the_logits_at_a_position_do_not_depend_on_later_tokens():
    decoder = _decoder()
    ids = torch.randint(3, 320, (1, 16), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[0, 10:] = 7
    with torch.no_grad():
        a, _ = train_forward(decoder, ids, RoutingOptions())
        b, _ = train_forward(decoder, changed, RoutingOptions())
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_capacity_dispatch_is_the_reference_sum_over_the_kept_assignments_only():
    decoder = _decoder()
    moe = next(b.ffn for b in decoder.layers if isinstance(b.ffn, MoE))
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(3))
    ids = torch.tensor([[0, 1]] * 12 + [[2, 0]] * 12)  # expert 0 heavily oversubscribed
    weights = torch.rand(24, 2, generator=torch.Generator().manual_seed(4))
    keep = capacity_keep(ids, 8, slots=5)
    assert 0 < int(keep.sum()) < keep.numel()
    with torch.no_grad():
        ours = experts_dispatch(moe.experts, x, ids, weights, keep, slots=5)
        reference = experts_reference(moe.experts, x, RoutingDecision(ids, weights * keep))
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    fully_dropped = ~keep.any(dim=1)
    assert bool(fully_dropped.any()) and bool((ours[fully_dropped] == 0).all())
