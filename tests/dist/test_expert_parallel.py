"""Expert parallelism over real gloo ranks: the greedy output, token for token and routing weight
for routing weight, of the single-process engine, on every MoE family at 2 and 4 ranks; and the
simulator's tokens per rank and bytes sent equal to what the ranks measured."""

from __future__ import annotations

import json

import pytest
import torch

from hf_tiny import MOE_FAMILIES
from ranks import run_ranks

# Rank processes; tests/conftest.py keeps such tests from overlapping.
pytestmark = pytest.mark.processes

PROMPT = [1, 17, 42, 9, 33, 5, 77]  # 7 tokens: home chunks of 4+3 at 2 ranks, 2+2+2+1 at 4
BATCH = [[1, 17, 42, 9, 33], [5, 77, 3]]  # two prompts, left padding in the prefill
NEW = 8
# mixtral has 6 experts: copies of experts 1 and 4 on both ranks, so tokens are split between them.
REPLICAS = {"0": [[0, 1, 2, 4], [3, 4, 5, 1]], "1": [[0, 1, 2, 4], [3, 4, 5, 1]]}


def _runs(tiny_checkpoints, out) -> list[dict]:
    runs = [{"name": f, "checkpoint": str(tiny_checkpoints(f)), "prompts": [PROMPT], "max_new_tokens": NEW,
             "trace": str(out / f"{f}.parquet")} for f in MOE_FAMILIES]
    runs.append({"name": "qwen3_moe batch", "checkpoint": str(tiny_checkpoints("qwen3_moe")), "prompts": BATCH,
                 "max_new_tokens": NEW})
    return runs


def _replica_run(tiny_checkpoints, out) -> dict:
    placement = out / "replicas.json"
    placement.write_text(json.dumps({"format": "moekit-placement", "version": 1, "ranks": 2,
                                     "layers": {l: {"num_experts": 6, "ranks": r} for l, r in REPLICAS.items()}}))
    return {"name": "mixtral replicas", "checkpoint": str(tiny_checkpoints("mixtral")), "prompts": [PROMPT],
            "max_new_tokens": NEW, "placement": str(placement)}


@pytest.fixture(scope="module", params=[2, 4], ids=["2 ranks", "4 ranks"])
def ranks_ran(request, tiny_checkpoints, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"ep{world}")
    runs = _runs(tiny_checkpoints, out) + ([_replica_run(tiny_checkpoints, out)] if world == 2 else [])
    results = run_ranks(world, runs, out)
    for rank, (code, err, _) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}: {err[-2000:]}"
    return world, runs, [r[2] for r in results]


def _single_process(checkpoint: str, prompts):
    from moekit.engine.loader import load_engine

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the ranks' thread count: bit-exactness holds at equal thread counts
    try:
        gen = load_engine(checkpoint, compile=False).generate(prompts, max_new_tokens=NEW, stop_ids=())
    finally:
        torch.set_num_threads(before)
    return gen.token_ids, [[layer.topk_weights.tolist() for layer in step.layers] for step in gen.routing]


def test_every_family_generates_what_one_process_generates(ranks_ran):
    world, runs, per_rank = ranks_ran
    for i, run in enumerate(runs):
        tokens, weights = _single_process(run["checkpoint"], run["prompts"])
        for rank in range(world):
            got = per_rank[rank][i]
            assert got["tokens"] == tokens, f"{run['name']}, rank {rank} of {world}: other tokens"
            if run.get("placement") is None:
                assert got["weights"] == weights, f"{run['name']}, rank {rank} of {world}: other routing weights"
            else:
                # Copies split an expert's rows, and a matmul over fewer rows may round differently
                # (docs/SCALING.md): the same tokens, weights equal to float32 rounding.
                assert torch.allclose(torch.tensor(got["weights"][0][0]), torch.tensor(weights[0][0]))
                for a, b in zip(got["weights"], weights):
                    assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-6), run["name"]


def test_each_rank_holds_only_its_experts(ranks_ran):
    world, runs, per_rank = ranks_ran
    from moekit.spec import load_spec

    for i, run in enumerate(runs):
        spec = load_spec(run["checkpoint"])
        for l in spec.moe_layers:
            held = [per_rank[r][i]["stats"]["experts"][str(l)] for r in range(world)]
            e = spec.layers[l].ffn.num_experts
            assert sum(held) == e + (2 if run.get("placement") else 0), (run["name"], held)


def test_simulator_agrees_with_the_exchange(ranks_ran):
    """Tokens per rank and bytes sent, per layer and rank, from the trace alone."""
    from moekit.dist.placement import linear_placement
    from moekit.dist.simulate import Cost, read_forwards, simulate
    from moekit.spec import load_spec

    world, runs, per_rank = ranks_ran
    for i, run in enumerate(runs):
        if "trace" not in run:
            continue
        forwards = read_forwards(run["trace"])
        spec = load_spec(run["checkpoint"])
        sims = simulate(forwards, linear_placement(forwards.experts, world), Cost(row_bytes=spec.hidden_size * 4))
        for l, sim in sims.items():
            measured = [per_rank[r][i]["stats"]["layers"][str(l)] for r in range(world)]
            assert sim.pairs.tolist() == [sum(m["pairs"]) for m in measured], run["name"]
            assert sim.dispatch_bytes.tolist() == [sum(m["dispatch_bytes"]) for m in measured], run["name"]
            assert sim.combine_bytes.tolist() == [sum(m["combine_bytes"]) for m in measured], run["name"]
