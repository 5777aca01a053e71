"""Bytes read per decode step, and the expected union of experts a batch reads."""

import itertools
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tiny_configs import TINY_MIXTRAL, spec

from moekit.calc.dtypes import DTYPES
from moekit.calc.kv_cache import kv_cache
from moekit.calc.params import count_params
from moekit.calc.traffic import expected_distinct_experts, step_traffic
from moekit.spec import load_spec


def brute_force_distinct(num_experts: int, top_k: int, batch: int) -> Fraction:
    """Average number of distinct experts over every way B tokens can each pick K of E."""
    choices = list(itertools.combinations(range(num_experts), top_k))
    total = count = 0
    for picks in itertools.product(choices, repeat=batch):
        total += len(set().union(*picks))
        count += 1
    return Fraction(total, count)


@pytest.mark.parametrize("e, k, b", [(5, 2, 3), (4, 1, 4), (6, 3, 2), (4, 4, 2)])
def test_union_formula_matches_enumeration(e, k, b):
    assert expected_distinct_experts(e, k, b) == pytest.approx(float(brute_force_distinct(e, k, b)))


@given(st.integers(1, 512), st.data())
def test_union_lies_between_k_and_e(e, data):
    k = data.draw(st.integers(1, e))
    b = data.draw(st.integers(1, 10_000))
    d = expected_distinct_experts(e, k, b)
    assert k - 1e-9 <= d <= min(e, k * b) + 1e-9
    assert expected_distinct_experts(e, k, 1) == pytest.approx(k)


def test_large_batches_read_every_expert():
    assert expected_distinct_experts(256, 8, 4096) == pytest.approx(256)
    assert expected_distinct_experts(256, 8, 8) < 64  # 8 tokens × 8 experts, some shared


def tiny(batch, context=100):
    s = spec(TINY_MIXTRAL)
    counts = count_params(s)
    kv = kv_cache(s, DTYPES["bf16"], context, batch)
    return s, counts, step_traffic(s, counts, DTYPES["bf16"], kv, batch)


def test_batch_one_reads_dense_weights_k_experts_one_row_and_the_cache():
    _, counts, t = tiny(1)
    dense = 3 * (2 * 64 * 64 + 2 * 64 * 32) + 3 * 64 * 4 + (3 * 2 * 64 + 64) + 100 * 64  # no embedding table
    experts = 3 * 2 * 3 * 64 * 32
    assert (t.dense_params, t.expert_params, t.embedding_row_params) == (dense, experts, 64)
    assert t.params_read == counts.active_params_excl_input_embedding + 64
    kv = 3 * 2 * 2 * 16 * 100 * 2
    assert t.total_bytes == (dense + experts + 64) * 2 + kv


def test_batch_reads_the_union_of_experts_and_every_cache():
    _, _, t = tiny(3)
    distinct = 4 * (1 - (1 - 2 / 4) ** 3)  # 3.5 of 4 experts per layer
    assert t.expert_params == pytest.approx(3 * distinct * 3 * 64 * 32)
    assert t.embedding_row_params == 3 * 64
    assert t.kv_bytes == 3 * (3 * 2 * 2 * 16 * 100 * 2)


def test_tied_head_is_read_in_full():
    s = load_spec("granite-3.0-1b-a400m")
    assert s.tie_word_embeddings
    counts = count_params(s)
    t = step_traffic(s, counts, DTYPES["bf16"], kv_cache(s, DTYPES["bf16"], 1, 1), 1)
    assert t.dense_params + t.expert_params == counts.active_params_excl_input_embedding
    assert t.dense_params > s.vocab_size * s.hidden_size  # the table, as the head


def test_mxfp4_reads_dense_weights_at_bf16_and_experts_at_4_25_bits():
    s = spec(TINY_MIXTRAL)
    counts = count_params(s)
    t = step_traffic(s, counts, DTYPES["mxfp4"], kv_cache(s, DTYPES["bf16"], 100, 1), 1)
    experts = 3 * 2 * 3 * 64 * 32  # whole 32-value blocks: 17 bytes each
    assert t.weight_bytes == (t.dense_params + 64) * 2 + experts // 32 * 17
