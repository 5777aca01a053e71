"""Hot-swapped experts of a paged store: their new weights in files of their own, read instead of
the checkpoint's.

A hot swap (moekit.serve.admin) of an expert the store pages writes the new weights to a
safetensors file in a folder the store owns (a temporary one, removed when the store closes), never
into the user's checkpoint, and points the store's loads of that expert at it; the store then
forgets any copy it holds (LayerStore.forget), so the next use reads the new weights. A rollback
points the loads back: at the file of the swap before, or at the checkpoint.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from safetensors.torch import load_file, save_file
from torch import Tensor


@dataclass
class ExpertOverlay:
    """The store's loader with swapped experts read from their own files (a dict lookup per load
    otherwise)."""

    read: Callable  # the store's own loader: (layer, expert, spare weights or None) → prepared weights
    lay_out: Callable  # (gate_up, down, spare or None) → prepared weights, as `read` lays out a float expert
    files: dict[tuple[int, int], Path] = field(default_factory=dict)
    folder: Optional[Path] = None
    _numbers: itertools.count = field(default_factory=lambda: itertools.count(1))

    def __call__(self, layer: int, e: int, into=None):
        path = self.files.get((layer, e))
        if path is None:
            return self.read(layer, e, into)
        tensors = load_file(path)
        return self.lay_out(tensors["gate_up"], tensors["down"], into)

    def write(self, layer: int, e: int, gate_up: Tensor, down: Tensor) -> Path:
        """gate_up [rows, D] and down [D, F] (the engine's dtype) in a new file; not read until `point`."""
        if self.folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix="moekit-swapped-experts-"))
        path = self.folder / f"layer{layer}-expert{e}-{next(self._numbers)}.safetensors"
        save_file({"gate_up": gate_up.contiguous(), "down": down.contiguous()}, str(path))
        return path

    def point(self, layer: int, e: int, path: Optional[Path]) -> Optional[Path]:
        """Loads of the expert read `path` from now on (None: the checkpoint); returns what they read before."""
        before = self.files.pop((layer, e), None)
        if path is not None:
            self.files[(layer, e)] = path
        return before

    def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
