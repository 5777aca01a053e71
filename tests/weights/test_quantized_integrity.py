"""Checkpoints published quantized are verified like any other: the MXFP4 / FP8 views read through
the safetensors Checkpoint, so `moekit checksum`'s crc32s catch a flipped byte in a dense tensor
(here a bias, an FP8 scale) on the resident load. Their routed experts have per-expert extents,
checked by the store and the resident load alike (tests/offload/test_store_packed.py)."""

from __future__ import annotations

import pytest

from moekit.engine.loader import load_engine
from moekit.errors import CheckpointError
from tests.offload.offload_files import flip_byte
from moekit.weights.manifest import checksum_checkpoint, read_manifest
from moekit.spec import load_spec
from quantized_files import write_fp8, write_mxfp4

WRITERS = {"mxfp4": (write_mxfp4, "model.layers.1.mlp.experts.down_proj_bias"),
           "fp8": (write_fp8, "model.layers.1.self_attn.o_proj.weight_scale_inv")}



@pytest.mark.parametrize("method", sorted(WRITERS))
def test_a_flipped_byte_in_a_quantized_tensor_is_refused_naming_it(method, tmp_path):
    write, name = WRITERS[method]
    folder = write(tmp_path / method)
    want = load_engine(folder, compile=False).generate([1, 17, 42], max_new_tokens=6, stop_ids=()).token_ids
    checksum_checkpoint(folder, load_spec(str(folder)))
    assert load_engine(folder, compile=False).generate([1, 17, 42], max_new_tokens=6, stop_ids=()).token_ids == want
    (t,) = [t for t in read_manifest(folder).tensors if t.name == name]
    flip_byte(folder / t.file, t.offset + t.length - 1)
    with pytest.raises(CheckpointError) as err:
        load_engine(folder, compile=False)
    assert str(err.value).startswith(f"{folder}: tensor {name}: checksum mismatch in {t.file} (bytes {t.offset}..")
    assert load_engine(folder, verify=False, compile=False).notes == ("checksums not verified (--no-verify)",)
