"""gpt-oss's MXFP4 GGUF experts read straight into the kernels' prepared rows (moekit.weights.gguf_mxfp4)
give the bytes of the Hub-layout conversion, and loading leaves no mapped pages behind."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from moekit.bench.make_checkpoint import make_checkpoint
from moekit.model.packed_loading import mxfp4_expert
from moekit.weights.checkpoint import open_checkpoint
from moekit.weights.gguf_checkpoint import hub_mxfp4, open_gguf
from moekit.weights.gguf_mxfp4 import hub_nibbles_

GPT_OSS = dict(model_type="gpt_oss", vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
               sliding_window=4, layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("oss_rows")
    return (make_checkpoint(GPT_OSS, "gguf-mxfp4", root / "m.gguf", seed=3).path,
            make_checkpoint(GPT_OSS, "mxfp4", root / "safetensors", seed=3).path)


def _names(layer: int) -> tuple[str, str]:
    pre = f"model.layers.{layer}.mlp.experts."
    return f"{pre}gate_up_proj", f"{pre}down_proj"


def test_every_byte_of_a_ggml_block_lands_where_the_hub_layout_puts_it():
    rng = np.random.default_rng(0)
    ggml = torch.from_numpy(rng.integers(0, 256, size=(5, 3 * 17), dtype=np.uint8))  # [R, G · 17], all byte values
    blocks, scales = hub_mxfp4(ggml.clone())  # the Hub's [R, G, 16], [R, G]
    want = torch.cat((scales.unsqueeze(-1), blocks), dim=-1).reshape(5, -1)
    assert torch.equal(hub_nibbles_(ggml.clone()), want)


def test_rows_read_from_the_gguf_are_the_hub_conversions_rows(pair):
    gguf, safetensors = open_gguf(pair[0]), open_checkpoint(pair[1])
    for layer in range(GPT_OSS["num_hidden_layers"]):
        gate_up, down = _names(layer)
        old = [gguf.read(n) for n in (gate_up, down)]  # the GGUF in the Hub's layout, whole tensors
        hub = [safetensors.read(n) for n in (gate_up, down)]  # the published safetensors of the same weights
        read = gguf.mxfp4_expert_rows(gate_up, down)
        assert len(read) == GPT_OSS["num_local_experts"]
        for j, rows in enumerate(read):
            for source in (old, hub):
                (ub, us), (db, ds) = source
                want = mxfp4_expert(ub[j], us[j], db[j], ds[j])
                assert all(torch.equal(got, w) for got, w in zip(rows, want)), (layer, j)
    gguf.close()


def _mapped_rss_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isdigit() or line[:1] in "abcdef" and "-" in line.split()[0]:
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_closing_the_gguf_unmaps_the_pages_its_reads_touched(pair):
    ckpt = open_gguf(pair[0])
    path = pair[0].resolve()
    ckpt.get("model.embed_tokens.weight")  # read through the mapping: its pages become resident
    assert _mapped_rss_kib(path) > 0
    ckpt.close()
    assert _mapped_rss_kib(path) == 0
    assert ckpt.get("model.embed_tokens.weight").shape == (GPT_OSS["vocab_size"], GPT_OSS["hidden_size"])
