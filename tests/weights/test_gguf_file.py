"""moekit's GGUF header parser against llama.cpp's own reader (gguf.GGUFReader), on GGUFs from
llama.cpp's converter: the same metadata, tensor table and tensor bytes."""

from __future__ import annotations

import numpy as np
import pytest

from moekit.weights.gguf_file import read_gguf


def assert_same_as_gguf_reader(path) -> None:
    import gguf

    reader = gguf.GGUFReader(path)
    ours = read_gguf(path)
    assert ours.metadata == {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        mine = ours.tensors[t.name]
        assert (mine.qtype, mine.offset, mine.n_bytes) == (t.tensor_type.name, t.data_offset, t.n_bytes)
        assert mine.shape == tuple(reversed(t.shape.tolist()))
        assert mine.data.dtype == t.data.dtype and np.array_equal(mine.data, t.data), t.name


@pytest.mark.parametrize("family,outtype", [("qwen3_moe", "f32"), ("qwen3_moe", "q8_0"), ("qwen2_moe", "bf16"),
                                            ("mixtral", "f32"), ("olmoe", "f16")])
def test_header_is_gguf_readers(converted, family, outtype):
    assert_same_as_gguf_reader(converted(family, outtype)[1])
