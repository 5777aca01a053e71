"""The decode cache: one preallocated entry per layer plus which slots hold real (non-pad) tokens."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass
class KVCache:
    layers: list  # one entry per layer: whatever that layer's mixer.new_cache() returned
    key_mask: Tensor  # [B, S_max] bool, True where a real token sits; prompts are LEFT-padded
    length: int = 0  # slots already written (the same for every row)

    @property
    def batch(self) -> int:
        return self.key_mask.shape[0]

    @property
    def max_len(self) -> int:
        return self.key_mask.shape[1]
