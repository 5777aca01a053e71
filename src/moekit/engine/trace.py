"""The routing trace: every real token's experts at every MoE layer, as a Parquet table.

One row per token x MoE layer, prompt tokens included (step 0 is the prefill). Columns:
step, row, position, token_id, layer, expert_ids (list<int32>), weights (list<float32>), entropy
(float32: nats of the router's full distribution over E, null when the routers were not watched,
see engine/router_health.py). `token_id` is the token fed in at that position; the routing
analysis tools read this file.

The model's facts ride in the Parquet schema metadata under b"moekit" (JSON, see TraceModel):
experts and K per MoE layer and a fingerprint of config.json, so a reader (cache-sim) never
guesses the expert count from the highest id a short trace happens to contain; and the shapes the
expert-parallel simulator prices (hidden size, expert width, router groups), so `moekit simulate`
needs nothing but the trace. This module
imports torch only to write a trace: reading the metadata needs pyarrow alone.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from moekit.errors import MoekitError

if TYPE_CHECKING:
    from moekit.engine.generate import Generation
    from moekit.spec.model_spec import ModelSpec

COLUMNS = ("step", "row", "position", "token_id", "layer", "expert_ids", "weights", "entropy")
METADATA_KEY = b"moekit"
TRACE_FORMAT = "moekit-trace"
TRACE_VERSION = 1


@dataclass(frozen=True)
class TraceModel:
    """What a trace's reader needs to know about the model that wrote it."""

    name: str
    model_type: str
    num_layers: int
    experts: dict[int, int]  # MoE layer -> routed experts E
    top_k: dict[int, int]  # MoE layer -> experts per token K
    config_sha256: Optional[str]  # of config.json's bytes: which model, exactly
    # The shapes `moekit simulate` prices (None in traces written before they were recorded):
    hidden_size: Optional[int] = None  # D: a dispatched row's width
    expert_width: Optional[int] = None  # F of a routed expert
    expert_gated: Optional[bool] = None  # gate, up and down (True) or up and down
    router_groups: Optional[int] = None  # DeepSeek's n_group (1: no groups)

    @property
    def num_experts(self) -> int:
        """The most routed experts of any MoE layer (the store sizes every layer's slots from it)."""
        return max(self.experts.values(), default=0)

    def to_json(self) -> dict:
        return {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "model": self.name,
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "moe_layers": {str(l): {"num_experts": self.experts[l], "top_k": self.top_k[l]} for l in self.experts},
            "config_sha256": self.config_sha256,
            "hidden_size": self.hidden_size,
            "expert": None if self.expert_width is None else {"width": self.expert_width, "gated": self.expert_gated},
            "router_groups": self.router_groups,
        }


def trace_model(spec: ModelSpec, folder: Optional[Path] = None) -> TraceModel:
    """The facts of `spec` (and the sha256 of folder/config.json when there is one)."""
    config = None if folder is None else Path(folder) / "config.json"
    sha = hashlib.sha256(config.read_bytes()).hexdigest() if config is not None and config.is_file() else None
    moe = {l: spec.layers[l].ffn for l in spec.moe_layers}
    first = next(iter(moe.values()), None)
    return TraceModel(
        name=spec.name,
        model_type=spec.model_type,
        num_layers=spec.num_layers,
        experts={l: ffn.num_experts for l, ffn in moe.items()},
        top_k={l: ffn.top_k for l, ffn in moe.items()},
        config_sha256=sha,
        hidden_size=spec.hidden_size,
        expert_width=None if first is None else first.expert.width,
        expert_gated=None if first is None else first.expert.gated,
        router_groups=None if first is None else first.router.n_group,
    )


def read_trace_model(metadata: Optional[dict], name: str = "trace") -> Optional[TraceModel]:
    """The TraceModel in a Parquet schema's metadata; None for a trace written without one."""
    raw = (metadata or {}).get(METADATA_KEY)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        if doc.get("format") != TRACE_FORMAT:
            raise ValueError(f"format {doc.get('format')!r}")
        layers = {int(l): v for l, v in doc["moe_layers"].items()}
        expert = doc.get("expert") or {}
        return TraceModel(
            name=str(doc["model"]),
            model_type=str(doc["model_type"]),
            num_layers=int(doc["num_layers"]),
            experts={l: int(v["num_experts"]) for l, v in layers.items()},
            top_k={l: int(v["top_k"]) for l, v in layers.items()},
            config_sha256=doc.get("config_sha256"),
            hidden_size=_optional_int(doc.get("hidden_size")),
            expert_width=_optional_int(expert.get("width")),
            expert_gated=None if expert.get("gated") is None else bool(expert["gated"]),
            router_groups=_optional_int(doc.get("router_groups")),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise MoekitError(f"{name}: unreadable moekit metadata in the trace ({err})") from None


def _optional_int(value) -> Optional[int]:
    return None if value is None else int(value)


def trace_table(gen: Generation, model: Optional[TraceModel] = None):
    import pyarrow as pa

    from moekit.engine.generate import token_routing

    cols: dict[str, list] = {name: [] for name in COLUMNS}
    for ev in token_routing(gen):
        cols["step"].append(ev.step)
        cols["row"].append(ev.row)
        cols["position"].append(ev.position)
        cols["token_id"].append(ev.token_id)
        cols["layer"].append(ev.layer)
        cols["expert_ids"].append(ev.expert_ids)
        cols["weights"].append(ev.weights)
        cols["entropy"].append(ev.entropy)
    schema = pa.schema(
        [
            ("step", pa.int32()),
            ("row", pa.int32()),
            ("position", pa.int32()),
            ("token_id", pa.int64()),
            ("layer", pa.int32()),
            ("expert_ids", pa.list_(pa.int32())),
            ("weights", pa.list_(pa.float32())),
            ("entropy", pa.float32()),
        ]
    )
    if model is not None:
        schema = schema.with_metadata({METADATA_KEY: json.dumps(model.to_json()).encode()})
    return pa.table(cols, schema=schema)


def write_trace(gen: Generation, path: str | Path, model: Optional[TraceModel] = None) -> int:
    """Write the trace (with `model`'s facts in its metadata); returns the number of rows written."""
    import pyarrow.parquet as pq

    path = Path(path)
    if path.parent and not path.parent.exists():
        raise MoekitError(f"{path}: folder {path.parent} does not exist")
    table = trace_table(gen, model)
    try:
        pq.write_table(table, path)
    except OSError as err:
        raise MoekitError(f"{path}: cannot write trace ({err})") from None
    return table.num_rows
