"""Routing analysis: statistics of a routing trace, routing policies measured on held-out text,
and the HTML report that shows both.

  trace_data     a Parquet trace as arrays, checked against the model facts in its metadata
  load_stats     expert load, router health, domain specialisation (numpy only)
  reuse_stats    reuse between consecutive tokens, co-activation, cross-layer prefetch headroom
  activation     experts, active parameters and share per token, by domain and position
  hitrate        the expert-cache hit-rate curve (moekit.analysis.cache_sim)
  replay         a layer's expert cache replayed from its forwards in one loop (cache-sim's and
                 eval-routing's; counts as the live store's SlotCache does)
  analyze        all of the above as one JSON-ready dict (`moekit analyze`)
  policy_eval    routing policies scored with the engine (`moekit eval-routing`; torch)
  prompts, sample, run_trace   labelled prompts, the shipped held-out sample, tracing them
  plots, report  the figures (matplotlib) and the self-contained HTML page (`moekit report`)
"""
