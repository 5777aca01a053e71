"""What structured output costs: decode throughput of grammar-constrained rows against free rows.

On the bundled model (or a checkpoint given), in one run: the scheduler decodes `batch` requests
together, either all free (greedy, a fixed number of tokens) or all constrained to a JSON Schema
(an array of --items booleans: about 2 tokens an item, so both sides decode similar lengths).
Rounds alternate free, constrained, constrained, free so the machine's drift cancels. Tokens/s is
generated tokens over the wall time of the whole batch (prefill included, same prompts both sides);
the ratio constrained / free is the figure to read. Also printed: the mean time to compile a
request's grammar (once per request, before it is queued) and the share of a constrained step
spent computing and applying masks.

  PYTHONPATH=src .venv/bin/python benchmarks/structured_output.py --batch 1,8 --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from moekit.engine import constraints
from moekit.engine.default_model import bundled_model_path
from moekit.engine.loader import load_engine
from moekit.engine.scheduler import Request, Scheduler, generate_batch
from moekit.serve.structured import Grammars

PROMPTS = ["def parse_args(argv):", "import os\n", "The quick brown fox", "class Stack:", "for i in range(",
           "SYNOPSIS\n", "#!/bin/sh\n", "NAME\n    ls - list"]


def _requests(engine, grammars: Grammars, batch: int, constrained: bool, tokens: int, schema: dict) -> list[Request]:
    out = []
    for i in range(batch):
        prompt = engine.encode(PROMPTS[i % len(PROMPTS)])
        if constrained:
            constraint = grammars.constraint(constraints.json_schema_grammar(schema), "bench")
            out.append(Request(prompt=prompt, max_new_tokens=4 * tokens, stop_ids=(), constraint=constraint))
        else:
            out.append(Request(prompt=prompt, max_new_tokens=tokens, stop_ids=()))
    return out


class _MaskClock:
    """Seconds spent in constraints.mask_logits (the per-row mask: the library's part and ours)."""

    def __init__(self):
        self.seconds = 0.0
        self._inner = constraints.mask_logits

    def __call__(self, logits, rows):
        began = time.perf_counter()
        out = self._inner(logits, rows)
        self.seconds += time.perf_counter() - began
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", type=Path, default=None)
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--items", type=int, default=48)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = load_engine(args.checkpoint or bundled_model_path())
    grammars = Grammars(engine.tokenizer, engine.spec.vocab_size, tuple(engine.eos_ids))
    schema = {"type": "array", "items": {"type": "boolean"}, "minItems": args.items, "maxItems": args.items}

    began = time.perf_counter()
    compiles = 20
    for _ in range(compiles):
        grammars.constraint(constraints.json_schema_grammar(schema), "bench")
    compile_ms = (time.perf_counter() - began) / compiles * 1e3

    # Tokens a constrained answer takes: the free side decodes as many.
    probe = generate_batch(Scheduler(engine.decoder, max_batch=1), _requests(engine, grammars, 1, True, 2 * args.items, schema))[0]
    tokens = len(probe.token_ids)

    import moekit.engine.scheduler as scheduler_module

    clock = _MaskClock()
    scheduler_module.mask_logits = clock  # timed in this script only; the library code is unchanged
    print(f"checkpoint {engine.folder}, {args.threads} thread(s); constrained answers: {tokens} tokens "
          f"(an array of {args.items} booleans), free answers: {tokens} tokens; grammar compile {compile_ms:.2f} ms a request")
    print(f"{'batch':>5} {'free tok/s':>11} {'constrained tok/s':>18} {'ratio':>6} {'mask share':>11}")
    for batch in [int(b) for b in args.batch.split(",")]:
        rates: dict[bool, list[float]] = {False: [], True: []}
        mask_share = []
        for r in range(args.rounds):
            order = (False, True, True, False) if r % 2 == 0 else (True, False, False, True)
            for constrained in order:
                scheduler = Scheduler(engine.decoder, max_batch=batch)
                requests = _requests(engine, grammars, batch, constrained, tokens, schema)
                clock.seconds = 0.0
                t0 = time.perf_counter()
                outcomes = generate_batch(scheduler, requests)
                wall = time.perf_counter() - t0
                rates[constrained].append(sum(len(o.token_ids) for o in outcomes) / wall)
                if constrained:
                    mask_share.append(clock.seconds / wall)
        free, constrained = statistics.median(rates[False]), statistics.median(rates[True])
        print(f"{batch:>5} {free:>11.1f} {constrained:>18.1f} {constrained / free:>6.3f} {statistics.median(mask_share):>10.1%}")


if __name__ == "__main__":
    main()
