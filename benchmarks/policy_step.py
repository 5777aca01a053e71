"""Decode tokens/s of a server's step with router health on, with and without a routing policy:
the eager step against the compiled one (routing policies run inside the step since issue 34
item 4, as one opaque op per MoE layer; router entropy comes from the step's own logits).

Both engines serve through the scheduler `moekit serve` runs (continuous batching, routers watched
as the server watches them), greedy, B requests of --tokens new tokens each, admitted together.
Rounds alternate eager and compiled; each side's figure is the median over --rounds of decode
tokens / (last token's time − first token's time), and the ratio is compiled over eager in the
same run. Compiling happens in an untimed first round.

  .venv/bin/python benchmarks/policy_step.py bench-out/ckpt/qwen3_moe-150m --policies none,adaptive:0.85 --batch 1,4
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from moekit.engine.loader import load_engine
from moekit.engine.router_health import watch_routers
from moekit.engine.scheduler import Request, Scheduler, generate_batch
from moekit.model.routing import parse_policy


def decode_tok_s(decoder, policy, batch: int, tokens: int, prompt_len: int) -> float:
    scheduler = Scheduler(decoder, max_batch=batch, max_len=prompt_len + tokens + 1)
    vocab = decoder.spec.vocab_size
    prompts = [[1 + (37 * r + 11 * t) % (vocab - 1) for t in range(prompt_len)] for r in range(batch)]
    outcomes = generate_batch(scheduler, [Request(prompt=p, max_new_tokens=tokens, stop_ids=(), routing=policy)
                                          for p in prompts])
    decoded = sum(len(o.token_ids) - 1 for o in outcomes)
    return decoded / (max(o.finished_at for o in outcomes) - min(o.first_token_at for o in outcomes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--policies", default="none,adaptive:0.85", help="'none': router health only")
    parser.add_argument("--batch", default="1,4")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    eager = load_engine(args.checkpoint, compile=False)
    compiled = load_engine(args.checkpoint, compile=True)
    if compiled.decoder.compiled is None:
        raise SystemExit(f"the compiled engine stayed eager: {compiled.notes}")
    k = max(b.ffn.router.spec.top_k for b in eager.decoder.layers if hasattr(b.ffn, "router"))
    experts = min(b.ffn.router.spec.num_experts for b in eager.decoder.layers if hasattr(b.ffn, "router"))
    sides = {"eager": eager.decoder, "compiled": compiled.decoder}
    for decoder in sides.values():
        watch_routers(decoder)  # as `moekit serve` does, before the compiled step warms up
    compiled.decoder.compiled.warm_up((1, 2))
    print(f"{args.checkpoint.name}: K = {k} of E = {experts}, {args.threads} threads, {args.tokens} tokens a row, "
          f"router health on; medians of {args.rounds} alternating rounds")
    print("| policy | batch | eager tok/s | compiled tok/s | compiled / eager |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for text in args.policies.split(","):
            policy = None if text == "none" else parse_policy(text, k, experts)
            for batch in (int(b) for b in args.batch.split(",")):
                for decoder in sides.values():  # untimed: compiles this width's and batch's graph
                    decode_tok_s(decoder, policy, batch, 4, args.prompt_len)
                figures: dict[str, list[float]] = {name: [] for name in sides}
                for _ in range(args.rounds):
                    for name, decoder in sides.items():
                        figures[name].append(decode_tok_s(decoder, policy, batch, args.tokens, args.prompt_len))
                e, c = (statistics.median(figures[name]) for name in ("eager", "compiled"))
                print(f"| {text} | {batch} | {e:.1f} | {c:.1f} | {c / e:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
