"""What structured output costs: decode throughput of grammar-constrained rows against free rows.

On the bundled model (or a checkpoint given), in one run: the scheduler decodes `batch` requests
together (greedy, the same prompts, the same number of tokens), in three modes:
  - free: no grammar;
  - any-text: a grammar that allows any text, so every step computes and applies a full mask but
    the tokens are the free ones (checked): the cost of the mask machinery alone;
  - json: a JSON Schema (an array of --items booleans), what a user asks for: different tokens,
    so the step itself may differ too (an MoE step reads the experts its tokens route to).
Rounds rotate the order of the modes so the machine's drift spreads over all three. Tokens/s is
generated tokens over the wall time of the whole batch (prefill included); the ratios to free are
the figures to read (the median of each round's own ratio). Also printed: the time to compile a request's grammar (once per request,
before it is queued) and the share of a constrained run's wall time spent computing its rows' masks
(llguidance's mask and its unpacking to a [V] bool; the masked_fill is not in it).

  PYTHONPATH=src .venv/bin/python benchmarks/structured_output.py --batch 1,8 --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moekit.engine import constraints
from moekit.engine.default_model import bundled_model_path
from moekit.engine.loader import load_engine
from moekit.engine.scheduler import Request, Scheduler, generate_batch
from moekit.serve.structured import Grammars

PROMPTS = ["def parse_args(argv):", "import os\n", "The quick brown fox", "class Stack:", "for i in range(",
           "SYNOPSIS\n", "#!/bin/sh\n", "NAME\n    ls - list"]


MODES = ("free", "any-text", "json")
ANY_TEXT = constraints.lark_grammar("start: /(.|\\n)*/")


def _requests(engine, grammars: Grammars, batch: int, mode: str, tokens: int, schema: dict, clock: _Clock) -> list[Request]:
    out = []
    for i in range(batch):
        prompt = engine.encode(PROMPTS[i % len(PROMPTS)])
        constraint = None
        if mode != "free":
            grammar = constraints.json_schema_grammar(schema) if mode == "json" else ANY_TEXT
            plain = grammars.constraint(grammar, "bench")
            constraint = _TimedConstraint(plain.matcher, plain.vocab, clock)
        out.append(Request(prompt=prompt, max_new_tokens=tokens, stop_ids=(), constraint=constraint))
    return out


@dataclass
class _Clock:
    seconds: float = 0.0


@dataclass(eq=False)
class _TimedConstraint(constraints.TokenConstraint):
    """A constraint that adds the time its masks take (the library's mask and our unpacking) to a clock."""

    clock: _Clock = field(default_factory=_Clock)

    def allowed(self):
        began = time.perf_counter()
        out = super().allowed()
        self.clock.seconds += time.perf_counter() - began
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
    engine = load_engine(args.checkpoint or bundled_model_path(), compile=False)
    grammars = Grammars(engine.tokenizer, engine.spec.vocab_size, tuple(engine.eos_ids))
    schema = {"type": "array", "items": {"type": "boolean"}, "minItems": args.items, "maxItems": args.items}

    began = time.perf_counter()
    compiles = 20
    for _ in range(compiles):
        grammars.constraint(constraints.json_schema_grammar(schema), "bench")
    compile_ms = (time.perf_counter() - began) / compiles * 1e3

    # Tokens a constrained answer takes: the free side decodes as many.
    probe = generate_batch(Scheduler(engine.decoder, max_batch=1), _requests(engine, grammars, 1, "json", 4 * args.items, schema, _Clock()))[0]
    tokens = len(probe.token_ids)

    clock = _Clock()
    print(f"checkpoint {engine.folder}, {args.threads} thread(s); constrained answers: {tokens} tokens "
          f"(an array of {args.items} booleans), free answers: {tokens} tokens; grammar compile {compile_ms:.2f} ms a request")
    print(f"{'batch':>5} {'free tok/s':>11} {'any-text tok/s':>15} {'json tok/s':>11} {'any/free':>9} {'json/free':>10} "
          f"{'mask share (any, json)':>23}  any-text tokens == free")
    for batch in [int(b) for b in args.batch.split(",")]:
        rates: dict[str, list[float]] = {m: [] for m in MODES}
        shares: dict[str, list[float]] = {m: [] for m in MODES}
        same = True
        free_tokens = None
        last: dict[str, list] = {}
        for r in range(args.rounds):
            for mode in MODES[r % 3 :] + MODES[: r % 3]:
                scheduler = Scheduler(engine.decoder, max_batch=batch)
                requests = _requests(engine, grammars, batch, mode, tokens, schema, clock)
                clock.seconds = 0.0
                t0 = time.perf_counter()
                outcomes = generate_batch(scheduler, requests)
                wall = time.perf_counter() - t0
                rates[mode].append(sum(len(o.token_ids) for o in outcomes) / wall)
                shares[mode].append(clock.seconds / wall)
                ids = [o.token_ids for o in outcomes]
                last[mode] = outcomes
                if mode == "free":
                    free_tokens = ids
                elif mode == "any-text":
                    any_tokens = ids
            same = same and any_tokens == free_tokens
        med = {m: statistics.median(rates[m]) for m in MODES}
        share = {m: statistics.median(shares[m]) for m in MODES}
        # Each round's own ratio, then their median: a round's three runs are seconds apart, so the
        # machine's drift between rounds cancels in it.
        ratio = {m: statistics.median(a / f for a, f in zip(rates[m], rates["free"])) for m in MODES}
        print(f"{batch:>5} {med['free']:>11.1f} {med['any-text']:>15.1f} {med['json']:>11.1f} {ratio['any-text']:>9.3f} "
              f"{ratio['json']:>10.3f} {share['any-text']:>11.1%} {share['json']:>10.1%}  {same}")
        for mode in ("free", "json"):  # what the step reads differs with the tokens: why json's rate is its own
            outcomes = last[mode]
            print(f"      {mode}: {len({t for o in outcomes for t in o.token_ids})} distinct tokens in the batch, "
                  f"{statistics.mean(o.usage.experts_touched for o in outcomes):.1f} (layer, expert) pairs touched a request")


if __name__ == "__main__":
    main()
