"""The decode step (T = 1) under torch.compile: the compile wrapper of moekit.model.decoder.decode_step.

Why compile it: the eager step is ~2,000 small ops, and on a CPU their fixed cost (dispatch,
allocation, one-row GEMMs that MKL and oneDNN run well below memory speed) is most of a token's
time. The step is written once, on the modules (each one's `decode`, with the products of
moekit.model.step_ops: no data-dependent Python), so the whole of it compiles into one graph of a
few dozen kernels:
  - routing is the shared `route()` (so every family's order of operations is the one the eager
    path and the reference use);
  - the KV cache is the Decoder's own, one tensor for all layers (KVCache.stack, whose views the
    eager layers use), written in place with one index_put_ on it per k / v at each row's slot;
    attention runs over slots 0..end-1 only (end is a dynamic size, not a recompile); in the
    batch-1 graph its products are `contract` (broadcast and sum, fused by Inductor with the mask
    and softmax), in a batch's graph einsum's bmm. One tensor, not one per layer: each input's
    length would be a dynamic size of its own, passed and checked every step.
Dynamo traces and Inductor compiles each graph once; the steps after it call the generated code
directly (moekit.model.direct_graph: the graph's own shape guards, no Dynamo frame that fetches
~80 weights through the modules again each token), ~0.1-0.2 ms less a step on a CPU.
It reads the Decoder's parameters in the Hub layout (the decoder is prepared with
`kernels=False`), so it costs no second copy of the weights, except on a machine with AMX, where
a bf16 decoder's projections and expert stacks are first laid out in tiles (`lay_out_tiles`,
moekit.ops.to_tiles: ~20% faster batch products, ~10% one-row ones, measured), in place of
the Hub layout, and the eager forward reads them through the TILES kernel. The eager forward of
the same decoder (or, for tiles, of a plain one) stays the reference: tests/model/test_compiled_step.py
holds the two to identical greedy tokens and fp32 logits within 1e-4 for every family it runs.

Latent attention (MLA) runs its absorbed form, as the eager decode does; llama4's chunked and NoPE
attention and input-weighed experts, and per-row K (expert-budget tiers: each row's K is one more
input, MoE.decode; a K past the model's is a graph of its own), routing policies (each MoE layer's
policy one opaque op, moekit.model.seated_policy) and router health's entropy (an output of the
graph) run as every other family's step: Decoder.step_routing's StepRouting keys the graphs. int8 weights (q8_0 blocks, `--weights int8` /
`int8-experts`) run through moekit::rows_q8 / experts_q8, the operator the eager int8 kernel calls,
reading the q8_0 stacks in place. MXFP4 / FP8 experts kept packed (gpt-oss's, DeepSeek-V3's published
formats) run through moekit::experts_mxfp4 / experts_fp8, reading the chosen experts' packed rows in
place, each expert's product the eager rows operator's own (mxfp4_gemv / fp8_gemv). The expert store
runs in it as opaque ops (each paged layer's experts, each prefetch guess: moekit.offload.graph_store),
as expert parallelism's exchange does (moekit.dist.graph_exchange), and so do routing policies
(moekit.model.seated_policy). What it does not run: hooks other than the store's (the decoder then
takes its eager step, and `unsupported()` says why).
Batch sizes and cache lengths are dynamic; batch 1 gets its own graph (Dynamo specialises 1).
"""

from __future__ import annotations

import threading
import time
import types
import weakref
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Optional

import torch

from moekit import ops
from moekit.model.combinations import compile_refusal
from moekit.model.compile_cache import DEFAULT_CACHE, compiling_into, start_line, step_key
from moekit.model.decoder import FAMILY, StepRouting, decode_step, step_decisions
from moekit.model.direct_graph import DirectGraph, direct_graph, named_held
from moekit.model.experts import RoutedExperts
from moekit.model.linear import PLAIN, TILES, Linear
from moekit.model.moe import MoE
from moekit.model import saved_graphs
from moekit.model.mixed_step import mixed_step
from moekit.model.prefill_step import prefill_step
from moekit.model.step_ops import (CONSTANT_WHILE_TRACING, _namespace, _widen_batch, grouped, has_attend, has_gemv,
                                   has_latent_attend)
from moekit.ops.torch_private import (assume_constant_result, compile_fx, inductor_options, mark_dynamic,
                                      serializable_compile)

for _fn in CONSTANT_WHILE_TRACING:  # the kernel choices: constants in the graph (step_ops says why here)
    assume_constant_result(_fn)


