"""A checkpoint that does not fit the config is refused with the offending tensor's name.

Each test damages one tensor of a checkpoint transformers wrote (drop it, reshape it, add a stray
one) and expects a CheckpointError that names it; the intact checkpoint loads.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from moekit.errors import CheckpointError
from tiny_checkpoints import CASES, load_ours, write_checkpoint

pytest.importorskip("transformers")

BY_ID = {c.id: c for c in CASES}


DAMAGED = ["mixtral-a", "gpt_oss-window", "granitemoe-multipliers", "qwen2_moe-dense-layer"]


@pytest.fixture(scope="module", params=DAMAGED)
def folder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_checkpoint(BY_ID[request.param], path)
    return path


def _rewrite(src, dst, change) -> None:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    change(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def _some_expert_tensor(tensors: dict) -> str:
    return sorted(n for n in tensors if "experts" in n or "input_linear" in n)[-1]


def test_intact_checkpoint_loads(folder):
    assert load_ours(folder).spec.num_layers >= 2


def test_missing_tensor_is_named(folder, tmp_path):
    name = {}

    def drop(tensors):
        name["it"] = _some_expert_tensor(tensors)
        del tensors[name["it"]]

    _rewrite(folder, tmp_path / "damaged", drop)
    with pytest.raises(CheckpointError, match=f"{name['it']} is missing"):
        load_ours(tmp_path / "damaged")


def test_wrong_shape_is_named(folder, tmp_path):
    name = "model.layers.1.self_attn.o_proj.weight"

    def reshape(tensors):
        tensors[name] = torch.zeros(tensors[name].shape[0], tensors[name].shape[1] + 1)

    _rewrite(folder, tmp_path / "damaged", reshape)
    with pytest.raises(CheckpointError, match=rf"{name} has shape \[\d+, \d+\], expected"):
        load_ours(tmp_path / "damaged")


def test_unexpected_tensor_is_named(folder, tmp_path):
    name = "model.layers.0.self_attn.extra_proj.weight"

    def add(tensors):
        tensors[name] = torch.zeros(3, 3)

    _rewrite(folder, tmp_path / "damaged", add)
    with pytest.raises(CheckpointError, match=f"unexpected tensor {name}"):
        load_ours(tmp_path / "damaged")


def test_layers_past_the_last_are_ignored_like_deepseek_mtp(folder, tmp_path):
    """DeepSeek ships its multi-token-prediction module as extra layers; they are not the decoder's."""
    first = load_ours(folder)
    layers = first.spec.num_layers

    def add_mtp(tensors):
        tensors[f"model.layers.{layers}.enorm.weight"] = torch.ones(4)

    _rewrite(folder, tmp_path / "with_mtp", add_mtp)
    second = load_ours(tmp_path / "with_mtp")
    ids = torch.arange(3, 9)[None]
    a = first(ids, first.new_cache(1, 6), torch.arange(6)[None])
    b = second(ids, second.new_cache(1, 6), torch.arange(6)[None])
    assert torch.equal(a, b)
