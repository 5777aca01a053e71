"""`moekit checksum` and `--no-verify` at the command line: a checksummed checkpoint with one flipped
byte, in a routed expert or a dense tensor, is one `error:` line naming it and the file, exit 2,
from `moekit run` resident and paged and from `moekit checksum` itself; `--no-verify` runs it."""

from __future__ import annotations

import json
import shutil

import pytest

from cli_runner import moekit, refused
from hf_tiny import write_checkpoint
from offload_files import MOEKIT, flip_byte, readonly_copy, run_unprivileged, write_llama4_mxfp4
from moekit.weights.manifest import MANIFEST_NAME, read_manifest
from moekit.weights.checkpoint import read_header

RUN = ["--prompt-ids", "1,17,42,99,5", "--max-new-tokens", "6", "--stop", "", "--json"]
DENSE = "model.layers.1.self_attn.o_proj.weight"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("cli_checksum"), seed=4)


@pytest.fixture
def checksummed(capsys, pristine, tmp_path):
    folder = shutil.copytree(pristine, tmp_path / "ckpt")
    code, out, err = moekit(capsys, "checksum", folder)
    assert code == 0, err
    assert out == f"wrote {folder / MANIFEST_NAME}: 16 routed experts and 21 other tensors checksummed (" \
        + out.split(" checksummed (", 1)[1]
    return folder


def _tokens(capsys, *args):
    code, out, err = moekit(capsys, "run", "--eager", *args, *RUN)
    assert code == 0, err
    return json.loads(out)["token_ids"], err


def test_checksum_then_run_gives_the_same_tokens_and_a_second_checksum_only_checks(capsys, pristine, checksummed):
    want, _ = _tokens(capsys, pristine)
    got, err = _tokens(capsys, checksummed)
    assert got == want and "note:" not in err
    manifest = (checksummed / MANIFEST_NAME).read_bytes()
    code, out, _ = moekit(capsys, "checksum", checksummed)
    assert code == 0 and out.startswith(f"{checksummed / MANIFEST_NAME}: 16 routed experts and 21 other tensors match (")
    assert out.rstrip().endswith("; nothing written") and (checksummed / MANIFEST_NAME).read_bytes() == manifest


@pytest.mark.parametrize("paged", [[], ["--expert-memory", "25%"]], ids=["resident", "paged"])
def test_a_flipped_dense_byte_is_refused_by_run_and_checksum_and_no_verify_runs(capsys, checksummed, paged):
    (t,) = [t for t in read_manifest(checksummed).tensors if t.name == DENSE]
    flip_byte(checksummed / t.file, t.offset + t.length // 3)
    err = refused(capsys, "run", checksummed, *RUN, *paged)
    assert f"tensor {DENSE}: checksum mismatch in model.safetensors (bytes {t.offset}..{t.offset + t.length})" in err
    assert "Traceback" not in err
    err = refused(capsys, "checksum", checksummed)
    assert f"tensor {DENSE}: checksum mismatch in model.safetensors" in err
    tokens, err = _tokens(capsys, checksummed, *paged, "--no-verify")
    assert len(tokens) == 6 and err.count("note: checksums not verified (--no-verify)") == 1


def test_a_flipped_expert_byte_is_refused_by_a_resident_run(capsys, checksummed):
    x = read_manifest(checksummed).experts[0, 6].down[0]
    flip_byte(checksummed / x.file, x.offset + 1)
    err = refused(capsys, "run", checksummed, *RUN)
    assert (f"layer 0 expert 6 (tensor model.layers.0.mlp.experts.6.down_proj.weight): checksum mismatch in "
            f"{x.file} (bytes {x.offset}..{x.end})") in err
    assert len(_tokens(capsys, checksummed, "--no-verify")[0]) == 6


def test_checksum_of_a_read_only_checkpoint_is_one_line_exit_2(pristine):
    with readonly_copy(pristine) as folder:
        done = run_unprivileged([str(MOEKIT), "checksum", str(folder)])
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr == f"error: {folder}: cannot write {MANIFEST_NAME} here (read-only or permission denied)\n"
        assert not (folder / MANIFEST_NAME).exists()


def test_a_layout_the_store_cannot_page_gets_whole_tensor_checksums(capsys, tmp_path):
    folder = write_llama4_mxfp4(tmp_path / "llama4")  # MXFP4 experts, but not gpt_oss's layout of them
    code, out, err = moekit(capsys, "checksum", folder)
    assert code == 0, err
    assert err.startswith("note: whole tensors only, no expert extents (") and "other tensors" not in out
    manifest = read_manifest(folder)
    stored = set(read_header(folder / "model.safetensors").tensors)  # blocks and scales, as stored
    assert manifest.experts == {} and {t.name for t in manifest.tensors} == stored
    (t,) = [t for t in manifest.tensors if t.name == "model.layers.1.feed_forward.experts.down_proj_blocks"]
    flip_byte(folder / t.file, t.offset + 9)
    err = refused(capsys, "run", folder, *RUN)
    assert f"tensor {t.name}: checksum mismatch in {t.file}" in err


def test_a_packed_checkpoint_verifies_its_dense_tensors(capsys, checksummed, tmp_path):
    dest = tmp_path / "packed"
    code, _, err = moekit(capsys, "pack", checksummed, "--out", dest)
    assert code == 0, err
    _, err = _tokens(capsys, dest, "--expert-memory", "25%")
    assert "has no checksums" not in err  # pack writes the dense tensors' checksums itself
    assert len(read_manifest(dest).tensors) == 69
    (t,) = [t for t in read_manifest(dest).tensors if t.name == DENSE]
    flip_byte(dest / t.file, t.offset)  # a hard link of the copy's file: the fixture is not touched
    for paged in ([], ["--expert-memory", "25%"]):
        err = refused(capsys, "run", dest, *RUN, *paged)
        assert f"tensor {DENSE}: checksum mismatch in model.safetensors" in err
