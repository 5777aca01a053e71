"""The routing trace round-trips through Parquet: one row per real token x MoE layer."""

from __future__ import annotations

import pyarrow.parquet as pq

from moekit.engine.loader import load_engine
from moekit.engine.trace import COLUMNS, write_trace


def test_trace_round_trips_and_agrees_with_the_meter(tiny_checkpoints, tmp_path):
    engine = load_engine(tiny_checkpoints("olmoe"), compile=False)
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

    # Every row, value by value, against the routing decisions the generation itself recorded:
    # step 0 holds the left-padded prompts (width P), each decode step one token per row.
    by_key = {(r["step"], r["row"], r["position"], r["layer"]): r for r in records}
    checked = 0
    for step in gen.routing:
        for row, prompt in enumerate(prompts):
            if step.step == 0:
                pad = gen.prompt_width - len(prompt)
                tokens = [(pad + p, p, prompt[p]) for p in range(len(prompt))]  # (column, position, fed id)
            elif step.step < len(gen.token_ids[row]):
                tokens = [(0, len(prompt) + step.step - 1, gen.token_ids[row][step.step - 1])]
            else:
                continue  # the row had stopped
            for column, position, fed in tokens:
                for lr in step.layers:
                    rec = by_key[step.step, row, position, lr.layer]
                    flat = row * step.tokens_per_row + column
                    assert rec["token_id"] == fed
                    assert rec["expert_ids"] == lr.topk_ids[flat].tolist()
                    assert rec["weights"] == lr.topk_weights[flat].tolist()  # float32 both ways: exact
                    checked += 1
    assert checked == rows

    for a in engine.meter(gen):
        for layer, ids in a.experts.items():
            rec = by_key[(a.index, a.row, a.position, layer)]
            assert (rec["expert_ids"], rec["weights"]) == (ids, a.weights[layer])