def lay_out_tiles(decoder) -> None:
    """Where bf16 weights stream faster in tiles here (moekit.ops.tiles_ready: an AMX machine),
    every plain bf16 projection that fits (moekit.model.linear.TILES) and every plain bf16 expert
    stack (RoutedExperts.lay_out_tiles) in that layout, in place of the Hub layout: still one copy.
    The eager forward (prefill, tiers) runs the same operator through the TILES kernel."""
    linears = [m for m in decoder.modules() if isinstance(m, Linear) and m.kernel is PLAIN and ops.tiles_fit(m.weight)]
    stacks = [m for m in decoder.modules() if isinstance(m, RoutedExperts) and m.tiles_fit()]
    if not (linears or stacks) or not ops.tiles_ready():
        return
    for m in linears:
        m.prepare(TILES)
    for m in stacks:
        m.lay_out_tiles()


def unsupported(decoder) -> Optional[str]:
    """Why this decoder's decode step cannot be compiled here, or None when it can: the one
    combination check's answer (moekit.model.combinations)."""
    return compile_refusal(decoder)


@contextmanager
def scratch_steps(decoder) -> Iterator[None]:
    """The steps run inside are scratch ones (the warm-up's, on a scratch cache): every MoE layer's
    experts form is told (ExpertsForm.scratch), so an expert store neither reads nor counts for them."""
    with ExitStack() as forms:
        for block in decoder.layers:
            if isinstance(block.ffn, MoE):
                forms.enter_context(block.ffn.experts.held.scratch())
        yield


def _mark_step(small) -> None:
    """Mark the batch and the visible length of one step's inputs (ids, slot, positions, key_mask
    and each row's K, if given) as dynamic sizes."""
    mark, key_mask = mark_dynamic, small[3]
    if key_mask.shape[0] > 1:  # a size of 1 is always specialised; batch 1 gets its own graph
        for t in small:
            mark(t, 0)
    if key_mask.shape[1] > 1:
        mark(key_mask, 1)


def _mark_prefill(small) -> None:
    """Mark the rows (past 1), the prompt's tokens and the cache length of a prefill's inputs (ids,
    positions [B, T], key_mask [B, S]) as dynamic sizes: one graph for one row, one for several."""
    mark = mark_dynamic
    for t in small:
        if t.shape[0] > 1:
            mark(t, 0)
        mark(t, 1)


def _mark_mixed(small, chunk_stack) -> None:
    """Mark a mixed step's per-call sizes dynamic: the decode rows' (ids, slot, positions, key_mask:
    their batch, past 1, and the visible length, as _mark_step), the chunk's tokens and its cache
    length (chunk_ids, chunk_positions [1, T], chunk_mask [1, P]), and the prompt cache's slots
    (a cache of each prompt's own size)."""
    _mark_step(small[:4])
    for t in small[4:]:
        mark_dynamic(t, 1)
    _mark_held(chunk_stack, ())


# Graphs Dynamo may trace from one decoder's copy of decode_step (or prefill_step) before it stops
# compiling and runs the function eagerly (its recompile_limit, 8 by default, counts per code object):
# batch 1 and larger batches, each StepRouting (per-row Ks, a policy's width, router health) and the
# cache forms make more than 8 on a server with tiers and policies, and the ninth would run eagerly.
GRAPHS_PER_STEP = 64
PREFILL = "prefill"  # the first field of a prefill graph's key (CompiledStep._graphs, saved records' routing)
MIXED = "mixed"  # the first field of a mixed step's key (moekit.model.mixed_step)


class PrefillShape(NamedTuple):
    """A prefill graph to compile ahead (CompiledStep.warm_up). A graph serves every prompt length
    and start, but not every cache: one row (a lone prompt's own cache) or several (a burst of
    prompts prefilled together), and a prompt that fills its cache (the scheduler's prefills: a
    cache of the prompt's size) or leaves room (generate's, a chunk before the last): each of
    those a graph of its own (the graph's shape guards, as a full cache's decode step has its own)."""

    rows: int  # 1, or 2 for every larger count
    full: bool  # the prompt's last token takes the cache's last slot
    # The chunk rides in the running rows' decode step (moekit.model.mixed_step): one graph for
    # every count of rows past 1 and every chunk, on a prompt cache with room (rows 1, full False).
    mixed: bool = False


MIXED_STEP = PrefillShape(1, False, mixed=True)
# A server's prefills (moekit.engine.scheduler): a prompt alone in a cache of its size; a chunk of a
# longer one (its cache keeps a slot spare, so the last chunk too), alone or in a mixed step; a burst
# of prompts prefilled together, left-padded.
SERVED_PREFILLS = (PrefillShape(1, True), PrefillShape(1, False), PrefillShape(2, True), MIXED_STEP)


