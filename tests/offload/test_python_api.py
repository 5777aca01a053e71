"""The README's Python example, as written but on the eager step (compile=False: the suite does not
compile the bundled model here), on the bundled demo model: `moekit.load(..., expert_memory="25%",
policy="lfu")` generates the resident engine's tokens, `store.stats()` reports the store, `decode()`
gives the text and `close()` stops the reader threads."""

from __future__ import annotations

import threading

import moekit
from demo_figures import DEMO

PROMPT = "def parse_args(argv):"


def _reader_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("moekit-experts")}


def test_the_readme_paged_example_generates_the_resident_tokens():
    engine = moekit.load(DEMO, dtype="bfloat16", compile=False)
    gen = engine.generate(engine.encode(PROMPT), max_new_tokens=32)
    text = engine.decode(gen.token_ids[0])
    assert len(gen.token_ids[0]) >= 8 and text.strip()
    assert engine.decode(engine.encode("import os\n")) == "import os\n"  # byte-level BPE round trip
    assert all(t.share > 0 for t in engine.meter(gen))

    paged = moekit.load(DEMO, dtype="bfloat16", expert_memory="25%", policy="lfu", compile=False)
    try:
        assert paged.store is not None
        again = paged.generate(paged.encode(PROMPT), max_new_tokens=32)
        assert again.token_ids == gen.token_ids  # the same tokens
        assert paged.decode(again.token_ids[0]) == text
        stats = paged.store.stats()
        assert stats["policy"] == "lfu" and stats["slots_per_layer"] == 128 // 4  # 25% of 128 experts
        assert 0 < stats["hit_rate"] < 1 and stats["loads"] > 0 and stats["disk_bytes"] > 0
        assert stats["accesses"] == sum(layer["accesses"] for layer in stats["layers"].values())
        assert stats["peak_resident_expert_bytes"] <= stats["budget_bytes"]
    finally:
        paged.close()

    # With prefetch the store reads on worker threads: the same tokens again, and close() stops them.
    before = _reader_threads()
    prefetching = moekit.load(DEMO, dtype="bfloat16", expert_memory="25%", policy="lfu", prefetch=True, compile=False)
    try:
        assert prefetching.generate(prefetching.encode(PROMPT), max_new_tokens=32).token_ids == gen.token_ids
        assert prefetching.store.stats()["prefetch_recall"] is not None
        started = _reader_threads() - before
        assert started
    finally:
        prefetching.close()
    assert not any(t.is_alive() for t in started)
