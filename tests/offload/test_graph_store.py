"""The expert store inside the compiled decode step (moekit.offload.graph_store): `moekit run
--expert-memory` (compiled by default) gives the resident engine's fp32 greedy tokens, and the
store reads, hits and misses exactly as the `--eager` step does, with and without prefetch."""

from __future__ import annotations

import json

import pytest
import torch

from cli_runner import moekit
from moekit.engine.loader import load_engine
from moekit.model.routing import RoutingDecision
from moekit.offload import graph_store
from moekit.offload.options import OffloadOptions

PROMPT = "5,17,42,9,77,3,101"
NEW = "16"


def _run(capsys, folder, *args) -> tuple[dict, str]:
    code, out, err = moekit(capsys, "run", folder, "--prompt-ids", PROMPT, "--max-new-tokens", NEW, "--stop", "",
                            "--json", *args)
    assert code == 0, err
    return json.loads(out), err


def _counted(report: dict) -> dict:
    """The store's counts of one run: every figure but times and the process's memory."""
    timed = {"stall_s", "stall_s_per_token", "stall_share", "peak_rss_bytes"}
    return {k: ({kk: vv for kk, vv in v.items() if kk not in timed} if isinstance(v, dict) else v)
            for k, v in report.items() if k not in timed}


def _unweighed(activation: dict) -> dict:
    return {k: v for k, v in activation.items() if k != "weights"}


@pytest.mark.parametrize("prefetch", [False, True], ids=["no-prefetch", "prefetch"])
def test_a_compiled_paged_run_gives_the_resident_tokens_and_the_eager_reads(capsys, tiny_checkpoints, prefetch):
    folder = tiny_checkpoints("qwen3_moe")
    store = ("--expert-memory", "25%", "--cache", "lfu") + (("--prefetch", "--prefetch-extra", "1") if prefetch else ())
    resident, _ = _run(capsys, folder, "--eager")
    eager, _ = _run(capsys, folder, *store, "--eager")
    compiled, err = _run(capsys, folder, *store)  # the default: the compiled step
    assert "decode steps run as one compiled graph" in err, err
    assert compiled["token_ids"] == eager["token_ids"] == resident["token_ids"]
    # The meter's experts, parameters and bytes; the routing weights as the compiled step rounds them.
    assert [_unweighed(a) for a in compiled["activation"]] == [_unweighed(a) for a in eager["activation"]]
    for c, e in zip(compiled["activation"], eager["activation"]):
        for layer, w in e["weights"].items():
            assert c["weights"][layer] == pytest.approx(w, abs=1e-5)
    assert eager["offload"]["decode"]["disk_bytes_per_token"] > 0  # 2 slots for K = 2 of 8: decode misses
    assert _counted(compiled["offload"]) == _counted(eager["offload"])  # the warm-up read and counted nothing
    if prefetch:
        assert compiled["offload"]["prefetch_recall"] is not None


def test_the_ops_agree_with_their_fakes_and_name_a_missing_handle(tiny_checkpoints):
    """torch.library.opcheck: schema, fake (shape, dtype) and the compiled dispatch, on a live store."""
    engine = load_engine(tiny_checkpoints("qwen3_moe"), offload=OffloadOptions("25%", prefetch=True), compile=False)
    try:
        layer = engine.decoder.layers[1]
        store, guess = engine.store.layers[1], layer.before_attn
        x = torch.randn(3, engine.spec.hidden_size)
        ids, weights = torch.tensor([[0, 5], [2, 5], [7, 1]]), torch.rand(3, 2)
        torch.library.opcheck(graph_store.paged_experts, (x, ids, weights, store.handle))
        torch.library.opcheck(graph_store.prefetch_guess, (x, guess.handle))
        want = store.forward(layer.ffn.experts, x, RoutingDecision(ids, weights))
        torch.testing.assert_close(torch.ops.moekit.paged_experts(x, ids, weights, store.handle), want, rtol=0, atol=0)
        assert store.stats.predicted > 0  # the guesses ran
    finally:
        engine.close()
    with pytest.raises(RuntimeError, match="nothing in this process has handle 0"):
        torch.ops.moekit.paged_experts(x, ids, weights, 0)
