"""Read one routed expert from disk into our layout: a few os.preadv calls, a crc32 check, no copies
where none are needed.

`ExpertReader(folder, manifest_or_extents, dtype).read(layer, e)` returns (gate_up [rows, D],
down [D, F]) exactly as moekit.model.loading would have put them in gate_up[e] / down[e]
(same bits: the same cast from the stored dtype, the same de-interleaving for gpt_oss). An expert
a packed file holds in a block format (Q8_0, Q4_0) comes back as its bytes, uint8 views of the
read buffer in the int8/int4 kernels' layout: nothing is cast or copied after the read. An
expert its checkpoint publishes packed (MXFP4, FP8) comes back as moekit.ops.packed_layout's prepared
rows, built from the bytes read by the same functions the resident load uses (model.packed_loading),
so a paged expert is byte for byte the resident kept-packed one. A gpt-oss GGUF's ggml MXFP4 expert
is read as the prepared rows themselves (gate's slice, up's, down's, back to back in one buffer of
its own) and its code nibbles reordered in place (moekit.weights.gguf_mxfp4, as the resident load).

Thread-safe by construction: file descriptors are opened once and only ever read with
positioned reads (no shared file offset), each read fills its own buffer, and os.preadv,
zlib.crc32 (on large buffers) and torch's copies all release the GIL, so the store's worker
threads overlap disk, checksum and compute. With a Manifest every extent is checked against its
crc32 before a tensor is built from it; a mismatch or a short read is an ExpertIntegrityError
naming the file, layer and expert. Plain extents (no crc32) are read unchecked (`moekit pack`
checksums what it writes).
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

from moekit.errors import CheckpointError, ExpertIntegrityError, MoekitError
from moekit.weights.extents import DEQUANTIZED, ITEMSIZE, ExpertExtents, ExtentMap, our_shapes, referenced_files
from moekit.weights.manifest import MANIFEST_NAME, Manifest
from moekit.offload.precision import is_quantized, memory_bytes, stored_kind

__all__ = ["ExpertIntegrityError", "ExpertReader", "TORCH_DTYPES"]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    # A packed file's block formats (moekit.offload.precision): read as their bytes, never cast.
    "Q8_0": torch.uint8,
    "Q4_0": torch.uint8,
    # Published packed experts' pieces: MXFP4 blocks and scales, FP8 codes (moekit.weights.extents).
    "U8": torch.uint8,
    "F8_E4M3": torch.float8_e4m3fn,
    # A GGUF's K-quants: read as bytes, dequantized to the reader's dtype (_dequantized).
    "Q4_K": torch.uint8,
    "Q6_K": torch.uint8,
}
ALIGN = 64  # each span starts on a cache line of the expert's buffer
DIRECT_ALIGN = 4096  # O_DIRECT: file offset, length and memory on the device's block (4 KiB covers 512 B ones)

_CHANGED = f"the file changed since the manifest was written — re-run `moekit pack` or delete {MANIFEST_NAME}"


@dataclass(frozen=True)
class _Span:
    """One positioned read: adjacent extents of one file, landing at `at` in the expert's buffer."""

    file: str
    offset: int
    length: int
    at: int


@dataclass(frozen=True)
class _Plan:
    spans: tuple[_Span, ...]
    at: tuple[int, ...]  # buffer offset of each extent, in ExpertExtents.extents order
    size: int  # buffer bytes


