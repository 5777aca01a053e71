"""One rank of a test's expert-parallel run (see ranks.py): joins, then for each run loads the
checkpoint sharded, generates greedily and records tokens, routing weights and exchange stats.

A `fault` makes one rank die (os._exit) or hang (sleep) inside its n-th MoE layer forward, so the
test can watch the others fail in bounded time."""

from __future__ import annotations

import json
import os
import sys
import time

import torch


def _inject(fault: dict) -> None:
    from moekit.dist import layer

    original = layer.ExpertParallelLayer.forward
    calls = {"n": 0}

    def forward(self, experts, x, decision):
        calls["n"] += 1
        if calls["n"] == fault["at_forward"]:
            if fault["kind"] == "die":
                os._exit(3)
            time.sleep(fault.get("seconds", 8))  # long past the others' timeout, then on to fail too
        return original(self, experts, x, decision)

    layer.ExpertParallelLayer.forward = forward


def main() -> int:
    from moekit.dist.group import Rank, join, leave
    from moekit.dist.session import Job, load_sharded, _agree
    from moekit.dist.fingerprint import checkpoint_fingerprint
    from moekit.errors import MoekitError

    torch.set_num_threads(1)
    orders = json.loads(sys.stdin.read())
    me = Rank(rank=orders["rank"], world=orders["world"], store_port=orders["port"])
    fault = orders.get("fault")
    if fault and fault["rank"] == me.rank:
        _inject(fault)
    results = []
    try:
        join(me, orders["timeout_s"])
        for run in orders["runs"]:
            checkpoint = orders.get("checkpoint") or run["checkpoint"]
            job = Job(checkpoint=checkpoint, dtype=run.get("dtype", "float32"), placement=run.get("placement"),
                      timeout_s=orders["timeout_s"])
            sharded = load_sharded(job, me)
            _agree(me, checkpoint_fingerprint(checkpoint), "test", None, orders["timeout_s"])
            gen = sharded.engine.generate(run["prompts"], max_new_tokens=run["max_new_tokens"], stop_ids=())
            weights = [[layer.topk_weights.tolist() for layer in step.layers] for step in gen.routing]
            if run.get("trace") and me.rank == 0:
                from moekit.engine.trace import trace_model, write_trace

                write_trace(gen, run["trace"], trace_model(sharded.engine.spec, sharded.engine.folder))
            results.append({"tokens": gen.token_ids, "weights": weights, "stats": sharded.stats()})
            sharded.engine.close()
    except MoekitError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    finally:
        with open(orders["out"], "w") as fh:
            json.dump(results, fh)
        leave()
    return 0


if __name__ == "__main__":
    sys.exit(main())
