"""A GGUF file seen as a Hub checkpoint: Checkpoint's interface (folder, config, files, get, shape, close).

The loader asks for Hub names (model.layers.0.mlp.experts.3.gate_proj.weight); `get` finds the
data in the GGUF (gguf_names), takes one expert's slice of a stacked tensor, dequantizes it with
llama.cpp's own numpy code (gguf.quants) and undoes the converter's q/k row permutation. Nothing
is read before `get`: the file stays memory-mapped, and each expert is dequantized alone, so a
quantized GGUF never exists in memory at full precision all at once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from moekit.errors import CheckpointError
from moekit.weights.gguf_config import gguf_family, hf_config
from moekit.weights.gguf_families import SUPPORTED_TYPES
from moekit.weights.gguf_file import GGUFFile, GGUFTensor, read_gguf
from moekit.weights.gguf_names import Source, hub_sources


def _unpermute(w, heads: int):
    """Inverse of convert_hf_to_gguf's LlamaModel.permute: rows (h, F/2, 2) back to (h, 2, F/2)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(t: GGUFTensor, data):
    """`data` (t's bytes or elements, any leading slice of them) as a torch tensor: exact for F32,
    F16 and BF16 (kept in their own dtype), float32 for the block-quantized types."""
    import numpy as np
    import torch

    if t.qtype == "F32":
        return torch.from_numpy(np.array(data, dtype=np.float32))
    if t.qtype == "F16":
        return torch.from_numpy(np.array(data, dtype=np.float16))
    if t.qtype == "BF16":  # gguf_file (like gguf.GGUFReader) gives BF16 as raw bytes, two per element
        return torch.from_numpy(np.array(data).view(np.int16)).view(torch.bfloat16)
    from gguf import GGMLQuantizationType, quants

    return torch.from_numpy(np.ascontiguousarray(quants.dequantize(data, GGMLQuantizationType[t.qtype])))


@dataclass
class GGUFCheckpoint:
    """An open GGUF: its config (as the original config.json would say) and lazy access by Hub name."""

    folder: Path  # the .gguf file (named folder for the loader's messages, like Checkpoint's)
    config: dict
    files: dict[str, Source]  # Hub tensor name → where it is in the GGUF
    gguf: GGUFFile

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
        data = t.data if source.expert is None else t.data[source.expert]
        try:
            w = dequantize(t, data)
        except Exception as err:  # gguf.quants raises on a malformed block
            raise CheckpointError(f"{self.folder}: cannot dequantize {source.tensor} ({t.qtype}): {err}") from None
        return _unpermute(w, source.unpermute_heads) if source.unpermute_heads else w

    def shape(self, name: str) -> tuple[int, ...]:
        source = self._source(name)
        shape = self.gguf.tensors[source.tensor].shape
        return shape[1:] if source.expert is not None else shape

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensor_names)

    def close(self) -> None:
        """Nothing to drop: the reader's mmap lives as long as this object (get reads through it)."""

    def types(self) -> Counter:
        """Tensor type → how many GGUF tensors hold it: what loading dequantized."""
        return Counter(t.qtype for t in self.gguf.tensors.values())

    def note(self) -> str:
        counts = self.types()
        kinds = ", ".join(f"{n} {q}" for q, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        quantized = sorted(q for q in counts if q not in ("F32", "F16", "BF16"))
        how = f"{'/'.join(quantized)} dequantized to float32 at load" if quantized else "no dequantization needed"
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
    files = hub_sources(family, shapes.items(), config["num_attention_heads"], config["num_key_value_heads"], where)
    return GGUFCheckpoint(folder=path, config=config, files=files, gguf=gguf)


def engine_parts(ckpt: GGUFCheckpoint, offload) -> tuple[Optional[object], list[str]]:
    """What load_engine takes from a GGUF beyond its weights: the tokenizer and the notes to show.
    Paging a GGUF's experts (offload) is not built yet: refused here in one line."""
    from moekit.weights.gguf_tokenizer import gguf_tokenizer

    if offload is not None:
        raise CheckpointError(f"{ckpt.folder}: --expert-memory does not page a GGUF's experts yet; run it resident "
                              "or page the safetensors checkpoint it was converted from")
    tokenizer, why_not = gguf_tokenizer(ckpt.gguf.metadata, str(ckpt.folder))
    return tokenizer, [ckpt.note()] + ([why_not] if why_not else [])