def _plan(ex: ExpertExtents) -> _Plan:
    """Coalesce the expert's extents into as few reads as the file order allows (per-expert
    families store an expert's down, gate and up next to each other: one read). A GGUF's MXFP4
    expert's extents land back to back in their own order instead: the buffer is then its
    prepared rows, gate_up [2F, G·17] and down, with nothing to copy."""
    in_place = ex.layout == "gguf_mxfp4"
    order = range(len(ex.extents)) if in_place else \
        sorted(range(len(ex.extents)), key=lambda i: (ex.extents[i].file, ex.extents[i].offset))
    spans: list[_Span] = []
    at = [0] * len(ex.extents)
    size = 0
    for i in order:
        x = ex.extents[i]
        last = spans[-1] if spans else None
        if last is not None and last.file == x.file and last.offset + last.length == x.offset:
            spans[-1] = _Span(last.file, last.offset, last.length + x.length, last.at)
        else:
            size = size if in_place else -(-size // ALIGN) * ALIGN
            spans.append(_Span(x.file, x.offset, x.length, size))
        at[i] = spans[-1].at + (x.offset - spans[-1].offset)
        size = max(size, at[i] + x.length)
    return _Plan(tuple(spans), tuple(at), size)


def _view(buf: torch.Tensor, at: int, length: int, dtype: str, shape) -> torch.Tensor:
    """Bytes at..at+length of the buffer as a tensor of a stored dtype and shape (no copy when aligned)."""
    raw = buf[at : at + length]
    if at % ITEMSIZE[dtype]:
        raw = raw.clone()  # a dtype view needs an element-aligned start
    return raw.view(TORCH_DTYPES[dtype]).view(shape)


class ExpertReader:
    """Routed experts read from disk (the checkpoint's safetensors or a packed file)."""

    def __init__(self, folder: Union[str, Path], source: Union[Manifest, ExtentMap], dtype: Optional[torch.dtype],
                 fp8_block: Optional[tuple[int, int]] = None, direct: bool = False):
        """dtype: what read() returns; None keeps each extent's stored dtype (for packing).
        fp8_block: config.json's weight_block_size, which FP8 experts' rows need (a scale grid
        alone does not say which rows share a scale). direct: read with O_DIRECT, past the page
        cache (which would otherwise keep a second copy of every expert read): each span's
        enclosing 4 KiB blocks land in a page-aligned buffer of the thread's and are copied out."""
        self._fds: dict[str, int] = {}
        self.direct = direct
        self._bounce = threading.local()
        self.folder = Path(folder)
        self.dtype = dtype
        self.fp8_block = fp8_block
        self.manifest = source if isinstance(source, Manifest) else None
        self.extents: ExtentMap = source.experts if isinstance(source, Manifest) else dict(source)
        self._plans = {key: _plan(ex) for key, ex in self.extents.items()}
        for file in referenced_files(self.extents):
            self._fds[file] = self._open(file)

    def _open(self, file: str) -> int:
        path = self.folder / file
        try:
            return os.open(path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        except FileNotFoundError:
            self.close()
            m = self.manifest
            if m is not None and m.source == "packed" and file == m.packed_file:
                missing = f"packed file {file} listed in {MANIFEST_NAME} is missing; re-run moekit pack"
                raise MoekitError(missing) from None
            raise CheckpointError(f"{self.folder}: {file} is missing (it holds routed experts)") from None
        except OSError as err:
            self.close()
            if self.direct and err.errno == errno.EINVAL:
                raise MoekitError(f"{path}: its file system does not take O_DIRECT reads; drop --direct-io") from None
            raise CheckpointError(f"{path}: cannot open ({err.strerror})") from None

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> "ExpertReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    # --- sizes -------------------------------------------------------------------------------

    def shapes(self, layer: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """(gate_up [rows, D], down [D, F]) of layer's experts in our layout."""
        return our_shapes(self._experts(layer, 0))

    def expert_nbytes(self, dtype: Optional[torch.dtype] = None) -> int:
        """Bytes of one expert (the largest, should layers differ) held at `dtype` (default: the
        reader's dtype; with neither, as stored)."""
        dtype = dtype or self.dtype
        if dtype is None:
            return max(ex.nbytes for ex in self.extents.values())
        itemsize = torch.empty((), dtype=dtype).element_size()
        # A stored kind's bytes do not depend on the float dtype: "F32" is only a placeholder.
        return max(memory_bytes(ex, "F32") if stored_kind(ex) else ex.numel * itemsize for ex in self.extents.values())

    def expert_disk_bytes(self, layer: int, e: int) -> int:
        """Bytes read from disk for one expert (its stored dtype, whatever the reader casts to)."""
        return self._experts(layer, e).nbytes

    # --- reading -----------------------------------------------------------------------------

    def _experts(self, layer: int, e: int) -> ExpertExtents:
        try:
            return self.extents[layer, e]
        except KeyError:
            raise MoekitError(f"{self.folder}: layer {layer} expert {e} is not a routed expert of this model") from None

    def read_size(self) -> int:
        """Bytes of the largest buffer read_bytes fills (a scratch buffer this size fits any expert)."""
        return max((plan.size for plan in self._plans.values()), default=0)

    def read_bytes(self, layer: int, e: int, verify: bool = True, scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The expert's extents read into one uint8 buffer, checked against their crc32s (`verify`).
        scratch: a uint8 buffer of at least read_size() bytes to read into instead of a fresh one
        (whose first touch costs a page fault per 4 KB); what comes back is then a view of it."""
        ex = self._experts(layer, e)
        if not self._fds:
            raise MoekitError(f"{self.folder}: the expert reader is closed (layer {layer} expert {e} requested)")
        plan = self._plans[layer, e]
        buf = scratch[: plan.size] if scratch is not None else torch.empty(plan.size, dtype=torch.uint8)
        arr = buf.numpy()  # shares memory: preadv writes straight into the tensor
        for span in plan.spans:
            self._pread(arr[span.at : span.at + span.length], span, layer, e)
        for x, at in zip(ex.extents, plan.at):
            if verify and x.crc32 is not None and zlib.crc32(arr[at : at + x.length]) != x.crc32:
                raise ExpertIntegrityError(
                    f"{self.folder}: layer {layer} expert {e}: checksum mismatch in {x.file} "
                    f"(bytes {x.offset}..{x.end}); {self._changed(x.file)}"
                )
        return buf

    def _changed(self, file: str) -> str:
        """What a mismatch line tells the user to do: a GGUF's manifest is named after the file."""
        if file.endswith(".gguf"):
            from moekit.weights.gguf_extents import changed

            return changed(self.folder / file)
        return _CHANGED

    def _pread(self, into, span: _Span, layer: int, e: int) -> None:
        if self.direct:
            return self._pread_direct(into, span, layer, e)
        done = 0
        while done < span.length:  # Linux reads at most ~2 GiB per call
            try:
                n = os.preadv(self._fds[span.file], [into[done:]], span.offset + done)
            except OSError as err:
                raise MoekitError(
                    f"{self.folder}: layer {layer} expert {e}: cannot read {span.file} ({err.strerror})"
                ) from None
            if n == 0:
                raise ExpertIntegrityError(
                    f"{self.folder}: layer {layer} expert {e}: {span.file} is truncated "
                    f"(bytes {span.offset}..{span.offset + span.length} wanted, file ends at "
                    f"{span.offset + done}); {self._changed(span.file)}"
                )
            done += n

    def _pread_direct(self, into, span: _Span, layer: int, e: int) -> None:
        """span's bytes through O_DIRECT: its enclosing aligned blocks into the bounce buffer, then
        the span copied out (the copy is the price of skipping the page cache)."""
        begin = span.offset - span.offset % DIRECT_ALIGN
        end = -(-(span.offset + span.length) // DIRECT_ALIGN) * DIRECT_ALIGN
        bounce = self._bounce_of(end - begin)
        done = 0
        while begin + done < span.offset + span.length:
            try:
                n = os.preadv(self._fds[span.file], [memoryview(bounce)[done : end - begin]], begin + done)
            except OSError as err:
                raise MoekitError(
                    f"{self.folder}: layer {layer} expert {e}: cannot read {span.file} with O_DIRECT ({err.strerror})"
                ) from None
            if n == 0:
                raise ExpertIntegrityError(
                    f"{self.folder}: layer {layer} expert {e}: {span.file} is truncated "
                    f"(bytes {span.offset}..{span.offset + span.length} wanted, file ends at "
                    f"{begin + done}); {self._changed(span.file)}"
                )
            done += n
        skip = span.offset - begin
        into[:] = np.frombuffer(bounce, dtype=np.uint8, count=span.length, offset=skip)

    def _bounce_of(self, size: int) -> mmap.mmap:
        """This thread's page-aligned buffer (an anonymous mapping) of at least size bytes."""
        buf = getattr(self._bounce, "buf", None)
        if buf is None or len(buf) < size:
            buf = self._bounce.buf = mmap.mmap(-1, -(-size // DIRECT_ALIGN) * DIRECT_ALIGN)
        return buf

    def read(self, layer: int, e: int, verify: bool = True, cast: bool = True,
             scratch: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e of `layer` in our layout: (gate_up [rows, D], down [D, F]), cast to the reader's
        dtype; cast=False leaves float parts in their stored dtype (views of the read where they
        lie so), for a caller that casts as it copies them into place. With `scratch` (read_bytes)
        the result may be views of it: good only until the scratch is read into again. A GGUF's
        MXFP4 expert always is (its nibbles reordered there): give it memory the expert may keep,
        an evicted expert's (gguf_mxfp4_rows), never a buffer shared between reads."""
        ex = self._experts(layer, e)
        dtype = self.dtype if cast else None
        if ex.layout == "gguf_mxfp4":  # reordered in place: the result IS the buffer read into
            return _gguf_mxfp4(self.read_bytes(layer, e, verify, scratch), ex)
        buf = self.read_bytes(layer, e, verify, scratch)
        at = self._plans[layer, e].at
        if ex.layout == "mxfp4":
            return self._mxfp4(buf, at, ex)
        if ex.layout == "fp8":
            return self._fp8(buf, at, ex, layer, e)
        n = len(ex.gate_up)
        up_shape, down_shape = our_shapes(ex)
        if ex.layout == "rows_transposed_down":
            (dx,) = ex.down
            dn = _view(buf, at[n], dx.length, dx.dtype, dx.shape)  # [F, D], applied x @ W
            down = torch.empty(down_shape, dtype=dtype or dn.dtype)
            down.copy_(dn.t())
            return _rows(buf, at[:n], ex.gate_up, up_shape, dtype), down
        if ex.layout in ("interleaved_transposed", "transposed"):
            (gx,), (dx,) = ex.gate_up, ex.down
            gu = _view(buf, at[0], gx.length, gx.dtype, gx.shape)  # [D, 2F]: gate/up interleaved, or halves (llama4)
            dn = _view(buf, at[1], dx.length, dx.dtype, dx.shape)  # [F, D]
            f = up_shape[0] // 2
            gate_up = torch.empty(up_shape, dtype=dtype or gu.dtype)
            if ex.layout == "transposed":
                gate_up.copy_(gu.t())
            else:
                gate_up[:f].copy_(gu[:, 0::2].t())
                gate_up[f:].copy_(gu[:, 1::2].t())
            down = torch.empty(down_shape, dtype=dtype or dn.dtype)
            down.copy_(dn.t())
            return gate_up, down
        return _rows(buf, at[:n], ex.gate_up, up_shape, dtype), _rows(buf, at[n:], ex.down, down_shape, dtype)

    def _pieces(self, buf: torch.Tensor, at, extents) -> list[torch.Tensor]:
        return [_view(buf, a, x.length, x.dtype, x.shape) for a, x in zip(at, extents)]

    def _mxfp4(self, buf: torch.Tensor, at, ex: ExpertExtents) -> tuple[torch.Tensor, torch.Tensor]:
        """gpt_oss's (blocks, scales) pairs → the prepared rows: gate_up's gate (even) rows then its
        up (odd) rows [2F, G·17], down as stored [D, G'·17]."""
        from moekit.model.packed_loading import mxfp4_expert

        up_blocks, up_scales, down_blocks, down_scales = self._pieces(buf, at, ex.extents)
        return mxfp4_expert(up_blocks, up_scales, down_blocks, down_scales)

    def _fp8(self, buf: torch.Tensor, at, ex: ExpertExtents, layer: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each weight's (codes, scale_inv) → its prepared rows [out, in + 4·nbc]; gate's then up's."""
        from moekit.ops.packed_layout import fp8_rows

        if self.fp8_block is None:
            raise MoekitError(f"{self.folder}: layer {layer} expert {e} is FP8, and the reader was given no weight_block_size")
        pieces = self._pieces(buf, at, ex.extents)
        rows = [fp8_rows(w, s, self.fp8_block) for w, s in zip(pieces[0::2], pieces[1::2])]
        *gate_up, down = rows
        return (gate_up[0] if len(gate_up) == 1 else torch.cat(gate_up)), down


def gguf_mxfp4_rows(buf: torch.Tensor, ex: ExpertExtents) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF MXFP4 expert's prepared rows (gate_up [2F, G·17], down [D, G'·17]) as views of `buf`
    (uint8, at least ex.nbytes), where _plan puts its gate, up and down slices back to back."""
    (gate, up), (down,) = ex.gate_up, ex.down
    split = gate.length + up.length
    gate_up = buf[:split].view(gate.shape[0] + up.shape[0], gate.shape[1])  # [2F, G·17]
    return gate_up, buf[split : split + down.length].view(down.shape)  # down [D, G'·17]


def _gguf_mxfp4(buf: torch.Tensor, ex: ExpertExtents) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert's ggml MXFP4 bytes, read into `buf` → its prepared rows with the Hub's nibble
    order, in place: the bytes moekit.weights.gguf_mxfp4.layer_rows gives the resident load."""
    from moekit.weights.gguf_mxfp4 import hub_nibbles_

    gate_up, down = gguf_mxfp4_rows(buf, ex)
    return hub_nibbles_(gate_up), hub_nibbles_(down)


def _dequantized(buf: torch.Tensor, at, extents, shape, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """K-quant parts dequantized by gguf-py, the function the resident GGUF load uses
    (moekit.weights.gguf_checkpoint.dequantize), then cast to dtype (None: left fp32): the
    resident weights' values."""
    from moekit.weights.gguf_checkpoint import dequantize_as

    out = torch.empty(shape, dtype=dtype or torch.float32)
    begin = 0
    for a, x in zip(at, extents):
        piece = _view(buf, a, x.length, x.dtype, x.shape)
        if x.dtype in DEQUANTIZED:
            piece = dequantize_as(x.dtype, piece.numpy())
        out[begin : begin + x.shape[0]].copy_(piece)
        begin += x.shape[0]
    return out


def _rows(buf: torch.Tensor, at, extents, shape, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """Parts stacked row-wise, cast to dtype (None: as stored): one view of the buffer when they
    already lie so in it and need no cast."""
    if any(x.dtype in DEQUANTIZED for x in extents):
        return _dequantized(buf, at, extents, shape, dtype)
    stored = extents[0].dtype
    total = sum(x.length for x in extents)
    if all(x.dtype == stored for x in extents) and all(a + x.length == b for a, b, x in zip(at, at[1:], extents)):
        t = _view(buf, at[0], total, stored, shape)
        return t if dtype in (None, t.dtype) or is_quantized(stored) else t.to(dtype)
    quantized = is_quantized(stored)
    out = torch.empty(shape, dtype=torch.uint8 if quantized else dtype or TORCH_DTYPES[stored])
    begin = 0
    for a, x in zip(at, extents):
        out[begin : begin + x.shape[0]].copy_(_view(buf, a, x.length, x.dtype, x.shape))
        begin += x.shape[0]
    return out
