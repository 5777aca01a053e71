"""Run labelled prompts through the engine and keep one routing trace of them all.

Each prompt is its own request (batch 1, as a single user runs them) and its own `row` in the
trace; steps continue from one prompt to the next, so every (step, layer) is one forward and the
cache simulator replays the prompts back to back through one warm cache. A `domain` column
carries each prompt's label, and `itl_jitter` each prompt's inter-token-latency jitter index
(engine/router_health.py); the routers are watched, so the `entropy` column is filled.
"""

from __future__ import annotations

from moekit.analysis.prompts import Prompt


def trace_prompts(engine, prompts: list[Prompt], prompt_tokens: int, max_new_tokens: int, policy=None,
                  progress=lambda done, total: None):
    """The combined trace (a pyarrow Table with the model's facts in its metadata)."""
    import pyarrow as pa

    import time

    from moekit.engine.router_health import jitter_index, watch_entropy
    from moekit.engine.trace import trace_model, trace_table

    facts = trace_model(engine.spec, engine.folder)
    parts, offset = [], 0
    for i, prompt in enumerate(prompts):
        ids = engine.encode(prompt.text)[:prompt_tokens] or [engine.eos_ids[0] if engine.eos_ids else 0]
        times: list[float] = []
        with watch_entropy(engine.decoder):
            gen = engine.generate(ids, max_new_tokens=max_new_tokens, stop_ids=(), policy=policy,
                                  on_token=lambda step, row: times.append(time.perf_counter()))
        part = trace_table(gen, facts)
        jitter = jitter_index(times)
        steps = part["step"].to_numpy() + offset
        offset = int(steps.max()) + 1
        part = part.set_column(part.column_names.index("step"), "step", pa.array(steps, pa.int32()))
        part = part.set_column(part.column_names.index("row"), "row", pa.array([i] * part.num_rows, pa.int32()))
        part = part.append_column("domain", pa.array([prompt.domain] * part.num_rows, pa.string()))
        parts.append(part.append_column("itl_jitter", pa.array([jitter] * part.num_rows, pa.float32())))
        progress(i + 1, len(prompts))
    return pa.concat_tables(parts)
