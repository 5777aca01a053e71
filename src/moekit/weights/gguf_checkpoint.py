"""A GGUF file seen as a Hub checkpoint: Checkpoint's interface (folder, config, files, get, shape, close).

The loader asks for Hub names (model.layers.0.mlp.experts.3.gate_proj.weight); `get` finds the
data in the GGUF (gguf_names), takes one expert's slice of a stacked tensor, dequantizes it with
llama.cpp's own numpy code (gguf.quants) and undoes the converter's q/k row permutation. Nothing
is read before `get`: the file stays memory-mapped, and each expert is dequantized alone, so a
quantized GGUF never exists in memory at full precision all at once.

Integrity: when `x.gguf.moekit-experts.json` lies beside the file (`moekit checksum x.gguf`;
moekit.weights.gguf_extents), the first `get` of each GGUF tensor checks all of that tensor's
bytes against it (its crc32, or one per expert slice of a stacked tensor: the loader reads every
slice of it next), on worker threads while the loader dequantizes (moekit.weights.integrity.Verifier);
`close` waits and raises the first mismatch in one line. `verify = False` skips it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from moekit.errors import CheckpointError
from moekit.weights.gguf_config import gguf_family, hf_config
from moekit.weights.gguf_families import SUPPORTED_TYPES
from moekit.weights.gguf_file import GGUFFile, GGUFTensor, read_gguf
from moekit.weights.gguf_names import Source, hub_sources
from moekit.weights.quantized import QuantizedCheckpoint


def _unpermute(w, heads: int):
    """Inverse of convert_hf_to_gguf's LlamaModel.permute: rows (h, F/2, 2) back to (h, 2, F/2)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hub_mxfp4(data):
    """ggml MXFP4 bytes uint8 [..., G * 17] (per block: the E8M0 byte, then 16 bytes whose low
    nibbles are values 0-15 and high nibbles 16-31) → the Hub's (blocks [..., G, 16], value 2i in
    the low nibble of byte i; scales [..., G]), undoing convert_hf_to_gguf's repack (torch)."""
    import torch

    raw = data.reshape(*data.shape[:-1], -1, 17)  # [..., G, 17]
    codes = raw[..., 1:]
    values = torch.cat((codes & 0x0F, codes >> 4), dim=-1)  # [..., G, 32] in order
    return (values[..., 0::2] | (values[..., 1::2] << 4)).contiguous(), raw[..., 0].contiguous()


def dequantize(t: GGUFTensor, data):
    """`data` (t's bytes or elements, any leading slice of them) as a torch tensor: exact for F32,
    F16 and BF16 (kept in their own dtype), float32 for the block-quantized types."""
    return dequantize_as(t.qtype, data)


def dequantize_as(qtype: str, data):
    """dequantize() for data of ggml type `qtype` (the expert store's K-quant slices use it too)."""
    import numpy as np
    import torch

    if qtype == "F32":
        return torch.from_numpy(np.array(data, dtype=np.float32))
    if qtype == "F16":
        return torch.from_numpy(np.array(data, dtype=np.float16))
    if qtype == "BF16":  # gguf_file (like gguf.GGUFReader) gives BF16 as raw bytes, two per element
        return torch.from_numpy(np.array(data).view(np.int16)).view(torch.bfloat16)
    from gguf import GGMLQuantizationType, quants

    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(data, GGMLQuantizationType[qtype])))