def served_prefills(max_batch: int, max_len: int, prefill_tokens: int) -> tuple[PrefillShape, ...]:
    """The prefill graphs a server of these settings can run, of SERVED_PREFILLS: several rows only
    where several can be prefilled together (max_batch > 1), and a chunk (1 row, not full) only
    where a prompt can be longer than a step's prefill tokens (the scheduler chunks no other: slots
    per row `max_len` > `prefill_tokens`), in a mixed step only where two rows can run beside the
    prompt being prefilled (max_batch > 2: one running row takes the separate forwards, as a batch
    of 1 is a graph of its own). A graph no prompt takes costs a cold start a compile for nothing
    (~10-20 s on 2 cores); a prompt without its graph would run the modules' forward anyway, with
    the same tokens."""
    return tuple(shape for shape in SERVED_PREFILLS
                 if (shape.rows == 1 or max_batch > 1) and (shape.full or max_len > prefill_tokens)
                 and (not shape.mixed or max_batch > 2))


def shape_name(shape: PrefillShape) -> str:
    """A prefill shape as the progress lines name it: "1 row full", "2 rows full", "1 row", "mixed"."""
    if shape.mixed:
        return "mixed"
    return f"{shape.rows} row{'s' * (shape.rows > 1)}{' full' * shape.full}"


def _mark_held(stack, tables) -> None:
    """Mark the cache's rows and slots and the rope tables' length as dynamic sizes. A mark stays on
    its tensor, so these, which live across steps, are marked once (CompiledStep._held)."""
    mark = mark_dynamic
    for t in tables:
        mark(t, 0)
    if stack.shape[1] > 1:
        mark(stack, 1)
    mark(stack, 2 if stack.dim() == 4 else 3)  # the slots: MLA's [N, B, S, R+Rr], attention's [N, B, Hkv, S, hd]


def trace_constants(cpp_wrapper: bool) -> dict:
    """What a trace of the step reads as constants (step_ops' kernel choices, which operators are
    loaded) and the Inductor option that changes the generated code: a saved graph is used only
    under the same (moekit.model.saved_graphs)."""
    values = {"cpp_wrapper": cpp_wrapper, "gemv": has_gemv(), "attend": has_attend(),
              "latent_attend": has_latent_attend()}
    for kind in ops.KINDS:
        values.update({f"namespace:{kind}": _namespace(kind), f"grouped:{kind}": grouped(kind),
                       f"widen:{kind}": _widen_batch(kind)})
    return values


def top_k_of(inputs: tuple) -> Optional[torch.Tensor]:
    """The per-row K among a step's per-call inputs (CompiledStep.__call__'s order), or None."""
    return inputs[7] if len(inputs) > 7 else None


class _Recorder:
    """The step's Dynamo backend: Inductor, as torch.compile's default, with each graph handed to the
    step to record. It holds the step weakly: Dynamo keeps every backend it was given for the life of
    the process (torch._dynamo.eval_frame.cached_backends), and the step holds its decoder's weights."""

    def __init__(self, step: "CompiledStep", inductor: dict):
        self._step = weakref.ref(step)
        self._inductor = inductor

    def __call__(self, gm, example_inputs):
        step = self._step()
        folder = step.cache_folder if step is not None else None
        if folder is None:
            run = compile_fx(gm, example_inputs, config_patches=self._inductor)
        else:  # serialisable, for moekit.model.saved_graphs
            with compiling_into(folder), serializable_compile():
                run = compile_fx(gm, example_inputs, config_patches=self._inductor)
        if step is not None:
            step._record(gm, example_inputs, run)
        return run


@dataclass
class StepResult:
    logits: torch.Tensor  # [B, 1, V] fp32
    chosen: torch.Tensor  # [L_moe, B, K] the experts each MoE layer chose
    weights: torch.Tensor  # [L_moe, B, K] their weights
    moe_layers: list  # the decoder's index of each MoE layer
    entropy: Optional[torch.Tensor] = None  # [L_moe, B] routing entropy, where the step was asked for it

    @property
    def decisions(self) -> list:
        """(layer index, RoutingDecision) per MoE layer; built only when a caller asks (the metered
        runs), so an unmetered step pays nothing for it."""
        return step_decisions(self.moe_layers, self.chosen, self.weights, self.entropy)


