"""The tiny model and training settings the train tests use, and a generated prose domain."""

from __future__ import annotations

import random
from pathlib import Path


TINY_MODEL = """
[model]
model_type = "qwen3_moe"
vocab_size = 320
hidden_size = 32
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 8
num_experts = 8
num_experts_per_tok = 2
moe_intermediate_size = 16
intermediate_size = 64
max_position_embeddings = 128
initializer_range = 0.05
"""

TINY_TRAIN = """
[train]
corpus = "{corpus}"
seed = 5
steps = {steps}
batch_size = 4
seq_len = 32
lr = 1e-2
warmup_steps = 2
log_every = 1
checkpoint_every = {every}
threads = 1
save_dtype = "float32"
"""


def tiny_config(folder: Path, corpus: Path, steps: int = 6, every: int = 3, model: str = TINY_MODEL) -> Path:
    path = folder / "tiny.toml"
    path.write_text(model + TINY_TRAIN.format(corpus=corpus, steps=steps, every=every))
    return path


def prose(n: int):
    rng = random.Random(0)
    words = "the a system file reads writes every process user option value returns line".split()
    for i in range(n):
        yield f"prose#{i}", " ".join(rng.choice(words) for _ in range(rng.randint(30, 80))) + "."
