"""Integrity on every load path: with moekit-experts.json beside a checkpoint, the resident load and
the paged load (--expert-memory) check every weight they read, routed experts and dense tensors
alike; one flipped byte is one CheckpointError naming the tensor (or expert) and the file, the
checkpoint is left as it was, and verify=False loads it anyway."""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import replace

import pytest

import moekit
from hf_tiny import write_checkpoint
from moekit.errors import CheckpointError
from tests.offload.offload_files import flip_byte
from moekit.weights.manifest import checksum_checkpoint, read_manifest, write_manifest
from moekit.spec import load_spec

PROMPT = [1, 17, 42, 99, 5]
# per-expert tensors (qwen3_moe) and one [E, ...] tensor per projection (granitemoe: an expert is rows of it)
FAMILIES = ["qwen3_moe", "granitemoe"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    made = {}

    def get(family):
        if family not in made:
            made[family] = write_checkpoint(family, tmp_path_factory.mktemp(family), seed=3)
        return made[family]

    return get


def _tokens(folder, **kw):
    engine = moekit.load(folder, compile=False, **kw)
    try:
        return engine.generate(PROMPT, max_new_tokens=8, stop_ids=()).token_ids[0], engine.notes
    finally:
        engine.close()


def _checksummed(pristine, family, tmp_path):
    folder = shutil.copytree(pristine(family), tmp_path / family)
    checksum_checkpoint(folder, load_spec(str(folder)))
    return folder, read_manifest(folder)



def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("family", FAMILIES)
def test_an_untouched_checkpoint_loads_verified_and_generates_the_same_tokens(pristine, family, tmp_path):
    want, notes = _tokens(pristine(family))  # no manifest: nothing to verify against
    assert notes == ()
    folder, manifest = _checksummed(pristine, family, tmp_path)
    assert manifest.tensors and manifest.experts  # both kinds of checksum are there
    got, notes = _tokens(folder)
    assert got == want and notes == ()
    got, notes = _tokens(folder, verify=False)
    assert got == want and notes == ("checksums not verified (--no-verify)",)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_flipped_byte_in_a_routed_expert_is_refused_naming_expert_tensor_and_file(pristine, family, tmp_path):
    folder, manifest = _checksummed(pristine, family, tmp_path)
    x = manifest.experts[1, 3].down[0]
    flip_byte(folder / x.file, x.offset + x.length // 2)
    before = _digest(folder)
    with pytest.raises(CheckpointError) as err:
        moekit.load(folder, compile=False)
    message = str(err.value)
    assert message.startswith(f"{folder}: layer 1 expert 3 (tensor model.layers.1.")
    assert f"): checksum mismatch in {x.file} (bytes {x.offset}..{x.end}); the file changed since" in message
    assert "\n" not in message
    assert _digest(folder) == before  # refused, not repaired or rewritten
    assert len(_tokens(folder, verify=False)[0]) == 8  # --no-verify loads it anyway


@pytest.mark.parametrize("expert_memory", [None, "25%"])  # resident, and paged by the expert store
def test_a_flipped_byte_in_a_dense_tensor_is_refused_on_both_load_paths(pristine, expert_memory, tmp_path):
    folder, manifest = _checksummed(pristine, "qwen3_moe", tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    (t,) = [t for t in manifest.tensors if t.name == name]
    flip_byte(folder / t.file, t.offset + 3)
    before = _digest(folder)
    with pytest.raises(CheckpointError) as err:
        moekit.load(folder, expert_memory=expert_memory, compile=False)
    assert str(err.value) == (
        f"{folder}: tensor {name}: checksum mismatch in {t.file} (bytes {t.offset}..{t.offset + t.length}); "
        "the file changed since moekit-experts.json was written; re-download it, or delete "
        "moekit-experts.json if the change is yours"
    )
    assert _digest(folder) == before
    tokens, notes = _tokens(folder, verify=False, expert_memory=expert_memory)
    assert len(tokens) == 8 and "checksums not verified (--no-verify)" in notes


def test_an_older_manifest_without_dense_checksums_verifies_the_experts_and_says_so(pristine, tmp_path):
    folder, manifest = _checksummed(pristine, "qwen3_moe", tmp_path)
    write_manifest(folder, replace(manifest, tensors=None))  # what an earlier moekit wrote
    _tokens_before, notes = _tokens(folder)
    (note,) = notes
    assert note.startswith(f"moekit-experts.json has no checksums for {len(manifest.tensors)} of the checkpoint's ")
    assert note.endswith(f"`moekit checksum {folder}` adds them")
    x = manifest.experts[0, 5].gate_up[0]
    flip_byte(folder / x.file, x.offset)
    with pytest.raises(CheckpointError, match="layer 0 expert 5 .tensor model.layers.0.mlp.experts.5.gate_proj.weight.: checksum mismatch"):
        moekit.load(folder, compile=False)
    # and `moekit checksum` adds the dense checksums to it, keeping the experts' (so the flip stays caught)
    result = checksum_checkpoint(folder, load_spec(str(folder)))
    assert result.action == "added" and read_manifest(folder).tensors == manifest.tensors
    with pytest.raises(CheckpointError, match="layer 0 expert 5"):
        moekit.load(folder, compile=False)


def test_a_manifest_for_another_config_is_refused_and_no_verify_skips_reading_it(pristine, tmp_path):
    folder, _ = _checksummed(pristine, "qwen3_moe", tmp_path)
    config = folder / "config.json"
    config.write_text(config.read_text() + "\n")
    with pytest.raises(moekit.errors.MoekitError, match="moekit-experts.json was written for another model .qwen3_moe, "
                       "2 layers, 8 experts, a different config.json."):
        moekit.load(folder, compile=False)
    assert len(_tokens(folder, verify=False)[0]) == 8


def test_bytes_after_the_last_tensor_are_one_line_not_a_safetensors_traceback(pristine, tmp_path):
    folder = shutil.copytree(pristine("qwen3_moe"), tmp_path / "padded")
    with (folder / "model.safetensors").open("ab") as fh:
        fh.write(b"\0" * 16)
    with pytest.raises(CheckpointError, match=r"model.safetensors: corrupted safetensors file \(16 bytes after the last tensor\)"):
        moekit.load(folder, compile=False)
