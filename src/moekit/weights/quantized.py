"""A checkpoint published quantized (MXFP4, block-scaled FP8), seen as the loader expects to see it.

`quantized_view(ckpt)` reads `quantization_config` from config.json. Without one the checkpoint is
returned as it is. With one, every stored (data, scales) pair is checked once, from the safetensors
headers (no data read): the scales must be there and have the shape the data calls for; anything
else is one CheckpointError line. The view then has Checkpoint's interface under the names and
shapes a bf16 checkpoint of the same model would have:

  mxfp4  `<p>_blocks` uint8 [E, R, G, 16] + `<p>_scales` uint8 [E, R, G]  →  `<p>` [E, G·32, R]
  fp8    `<p>.weight` float8_e4m3fn [out, in] + `<p>.weight_scale_inv`    →  `<p>.weight` [out, in]

`get(name)` dequantizes (exactly, to fp32), so every loader path works unchanged; `packed(name)`
tells a loader that can keep a tensor packed (the routed experts: moekit.ops.packed_layout) where the
stored bytes are, and `read(name)` gives them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from moekit.errors import CheckpointError
from moekit.weights import fp8, mxfp4
from moekit.weights.checkpoint import Checkpoint, read_header

SUPPORTED = ("mxfp4", "fp8")
Shape = tuple[int, ...]


@dataclass(frozen=True)
class Packed:
    """One tensor stored quantized: which two stored tensors hold it and what it stands for."""

    method: str  # "mxfp4" | "fp8"
    data: str  # stored name: the blocks (mxfp4) or the fp8 weight
    scales: str  # stored name: the E8M0 scales (mxfp4) or weight_scale_inv (fp8)
    shape: Shape  # the tensor as a bf16 checkpoint holds it (what get() returns)
    stored_shape: Shape  # the data tensor's own shape
    block: tuple[int, int] = (1, mxfp4.BLOCK)  # fp8: weight_block_size; mxfp4: one row × 32


@dataclass
class QuantizedCheckpoint:
    """Checkpoint's interface (folder, config, files, get, shape, close) over a quantized one."""

    inner: Checkpoint
    method: str
    packed_tensors: dict[str, Packed]  # name the loader asks for → how it is stored
    files: dict[str, Path] = field(default_factory=dict)  # the names the loader sees → file

    @property
    def folder(self) -> Path:
        return self.inner.folder

    @property
    def config(self) -> dict:
        return self.inner.config

    @property
    def tensor_names(self) -> list[str]:
        return sorted(self.files)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensor_names)

    def packed(self, name: str) -> Optional[Packed]:
        return self.packed_tensors.get(name)

    def read(self, name: str):
        """The stored (data, scales) of a packed tensor, memory-mapped."""
        p = self.packed_tensors[name]
        return self.inner.get(p.data), self.inner.get(p.scales)

    def get(self, name: str):
        p = self.packed_tensors.get(name)
        if p is None:
            return self.inner.get(name)
        data, scales = self.read(name)
        if p.method == "mxfp4":
            return mxfp4.dequantize_stack(data, scales)
        return fp8.dequantize(data, scales, p.block)

    def shape(self, name: str) -> Shape:
        p = self.packed_tensors.get(name)
        return p.shape if p is not None else self.inner.shape(name)

    def close(self) -> None:
        self.inner.close()


