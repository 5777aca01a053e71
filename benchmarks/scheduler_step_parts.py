"""Where a scheduler's decode step at c = 1 spends its time around the real compiled graph, in process
(no HTTP): timestamps at each layer of the step, the graph's own code included.

benchmarks/step_wrapper_cost.py times the Python around the step with the graph's code stubbed out,
so that Python runs with its objects in cache; here the graph runs for real between two steps, and
on the ~140M model its ~90 MB of weights a token leave that Python running cold, at two to four times
the stubbed cost. The parts, medians over the steps of --rounds requests of --tokens tokens (µs):

  step → decode         Scheduler.step before _decode (release, admit, the first-token wait)
  decode → forward      _decode's inputs (ids, lengths, routing)
  forward → outputs     Decoder.forward_rows and _step before CompiledStep.outputs
  outputs → graph       CompiledStep.outputs before the DirectGraph call (copies, the guards)
  graph → C++           the DirectGraph call up to the generated code's own (its arguments, and
                        AOTAutograd's wrappers unless the graph calls Inductor's code directly)
  C++                   the generated code: Inductor's kernels and moekit's operators
  C++ → graph return    back out through the same layers
  graph → forward end   the outputs handed back, the routing decisions built
  meter                 Scheduler._meter_step
  advance               Scheduler._advance: sampling, each token's callbacks
  the rest              the step's end
Also `outside`, the step less the C++, and with --threads 1 the step thread's CPU time outside it.

  PYTHONPATH=src .venv/bin/python benchmarks/scheduler_step_parts.py bench-out/ckpt/qwen3_moe-150m
  PYTHONPATH=src .venv/bin/python benchmarks/scheduler_step_parts.py bench-out/ckpt/qwen3_moe-150m --threads 1
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from pathlib import Path

import torch
import torch._C._aoti as aoti

import moekit.engine.scheduler as scheduler_module
import moekit.model.compiled_step as compiled_step
import moekit.model.decoder as decoder_module
import moekit.model.direct_graph as direct_graph
from moekit.engine.loader import load_engine
from moekit.engine.router_health import watch_routers
from moekit.engine.sampling import SamplingParams
from moekit.engine.scheduler import Request, Scheduler

PARTS = [("step", "decode", "step → decode"), ("decode", "forward", "decode → forward"),
         ("forward", "outputs", "forward → outputs"), ("outputs", "graph", "outputs → graph"),
         ("graph", "cpp", "graph → C++"), ("cpp", "cpp_end", "C++"), ("cpp_end", "graph_end", "C++ → graph return"),
         ("graph_end", "forward_end", "graph → forward end"), ("meter", "meter_end", "meter"),
         ("advance", "advance_end", "advance"), ("advance_end", "step_end", "the rest")]


class Stamps:
    """perf_counter_ns (and the thread's CPU clock) at named points of the step being timed."""

    def __init__(self):
        self.wall: dict[str, int] = {}
        self.cpu: dict[str, int] = {}

    def __call__(self, name: str) -> None:
        self.wall[name] = time.perf_counter_ns()
        self.cpu[name] = time.thread_time_ns()

    def around(self, owner, attribute: str, before: str, after: str) -> None:
        """Stamp `before` and `after` around owner.attribute (a method or function), in place."""
        inner = getattr(owner, attribute)

        def stamped(*args, **kwargs):
            self(before)
            out = inner(*args, **kwargs)
            self(after)
            return out

        setattr(owner, attribute, stamped)


def stamp_everything(stamps: Stamps, scheduler: Scheduler) -> None:
    """The generated code's call is found by the two torch calls that bracket it in Inductor's caller."""
    take, give = aoti.unsafe_alloc_void_ptrs_from_tensors, aoti.alloc_tensors_by_stealing_from_void_ptrs

    def taken(tensors):
        handles = take(tensors)
        stamps("cpp")
        return handles

    def given(handles):
        stamps("cpp_end")
        return give(handles)

    aoti.unsafe_alloc_void_ptrs_from_tensors, aoti.alloc_tensors_by_stealing_from_void_ptrs = taken, given
    stamps.around(direct_graph.DirectGraph, "__call__", "graph", "graph_end")
    stamps.around(compiled_step.CompiledStep, "outputs", "outputs", "outputs_end")
    stamps.around(decoder_module.Decoder, "forward_rows", "forward", "forward_end")
    stamps.around(scheduler_module.Scheduler, "_meter_step", "meter", "meter_end")
    stamps.around(scheduler_module.Scheduler, "_advance", "advance", "advance_end")
    stamps.around(scheduler_module.Scheduler, "_decode", "decode", "decode_end")
    stamps.around(scheduler, "step", "step", "step_end")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = load_engine(args.checkpoint, dtype=args.dtype)
    if engine.decoder.compiled is None:
        raise SystemExit("the engine did not compile its decode step: nothing to time")
    watch_routers(engine.decoder)  # as a server's steps run: router health on
    engine.decoder.compiled.warm_up((1, 2), rows=16)
    scheduler = Scheduler(engine.decoder, max_batch=16, max_len=args.tokens + 16, bytes_per_param=engine.bytes_per_param,
                          expert_bytes=engine.expert_bytes, dense_saving=engine.dense_saving, store=engine.store,
                          on_step=lambda step: None)
    stamps = Stamps()
    stamp_everything(stamps, scheduler)
    parts, outside, outside_cpu = collections.defaultdict(list), [], []
    for _ in range(args.rounds):
        request = Request(prompt=list(range(3, 11)), max_new_tokens=args.tokens, sampling=SamplingParams(temperature=0.0))
        request.on_token = lambda token: None
        scheduler.submit(request)
        first = True
        while scheduler.step():
            wall, cpu = dict(stamps.wall), dict(stamps.cpu)
            stamps.wall.clear()
            stamps.cpu.clear()
            if first or "cpp_end" not in wall or "meter" not in wall:  # the prefill's step, or the last
                first = False
                continue
            for start, end, name in PARTS:
                parts[name].append(wall[end] - wall[start])
            step = wall["step_end"] - wall["step"]
            outside.append(step - (wall["cpp_end"] - wall["cpp"]))
            outside_cpu.append((cpu["step_end"] - cpu["step"]) - (cpu["cpp_end"] - cpu["cpp"]))
    print(f"{args.checkpoint} {args.dtype}, {args.threads} threads, {len(outside)} decode steps at c = 1; medians, µs")
    for _, _, name in PARTS:
        print(f"  {name:22s} {statistics.median(parts[name]) / 1e3:9.1f}")
    print(f"  {'outside the C++':22s} {statistics.median(outside) / 1e3:9.1f}")
    if args.threads == 1:
        print(f"  {'its CPU time':22s} {statistics.median(outside_cpu) / 1e3:9.1f}")


if __name__ == "__main__":
    main()
