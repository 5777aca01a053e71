"""`moekit pack`: a packed checkpoint in a new folder (a valid safetensors file with each expert
contiguous in our layout, a manifest that points at it, reads from it identical to reads from the
checkpoint), and the checkpoint itself left byte for byte as it was."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open

from cli_runner import moekit
from hf_tiny import write_checkpoint
from offload_files import MOEKIT, flip_byte, readonly_copy, run_unprivileged, write_tiny
from moekit.errors import ExpertIntegrityError, MoekitError
from moekit.weights.extents import PACKED_NAME, expert_extents
from moekit.weights.manifest import MANIFEST_NAME, load_or_build_manifest
from moekit.offload.pack import pack_experts
from moekit.offload.reader import ExpertReader
from moekit.spec import load_spec
from moekit.weights.checkpoint import open_checkpoint

# One family per Hub layout: per-expert tensors, stacked rows, gpt_oss's interleaved transposes.
FAMILIES = ["mixtral", "granitemoe", "gpt_oss"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return {f: write_checkpoint(f, tmp_path_factory.mktemp(f)) for f in FAMILIES}


@pytest.fixture
def copy_of(pristine, tmp_path):
    return lambda family: shutil.copytree(pristine[family], tmp_path / family)


@pytest.fixture
def packed_of(copy_of, tmp_path):
    """family -> (the checkpoint, its packed checkpoint in tmp_path/packed-FAMILY)."""

    def pack(family, **kwargs):
        folder = copy_of(family)
        return folder, pack_experts(folder, tmp_path / f"packed-{family}", **kwargs).folder

    return pack


def _all_reads(reader):
    return {key: reader.read(*key) for key in sorted(reader.extents)}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k][0], b[k][0]) and torch.equal(a[k][1], b[k][1]) for k in a)


@pytest.mark.parametrize("family", FAMILIES)
def test_reads_from_the_packed_file_equal_reads_from_the_checkpoint(copy_of, tmp_path, family):
    folder = copy_of(family)
    spec = load_spec(str(folder))
    result = pack_experts(folder, tmp_path / "packed")
    dest = result.folder
    assert result.path == dest / PACKED_NAME and result.experts == len(expert_extents(folder, spec))
    manifest = load_or_build_manifest(dest, spec)
    assert manifest.source == "packed" and manifest.packed_file == PACKED_NAME and not manifest.built
    assert {x.file for ex in manifest.experts.values() for x in ex.extents} == {PACKED_NAME}
    for dtype in (torch.float32, torch.bfloat16):
        with ExpertReader(dest, manifest, dtype) as packed:
            with ExpertReader(folder, expert_extents(folder, spec), dtype) as direct:
                assert _same(_all_reads(packed), _all_reads(direct))


def test_packed_file_is_safetensors_with_each_expert_contiguous(packed_of):
    folder, dest = packed_of("gpt_oss")
    spec = load_spec(str(folder))
    manifest = load_or_build_manifest(dest, spec)
    with ExpertReader(folder, expert_extents(folder, spec), None) as direct:
        want = _all_reads(direct)
    with safe_open(str(dest / PACKED_NAME), framework="pt") as fh:
        names = set(fh.keys())
        assert names == {f"layers.{l}.experts.{e}.{p}" for l, e in want for p in ("gate_up", "down")}
        for (layer, e), (gate_up, down) in want.items():
            assert torch.equal(fh.get_tensor(f"layers.{layer}.experts.{e}.gate_up"), gate_up)
            assert torch.equal(fh.get_tensor(f"layers.{layer}.experts.{e}.down"), down)
    ends = []
    for key in sorted(manifest.experts):
        (gu,), (dn,) = manifest.experts[key].gate_up, manifest.experts[key].down
        assert dn.offset == gu.end  # gate_up then down, back to back
        ends.append((gu.offset, dn.end))
    assert all(a[1] == b[0] for a, b in zip(ends, ends[1:]))  # expert after expert, no gaps
    assert ends[-1][1] == (dest / PACKED_NAME).stat().st_size


def test_bf16_checkpoint_packs_in_bf16(tmp_path):
    folder = write_tiny("mixtral", tmp_path / "bf16", dtype=torch.bfloat16)
    spec = load_spec(str(folder))
    result = pack_experts(folder, tmp_path / "packed")
    manifest = load_or_build_manifest(result.folder, spec)
    assert {x.dtype for ex in manifest.experts.values() for x in ex.extents} == {"BF16"}
    stored = sum(ex.nbytes for ex in expert_extents(folder, spec).values())
    assert stored < result.nbytes < stored + 8192  # the experts' bytes plus a header
    with ExpertReader(result.folder, manifest, torch.float32) as packed:
        with ExpertReader(folder, expert_extents(folder, spec), torch.float32) as direct:
            assert _same(_all_reads(packed), _all_reads(direct))


def test_the_packed_checkpoint_loads_resident_too(packed_of):
    folder, dest = packed_of("mixtral")
    assert open_checkpoint(dest).tensor_names == open_checkpoint(folder).tensor_names  # the packed file is not a shard


def test_a_missing_packed_file_is_a_clear_error(packed_of):
    folder, dest = packed_of("granitemoe")
    (dest / PACKED_NAME).unlink()
    missing = f"packed file {PACKED_NAME} listed in {MANIFEST_NAME} is missing; re-run moekit pack"
    with pytest.raises(MoekitError, match=missing):
        load_or_build_manifest(dest, load_spec(str(folder)))


def test_a_flipped_byte_in_the_packed_file_names_the_expert(packed_of):
    folder, dest = packed_of("granitemoe")
    manifest = load_or_build_manifest(dest, load_spec(str(folder)))
    x = manifest.experts[1, 2].gate_up[0]
    flip_byte(dest / x.file, x.offset + 7)
    with ExpertReader(dest, manifest, torch.float32) as reader:
        with pytest.raises(ExpertIntegrityError, match=f"layer 1 expert 2: checksum mismatch in {PACKED_NAME}"):
            reader.read(1, 2)


def test_pack_refuses_a_corrupted_checkpoint_its_manifest_knows(copy_of, tmp_path):
    folder = copy_of("mixtral")
    manifest = load_or_build_manifest(folder, load_spec(str(folder)))
    x = manifest.experts[0, 1].down[0]
    flip_byte(folder / x.file, x.offset)
    with pytest.raises(ExpertIntegrityError, match="layer 0 expert 1: checksum mismatch"):
        pack_experts(folder, tmp_path / "packed")
    assert not (tmp_path / "packed").exists()  # a failed pack leaves no half-written folder


def test_pack_refuses_to_write_into_the_checkpoint(copy_of):
    folder = copy_of("mixtral")
    for inside in (folder, folder / "packed"):
        with pytest.raises(MoekitError, match="never writes into the checkpoint it packs"):
            pack_experts(folder, inside)
    with pytest.raises(MoekitError, match="holds the checkpoint"):
        pack_experts(folder, folder.parent)


def test_pack_refuses_a_folder_holding_other_files(copy_of, tmp_path):
    folder = copy_of("mixtral")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(MoekitError, match="exists and holds other files"):
        pack_experts(folder, busy)
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]


def test_packing_again_into_an_earlier_pack_replaces_it(packed_of, tmp_path):
    folder, dest = packed_of("mixtral")
    again = pack_experts(folder, dest)
    assert again.folder == dest and load_or_build_manifest(dest, load_spec(str(folder))).source == "packed"


def test_pack_refuses_a_dense_model(tmp_path):
    folder = write_checkpoint("llama", tmp_path / "llama")
    with pytest.raises(MoekitError, match="llama has no MoE layers"):
        pack_experts(folder)


def test_cli_pack_exits_0_says_where_and_how_to_run_it(copy_of, tmp_path, capsys):
    folder = copy_of("granitemoe")
    dest = tmp_path / "granite-packed"
    code, out, _ = moekit(capsys, "pack", folder, "--out", dest)
    assert code == 0
    assert "packed 12 experts of 2 MoE layers" in out and str(dest / PACKED_NAME) in out
    assert f"packed checkpoint: {dest}" in out and f"{folder} is unchanged" in out
    assert f"moekit run {dest}" in out
    assert load_or_build_manifest(dest, load_spec(str(dest))).source == "packed"


def test_cli_pack_on_a_missing_folder_is_one_line_exit_2(tmp_path, capsys):
    code, out, err = moekit(capsys, "pack", tmp_path / "nope")
    assert code == 2 and out == ""
    assert err.strip().count("\n") == 0 and "no such checkpoint folder" in err


def test_cli_pack_of_a_read_only_checkpoint_leaves_it_as_it_was(pristine, tmp_path):
    dest = tmp_path / "packed"
    with readonly_copy(pristine["mixtral"]) as folder:
        before = {p.name: p.read_bytes() for p in folder.iterdir()}
        done = run_unprivileged([str(MOEKIT), "pack", str(folder), "--out", str(dest)])
        assert done.returncode == 0, done.stderr
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert (dest / PACKED_NAME).is_file() and (dest / MANIFEST_NAME).is_file()


def test_cli_pack_into_a_read_only_folder_is_one_line_exit_2(pristine, tmp_path):
    with readonly_copy(pristine["mixtral"]) as folder:
        target = folder.parent / "ro-out"
        target.mkdir()
        target.chmod(0o555)
        done = run_unprivileged([str(MOEKIT), "pack", str(pristine["mixtral"]), "--out", str(target)])
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().count("\n") == 0
        assert "cannot write here (read-only or permission denied)" in done.stderr
        assert "Traceback" not in done.stderr and not any(target.iterdir())
