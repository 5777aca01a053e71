"""Profiles (`moekit profile`): which experts a workload uses most, and the pins a run takes from them.

A profile names the model it was measured on; pinning experts measured on another model would pin
the wrong weights, so a mismatch is an error, not a warning. No torch here.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from moekit.errors import MoekitError
from moekit.spec.model_spec import ModelSpec

FORMAT = "moekit-profile/1"


def model_identity(folder: Path, spec: ModelSpec) -> dict:
    moe = [layer.ffn for layer in spec.layers if layer.is_moe]
    return {
        "model_type": spec.model_type,
        "num_layers": spec.num_layers,
        "num_experts": moe[0].num_experts if moe else 0,
        "hidden_size": spec.hidden_size,
        "vocab_size": spec.vocab_size,
        "config_sha256": hashlib.sha256((Path(folder) / "config.json").read_bytes()).hexdigest(),
    }


def ranked_pins(counts: dict[int, list[int]], top: int) -> dict[int, list[int]]:
    """Per layer, the `top` most used experts (ties: lower id first), most used first; unused never."""
    pins = {}
    for layer, row in counts.items():
        order = sorted(range(len(row)), key=lambda e: (-row[e], e))
        pins[layer] = [e for e in order[:top] if row[e] > 0]
    return pins


def profile_document(identity: dict, counts: dict[int, list[int]], top: int, workload: dict) -> dict:
    return {
        "format": FORMAT,
        "model": identity,
        "workload": workload,
        "counts": {str(l): row for l, row in counts.items()},
        "pins": {str(l): ids for l, ids in ranked_pins(counts, top).items()},
    }


def read_pins(path: Path, folder: Path, spec: ModelSpec) -> dict[int, list[int]]:
    """layer → pinned expert ids (most used first), after checking the profile is for this model."""
    path = Path(path)
    if not path.is_file():
        raise MoekitError(f"{path}: no such pin file")
    try:
        doc = json.loads(path.read_text())
        model, pins = doc["model"], doc["pins"]
        pins = {int(l): [int(e) for e in ids] for l, ids in pins.items()}
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        raise MoekitError(f"{path}: not a moekit profile (expected JSON with 'model' and 'pins'; "
                          "write one with `moekit profile`)") from None
    ours = model_identity(folder, spec)
    differs = [k for k in ours if model.get(k) != ours[k]]
    if differs:
        raise MoekitError(f"{path}: this pin file was made for another model ({', '.join(differs)} differ from {folder})")
    moe = {i for i, layer in enumerate(spec.layers) if layer.is_moe}
    for layer, ids in pins.items():
        if layer not in moe or any(not 0 <= e < ours["num_experts"] for e in ids):
            raise MoekitError(f"{path}: pins name layer {layer} or experts outside this model")
    return pins
