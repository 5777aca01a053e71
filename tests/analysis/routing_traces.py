"""Hand-built routing traces whose statistics are known (the trace schema of moekit.engine.trace)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq

from moekit.engine.trace import METADATA_KEY, TraceModel


def model(experts: int, top_k: int, layers=(0, 1)) -> TraceModel:
    return TraceModel(name="hand-built", model_type="mixtral", num_layers=len(layers),
                      experts={l: experts for l in layers}, top_k={l: top_k for l in layers}, config_sha256=None)


def table(tokens: list[dict], facts: TraceModel | None) -> pa.Table:
    """tokens: one dict per token × layer: row, position, layer, ids, weights (+ step, domain)."""
    cols = {
        "step": pa.array([t.get("step", t["position"]) for t in tokens], pa.int32()),
        "row": pa.array([t.get("row", 0) for t in tokens], pa.int32()),
        "position": pa.array([t["position"] for t in tokens], pa.int32()),
        "token_id": pa.array([t.get("token_id", 5) for t in tokens], pa.int64()),
        "layer": pa.array([t["layer"] for t in tokens], pa.int32()),
        "expert_ids": pa.array([t["ids"] for t in tokens], pa.list_(pa.int32())),
        "weights": pa.array([t["weights"] for t in tokens], pa.list_(pa.float32())),
    }
    if any("domain" in t for t in tokens):
        cols["domain"] = pa.array([t.get("domain") for t in tokens], pa.string())
    out = pa.table(cols)
    if facts is not None:
        out = out.replace_schema_metadata({METADATA_KEY: json.dumps(facts.to_json()).encode()})
    return out


def write(path, tokens, facts):
    pq.write_table(table(tokens, facts), path)
    return path


def sequence(choices, layers=(0, 1), row=0, domain=None, weights=None):
    """Token t at every layer chooses choices[t] (ids); equal weights unless given."""
    out = []
    for t, ids in enumerate(choices):
        for layer in layers:
            w = weights[t] if weights is not None else [1.0 / len(ids)] * len(ids)
            entry = {"row": row, "position": t, "layer": layer, "ids": list(ids), "weights": w}
            if domain is not None:
                entry["domain"] = domain
            out.append(entry)
    return out
