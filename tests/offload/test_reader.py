"""The expert reader gives, bit for bit, what moekit.model.loading puts in a resident model's expert
stacks, for every Hub layout and dtype; damaged bytes are an error naming the expert, never weights."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from hf_tiny import write_checkpoint
from offload_files import flip_byte, write_tiny
from moekit.errors import ExpertIntegrityError, MoekitError
from moekit.model.decoder import Decoder
from moekit.model.loading import load_into
from moekit.weights.extents import expert_extents
from moekit.weights.manifest import load_or_build_manifest
from moekit.offload.reader import ExpertReader
from moekit.spec import load_spec
from moekit.weights.checkpoint import open_checkpoint

FAMILIES = ["qwen3_moe", "mixtral", "granitemoe", "gpt_oss", "deepseek_v3", "dbrx"]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {}

    def get(family, stored=None):
        if (family, stored) not in made:
            where = tmp_path_factory.mktemp(f"{family}_{stored or 'fp32'}".replace("torch.", ""))
            made[family, stored] = (
                write_checkpoint(family, where) if stored is None else write_tiny(family, where, dtype=stored)
            )
        return made[family, stored]

    return get


def _resident_stacks(folder, dtype):
    """The Hub layout loading.py gives a resident model, before prepare() re-lays it out."""
    spec = load_spec(str(folder))
    decoder = Decoder(spec, dtype=dtype)
    load_into(decoder, open_checkpoint(folder))
    return {i: decoder.layers[i].ffn.experts for i in spec.moe_layers}


def _assert_reads_equal_resident(folder, dtype, direct=False):
    spec = load_spec(str(folder))
    stacks = _resident_stacks(folder, dtype)
    with ExpertReader(folder, load_or_build_manifest(folder, spec), dtype, direct=direct) as reader:
        scratch = torch.full((reader.read_size(),), 0xFF, dtype=torch.uint8)
        for layer, experts in stacks.items():
            for e in range(experts.num_experts):
                gate_up, down = reader.read(layer, e)
                assert gate_up.dtype == down.dtype == dtype
                assert torch.equal(gate_up, experts.gate_up[e]), (layer, e)
                assert torch.equal(down, experts.down[e]), (layer, e)
                # As stored, read into a reused buffer: the same values once cast (the store's path).
                gate_up, down = reader.read(layer, e, cast=False, scratch=scratch)
                assert torch.equal(gate_up.to(dtype), experts.gate_up[e]), (layer, e)
                assert torch.equal(down.to(dtype), experts.down[e]), (layer, e)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_reader_matches_resident_loading_bit_for_bit(folders, family, dtype):
    _assert_reads_equal_resident(folders(family), dtype)


@pytest.mark.parametrize("family", FAMILIES)
def test_direct_reads_past_the_page_cache_match_resident_loading_bit_for_bit(folders, family):
    # O_DIRECT reads whole 4 KiB blocks into a bounce buffer: every span's offset and length in
    # these tiny files is unaligned, so each one exercises the copy out of the enclosing blocks.
    _assert_reads_equal_resident(folders(family), torch.float32, direct=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_bf16_checkpoint_reads_match_resident_loading(folders, family, dtype):
    _assert_reads_equal_resident(folders(family, torch.bfloat16), dtype)


def test_sharded_checkpoint_reads_match_resident_loading(tmp_path):
    folder = write_tiny("qwen3_moe", tmp_path / "sharded", max_shard_size="40KB")
    assert len(list(folder.glob("*.safetensors"))) > 1
    _assert_reads_equal_resident(folder, torch.float32)


def test_reads_from_many_threads_agree_with_one_thread(folders):
    folder = folders("mixtral")
    spec = load_spec(str(folder))
    with ExpertReader(folder, load_or_build_manifest(folder, spec), torch.float32) as reader:
        keys = sorted(reader.extents) * 8
        alone = [reader.read(*k) for k in keys]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda k: reader.read(*k), keys))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(alone, together))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_expert_nbytes_is_what_one_read_expert_holds(folders, dtype):
    folder = folders("granitemoe")
    with ExpertReader(folder, expert_extents(folder, load_spec(str(folder))), dtype) as reader:
        gate_up, down = reader.read(1, 3)
        held = gate_up.numel() * gate_up.element_size() + down.numel() * down.element_size()
        assert reader.expert_nbytes() == held
        assert reader.expert_disk_bytes(1, 3) == (gate_up.numel() + down.numel()) * 4  # stored fp32


def _damaged_copy(folders, tmp_path, family="deepseek_v3"):
    folder = shutil.copytree(folders(family), tmp_path / family)
    spec = load_spec(str(folder))
    manifest = load_or_build_manifest(folder, spec)
    layer = spec.moe_layers[-1]
    victim = manifest.experts[layer, 5]
    return folder, manifest, layer, victim


def test_one_flipped_byte_is_an_integrity_error_naming_layer_expert_and_file(folders, tmp_path):
    folder, manifest, layer, victim = _damaged_copy(folders, tmp_path)
    x = victim.down[0]
    flip_byte(folder / x.file, x.offset + x.length // 2)
    with ExpertReader(folder, manifest, torch.float32) as reader:
        with pytest.raises(ExpertIntegrityError) as err:
            reader.read(layer, 5)
        message = str(err.value)
        assert f"layer {layer} expert 5" in message and "checksum mismatch" in message
        assert f"in {x.file} (bytes {x.offset}..{x.end})" in message and "\n" not in message
        # its neighbours are intact and still served, byte for byte what the undamaged file holds
        with ExpertReader(folders("deepseek_v3"), manifest, torch.float32) as pristine:
            assert all(torch.equal(a, b) for a, b in zip(reader.read(layer, 4), pristine.read(layer, 4)))


def test_a_truncated_file_is_an_integrity_error_not_short_weights(folders, tmp_path):
    folder, manifest, layer, victim = _damaged_copy(folders, tmp_path)
    x = victim.gate_up[0]
    with (folder / x.file).open("r+b") as fh:
        fh.truncate(x.offset + 10)
    with ExpertReader(folder, manifest, torch.bfloat16) as reader:
        with pytest.raises(ExpertIntegrityError, match=f"layer {layer} expert 5: {x.file} is truncated"):
            reader.read(layer, 5)


def test_unknown_expert_is_a_clear_error(folders):
    folder = folders("qwen3_moe")
    with ExpertReader(folder, expert_extents(folder, load_spec(str(folder))), torch.float32) as reader:
        with pytest.raises(MoekitError, match="layer 0 expert 99 is not a routed expert"):
            reader.read(0, 99)
