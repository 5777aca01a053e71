"""The routing trace round-trips through Parquet: one row per real token x MoE layer."""

from __future__ import annotations

import pyarrow.parquet as pq

from moekit.engine.loader import load_engine
from moekit.engine.trace import COLUMNS, write_trace


def test_trace_round_trips_and_agrees_with_the_meter(tiny_checkpoints, tmp_path):
    engine = load_engine(tiny_checkpoints("olmoe"))
    prompts = [[1, 17, 42, 99], [5, 6]]
    gen = engine.generate(prompts, max_new_tokens=5, stop_ids=())
    path = tmp_path / "trace.parquet"
    rows = write_trace(gen, path)
    table = pq.read_table(path)
    assert tuple(table.column_names) == COLUMNS
    moe_layers = len(engine.spec.moe_layers)
    fed = sum(len(p) + len(t) - 1 for p, t in zip(prompts, gen.token_ids))
    assert rows == table.num_rows == fed * moe_layers

    records = table.to_pylist()
    prompt_rows = [r for r in records if r["step"] == 0 and r["row"] == 1]
    assert [r["token_id"] for r in prompt_rows[::moe_layers]] == prompts[1]
    assert [r["position"] for r in prompt_rows[::moe_layers]] == [0, 1]

    by_key = {(r["row"], r["position"], r["layer"]): r for r in records}
    for a in engine.meter(gen):
        for layer, ids in a.experts.items():
            rec = by_key[(a.row, a.position, layer)]
            assert rec["expert_ids"] == ids
            assert rec["weights"] == [float(w) for w in rec["weights"]]
            assert abs(sum(rec["weights"]) - sum(a.weights[layer])) < 1e-6
