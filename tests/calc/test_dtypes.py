from fractions import Fraction

import pytest

from moekit.calc.dtypes import DTYPES, default_kv_dtype, get_dtype, get_kv_dtype
from moekit.errors import MoekitError


def test_block_formats_count_their_scales():
    # mxfp4: 32 values × 4 bits + one 8-bit scale = 136 bits = 17 bytes per block.
    assert get_dtype("mxfp4").bytes_for(32) == 17
    # int4: 128 values × 4 bits + one fp16 scale = 528 bits = 66 bytes per group.
    assert get_dtype("int4").bytes_for(128) == 66


@pytest.mark.parametrize("name, bytes_per_param", [("fp32", 4), ("bf16", 2), ("fp16", 2), ("fp8", 1), ("int8", 1)])
def test_plain_dtypes(name, bytes_per_param):
    assert get_dtype(name).bytes_for(1000) == 1000 * bytes_per_param


def test_bytes_round_up_to_whole_bytes():
    assert get_dtype("int4").bytes_for(1) == 1
    assert get_dtype("int4").bits == Fraction(33, 8)


def test_aliases_and_case():
    assert get_dtype("BFloat16").name == "bf16"
    assert get_dtype("float32").name == "fp32"


def test_unknown_dtype_lists_known_ones():
    with pytest.raises(MoekitError, match="known: fp32, bf16"):
        get_dtype("int3")


def test_kv_cache_refuses_block_quantised_formats():
    with pytest.raises(MoekitError, match="KV cache dtype"):
        get_kv_dtype("mxfp4")


def test_quantised_weights_keep_a_bf16_cache():
    assert default_kv_dtype(DTYPES["int4"]).name == "bf16"
    assert default_kv_dtype(DTYPES["fp8"]).name == "bf16"
    assert default_kv_dtype(DTYPES["fp32"]).name == "fp32"
