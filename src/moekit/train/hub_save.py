"""Writing a trained Decoder in the Hub's format: the engine's own name map (moekit.model.loading.plan), inverted.

Each Piece of the loading plan says which Hub tensors make one of our parameters, stacked along the
first dimension (q/k/v into qkv, gate/up into gate_up, per-expert weights into one stack). Splitting
the parameter back along that dimension gives the Hub tensors; `_split` checks that loading them
would rebuild the parameter exactly, so save and load cannot drift apart.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from torch import Tensor

from moekit.train.tokenizer import BOS_ID, EOS_ID, PAD_ID


def _split(piece, param: Tensor) -> dict[str, Tensor]:
    shapes = [shape for _, shape in piece.sources]
    rest = shapes[0][1:] if shapes[0] else ()
    if len(shapes) == 1 and tuple(shapes[0]) == tuple(param.shape):
        parts = [param]
    else:
        if any(tuple(s[1:]) != tuple(rest) for s in shapes):
            raise ValueError(f"{piece.target}: sources of different trailing shapes cannot be split")
        parts = list(param.reshape(-1, *rest).split([s[0] for s in shapes]))
    out = {name: part.contiguous() for (name, _), part in zip(piece.sources, parts)}
    rebuilt = torch.empty_like(param)
    piece.fill(rebuilt, list(out.values()))
    if not torch.equal(rebuilt, param):
        raise ValueError(f"{piece.target}: the Hub layout does not rebuild the parameter")
    return out


def hub_tensors(decoder, dtype: torch.dtype) -> dict[str, Tensor]:
    """Hub name → tensor (cpu, `dtype`) for every parameter of a decoder in the Hub layout (not prepared)."""
    from moekit.model.loading import plan

    params = dict(decoder.named_parameters())
    tensors: dict[str, Tensor] = {}
    with torch.no_grad():
        for piece in plan(decoder):
            for name, t in _split(piece, params[piece.target].detach().cpu().float()).items():
                tensors[name] = t.to(dtype).contiguous()
    return tensors


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def export(decoder, config: dict, folder: Path, dtype: str, tokenizer_folder: Path) -> None:
    """config.json, generation_config.json, model.safetensors, tokenizer files: a folder transformers loads."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = hub_tensors(decoder, getattr(torch, dtype))
    tmp = folder / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, folder / "model.safetensors")
    hub_config = {**config, "dtype": dtype, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    _atomic_write_text(folder / "config.json", json.dumps(hub_config, indent=2) + "\n")
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    _atomic_write_text(folder / "generation_config.json", json.dumps(generation, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_folder / name, folder / (name + ".tmp"))
        os.replace(folder / (name + ".tmp"), folder / name)
