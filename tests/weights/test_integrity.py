"""moekit.weights.integrity: a byte range against its crc32, inline or on worker threads, and the one
line a mismatch becomes."""

from __future__ import annotations

import os
import zlib

import pytest

from moekit.errors import CheckpointError
from moekit.weights.integrity import INLINE_BYTES, RangeCheck, Verifier, check_range, first_bad


def _file(tmp_path, data: bytes):
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    return path


def test_check_range_accepts_the_recorded_bytes_and_names_what_changed(tmp_path):
    data = os.urandom(3 * 4096)
    path = _file(tmp_path, data)
    crc = zlib.crc32(data[4096:8192])
    check_range(path, 4096, 4096, crc, "tensor blk.0.ffn_down_exps.weight")  # a GGUF reader's call
    with pytest.raises(CheckpointError) as err:
        check_range(path, 4097, 4096, crc, "tensor blk.0.ffn_down_exps.weight")
    assert str(err.value) == f"{path}: tensor blk.0.ffn_down_exps.weight: checksum mismatch (bytes 4097..8193)"


def test_check_range_past_the_end_is_truncation_not_a_mismatch(tmp_path):
    path = _file(tmp_path, b"x" * 100)
    with pytest.raises(CheckpointError, match=r"tensor t: truncated \(bytes 50..150 run past its end\)"):
        check_range(path, 50, 100, 0, "tensor t")


def test_first_bad_finds_the_one_flipped_range():
    data = bytearray(os.urandom(1000))
    checks = tuple(RangeCheck(i * 250, 250, zlib.crc32(data[i * 250 : (i + 1) * 250]), f"part {i}") for i in range(4))
    assert first_bad(data, checks) is None
    data[600] ^= 1
    assert first_bad(data, checks).what == "part 2"


@pytest.mark.parametrize("size", [1000, 4 * INLINE_BYTES])  # checked inline, and on a worker thread
def test_the_verifier_reports_a_mismatch_with_the_absolute_range(size, tmp_path):
    data = bytearray(os.urandom(size))
    good = RangeCheck(0, size, zlib.crc32(data), "tensor a")
    v = Verifier()
    assert v.submit(data, (good,), "model.safetensors", 8000) is None and v.wait() is None
    data[size // 2] ^= 0x5A
    found = v.submit(data, (good,), "model.safetensors", 8000) or v.wait()
    err = found.error(tmp_path, "fix it")
    assert str(err) == f"{tmp_path}: tensor a: checksum mismatch in model.safetensors (bytes 8000..{8000 + size}); fix it"
    assert v.checked_bytes == 2 * size
