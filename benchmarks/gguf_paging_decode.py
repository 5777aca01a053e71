"""usage: .venv/bin/python benchmarks/gguf_paging_decode.py SRC.gguf [...]

Decode tok/s, resident vs paged at 50%, engines loaded once, generate calls alternated (median of 3)."""
import os, statistics, sys
from pathlib import Path
from moekit.engine.loader import load_engine
from moekit.offload.options import OffloadOptions

PROMPT, NEW = [1, 17, 42, 99, 5, 7, 150, 3], 32
for src in map(Path, sys.argv[1:]):
    engines = {"resident": load_engine(src, compile=False), "paged 50%": load_engine(src, offload=OffloadOptions("50%"), compile=False)}
    if "q8_0" in src.name:
        engines["resident --weights int8-experts"] = load_engine(src, weights="int8-experts", compile=False)
    speeds = {k: [] for k in engines}
    tokens = {}
    for _ in range(3):
        for name, e in engines.items():
            gen = e.generate([PROMPT], max_new_tokens=NEW, stop_ids=())
            speeds[name].append(gen.timing.decode_steps / gen.timing.decode_s)
            tokens[name] = gen.token_ids[0]
    print(f"== {src.name}, loadavg {os.getloadavg()}")
    for name, s in speeds.items():
        print(f"{name}: {statistics.median(s):.1f} tok/s (runs {', '.join(f'{x:.1f}' for x in s)}), "
              f"tokens = resident: {tokens[name] == tokens['resident']}")
    st = engines["paged 50%"].store.stats()
    print(f"paged: {st['slots_per_layer']} slots/layer, hit rate {st['hit_rate']:.3f}, {st['expert_precision']}")
    engines["paged 50%"].close()
