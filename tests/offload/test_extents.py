"""Expert extents: the byte ranges found from safetensors headers hold exactly the bytes safetensors'
own reader gives for that expert's tensors, for every Hub layout, sharded or not."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from hf_tiny import write_checkpoint
from offload_files import write_tiny
from moekit.errors import CheckpointError
from moekit.weights.hub_names import hub_names
from moekit.weights.extents import expert_extents, our_shapes, read_header
from moekit.spec import load_spec

# One family per Hub layout, plus qwen2_moe's dense layer between MoE layers.
LAYOUT_FAMILIES = ["mixtral", "granitemoe", "gpt_oss", "qwen2_moe"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {}

    def get(family):
        if family not in made:
            made[family] = write_checkpoint(family, tmp_path_factory.mktemp(family))
        return made[family]

    return get


def _bytes_at(folder, x) -> bytes:
    with open(folder / x.file, "rb") as fh:
        fh.seek(x.offset)
        return fh.read(x.length)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _expected_pieces(folder, spec, layer, e):
    """The expert's stored pieces, by Hub name through safetensors (the independent oracle)."""
    names = hub_names(spec.model_type)
    block = f"model.layers.{layer}.{names.moe}"
    if names.experts == "per_expert":
        up = [f"{block}.experts.{e}.{k}.weight" for k in (names.expert_gate, names.expert_up)]
        gate_up, down = up, [f"{block}.experts.{e}.{names.expert_down}.weight"]
        rows = lambda t: t  # noqa: E731
    else:
        gate_up, down = [f"{block}.{names.stacked_gate_up}"], [f"{block}.{names.stacked_down}"]
        rows = lambda t: t[e]  # noqa: E731
    out = []
    for group in (gate_up, down):
        pieces = []
        for name in group:
            shard = _shard_of(folder, name)
            with safe_open(str(folder / shard), framework="pt") as fh:
                pieces.append(rows(fh.get_tensor(name)))
        out.append(pieces)
    return out


def _shard_of(folder, name):
    import json

    index = folder / "model.safetensors.index.json"
    return json.loads(index.read_text())["weight_map"][name] if index.exists() else "model.safetensors"


@pytest.mark.parametrize("family", LAYOUT_FAMILIES)
def test_every_extent_holds_the_bytes_safetensors_reads_for_that_expert(folders, family):
    folder = folders(family)
    spec = load_spec(str(folder))
    extents = expert_extents(folder, spec)
    moe = spec.layers[spec.moe_layers[0]].ffn
    assert set(extents) == {(layer, e) for layer in spec.moe_layers for e in range(moe.num_experts)}
    for (layer, e), ex in extents.items():
        want_up, want_down = _expected_pieces(folder, spec, layer, e)
        assert [_bytes_at(folder, x) for x in ex.gate_up] == [_tensor_bytes(t) for t in want_up]
        assert [_bytes_at(folder, x) for x in ex.down] == [_tensor_bytes(t) for t in want_down]
        f, d = moe.expert.width, moe.expert.hidden_size
        assert our_shapes(ex) == ((2 * f, d), (d, f))


def test_sharded_checkpoint_extents_point_into_the_right_shard(tmp_path):
    folder = write_tiny("qwen3_moe", tmp_path / "sharded", max_shard_size="40KB")
    spec = load_spec(str(folder))
    extents = expert_extents(folder, spec)
    files = {x.file for ex in extents.values() for x in ex.extents}
    assert len(files) > 1, "the test needs experts in more than one shard"
    for (layer, e), ex in extents.items():
        want_up, want_down = _expected_pieces(folder, spec, layer, e)
        assert [_bytes_at(folder, x) for x in ex.extents] == [_tensor_bytes(t) for t in want_up + want_down]


def test_bf16_checkpoint_extents_say_bf16_and_are_half_the_bytes(folders, tmp_path):
    fp32 = expert_extents(folders("mixtral"), load_spec(str(folders("mixtral"))))
    folder = write_tiny("mixtral", tmp_path / "bf16", dtype=torch.bfloat16)
    bf16 = expert_extents(folder, load_spec(str(folder)))
    assert {x.dtype for ex in bf16.values() for x in ex.extents} == {"BF16"}
    assert all(bf16[k].nbytes * 2 == fp32[k].nbytes for k in fp32)


def test_dense_model_has_no_extents(tmp_path):
    folder = write_checkpoint("llama", tmp_path / "llama")
    assert expert_extents(folder, load_spec(str(folder))) == {}


def test_truncated_shard_is_one_clear_error(folders, tmp_path):
    folder = shutil.copytree(folders("granitemoe"), tmp_path / "cut")
    path = folder / "model.safetensors"
    size = path.stat().st_size
    with path.open("r+b") as fh:
        fh.truncate(size // 2)  # mid-way: some expert runs past the end
    with pytest.raises(CheckpointError, match="truncated"):
        expert_extents(folder, load_spec(str(folder)))


def test_corrupted_header_length_is_one_clear_error(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointError, match="corrupted safetensors header"):
        read_header(path)


def test_extents_and_manifest_import_without_torch():
    code = (
        "import sys; import moekit.weights.extents, moekit.weights.manifest; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
