"""Give a dense-loaded Decoder an expert store: budget → slots, manifest + reader, pins, prefetch.

`load_engine(..., offload=OffloadOptions(...))` calls `plan_offload` before building the decoder (a
budget that covers every expert means a plain resident load) and `attach_store` after the dense
weights are in.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moekit.errors import MoekitError
from moekit.model.experts import RoutedExperts
from moekit.model.linear import kernel_for
from moekit.offload.budget import SlotPlan, parse_budget, plan_slots
from moekit.offload.memory import pin_mmap_threshold
from moekit.offload.options import NO_CACHE, OffloadOptions
from moekit.offload.pins import read_pins
from moekit.offload.policies import LIVE_POLICIES, make_policy
from moekit.offload.prefetch import install_prefetch
from moekit.offload.slot_cache import SlotCache, most_pins as pins_allowed
from moekit.offload.store import ExpertStore, LayerStore, StoreClock
from moekit.spec.model_spec import ModelSpec


def expert_shape(spec: ModelSpec) -> tuple[int, int, int]:
    """(rows of gate_up, D, F) of a routed expert; every MoE layer of a family has the same."""
    layer = next(layer for layer in spec.layers if layer.is_moe)
    expert = layer.ffn.expert
    rows = (2 if expert.gated else 1) * expert.width
    return rows, expert.hidden_size, expert.width


def expert_nbytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    """Bytes of one routed expert's weights in memory at `dtype` (biases stay resident, not counted)."""
    rows, d, f = expert_shape(spec)
    return (rows * d + d * f) * torch.empty((), dtype=dtype).element_size()


def moe_layers(spec: ModelSpec) -> list[int]:
    return [i for i, layer in enumerate(spec.layers) if layer.is_moe]


def plan_offload(spec: ModelSpec, dtype: torch.dtype, options: OffloadOptions) -> SlotPlan:
    layers = moe_layers(spec)
    if not layers:
        raise MoekitError(f"{spec.name}: a dense model has no routed experts to offload; drop --expert-memory")
    if options.policy not in (*LIVE_POLICIES, NO_CACHE):
        raise MoekitError(f"unknown cache policy {options.policy!r}; choose one of {', '.join((*LIVE_POLICIES, NO_CACHE))}")
    first = spec.layers[layers[0]].ffn
    each = expert_nbytes(spec, dtype)
    budget = parse_budget(options.expert_memory, each * first.num_experts * len(layers))
    return plan_slots(budget, each, len(layers), first.num_experts, first.router.top_k, text=options.expert_memory)


@dataclass
class _ExpertLoader:
    """Runs on a worker thread: read → the kernel's layout. Kernels are per dtype and shape, the
    same ones RoutedExperts.prepare would have chosen for a resident stack.

    An expert's bytes are checked against the manifest on its first load in this process; later
    reloads of it skip the crc32 (0.23 of a 1.25 ms load for a 1 MB expert, measured)."""

    reader: object  # moekit.offload.reader.ExpertReader
    kernels: tuple
    verified: set = field(default_factory=set)  # (layer, expert) checked once already

    def __call__(self, layer: int, e: int):
        first = (layer, e) not in self.verified
        gate_up, down = self.reader.read(layer, e, verify=first)
        self.verified.add((layer, e))  # only after the check passed
        up_kernel, down_kernel = self.kernels
        return up_kernel.prepare(gate_up), down_kernel.prepare(down)


def attach_store(decoder, folder: Path, plan: SlotPlan, options: OffloadOptions, progress=None) -> ExpertStore:
    """Wire an ExpertStore into every offloaded RoutedExperts of `decoder` (built with offload_experts=True)."""
    from moekit.offload.manifest import load_or_build_manifest
    from moekit.offload.reader import ExpertReader

    spec = decoder.spec
    if decoder.device.type != "cpu":
        raise MoekitError("--expert-memory runs on CPU only in this version (the CUDA tier is not built yet)")
    pin_mmap_threshold()
    manifest = load_or_build_manifest(folder, spec, progress=progress)
    reader = ExpertReader(folder, manifest, decoder.dtype)
    rows, d, f = expert_shape(spec)
    probe_up = torch.empty(rows, d, dtype=decoder.dtype, device=decoder.device)
    probe_down = torch.empty(d, f, dtype=decoder.dtype, device=decoder.device)
    kernels = (kernel_for(probe_up), kernel_for(probe_down))
    load = _ExpertLoader(reader, kernels)

    notes: list[str] = []
    if plan.clamped:
        notes.append("the budget is larger than all routed experts: capped at their total")
    pins = read_pins(options.pin, folder, spec) if options.pin is not None else {}
    most_pins = pins_allowed(plan.slots)
    if any(len(v) > most_pins for v in pins.values()):
        notes.append(f"pins capped at {most_pins} per layer (half of the {plan.slots} slots)")
    retain = options.policy != NO_CACHE
    # One intra-op thread per worker: a fresh thread's OpenMP default (every core) made a 0.2 ms
    # weight reorder take 15-75 ms on a busy machine (barrier waits), measured.
    pool = ThreadPoolExecutor(max_workers=max(1, options.workers), thread_name_prefix="moekit-experts",
                              initializer=torch.set_num_threads, initargs=(1,))
    clock = StoreClock()
    stores: dict[int, LayerStore] = {}
    pinned: dict[int, list[int]] = {}
    for i in moe_layers(spec):
        experts: RoutedExperts = decoder.layers[i].ffn.experts
        experts.kernels = kernels
        layer_pins = pins.get(i, [])[:most_pins] if retain else []
        policy = make_policy("lru" if not retain else options.policy)
        cache = SlotCache(plan.slots, policy, pinned=layer_pins)
        stores[i] = LayerStore(i, cache, load, manifest.experts[(i, 0)].nbytes, pool, clock, retain=retain)
        experts.store = stores[i]
        pinned[i] = list(layer_pins)
    try:
        for store in stores.values():
            store.load_pinned()
    except BaseException:
        pool.shutdown(wait=True)
        raise
    prefetch = options.prefetch and retain
    if prefetch:
        if options.prefetch_extra < 0:
            raise MoekitError(f"--prefetch-extra must be 0 or more, got {options.prefetch_extra}")
        # A guess may fill the slots pins leave; more would evict part of itself.
        free = plan.slots - max((len(v) for v in pinned.values()), default=0)
        install_prefetch(decoder, stores, extra=options.prefetch_extra, limit=max(1, free))
    return ExpertStore(
        layers=stores,
        pool=pool,
        clock=clock,
        expert_bytes=plan.expert_bytes,
        slots=plan.slots,
        policy=options.policy,
        prefetch=prefetch,
        pinned=pinned,
        notes=notes,
    )

