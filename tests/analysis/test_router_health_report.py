"""The report's router-health figure: entropy drift per layer and ITL jitter per prompt, from a
real trace of the bundled model (routers watched by trace_prompts)."""

from __future__ import annotations

from moekit.analysis.prompts import Prompt
from moekit.analysis.report import router_health
from moekit.analysis.run_trace import trace_prompts
from moekit.engine.default_model import bundled_model_path
from moekit.engine.loader import load_engine
from moekit.engine.router_health import POSITION_BUCKET


def test_the_router_health_figure_has_every_layer_and_each_prompts_jitter():
    engine = load_engine(bundled_model_path(), compile=False)
    prompts = [Prompt("def parse_args(argv):\n    " * 8, "python"), Prompt("NAME\n    ls - list directory", "manpages")]
    table = trace_prompts(engine, prompts, prompt_tokens=80, max_new_tokens=6)
    assert table["entropy"].null_count == 0
    jitters = table["itl_jitter"].to_pylist()
    assert all(j is not None and j >= 0 for j in jitters)
    figure = router_health(table)
    (drift,) = figure.tables
    assert [row[0] for row in drift["rows"]] == [f"layer {l}" for l in engine.spec.moe_layers]
    assert drift["head"][1:3] == ["pos 0+", f"pos {POSITION_BUCKET}+"]  # 80 prompt tokens span two buckets
    assert "jitter index" in figure.text and figure.png
    assert router_health(table.drop_columns(["entropy"])) is None  # an old trace: no figure
