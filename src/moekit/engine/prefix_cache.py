"""Automatic prefix caching: the KV of prompt prefixes kept across requests, with their routing.

vLLM's semantics (llama-server calls it cache_prompt). A prompt is cut into full blocks of
`block_size` tokens; block i's key hashes its tokens chained with block i-1's key, so one key names
the whole prefix up to the block's end, and the chain starts from a salt holding whatever else
shapes the KV (the row's experts per token: a tier-B prefix routes, and so attends, differently).
A request reuses the longest run of leading blocks found, always leaving its last prompt token to
compute, since that token's logits give the first generated one.

Beside each block's KV sit the routing decisions of its tokens: a cached prefix's experts are not
run again, yet the request's usage counts the experts its whole prompt touched.

Blocks are evicted least recently used first under a byte budget. When a prompt's blocks are used,
its later blocks are marked older than its earlier ones, so eviction takes a chain from its end:
a block whose predecessor is gone can never be found again.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from moekit.model.cache import KVCache, slot_tensors

BLOCK_SIZE = 16  # vLLM's default: small enough that chat turns share most of their history
DEFAULT_MEMORY = "1GiB"  # `moekit serve --prefix-cache-memory`; 0 turns caching off


@dataclass
class Block:
    """One block of a prompt: every layer's cache slots for its tokens and their routing."""

    slots: list[Tensor]  # one per cache tensor (slot_tensors order), the block's slots only
    routing: list[tuple[int, Tensor]]  # (MoE layer, topk_ids [block, K]) of the block's tokens

    @property
    def nbytes(self) -> int:
        tensors = self.slots + [ids for _, ids in self.routing]
        return sum(t.numel() * t.element_size() for t in tensors)


def block_keys(tokens: Sequence[int], block_size: int, salt: str) -> list[bytes]:
    """The chained key of each full block of `tokens` (a trailing partial block has none)."""
    keys = []
    parent = hashlib.sha256(salt.encode()).digest()
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = ",".join(str(int(t)) for t in tokens[start : start + block_size])
        parent = hashlib.sha256(parent + block.encode()).digest()
        keys.append(parent)
    return keys


def read_slots(cache: KVCache, row: int, start: int, length: int) -> list[Tensor]:
    """Copies of slots start..start+length-1 of `row`, every cache tensor of every layer."""
    return [
        t[row].narrow(axis - 1, start, length).clone()
        for entry in cache.layers
        for t, axis in slot_tensors(entry)
    ]


def write_slots(cache: KVCache, row: int, start: int, slots: list[Tensor]) -> None:
    """The inverse of read_slots: `slots` into `row` from slot `start` on."""
    tensors = [(t, axis) for entry in cache.layers for t, axis in slot_tensors(entry)]
    for (t, axis), values in zip(tensors, slots):
        t[row].narrow(axis - 1, start, values.shape[axis - 1]).copy_(values)


class PrefixCache:
    """Blocks by key, least recently used first, within `budget_bytes`."""

    def __init__(self, budget_bytes: int, block_size: int = BLOCK_SIZE):
        if block_size < 1:
            raise ValueError(f"block size must be at least 1, got {block_size}")
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()  # oldest first
        self.nbytes = 0
        self.queried_tokens = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hit_tokens = 0  # of those, tokens found cached (prefix_cache_hits)

    def keys(self, prompt: Sequence[int], salt: str) -> list[bytes]:
        return block_keys(prompt, self.block_size, salt)

    def lookup(self, prompt: Sequence[int], keys: list[bytes]) -> list[Block]:
        """The longest run of leading blocks cached, leaving at least the last prompt token out;
        counts the query and its hit tokens."""
        usable = keys[: (len(prompt) - 1) // self.block_size]
        found: list[Block] = []
        for key in usable:
            block = self.blocks.get(key)
            if block is None:
                break
            found.append(block)
        self.touch(usable[: len(found)])
        self.queried_tokens += len(prompt)
        self.hit_tokens += len(found) * self.block_size
        return found

    def insert(self, key: bytes, block: Block) -> None:
        """Keep `block` (as most recent), evicting the oldest blocks beyond the budget. A block
        larger than the whole budget is not kept."""
        if key in self.blocks or block.nbytes > self.budget_bytes:
            return
        self.blocks[key] = block
        self.nbytes += block.nbytes
        while self.nbytes > self.budget_bytes:
            _, old = self.blocks.popitem(last=False)
            self.nbytes -= old.nbytes

    def touch(self, keys: list[bytes]) -> None:
        """Mark one prompt's blocks used, its first block the most recent (see the module note)."""
        for key in reversed(keys):
            if key in self.blocks:
                self.blocks.move_to_end(key)

    def clear(self) -> None:
        """Forget every block (the weights changed, so every cached KV is stale)."""
        self.blocks.clear()
        self.nbytes = 0


def routing_rows(decisions: list, first: int, count: int, width: int, row: int = 0) -> list[tuple[int, Tensor]]:
    """(layer, topk_ids [count, K]) of tokens first..first+count-1 of `row`, from one forward's
    decisions over rows of `width` tokens (topk_ids [B*width, K], rows flattened row-major)."""
    out = []
    for layer, decision in decisions:
        ids = decision.topk_ids.view(-1, width, decision.topk_ids.shape[-1])[row]  # [width, K]
        out.append((layer, ids[first : first + count].to("cpu", torch.int64, copy=True)))
    return out
