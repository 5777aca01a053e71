"""Training extras (off by default): expert dropout drops assignments at its rate and scales the
kept ones as dropout does; the routing-entropy regulariser's sign sharpens or flattens the router;
both are refused out of range, and leave a run's identity alone when off."""

import json
import tomllib

import pytest
import torch

from moekit.model.experts import experts_reference
from moekit.model.moe import MoE
from moekit.model.routing import RoutingDecision, route
from moekit.train.aux_losses import router_probs, routing_entropy
from moekit.train.config import load_config, model_config
from moekit.train.forward import RoutingOptions, moe_forward
from moekit.train.init import build_decoder
from moekit.train.session import train

from test_bad_input import _one_line_error, moekit  # noqa: F401 (moekit: the CLI fixture)
from train_fixtures import TINY_MODEL, tiny_config


def _moe(seed=0):
    decoder = build_decoder(model_config(tomllib.loads(TINY_MODEL)["model"], "tiny"), seed)
    return next(b.ffn for b in decoder.layers if isinstance(b.ffn, MoE))


def test_expert_dropout_drops_at_its_rate_and_scales_the_kept_by_one_over_one_minus_p():
    moe = _moe()
    x = torch.randn(1, 400, 32, generator=torch.Generator().manual_seed(0))
    options = RoutingOptions(expert_dropout=0.25, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, routing = moe_forward(moe, x, options)
        flat = x.view(400, 32)
        decision = route(moe.router.logits(flat), moe.router.spec)
        kept = routing.kept
        want = experts_reference(moe.experts, flat, RoutingDecision(decision.topk_ids, decision.topk_weights * kept / 0.75))
    assert 0.2 < 1 - float(kept.float().mean()) < 0.3
    torch.testing.assert_close(out.view(400, 32), want, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        same, again = moe_forward(moe, x, RoutingOptions(expert_dropout=0.25, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(again.kept, kept) and torch.equal(same, out)  # seeded: reproducible


def test_the_entropy_term_is_the_mean_token_entropy_and_its_gradient_sharpens_the_router():
    moe = _moe()
    x = torch.randn(1, 64, 32, generator=torch.Generator().manual_seed(2))
    _, routing = moe_forward(moe, x, RoutingOptions())
    probs = router_probs(moe.router.logits(x.view(64, 32)), "softmax")
    want = float(-(probs * probs.log()).sum(-1).mean().detach())
    assert float(routing.entropy.detach()) == pytest.approx(want, rel=1e-5)
    routing.entropy.backward()
    with torch.no_grad():  # one step down the entropy's gradient lowers the entropy
        moe.router.weight -= 0.5 * moe.router.weight.grad
        after = float(routing_entropy(router_probs(moe.router.logits(x.view(64, 32)), "softmax")))
    assert after < want


@pytest.mark.parametrize("coef", [0.3, -0.3])
def test_a_short_run_with_the_regulariser_moves_router_entropy_its_way(tiny_corpus, tmp_path, coef):
    def run(extra, name):
        (tmp_path / name).mkdir()
        config = tiny_config(tmp_path / name, tiny_corpus, steps=12, every=12)
        config.write_text(config.read_text() + extra)
        train(config, tmp_path / name / "run", say=lambda s: None)
        lines = [json.loads(x) for x in (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()]
        return sum(x["entropy"] for x in lines[-4:]) / 4

    base = run("", "base")
    with_term = run(f"entropy_coef = {coef}\nexpert_dropout = 0.1\n", "term")
    assert (with_term < base) if coef > 0 else (with_term > base)


def test_off_by_default_and_the_identity_of_older_runs_is_kept(tiny_corpus, tmp_path):
    path = tiny_config(tmp_path, tiny_corpus)
    plain = load_config(path)
    assert plain.train.expert_dropout == 0.0 and plain.train.entropy_coef == 0.0
    path.write_text(path.read_text() + "expert_dropout = 0.0\nentropy_coef = 0.0\n")
    assert load_config(path).identity() == plain.identity()
    path.write_text(path.read_text().replace("expert_dropout = 0.0", "expert_dropout = 0.1"))
    assert load_config(path).identity() != plain.identity()


@pytest.mark.parametrize("line, needle", [("expert_dropout = 1.0", "expert_dropout must be in [0, 1)"),
                                          ("expert_dropout = -0.1", "expert_dropout must be in [0, 1)"),
                                          ("entropy_coef = nan", "entropy_coef must be a finite number")])
def test_out_of_range_extras_are_refused(moekit, tiny_corpus, tmp_path, line, needle):
    config = tiny_config(tmp_path, tiny_corpus)
    config.write_text(config.read_text() + line + "\n")
    _one_line_error(moekit("train", "--config", str(config), "--out", str(tmp_path / "run")), needle)
