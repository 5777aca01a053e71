"""moekit's C++ operators, through one door: built from csrc/ (moekit.ops.build), loaded by the
commands before a run (`--kernels auto`) or not at all (`--kernels reference`), chosen per kind of
weight once per machine (moekit.ops.select), each with a plain PyTorch reference (moekit.ops.reference)
and a shape function (moekit.ops.fake). The model and the engine import from here only.
"""

from moekit.ops import reference
from moekit.ops.calls import (GEMV_ROWS, MXFP4_ROWS, c_shims, copy_into, experts_gemv, fp8_gemv, is_transpose, mxfp4_gemv, packed_experts,
                              packed_experts_operator, packed_operator_wins, rows_argmax, rows_gemv)
from moekit.ops.runtime import KERNELS, OPERATORS, Loaded, available, load, namespaces, op, operators_used
from moekit.ops.select import KINDS, Choice, bf16_tiles, chosen, kind_of, operator_wins, tiles_ready, variant, widen_batch
from moekit.ops.tiles import from_tiles, tiles_fit, to_tiles

__all__ = ["GEMV_ROWS", "KERNELS", "MXFP4_ROWS", "KINDS", "OPERATORS", "Choice", "Loaded", "available", "bf16_tiles", "c_shims", "chosen",
           "copy_into", "experts_gemv", "fp8_gemv", "from_tiles", "is_transpose", "kind_of", "load", "mxfp4_gemv", "namespaces", "op",
           "operator_wins", "packed_experts", "packed_experts_operator", "packed_operator_wins", "reference", "rows_argmax", "rows_gemv", "tiles_fit", "tiles_ready", "to_tiles", "variant", "widen_batch"]
