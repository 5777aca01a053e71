"""The routing trace: every real token's experts at every MoE layer, as a Parquet table.

One row per token x MoE layer, prompt tokens included (step 0 is the prefill). Columns:
step, row, position, token_id, layer, expert_ids (list<int32>), weights (list<float32>).
`token_id` is the token fed in at that position; the routing analysis tools read this file.
"""

from __future__ import annotations

from pathlib import Path

from moekit.engine.generate import Generation, token_routing
from moekit.errors import MoekitError

COLUMNS = ("step", "row", "position", "token_id", "layer", "expert_ids", "weights")


def trace_table(gen: Generation):
    import pyarrow as pa

    cols: dict[str, list] = {name: [] for name in COLUMNS}
    for ev in token_routing(gen):
        cols["step"].append(ev.step)
        cols["row"].append(ev.row)
        cols["position"].append(ev.position)
        cols["token_id"].append(ev.token_id)
        cols["layer"].append(ev.layer)
        cols["expert_ids"].append(ev.expert_ids)
        cols["weights"].append(ev.weights)
    schema = pa.schema(
        [
            ("step", pa.int32()),
            ("row", pa.int32()),
            ("position", pa.int32()),
            ("token_id", pa.int64()),
            ("layer", pa.int32()),
            ("expert_ids", pa.list_(pa.int32())),
            ("weights", pa.list_(pa.float32())),
        ]
    )
    return pa.table(cols, schema=schema)


def write_trace(gen: Generation, path: str | Path) -> int:
    """Write the trace; returns the number of rows written."""
    import pyarrow.parquet as pq

    path = Path(path)
    if path.parent and not path.parent.exists():
        raise MoekitError(f"{path}: folder {path.parent} does not exist")
    table = trace_table(gen)
    try:
        pq.write_table(table, path)
    except OSError as err:
        raise MoekitError(f"{path}: cannot write trace ({err})") from None
    return table.num_rows