@dataclass
class GGUFCheckpoint:
    """An open GGUF: its config (as the original config.json would say) and lazy access by Hub name."""

    folder: Path  # the .gguf file (named folder for the loader's messages, like Checkpoint's)
    config: dict
    files: dict[str, Source]  # Hub tensor name → where it is in the GGUF
    gguf: GGUFFile
    verify: bool = True  # check what get() reads against x.gguf.moekit-experts.json, when there is one
    _checks: Optional[dict] = field(default=None, repr=False)  # GGUF tensor → its RangeChecks; None: not read yet
    _verifier: Optional[object] = field(default=None, repr=False)
    _manifest: Optional[tuple] = field(default=None, repr=False)  # (the manifest or None), once read

    @property
    def tensor_names(self) -> list[str]:
        return sorted(self.files)

    def _source(self, name: str) -> Source:
        if name not in self.files:
            raise CheckpointError(f"{self.folder}: tensor {name} not found in the GGUF")
        return self.files[name]

    def get(self, name: str):
        source = self._source(name)
        t = self.gguf.tensors[source.tensor]
        self._check(t)
        if source.interleave is not None or source.mxfp4 is not None:
            return self._gpt_oss_experts(source)
        data = t.data if source.expert is None else t.data[source.expert]
        try:
            w = dequantize(t, data)
        except Exception as err:  # gguf.quants raises on a malformed block
            raise CheckpointError(f"{self.folder}: cannot dequantize {source.tensor} ({t.qtype}): {err}") from None
        return _unpermute(w, source.unpermute_heads) if source.unpermute_heads else w

    def row_reader(self, name: str):
        """(start, stop) → rows start:stop of `name` as get() gives them, dequantizing only those
        rows: the loader streams a large tensor (a vocabulary matrix) through it. None where the
        stored rows are not the Hub's in order (q/k rows permuted by the converter, gpt-oss's pairs)."""
        source = self._source(name)
        t = self.gguf.tensors[source.tensor]
        if source.unpermute_heads or source.interleave is not None or source.mxfp4 is not None or len(t.shape) < 2:
            return None
        data = t.data if source.expert is None else t.data[source.expert]

        def rows(start: int, stop: int):
            self._check(t)
            try:
                return dequantize(t, data[start:stop])
            except Exception as err:  # gguf.quants raises on a malformed block
                raise CheckpointError(f"{self.folder}: cannot dequantize {source.tensor} ({t.qtype}): {err}") from None

        return rows

    def q8_0_blocks(self, name: str):
        """`name` as the file stores it when that is Q8_0: uint8 [rows, in / 32 · 34], copied out of
        the map, rows in the Hub's order. This is the int8 kernels' layout (moekit.ops.q8_0), so
        `--weights int8` holds the file's own weights, never rounded through the engine's dtype.
        None for any other type."""
        import numpy as np
        import torch

        source = self._source(name)
        t = self.gguf.tensors[source.tensor]
        if t.qtype != "Q8_0" or source.interleave is not None or source.mxfp4 is not None or len(t.shape) < 2:
            return None
        self._check(t)
        data = t.data if source.expert is None else t.data[source.expert]
        blocks = torch.from_numpy(np.array(data))  # [rows, row bytes], a copy: the map's pages are dropped later
        return _unpermute(blocks, source.unpermute_heads).contiguous() if source.unpermute_heads else blocks

    def _gpt_oss_experts(self, source: Source):
        """A Hub gpt-oss expert tensor: MXFP4 blocks or scales in the Hub's layout, or a bias, with
        gate's and up's rows interleaved again where the converter split them."""
        import numpy as np
        import torch

        def one(name: str):
            t = self.gguf.tensors[name]
            if source.mxfp4 is None:
                return dequantize(t, t.data)
            blocks, scales = hub_mxfp4(torch.from_numpy(np.array(t.data)))  # a copy: the mmap is read-only
            return blocks if source.mxfp4 == "blocks" else scales

        first = one(source.tensor)
        if source.interleave is None:
            return first
        self._check(self.gguf.tensors[source.interleave])
        return torch.stack((first, one(source.interleave)), dim=2).flatten(1, 2)  # [E, 2R, ...] gate, up, ...

    def mxfp4_expert_rows(self, gate_up: str, down: str) -> list:
        """gpt-oss's MXFP4 experts of one layer (gate_up, down: the Hub names of their blocks) as the
        kernels' prepared (gate_up, down) rows of each expert, read straight from ggml's blocks
        (moekit.weights.gguf_mxfp4): views of one tensor per layer."""
        from moekit.weights.gguf_mxfp4 import layer_rows

        pair, single = self._source(gate_up), self._source(down)
        gate, up, dn = (self.gguf.tensors[n] for n in (pair.tensor, pair.interleave, single.tensor))
        for t in (gate, up, dn):
            self._check(t)
        ups, downs = layer_rows(self.folder, gate, up, dn)
        return list(zip(ups.unbind(0), downs.unbind(0)))

    def spec(self):
        from moekit.spec.loading import spec_from_config

        return spec_from_config(self.config, self.folder.stem)

    def manifest(self):
        """The checksum manifest beside the GGUF (checked to be this file's), None when there is none."""
        if self._manifest is None:
            from moekit.weights.gguf_extents import read

            self._manifest = (read(self.gguf, self.spec()),)
        return self._manifest[0]

    def _check(self, t: GGUFTensor) -> None:
        """Start checking all of t's bytes, the first time any of it is read."""
        if not self.verify:
            return
        if self._checks is None:
            from moekit.weights.gguf_extents import resident_checks
            from moekit.weights.integrity import Verifier

            manifest = self.manifest()
            self._checks = {} if manifest is None else dict(resident_checks(self.gguf, manifest))
            self._verifier = Verifier()
        checks = self._checks.pop(t.name, None)  # popped: each tensor is checked once
        if checks:
            import numpy as np

            raw = np.asarray(t.data).reshape(-1).view(np.uint8)  # the stored bytes, no copy (the mmap)
            failure = self._verifier.submit(raw, checks, self.folder.name, t.offset)
            if failure is not None:
                raise self._mismatch(failure)

    def _mismatch(self, failure) -> CheckpointError:
        from moekit.weights.gguf_extents import changed

        return failure.error(self.folder, changed(self.folder))

    def wait_verified(self) -> None:
        """Block until every check get() started is done; the first mismatch as a CheckpointError."""
        if self._verifier is not None:
            failure = self._verifier.wait()
            if failure is not None:
                raise self._mismatch(failure)

    def shape(self, name: str) -> tuple[int, ...]:
        source = self._source(name)
        shape = self.gguf.tensors[source.tensor].shape
        if source.mxfp4 is not None:  # [E, R, K] elements → blocks [E, R, K/32, 16], scales [E, R, K/32]
            shape = (*shape[:-1], shape[-1] // 32) + ((16,) if source.mxfp4 == "blocks" else ())
        if source.interleave is not None:
            shape = (shape[0], 2 * shape[1], *shape[2:])
        return shape[1:] if source.expert is not None else shape

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensor_names)

    def close(self) -> None:
        """Wait for pending checks and raise the first mismatch, then let go of the pages read
        through the memory map (they count in RSS until then; a later get maps them again)."""
        self.wait_verified()
        self.gguf.drop_pages()

    def types(self) -> Counter:
        """Tensor type → how many GGUF tensors hold it: what loading dequantized."""
        return Counter(t.qtype for t in self.gguf.tensors.values())

    def note(self, paged: bool = False) -> str:
        """paged: the routed experts are the expert store's, read as stored (gguf_extents): only the
        other tensors are dequantized here."""
        counts = self.types()
        kinds = ", ".join(f"{n} {q}" for q, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        loaded = Counter(t.qtype for t in self.gguf.tensors.values() if not (paged and "_exps." in t.name))
        quantized = sorted(q for q in loaded if q not in ("F32", "F16", "BF16", "MXFP4"))
        how = f"{'/'.join(quantized)} dequantized to float32 at load" if quantized else "no dequantization needed"
        if "MXFP4" in loaded:
            how += "; MXFP4 experts kept packed"
        return f"GGUF {self.config['model_type']} ({kinds} tensors): {how}"


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open a .gguf as a checkpoint: header, family, config, every tensor placed and its type supported."""
    path = Path(path)
    gguf = read_gguf(path)
    where = str(path)
    family = gguf_family(gguf.metadata, where)
    unsupported = sorted({t.qtype for t in gguf.tensors.values()} - set(SUPPORTED_TYPES))
    if unsupported:
        first = next(t.name for t in gguf.tensors.values() if t.qtype in unsupported)
        raise CheckpointError(f"{where}: {family.arch} GGUF with tensor type {', '.join(unsupported)} (e.g. {first}), "
                              f"which moekit does not dequantize (supported: {', '.join(SUPPORTED_TYPES)})")
    shapes = {name: t.shape for name, t in gguf.tensors.items()}
    config = hf_config(gguf.metadata, shapes, where)
    qtypes = {name: t.qtype for name, t in gguf.tensors.items()}
    files = hub_sources(family, shapes.items(), config["num_attention_heads"], config["num_key_value_heads"], where,
                        qtypes)
    ckpt = GGUFCheckpoint(folder=path, config=config, files=files, gguf=gguf)
    return packed_view(ckpt) if "quantization_config" in config else ckpt


def packed_view(ckpt: GGUFCheckpoint):
    """gpt-oss's MXFP4 experts as the published safetensors hold them (moekit.weights.quantized):
    the loader keeps them packed, exactly as it does for the Hub's files."""
    from moekit.weights import mxfp4
    from moekit.weights.quantized import Packed

    packed = {}
    for name in ckpt.files:
        if name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            e, rows, groups, _ = shape = ckpt.shape(name)
            packed[base] = Packed("mxfp4", name, f"{base}_scales", (e, groups * mxfp4.BLOCK, rows), shape)
    hidden = {p.data for p in packed.values()} | {p.scales for p in packed.values()}
    files = {name: s for name, s in ckpt.files.items() if name not in hidden}
    files.update({name: ckpt.files[p.data] for name, p in packed.items()})
    return GGUFPackedView(inner=ckpt, method="mxfp4", packed_tensors=packed, files=files)


@dataclass
class GGUFPackedView(QuantizedCheckpoint):
    """A gpt-oss GGUF's packed view, which reads an expert's prepared rows from the file directly."""

    def mxfp4_expert_rows(self, gate_up: str, down: str) -> list:
        """Each expert's prepared (gate_up, down) rows (gate_up, down: the view's names of a layer's experts)."""
        return self.inner.mxfp4_expert_rows(self.packed_tensors[gate_up].data, self.packed_tensors[down].data)


def engine_parts(ckpt: GGUFCheckpoint, offload, verify: bool = True) -> tuple[Optional[object], Optional[object], list[str]]:
    """What load_engine takes from a GGUF beyond its weights: the tokenizer, the manifest the
    expert store reads experts through (with offload; moekit.weights.gguf_extents) and the notes
    to show. verify: the resident reads and the store check against the GGUF's manifest."""
    from moekit.weights.gguf_tokenizer import gguf_tokenizer

    ckpt = getattr(ckpt, "inner", ckpt)  # gpt-oss: the GGUF under its packed view (packed_view)
    ckpt.verify = verify
    notes = [ckpt.note(paged=offload is not None)]
    store_manifest = None
    if offload is not None:
        from moekit.weights.gguf_extents import store_manifest as for_the_store

        if offload.pin is not None:  # a profile names its model by config.json, which a GGUF has not
            raise CheckpointError(f"{ckpt.folder}: --pin is not supported for a GGUF yet (drop it)")
        store_manifest, paged = for_the_store(ckpt.gguf, ckpt.spec(), verify)
        if verify and store_manifest.tensors is not None:
            ckpt._manifest = (store_manifest,)  # read once: the resident reads check against the same
        notes.extend(paged)
    tokenizer, why_not = gguf_tokenizer(ckpt.gguf.metadata, str(ckpt.folder))
    return tokenizer, store_manifest, notes + ([why_not] if why_not else [])
