"""Prefix caching is exact: a request whose prompt prefix comes from the cache gets the greedy fp32
tokens and the usage it gets cold, on the bundled model and on families whose attention differs
(MLA in deepseek_v3, sliding windows and sinks in gpt_oss, chunks in llama4; every MoE family
and the dense ones)."""

from __future__ import annotations

import pytest
import torch

from hf_tiny import DENSE_FAMILIES, MOE_FAMILIES
from moekit.engine.default_model import bundled_model_path
from moekit.engine.loader import load_engine
from moekit.engine.prefix_cache import Block, PrefixCache, block_keys
from moekit.engine.scheduler import Request, Scheduler, generate_batch

SHARED = [(7 * i + 3) % 150 + 3 for i in range(37)]  # 37 tokens: two full blocks of 16, then 5
SUFFIXES = [[11, 12, 13], [120, 5, 9, 31, 8], [44]]


def block(nbytes: int) -> Block:
    return Block(slots=[torch.zeros(nbytes, dtype=torch.uint8)], routing=[])


def test_a_blocks_key_names_its_whole_prefix():
    a = block_keys(list(range(40)), 16, "s")
    b = block_keys(list(range(32)) + [9] * 8, 16, "s")
    c = block_keys([99] + list(range(1, 40)), 16, "s")
    assert len(a) == 2 and a == b  # the trailing partial block has no key
    assert c[0] != a[0] and c[1] != a[1]  # a changed first token changes every later key
    assert block_keys(list(range(40)), 16, "other") != a  # the salt starts the chain


def test_lookup_leaves_the_last_prompt_token_and_counts_tokens():
    cache = PrefixCache(budget_bytes=1000, block_size=4)
    prompt = list(range(8))
    keys = cache.keys(prompt, "s")
    for key in keys:
        cache.insert(key, block(10))
    assert len(cache.lookup(prompt, keys)) == 1  # block 2 holds the last token, which must be run
    assert len(cache.lookup(prompt + [5], cache.keys(prompt + [5], "s"))) == 2
    assert (cache.queried_tokens, cache.hit_tokens) == (17, 12)


def test_eviction_is_least_recent_first_and_a_chain_goes_from_its_end():
    cache = PrefixCache(budget_bytes=30, block_size=2)
    first = cache.keys([1, 2, 3, 4, 5, 6], "s")
    for key in first:
        cache.insert(key, block(10))
    cache.touch(first)
    other = cache.keys([9, 9], "s")
    cache.insert(other[0], block(10))  # over budget: the first chain's last block goes
    assert list(cache.blocks) == [first[1], first[0], other[0]]
    assert cache.nbytes == 30
    cache.insert(b"huge", block(31))  # larger than the whole budget: not kept, nothing evicted
    assert b"huge" not in cache.blocks and len(cache.blocks) == 3


def run_cold_and_cached(engine, prompts, new=8, **request):
    """Each prompt cold (a scheduler without a cache) and then, one after another, through one
    scheduler with a prefix cache, so later prompts find the blocks the earlier ones left."""
    cold = Scheduler(engine.decoder, max_batch=2)
    cached = Scheduler(engine.decoder, max_batch=2, prefix_cache=PrefixCache(budget_bytes=1 << 30))
    cold_out = [generate_batch(cold, [Request(prompt=p, max_new_tokens=new, **request)])[0] for p in prompts]
    warm_out = [generate_batch(cached, [Request(prompt=p, max_new_tokens=new, **request)])[0] for p in prompts]
    return cold_out, warm_out


def assert_same(cold_out, warm_out):
    for cold, warm in zip(cold_out, warm_out):
        assert warm.finish_reason != "error", warm.error
        assert warm.token_ids == cold.token_ids
        assert warm.usage.experts_touched == cold.usage.experts_touched
        assert warm.usage.bytes_read_per_token == cold.usage.bytes_read_per_token


@pytest.mark.parametrize("family", MOE_FAMILIES + DENSE_FAMILIES)
def test_cached_prefix_gives_the_cold_tokens(family, tiny_checkpoints):
    engine = load_engine(tiny_checkpoints(family), compile=False)
    prompts = [SHARED + s for s in SUFFIXES] + [SHARED + SUFFIXES[0]]  # the last one repeats the first
    cold_out, warm_out = run_cold_and_cached(engine, prompts)
    assert_same(cold_out, warm_out)
    assert [o.cached_tokens for o in warm_out] == [0, 32, 32, 32]


def test_cached_prefix_gives_the_cold_tokens_on_the_bundled_model():
    engine = load_engine(bundled_model_path(), compile=False)
    shared = engine.encode("def parse_args(argv):\n    parser = argparse.ArgumentParser(description='x')\n" * 3)
    prompts = [shared + engine.encode(s) for s in ("    parser.add", "    return", "\n\nclass Config:")]
    cold_out, warm_out = run_cold_and_cached(engine, prompts, new=12)
    assert_same(cold_out, warm_out)
    full = (len(shared) // 16) * 16
    assert warm_out[0].cached_tokens == 0 and all(o.cached_tokens == full for o in warm_out[1:])


def test_a_tier_does_not_reuse_another_tiers_prefix(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("mixtral"), compile=False)
    scheduler = Scheduler(engine.decoder, max_batch=2, prefix_cache=PrefixCache(budget_bytes=1 << 30))
    prompt = SHARED + SUFFIXES[0]
    full, = generate_batch(scheduler, [Request(prompt=prompt, max_new_tokens=6)])
    one, = generate_batch(scheduler, [Request(prompt=prompt, max_new_tokens=6, tier="B")])
    again, = generate_batch(scheduler, [Request(prompt=prompt, max_new_tokens=6, tier="B")])
    cold, = generate_batch(Scheduler(engine.decoder), [Request(prompt=prompt, max_new_tokens=6, tier="B")])
    assert one.cached_tokens == 0 and again.cached_tokens == 32
    assert again.token_ids == one.token_ids == cold.token_ids


def test_prompts_prefilled_together_fill_the_cache(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("qwen3_moe"), compile=False)
    scheduler = Scheduler(engine.decoder, max_batch=4, prefix_cache=PrefixCache(budget_bytes=1 << 30))
    prompts = [SHARED[:20] + [5, 6], SHARED + [1, 2]]  # different lengths: the shorter one is left-padded
    generate_batch(scheduler, [Request(prompt=p, max_new_tokens=4) for p in prompts])
    later = [SHARED[:16] + [9] * 3, SHARED + [3]]
    cold_out = [generate_batch(Scheduler(engine.decoder), [Request(prompt=p, max_new_tokens=6)])[0] for p in later]
    warm_out = [generate_batch(scheduler, [Request(prompt=p, max_new_tokens=6)])[0] for p in later]
    assert_same(cold_out, warm_out)
    assert [o.cached_tokens for o in warm_out] == [16, 32]


def test_a_change_between_steps_empties_the_cache(tiny_checkpoints):
    engine = load_engine(tiny_checkpoints("mixtral"), compile=False)
    scheduler = Scheduler(engine.decoder, prefix_cache=PrefixCache(budget_bytes=1 << 30))
    generate_batch(scheduler, [Request(prompt=SHARED + [4], max_new_tokens=2)])
    assert scheduler.prefix_cache.blocks
    scheduler.between_steps(lambda: None)
    scheduler.step()
    assert not scheduler.prefix_cache.blocks