def quant_method(config: dict, folder: Path) -> Optional[str]:
    """config.json's quantization_config.quant_method, checked; None for an unquantized model."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in SUPPORTED:
        raise CheckpointError(
            f"{folder}: quantization_config quant_method {method!r} is not supported (supported: {', '.join(SUPPORTED)})"
        )
    return method


def _headers(ckpt: Checkpoint) -> dict[str, dict]:
    """Every stored tensor's header entry (dtype, shape), from the files' headers only."""
    entries: dict[str, dict] = {}
    for path in sorted(set(ckpt.files.values())):
        entries.update(read_header(path).tensors)
    return {name: entries[name] for name in ckpt.files}


def _mxfp4(ckpt: Checkpoint, entries: dict[str, dict]) -> dict[str, Packed]:
    folder, packed = ckpt.folder, {}
    for name, entry in entries.items():
        if name.endswith("_scales") and name[: -len("_scales")] + "_blocks" not in entries:
            raise CheckpointError(f"{folder}: tensor {name} has no {name[: -len('_scales')]}_blocks beside it")
        if not name.endswith("_blocks"):
            continue
        base = name[: -len("_blocks")]
        shape = tuple(entry["shape"])
        if entry["dtype"] != "U8" or len(shape) != 4 or shape[-1] != mxfp4.BLOCK_BYTES:
            raise CheckpointError(
                f"{folder}: MXFP4 tensor {name} is {entry['dtype']} {list(shape)}, expected U8 [E, rows, groups, 16]"
            )
        scales = f"{base}_scales"
        if scales not in entries:
            raise CheckpointError(f"{folder}: MXFP4 scales {scales} are missing (needed for {name})")
        got = tuple(entries[scales]["shape"])
        if got != shape[:-1] or entries[scales]["dtype"] != "U8":
            raise CheckpointError(
                f"{folder}: MXFP4 scales {scales} are {entries[scales]['dtype']} {list(got)}, expected U8 {list(shape[:-1])}"
            )
        e, rows, groups, _ = shape
        packed[base] = Packed("mxfp4", name, scales, (e, groups * mxfp4.BLOCK, rows), shape)
    return packed


def _block(config: dict, folder: Path) -> tuple[int, int]:
    qc = config["quantization_config"]
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"{folder}: FP8 fmt {fmt!r} is not supported (supported: e4m3)")
    block = qc.get("weight_block_size", list(fp8.DEFAULT_BLOCK))
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"{folder}: FP8 weight_block_size {block!r} is not two positive integers")
    return block[0], block[1]


def _fp8(ckpt: Checkpoint, entries: dict[str, dict]) -> dict[str, Packed]:
    folder, packed = ckpt.folder, {}
    block = _block(ckpt.config, folder)
    for name, entry in entries.items():
        if name.endswith(".weight_scale_inv") and name[: -len("_scale_inv")] not in entries:
            raise CheckpointError(f"{folder}: tensor {name} has no {name[: -len('_scale_inv')]} beside it")
        if entry["dtype"] != "F8_E4M3":
            continue
        shape = tuple(entry["shape"])
        scales = f"{name}_scale_inv"
        if len(shape) != 2:
            raise CheckpointError(f"{folder}: FP8 tensor {name} has shape {list(shape)}, expected [out, in]")
        if scales not in entries:
            raise CheckpointError(f"{folder}: FP8 scales {scales} are missing (needed for {name})")
        want = fp8.scale_shape(shape, block)
        got = tuple(entries[scales]["shape"])
        if got != want or entries[scales]["dtype"] not in ("F32", "BF16", "F16"):
            raise CheckpointError(
                f"{folder}: FP8 scales {scales} are {entries[scales]['dtype']} {list(got)}, expected F32 {list(want)} "
                f"(one per {block[0]}×{block[1]} block of {list(shape)})"
            )
        packed[name] = Packed("fp8", name, scales, shape, shape, block)
    return packed


def quantized_view(ckpt: Checkpoint):
    """`ckpt` itself when config.json declares no quantization, else its QuantizedCheckpoint view."""
    method = quant_method(ckpt.config, ckpt.folder)
    if method is None:
        return ckpt
    entries = _headers(ckpt)
    packed = _mxfp4(ckpt, entries) if method == "mxfp4" else _fp8(ckpt, entries)
    hidden = {p.data for p in packed.values()} | {p.scales for p in packed.values()}
    files = {name: path for name, path in ckpt.files.items() if name not in hidden}
    files.update({name: ckpt.files[p.data] for name, p in packed.items()})
    return QuantizedCheckpoint(inner=ckpt, method=method, packed_tensors=packed, files=files)
