"""A model's spec from any source a user names, a GGUF file included.

moekit.spec reads presets and config.json files; a GGUF's config is in its header, which only
weights reads (gguf_file, gguf_config). Counting a GGUF is therefore done here, above spec, so that
spec never imports weights. No tensor data is read and torch is not imported: `moekit calc x.gguf`
runs where only the calculator's dependencies are.
"""

from __future__ import annotations

from pathlib import Path

from moekit.spec.loading import load_spec, spec_from_config
from moekit.spec.model_spec import ModelSpec
from moekit.weights.gguf_config import hf_config
from moekit.weights.gguf_file import read_gguf


def spec_from_gguf(path: Path) -> ModelSpec:
    """A GGUF file, counted from its metadata and tensor shapes (no tensor data is read)."""
    gguf = read_gguf(path)
    shapes = {name: t.shape for name, t in gguf.tensors.items()}
    return spec_from_config(hf_config(gguf.metadata, shapes, str(path)), path.stem)


def load_any_spec(source: str) -> ModelSpec:
    """What moekit.spec.load_spec takes (a preset name, a config.json, a checkpoint folder) or a .gguf file."""
    path = Path(source)
    if path.suffix == ".gguf" and path.is_file():
        return spec_from_gguf(path)
    return load_spec(source)