class CompiledStep:
    """The decoder's T = 1 step, compiled once per process (Inductor's cache makes later processes
    quicker: it keeps the generated code on disk). Call it where Decoder.forward would run T = 1."""

    def __init__(self, decoder, cpp_wrapper: bool = True, cache: Optional[Path] = DEFAULT_CACHE):
        """cpp_wrapper: Inductor writes the code that calls the step's ~80 kernels in C++ instead of
        Python: +25% tokens/s on the ~140M qwen3_moe at 2 threads (measured), for a longer first
        compile (~35 s instead of ~8 s there). The kernels, and so the results, are the same.
        cache: the folder under which each model's compiled graphs are kept between processes
        (moekit.model.compile_cache; its key names the subfolder); None: torch's default."""
        reason = unsupported(decoder)
        if reason is not None:
            raise ValueError(f"cannot compile the decode step: {reason}")
        self.decoder = decoder
        lay_out_tiles(decoder)  # an AMX machine's bf16 weights, once, before tracing reads their kernels
        self.moe_layers = [i for i, block in enumerate(decoder.layers) if isinstance(block.ffn, MoE)]
        self._tables = None  # (the rope's cos table it was copied from, cos, sin_signed)
        self._marked = None  # a weak reference to the cache stack last marked (_held)
        # Sizes that change from call to call are marked dynamic (_mark_step, _mark_held): one graph
        # for batch 1, one for larger batches, whatever the cache length. Everything else (weights, heads, widths)
        # stays static, which is what lets Inductor vectorise the products.
        # Dynamo keeps its graphs, and its limit of 8 recompiles, per code object: a copy of decode_step's
        # code for each decoder keeps one model's graphs from counting against another's.
        own = types.FunctionType(decode_step.__code__.replace(), decode_step.__globals__, decode_step.__name__,
                                 decode_step.__defaults__)
        # Guards on the decoder's modules are skipped (tensor inputs keep theirs): checking ~100
        # parameters' modules on every call cost ~0.7 ms a step here, and nothing replaces a module or
        # a parameter of a compiled decoder (a hot swap writes into the expert stacks in place).
        self._inductor = {"cpp_wrapper": cpp_wrapper}
        if has_gemv():
            # Inductor checks each vector ISA this CPU lists by building and loading a test library in a
            # child Python (~0.85 s a process here, measured: half of loading a saved graph). Where moekit's
            # own -march=native operators loaded, this machine's compiler and OS already build and run
            # them, so the CPU's flags are taken as they are.
            self._inductor["cpp.vec_isa_ok"] = True
        if cpp_wrapper:  # the C++ calls the operators' C entry points, not the boxed dispatcher
            self._inductor["aot_inductor.custom_ops_to_c_shims"] = ops.c_shims()
        # Inductor compiles each graph through _Recorder, which hands it to _record to keep how to call it
        # again without Dynamo (moekit.model.direct_graph): later steps whose inputs pass a recorded
        # graph's guards call it directly, the rest go through Dynamo.
        self.cache_folder = None if cache is None else cache / step_key(decoder, self._inductor)
        # Per StepRouting (the step's constants, which direct graphs' guards do not see), its graphs; a
        # prefill's under (PREFILL, *its StepRouting).
        self._graphs: dict[tuple, list[DirectGraph]] = {}
        self._tracing: Optional[tuple] = None  # (the per-call inputs, the key, the outputs) of the call Dynamo may be compiling
        self.direct_steps = 0  # steps that called a recorded graph directly (the rest went through Dynamo)
        # One compile or load at a time, and the graph it records is the one its inputs asked for (_tracing):
        # a server compiles its prefill graphs on a thread of its own while its steps run (warm_up_prefills).
        self._compiling = threading.Lock()
        self._scratch = threading.local()  # .on: this thread runs scratch steps (_scratch_steps)
        # Graphs an earlier process compiled under the same constants (moekit.model.saved_graphs): a
        # step whose inputs one of them accepts loads it instead of tracing (loaded ones move to _graphs).
        self._load_options = {k: v for k, v in self._inductor.items() if k == "cpp.vec_isa_ok"}
        # trace_constants also makes each kind's kernel choice now (measured once per machine), not while
        # Dynamo traces; the operators are the command's to load (moekit.ops.load), where not, the reductions.
        self._constants = saved_graphs.step_constants({**trace_constants(cpp_wrapper), **self._load_options}, decoder)
        self._saved = saved_graphs.saved(self.cache_folder, self._constants)
        self.loaded_graphs = 0  # graphs loaded from the cache folder rather than traced
        # Whether prompts are prefilled by a graph (moekit.model.prefill_step) where one is ready, which
        # warm_up and warm_up_prefills turn on: a server's many prompts repay its compile or load; one
        # `moekit run` prompt, prefilled eagerly in tens of ms, does not (its start-up target: 5 s).
        # Decoder.forward never compiles one for a prompt: a shape without its graph runs the modules' forward.
        self.prefills = False
        options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        self._fn = torch.compile(own, backend=_Recorder(self, self._inductor), fullgraph=True, dynamic=False, options=options)
        own = types.FunctionType(prefill_step.__code__.replace(), prefill_step.__globals__, prefill_step.__name__,
                                 prefill_step.__defaults__)
        # A prefill's graph calls its kernels from Python: its ~0.2 ms of calls is little of a prompt's
        # milliseconds, and its compile a quarter of the C++ caller's (a server's start-up compiles three).
        prefill_inductor = {k: v for k, v in self._inductor.items() if k != "aot_inductor.custom_ops_to_c_shims"}
        self._prefill_fn = torch.compile(own, backend=_Recorder(self, {**prefill_inductor, "cpp_wrapper": False}),
                                         fullgraph=True, dynamic=False, options=options)
        # The mixed step (moekit.model.mixed_step) likewise: its ~0.2 ms of Python calls is little of a
        # step that carries a chunk of tens of ms.
        own = types.FunctionType(mixed_step.__code__.replace(), mixed_step.__globals__, mixed_step.__name__,
                                 mixed_step.__defaults__)
        self._mixed_fn = torch.compile(own, backend=_Recorder(self, {**prefill_inductor, "cpp_wrapper": False}),
                                       fullgraph=True, dynamic=False, options=options)

    @property
    def graphs(self) -> list[DirectGraph]:
        """Every graph recorded so far, of every StepRouting."""
        return [g for graphs in list(self._graphs.values()) for g in graphs]

    def _record(self, gm, example_inputs, run) -> None:
        """Keep how to call `run` (just compiled from gm) without Dynamo, where that can be done."""
        if self._tracing is not None:
            inputs, key, outputs = self._tracing
            named = named_held(self.decoder)
            graph = direct_graph(gm, example_inputs, run, inputs, {id(t): t for t in named.values()}, outputs=outputs)
            if graph is not None:
                self._graphs.setdefault(key, []).append(graph)
                if self.cache_folder is not None and not saved_graphs.keeps_process_objects(gm):
                    self._save(graph, key, named)

    def _save(self, graph: DirectGraph, routing: tuple, named: dict) -> None:
        """Keep graph for later processes. A cache that cannot be written costs only their start-up,
        so nothing here stops the step (a full disk, a read-only home, a graph torch cannot serialise)."""
        try:
            saved_graphs.save(self.cache_folder, graph, tuple(routing), self._constants,
                              {id(t): name for name, t in named.items()})
        except Exception:  # noqa: BLE001 — see the docstring
            pass

    def _load_saved(self, inputs: tuple, routing: tuple) -> Optional[DirectGraph]:
        """A graph an earlier process saved that accepts inputs, loaded, or None. A record that fails
        to load is dropped for this process, and the step traces instead."""
        named = None
        for record in [r for r in self._saved if r.routing == tuple(routing) and r.accepts(inputs)]:
            self._saved.remove(record)
            named = named_held(self.decoder) if named is None else named
            try:
                with compiling_into(self.cache_folder), inductor_options(self._load_options):
                    graph = saved_graphs.load(record, named)
            except Exception:  # noqa: BLE001 — a stale or damaged cache entry: trace instead
                graph = None
            if graph is not None:
                self._graphs.setdefault(routing, []).append(graph)
                self.loaded_graphs += 1
                return graph
        return None

    def __call__(self, ids, cache, slot, positions, key_mask, top_k=None, routing: StepRouting = FAMILY) -> StepResult:
        """ids [B, 1]; slot, positions [B] int64: where each row's token goes and its RoPE position
        (never past the slot, so below cache.max_len); key_mask [B, S] bool, False at padding (S =
        the last slot written + 1); top_k: None, or each row's K [B] int64 (1..the model's K, or
        routing.width), a graph of its own; routing: the step's constants (Decoder.step_routing), a
        graph each (a seated policy is the decoder's, held for this call: Decoder._step). The cache
        must be stacked (KVCache.stack; Decoder.new_cache's are)."""
        logits, chosen, weights, entropy = self.outputs(ids, cache, slot, positions, key_mask, top_k, routing)
        return StepResult(logits[:, None, :], chosen, weights, self.moe_layers, entropy)

    def outputs(self, ids, cache, slot, positions, key_mask, top_k=None, routing: StepRouting = FAMILY) -> tuple:
        """The step as __call__ takes it → its outputs as they are: (logits [B, V] fp32, chosen
        [L_moe, B, K], weights [L_moe, B, K], entropy [L_moe, B] or None). What Decoder._step calls
        on every token, so it builds nothing a token does not need (no StepResult, no view of the logits)."""
        if cache.stack is None:
            raise ValueError("the compiled step needs a stacked cache (Decoder.new_cache makes one)")
        # Dynamo guards on whether a tensor was made under inference mode: the small per-step inputs
        # and the rope tables are made so here, whoever the caller is, so one graph serves them all
        # (the caches are always normal tensors: Decoder.new_cache makes them outside it). generate and
        # the scheduler step under inference mode already: entering it again would cost ~1 µs a step.
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return self.outputs(ids, cache, slot, positions, key_mask, top_k, routing)
        tables = self._held(cache.stack, self.decoder.rope)  # its tables cover the cache: Decoder.new_cache reserved them
        # Fresh tensors: inference ones, and none of them another's (forward_rows passes one tensor as slot and positions).
        small = (ids[:, 0].clone(), slot.clone(), positions.clone(), key_mask.clone())  # ids [B]
        if top_k is not None:
            small += (top_k.clone(),)
        inputs = (*small[:4], cache.stack, *tables, *small[4:])
        outputs = self._run(routing, inputs, small, _mark_step, 4 if routing.entropy else 3,
                            lambda: self._fn(self.decoder, *inputs[:7], top_k_of(inputs), routing))
        return outputs[0], outputs[1], outputs[2], outputs[3] if routing.entropy else None

    def prefill(self, ids, cache, positions, key_mask, routing: StepRouting = FAMILY,
                trace: bool = True) -> Optional[StepResult]:
        """A prompt's T > 1 tokens a row as one compiled graph (moekit.model.prefill_step): ids,
        positions [B, T] int64; key_mask [B, S] bool, S = the slots written before + T (False at
        left padding); writes slots S-T..S-1 of the stacked cache's first B rows. → StepResult with
        each row's last token's logits [B, 1, V] and decisions over the B*T tokens (row-major).
        routing: FAMILY, or with entropy (router health); a graph each. trace: False → None, the
        cache untouched, where no graph recorded in this process takes these inputs (a prompt then
        runs the modules' forward rather than wait for a compile: Decoder.forward)."""
        if cache.stack is None:
            raise ValueError("the compiled prefill needs a stacked cache (Decoder.new_cache makes one)")
        with torch.inference_mode():
            tables = self._held(cache.stack, self.decoder.rope)
            # Fresh, in the standard layout: a view's clone keeps its strides (a row of a wider tensor),
            # which the graph's shape guards check.
            small = tuple(t.clone(memory_format=torch.contiguous_format) for t in (ids, positions, key_mask))
            inputs = (*small, cache.stack, *tables)
            key = (PREFILL, *routing)
            run = self._run(key, inputs, small, _mark_prefill, 4 if routing.entropy else 3,
                            (lambda: self._prefill_fn(self.decoder, *inputs, routing)) if trace else None)
            if run is None:
                return None
            logits, chosen, weights, *entropy = run
        return StepResult(logits[:, None, :], chosen, weights, self.moe_layers, entropy[0] if entropy else None)

    @property
    def mixes(self) -> bool:
        """Whether a mixed step's graph is ready (warm_up compiled or loaded it): steps run it from then."""
        return any(key[0] == MIXED and graphs for key, graphs in list(self._graphs.items()))

    def mixed(self, ids, cache, slot, positions, key_mask, chunk_ids, chunk_cache, chunk_positions,
              routing: StepRouting = FAMILY, trace: bool = False) -> Optional[tuple]:
        """The running rows' decode step and one chunk of a prompt as one graph (moekit.model.mixed_step):
        ids [B, 1], slot, positions [B], key_mask [B, S] as __call__ takes them (B > 1), on cache;
        chunk_ids, chunk_positions [1, T] (T > 1), the chunk's tokens after the chunk_cache.length
        slots its prompt's cache (one row, a slot past the prompt spare) holds. → (logits [B + 1, V]
        fp32, chosen [L_moe, B + T, K], weights, entropy or None), both caches written; or None, both
        untouched, where no graph recorded or saved takes these inputs (trace: compile one now,
        what warm_up does: a request never waits for a compile, its step runs the separate forwards)."""
        if cache.stack is None or chunk_cache.stack is None:
            raise ValueError("the mixed step needs stacked caches (Decoder.new_cache makes them)")
        end = chunk_cache.length + chunk_ids.shape[1]
        if end >= chunk_cache.max_len:
            raise ValueError(f"the prompt's cache must keep a slot spare: {end} of {chunk_cache.max_len} asked")
        with torch.inference_mode():
            tables = self._held(cache.stack, self.decoder.rope)
            # Fresh tensors in the standard layout (prefill says why).
            small = tuple(t.clone(memory_format=torch.contiguous_format)
                          for t in (ids[:, 0], slot, positions, key_mask, chunk_ids, chunk_positions,
                                    chunk_cache.key_mask[:, :end]))
            inputs = (*small, cache.stack, chunk_cache.stack, *tables)
            key = (MIXED, *routing)
            run = self._run(key, inputs, small, lambda marked: _mark_mixed(marked, chunk_cache.stack),
                            4 if routing.entropy else 3,
                            (lambda: self._mixed_fn(self.decoder, *inputs, routing)) if trace else None)
        if run is None:
            return None
        logits, chosen, weights, *entropy = run
        return logits, chosen, weights, entropy[0] if entropy else None

    def _recorded(self, key, inputs: tuple) -> Optional[DirectGraph]:
        """The graph of `key` recorded in this process that accepts inputs (moved first: the graph of
        the last call is tried first), or None."""
        graphs = self._graphs.get(key)
        if not graphs or graphs[0].accepts(inputs):  # the last call's graph: most steps'
            return graphs[0] if graphs else None
        graph = next((g for g in graphs[1:] if g.accepts(inputs)), None)
        if graph is not None:
            graphs.remove(graph)
            graphs.insert(0, graph)
        return graph

    def _run(self, key, inputs: tuple, small: tuple, mark: Callable, outputs: int,
             trace: Optional[Callable]) -> Optional[list]:
        """The results of the graph of `key` (a StepRouting, or a prefill's key) that accepts inputs:
        recorded in this process, saved by an earlier one, or else traced now (trace(), through Dynamo,
        after mark(small) marks the per-call sizes dynamic). trace None: only a recorded graph, else None."""
        graph = self._recorded(key, inputs)
        if graph is None and trace is None:
            return None
        if graph is None:
            with self._compiling:  # another thread may have just recorded it
                graph = self._recorded(key, inputs) or (self._load_saved(inputs, key) if self._saved else None)
                if graph is None:
                    mark(small)
                    self._tracing = (inputs, key, outputs)
                    try:
                        with torch._dynamo.config.patch(recompile_limit=GRAPHS_PER_STEP):
                            results = list(trace())
                    finally:
                        self._tracing = None
                    recorded = self._recorded(key, inputs) if self._scratch_here() else None
                    if recorded is not None:
                        recorded.confirm(inputs)  # a scratch step: running it again changes nothing
                    return results
        self.direct_steps += 1
        if not graph.confirmed and self._scratch_here():
            return graph.confirm(inputs)
        return graph(inputs)

    def _scratch_here(self) -> bool:
        """Whether this thread is running scratch steps (warm_up's, _warm_prefill's), which a graph may
        run twice (DirectGraph.confirm); a served step never is, so a graph first met there keeps
        AOTAutograd's wrappers."""
        return getattr(self._scratch, "on", False)

    @contextmanager
    def _scratch_steps(self) -> Iterator[None]:
        """The steps this thread runs inside are scratch ones (see _scratch_here)."""
        before = self._scratch_here()
        self._scratch.on = True
        try:
            yield
        finally:
            self._scratch.on = before

    def _held(self, stack, rope) -> tuple:
        """The rope tables, and the stack and tables marked dynamic once each (marking them on every
        step cost ~0.1 ms, measured)."""
        if self._tables is None or self._tables[0] is not rope.cos_table:
            self._tables = (rope.cos_table, rope.cos_table.clone(), rope.sin_signed_table.clone())
            self._marked = None
        if self._marked is None or self._marked() is not stack:
            _mark_held(stack, self._tables[1:])
            self._marked = weakref.ref(stack)
        return self._tables[1:]

    def warm_up(self, batches: tuple[int, ...] = (1, 2), per_row_k: bool = False,
                say: Optional[Callable[[str], None]] = None, prefills: tuple[PrefillShape, ...] = (),
                rows: Optional[int] = None) -> float:
        """Compile the graphs now, on a scratch cache (batch 1, and 2 for every larger batch), so
        that no request waits for a compile and no timing includes one. per_row_k: the graphs of
        steps with each row's K (expert-budget tiers) too. prefills: the prefill graphs' shapes
        (PrefillShape), compiled here too (a server compiles them after it answers: warm_up_prefills);
        prompts are prefilled by a graph from then on where one is ready. say: told what it is doing,
        before (a line ending in "...") and after (each graph's time, then the whole's). Returns the
        seconds it took. The graphs carry routing entropy where the decoder's routers are watched now
        (router health). rows: the rows of the cache the steps will run on (a server's max batch: a
        lone request's batch-1 step reads a cache of that many rows, which a graph traced on one row
        does not take); None: each batch's own (generate's)."""
        device = self.decoder.device
        routing = StepRouting(entropy=self.decoder.entropy_watched)
        if say is not None:
            say(start_line(self.cache_folder, batches, prefills))
        start = time.perf_counter()
        each = []  # (what, seconds) per graph, for the user: where a cold start's time goes
        with torch.inference_mode(), scratch_steps(self.decoder), self._scratch_steps():
            for b in batches:
                began = time.perf_counter()
                for top_k in (None, torch.ones(b, dtype=torch.int64, device=device))[: 2 if per_row_k else 1]:
                    # More rows than any batch, and than 1 (a size Dynamo specialises): one graph for every row count.
                    cache = self.decoder.new_cache(b if rows is None or rows == 1 else max(3, b + 1), 4)
                    slot = torch.ones(b, dtype=torch.int64, device=device)
                    self(torch.zeros(b, 1, dtype=torch.int64, device=device), cache, slot, slot, cache.key_mask[:b, :2], top_k,
                         routing)
                each.append((f"batch {b}", time.perf_counter() - began))
            self.prefills = self.prefills or bool(prefills)
            for shape in prefills:
                each.append((f"prefill {shape_name(shape)}", self._warm_prefill(shape, routing)))
        seconds = time.perf_counter() - start
        if say is not None:
            say(" " + "".join(f"{what} {s:.1f} s, " for what, s in each) + f"in all {seconds:.1f} s")
        return seconds

    def _warm_prefill(self, shape: PrefillShape, routing: StepRouting) -> float:
        """Compile (or load) the prefill graph of shape, on a scratch cache. → its seconds."""
        device = self.decoder.device
        began = time.perf_counter()
        if shape.mixed:
            with torch.inference_mode(), self._scratch_steps():
                # Every dynamic size apart from the others (as below): 2 rows of a 4-row cache at slots 4
                # and 5 of 11, a 3-token chunk at slots 4..6 of a prompt cache of 8.
                cache, chunk_cache = self.decoder.new_cache(4, 11), self.decoder.new_cache(1, 8)
                chunk_cache.length = 4
                slot = torch.arange(4, 6, device=device)
                ids = torch.zeros(3, dtype=torch.int64, device=device)
                self.mixed(ids[:2, None], cache, slot, slot, cache.key_mask[:2, :6], ids[None], chunk_cache,
                           torch.arange(4, 7, device=device)[None], routing, trace=True)
            return time.perf_counter() - began
        with torch.inference_mode(), self._scratch_steps():
            # Sizes that differ from each other (3 tokens after 2; one row more than prefilled,
            # past one), so that the trace ties none of them to another (Dynamo's duck sizing).
            b = shape.rows
            cache = self.decoder.new_cache(b if b == 1 else b + 1, 5 if shape.full else 7)
            positions = torch.arange(2, 5, device=device).expand(b, 3)
            self.prefill(torch.zeros(b, 3, dtype=torch.int64, device=device), cache, positions, cache.key_mask[:b, :5],
                         routing)
        return time.perf_counter() - began

    def warm_up_prefills(self, shapes: tuple[PrefillShape, ...], say: Optional[Callable[[str], None]] = None,
                         stop: Optional[threading.Event] = None) -> None:
        """Compile (or load) the prefill graphs of shapes one at a time, while the decoder serves
        (a server runs this on a thread of its own once it answers): until a shape's graph is ready,
        its prompts run the modules' forward (Decoder.forward), which gives the same tokens. Only for
        a decoder whose prompts the prefill form takes (moekit.model.prefill_step.takes: no expert
        store, whose scratch steps warm_up keeps apart). say: told a whole line per graph (another
        thread prints too); a graph that fails is named with why, its prompts keep the forward.
        stop: set, no further graph is begun (the server is stopping)."""
        if not shapes:
            return
        routing = StepRouting(entropy=self.decoder.entropy_watched)
        self.prefills = True
        if say is not None:
            saved = any(r.routing[:1] == (PREFILL,) for r in self._saved)
            say(f"{'loading' if saved else 'compiling'} the prefill graphs "
                f"({', '.join(map(shape_name, shapes))}) one at a time; until each is ready its prompts run eagerly")
        for shape in shapes:
            if stop is not None and stop.is_set():
                return
            loaded = self.loaded_graphs
            try:
                seconds = self._warm_prefill(shape, routing)
            except Exception as err:  # noqa: BLE001 — its prompts keep the modules' forward; the server goes on
                if say is not None:
                    say(f"prefill graph ({shape_name(shape)}) not compiled: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
                continue
            if say is not None:
                done = "loaded" if self.loaded_graphs > loaded else "compiled"
                say(f"prefill graph ({shape_name(shape)}) {done} in {seconds:.1f} s; its prompts run it from now")
