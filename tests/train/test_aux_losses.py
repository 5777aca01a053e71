"""Router losses and capacity on hand-made examples, computed by hand next to the code's answer."""

import math

import torch

from moekit.train.aux_losses import (
    capacity,
    capacity_keep,
    expert_load,
    imbalance,
    load_balance_loss,
    router_entropy,
    z_loss,
)


def test_load_balance_loss_is_E_times_sum_of_load_share_times_mean_probability():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.1, 0.1, 0.8], [0.5, 0.4, 0.1]])
    topk_ids = torch.tensor([[0, 1], [0, 1], [2, 0], [0, 1]])
    f = [4 / 8, 3 / 8, 1 / 8]  # expert 0 got 4 of the 8 assignments, 1 got 3, 2 got 1
    p = [(0.7 + 0.6 + 0.1 + 0.5) / 4, (0.2 + 0.3 + 0.1 + 0.4) / 4, (0.1 + 0.1 + 0.8 + 0.1) / 4]
    expected = 3 * sum(fi * pi for fi, pi in zip(f, p))
    assert math.isclose(float(load_balance_loss(probs, topk_ids)), expected, rel_tol=1e-6)


def test_uniform_routing_has_balance_loss_one_and_the_skewed_one_more():
    e = 4
    uniform = torch.full((8, e), 1 / e)
    ids = torch.tensor([[0, 1], [2, 3]] * 4)
    assert math.isclose(float(load_balance_loss(uniform, ids)), 1.0, rel_tol=1e-6)
    skewed = torch.tensor([[0.9, 0.05, 0.03, 0.02]] * 8)
    assert float(load_balance_loss(skewed, torch.tensor([[0, 1]] * 8))) > 1.5


def test_balance_loss_gradient_moves_probability_off_the_busy_expert():
    logits = torch.tensor([[2.0, 0.0, 0.0, 0.0]] * 4, requires_grad=True)
    ids = torch.tensor([[0, 1]] * 4)
    load_balance_loss(torch.softmax(logits, -1), ids).backward()
    assert logits.grad[0, 0] > 0  # descending lowers the busy expert's logit


def test_z_loss_is_the_mean_squared_logsumexp():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    lse = [math.log(math.e + math.e**2 + math.e**3), math.log(3)]
    assert math.isclose(float(z_loss(logits)), (lse[0] ** 2 + lse[1] ** 2) / 2, rel_tol=1e-6)


def test_load_imbalance_and_entropy():
    load = expert_load(torch.tensor([[0, 0], [0, 1]]), 4)
    assert load.tolist() == [0.75, 0.25, 0.0, 0.0]
    assert imbalance(load) == 3.0
    assert math.isclose(router_entropy(torch.full((3, 8), 1 / 8)), math.log(8), rel_tol=1e-6)


def test_capacity_drops_second_choices_before_first_and_later_tokens_before_earlier():
    # 4 experts, K=2, capacity 2 slots each. Expert 0 is everyone's first choice.
    ids = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 0]])
    keep = capacity_keep(ids, 4, slots=2)
    # First choices are served in token order: tokens 0 and 1 fill expert 0, token 2's first choice
    # is dropped; token 3's SECOND choice (expert 0) comes after all first choices and is dropped too.
    assert keep.tolist() == [[True, True], [True, True], [False, True], [True, False]]


def test_capacity_is_ceil_of_factor_times_fair_share():
    assert capacity(tokens=10, top_k=2, num_experts=8, factor=1.25) == math.ceil(1.25 * 20 / 8)
    assert capacity(tokens=1, top_k=1, num_experts=64, factor=1.0) == 1
