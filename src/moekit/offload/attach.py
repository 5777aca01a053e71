"""Give a dense-loaded Decoder an expert store: budget → slots, manifest + reader, pins, prefetch.

`load_engine(..., offload=OffloadOptions(...))` calls `plan_offload` before building the decoder (a
budget that covers every expert means a plain resident load) and `attach_store` after the dense
weights are in.

What an expert holds once loaded, and the kernel it runs with, follow how it is stored: a float
expert (a checkpoint's, or a packed bf16/fp32 one) is cast to the engine dtype and laid out for
kernel_for, or quantized to q8_0 on load with `quantize` (`--weights int8`: cheap, but the disk
still moves float bytes); a packed Q8_0 / Q4_0 expert is used as read, with the int8 / int4
kernels. A packed file with block-format experts always runs through the store, even when the
budget holds every expert: a plain resident load would read the checkpoint's float experts instead.
MXFP4 / FP8 experts (a checkpoint published so) stay packed: a slot holds an expert's prepared rows
(4.25 / 8.25 bits a weight), run with the kernels the resident load chose for them (the decoder's
RoutedExperts.packed_format); a budget that holds every expert is the resident kept-packed load.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch

from moekit.errors import MoekitError
from moekit import ops
from moekit.model.experts import RoutedExperts
from moekit.model.combinations import Options, check
from moekit.model.expert_forms import Paged
from moekit.model.linear import INT4, int8_kernel_for, kernel_for
from moekit.offload.budget import SlotPlan, parse_budget, plan_slots, split_slots
from moekit.offload.memory import pin_mmap_threshold
from moekit.offload.options import NO_CACHE, OffloadOptions
from moekit.offload.pins import read_pins
from moekit.offload.precision import describe, is_quantized, memory_bytes, stored_kind
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


_FLOAT_NAMES = {torch.float32: ("F32", "fp32"), torch.bfloat16: ("BF16", "bf16"), torch.float16: ("F16", "fp16")}
_KIND_NAMES = {"Q8_0": "int8", "Q4_0": "int4", "MXFP4": "mxfp4", "FP8": "fp8"}


def packed_experts(folder: Optional[Path]):
    """The packed manifest's extents when `folder` is a packed checkpoint, else None."""
    from moekit.weights.manifest import read_manifest

    found = read_manifest(folder) if folder is not None else None
    return found.experts if found is not None and found.source == "packed" else None


def published_extents(folder: Optional[Path], spec: ModelSpec):
    """The checkpoint's own extents when it publishes its experts packed (config.json's
    quantization_config: MXFP4, FP8), which decide each expert's bytes; else None. Headers only."""
    from moekit.weights.extents import expert_extents

    config = folder / "config.json" if folder is not None else None
    if config is None or not config.is_file():
        return None  # a GGUF file, or no checkpoint folder: not a published packed layout
    from moekit.weights.checkpoint import read_config

    if read_config(folder).get("quantization_config") is None:
        return None
    return expert_extents(folder, spec, published=True)


def held_bytes(spec: ModelSpec, dtype: torch.dtype, extents, quantize: bool) -> dict[tuple[int, int], int]:
    """(layer, expert) → bytes it holds once loaded. extents: a packed manifest's or a published
    packed checkpoint's, or None (the checkpoint's float experts, all alike)."""
    if extents is None:
        rows, d, f = expert_shape(spec)
        each = int8_nbytes(rows, d, f) if quantize else expert_nbytes(spec, dtype)
        return {(l, e): each for l in moe_layers(spec) for e in range(spec.layers[l].ffn.num_experts)}
    return {key: memory_bytes(ex, _FLOAT_NAMES[dtype][0], quantize) for key, ex in extents.items()}


def int8_nbytes(rows: int, d: int, f: int) -> int:
    """One expert as q8_0 blocks: gate_up [rows, D] and down [D, F], 34 bytes per 32 inputs."""
    from moekit.offload.precision import weight_bytes

    return weight_bytes("Q8_0", (rows, d)) + weight_bytes("Q8_0", (d, f))


def plan_offload(spec: ModelSpec, dtype: torch.dtype, options: OffloadOptions, folder: Optional[Path] = None,
                 quantize: bool = False, manifest=None) -> SlotPlan:
    """folder: the checkpoint, whose packed experts (if any) decide each expert's bytes; quantize:
    float experts are held as q8_0 (`--weights int8`). manifest: the experts' extents when they are
    not where folder's manifest says (a GGUF's, moekit.weights.gguf_extents): they decide instead."""
    layers = moe_layers(spec)
    if not layers:
        raise MoekitError(f"{spec.name}: a dense model has no routed experts to offload; drop --expert-memory")
    if options.read_ahead < 0:
        raise MoekitError(f"--read-ahead must be 0 or more, got {options.read_ahead}")
    if options.policy not in (*LIVE_POLICIES, NO_CACHE):
        raise MoekitError(f"unknown cache policy {options.policy!r}; choose one of {', '.join((*LIVE_POLICIES, NO_CACHE))}")
    first = spec.layers[layers[0]].ffn
    packed = manifest.experts if manifest is not None else packed_experts(folder)
    sizes = held_bytes(spec, dtype, packed if packed is not None else published_extents(folder, spec), quantize)
    total = sum(sizes.values())
    budget = parse_budget(options.expert_memory, total)
    plan = plan_slots(budget, max(sizes.values()), len(layers), first.num_experts, first.router.top_k,
                      text=options.expert_memory, total_bytes=total)
    if packed is not None and any(is_quantized(stored_kind(ex) or "") for ex in packed.values()):
        # Only the store reads int8/int4 blocks; MXFP4 (a gpt-oss GGUF's) the resident load keeps packed too.
        plan = replace(plan, fully_resident=False)
    return plan


def expert_kernels(kind: Optional[str], probe_up: torch.Tensor, probe_down: torch.Tensor, quantize: bool) -> tuple:
    """(gate_up's, down's) kernel for an expert stored as `kind` (None: a float), chosen as
    RoutedExperts.prepare / quantize_int8 would for a resident stack of this shape and dtype."""
    if kind == "Q4_0":
        return INT4, INT4
    if kind == "Q8_0" or quantize:
        return int8_kernel_for(probe_up, probe_up.dtype), int8_kernel_for(probe_down, probe_down.dtype)
    return kernel_for(probe_up), kernel_for(probe_down)


def packed_formats(decoder, kinds: dict) -> dict:
    """"MXFP4" / "FP8" → the moekit.model.packed_loading.PackedFormat the loader recorded for the
    experts the manifest lists so (every MoE layer of a checkpoint shares one: same shapes, block
    and kernels); one line when the checkpoint did not load them as packed experts."""
    from moekit.weights.manifest import MANIFEST_NAME

    found: dict = {}
    for (layer, e), kind in sorted(kinds.items()):
        if kind not in ("MXFP4", "FP8") or kind in found:
            continue
        fmt = decoder.layers[layer].ffn.experts.packed_format
        if fmt is None or fmt.method.upper() != kind:
            raise MoekitError(f"{MANIFEST_NAME} lists {kind} experts (layer {layer}), which the checkpoint does not "
                              "declare in config.json's quantization_config; delete it and moekit rebuilds it")
        found[kind] = fmt
    return found


@dataclass
class _ExpertLoader:
    """Runs on a worker thread: read → the kernel's layout. Kernels are per dtype and shape, the
    same ones RoutedExperts.prepare would have chosen for a resident stack. A block-format expert
    is already that layout: the bytes read are the weights.

    A float expert whose kernels lay it out as a view (moekit.model.linear.Kernel.layout) is cast
    and laid out in one copy, into `into` when it is given and fits: the weights of an expert the
    store evicted, so a miss allocates nothing (a fresh 1.5 MB expert meant a cast, a transpose
    and their page faults: 1.45 ms of a miss, against 0.6 ms now, measured on the ~140M checkpoint).

    A GGUF's MXFP4 expert is read into `into` itself (its prepared rows are the bytes read, nibbles
    reordered in place: moekit.offload.reader): a 13.2 MB gpt-oss-20b expert read from the page
    cache in a median 32.7 ms into fresh memory (3,228 page faults) and 15.2 ms into a reused buffer,
    measured under load.

    An expert's bytes are checked against the manifest on its first load in this process; later
    reloads of it skip the crc32 (0.23 of a 1.25 ms load for a 1 MB expert, measured)."""

    reader: object  # moekit.offload.reader.ExpertReader
    kinds: dict  # (layer, expert) → stored kind (None: a float)
    kernels: dict  # stored kind → (gate_up's, down's) kernel
    verified: set = field(default_factory=set)  # (layer, expert) checked once already
    verify: bool = True  # False: --no-verify, no expert's crc32 is checked
    # Each thread's read buffer, where an expert is copied out of it at once (a fresh one per
    # read cost 0.2 of a 1.05 ms miss in page faults, measured).
    scratch: threading.local = field(default_factory=threading.local)

    def __call__(self, layer: int, e: int, into: Optional[tuple] = None):
        first = self.verify and (layer, e) not in self.verified
        kind = self.kinds[layer, e]
        kernels = self.kernels[kind]
        in_place = kind is None and all(k.layout is not None for k in kernels)
        scratch = self._scratch() if in_place else None
        if self.reader.extents[layer, e].layout == "gguf_mxfp4":
            scratch = _whole(into)  # never the thread's scratch: the rows it returns are the buffer read into
        gate_up, down = self.reader.read(layer, e, verify=first, cast=not in_place, scratch=scratch)
        self.verified.add((layer, e))  # only after the check passed
        if kind is not None:
            return gate_up, down
        return self.lay_out(gate_up, down, into)

    def lay_out(self, gate_up: torch.Tensor, down: torch.Tensor, into: Optional[tuple] = None):
        """A float expert's Hub tensors → the float kernels' layout (written into `into` where it fits)."""
        kernels = self.kernels[None]
        if not all(k.layout is not None for k in kernels):
            return kernels[0].prepare(gate_up), kernels[1].prepare(down)
        into = into or (None, None)
        dtype = self.reader.dtype
        return _laid_out(kernels[0], gate_up, into[0], dtype), _laid_out(kernels[1], down, into[1], dtype)

    def _scratch(self) -> torch.Tensor:
        buf = getattr(self.scratch, "buf", None)
        if buf is None:
            buf = self.scratch.buf = torch.empty(self.reader.read_size(), dtype=torch.uint8)
        return buf


def _whole(into: Optional[tuple]) -> Optional[torch.Tensor]:
    """The one uint8 buffer an evicted GGUF MXFP4 expert's (gate_up, down) rows are views of, back
    to back (moekit.offload.reader.gguf_mxfp4_rows); None when they are not that."""
    if into is None:
        return None
    gate_up, down = into
    nbytes = gate_up.numel() + down.numel()
    views = all(t.dtype == torch.uint8 and t.is_contiguous() for t in into)
    if not views or down.data_ptr() != gate_up.data_ptr() + gate_up.numel() \
            or down.untyped_storage().data_ptr() != gate_up.untyped_storage().data_ptr():
        return None
    return gate_up.as_strided((nbytes,), (1,))


def mxfp4_slots(extents, layer_slots: dict[int, int]) -> dict[int, list[tuple]]:
    """Memory for each layer's resident GGUF MXFP4 experts (in layers whose experts all are), carved
    from one mapping in huge pages as slot_weights does: per slot the (gate_up, down) rows of one
    expert, views of its own buffer, which a miss reads into once the expert holding it is evicted."""
    from moekit.model.huge_pages import ALIGN, huge_page_arena
    from moekit.offload.reader import gguf_mxfp4_rows

    forms: dict[int, set] = {}  # layer → its experts' (layout, bytes): one of them, or no slots here
    for (layer, _), ex in extents.items():
        forms.setdefault(layer, set()).add((ex.layout, ex.nbytes))
    layers = [i for i in sorted(layer_slots) if len(forms.get(i, ())) == 1 and next(iter(forms[i]))[0] == "gguf_mxfp4"]
    if not layers:
        return {}
    first = {i: extents[i, 0] for i in layers}
    size = {i: -(-first[i].nbytes // ALIGN) * ALIGN for i in layers}
    arena = huge_page_arena(sum(size[i] * layer_slots[i] for i in layers))
    at, out = 0, {}
    for i in layers:
        out[i] = []
        for _ in range(layer_slots[i]):
            out[i].append(gguf_mxfp4_rows(arena[at : at + first[i].nbytes], first[i]))
            at += size[i]
    return out


def slot_weights(kernels: Optional[tuple], probes: tuple, per_layer: list[int]) -> list[list[tuple]]:
    """Memory for each layer's resident float experts, `per_layer[i]` for the i-th: (gate_up, down) in the
    kernels' layouts at the probes' dtype, carved from one mapping in huge pages, so that slots
    lie side by side rather than one allocation each (a store whose slots were separate
    allocations decoded 3-4% slower with every expert resident; the mapping is backed as slots
    fill). Empty when these kernels have no plain layout to write into (oneDNN's, int8's)."""
    if kernels is None or any(k.layout is None for k in kernels) or not per_layer:
        return []
    from moekit.model.huge_pages import ALIGN, huge_page_arena

    shapes = [tuple(k.layout(p).shape) for k, p in zip(kernels, probes)]
    dtype = probes[0].dtype
    sizes = [-(-math.prod(shape) * dtype.itemsize // ALIGN) * ALIGN for shape in shapes]
    arena = huge_page_arena(sum(sizes) * sum(per_layer))
    at, out = 0, []
    for count in per_layer:
        layer = []
        for _ in range(count):
            pair = []
            for shape, size in zip(shapes, sizes):
                pair.append(arena[at : at + size].view(dtype)[: math.prod(shape)].view(shape))
                at += size
            layer.append(tuple(pair))
        out.append(layer)
    return out


def _laid_out(kernel, hub: torch.Tensor, slot: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """A Hub weight (any float dtype) in the kernel's layout at dtype: one copy into slot when it
    is that shape and dtype, else into a fresh tensor."""
    view = kernel.layout(hub)
    if slot is None or slot.shape != view.shape or slot.dtype != dtype or not slot.is_contiguous():
        slot = torch.empty(view.shape, dtype=dtype)
    # A slot made under inference mode (an inline load) may be refilled on a worker, which is not.
    with torch.inference_mode(slot.is_inference()):
        return ops.copy_into(slot, view)


def slots_by_layer(options: OffloadOptions, spec: ModelSpec, plan: SlotPlan) -> dict[int, int]:
    """MoE layer → its slots: the plan's in each (equal), or, with `--expert-split TRACE`, the same
    total split by the hit curves the trace's routing gives each layer (moekit.offload.trace_split)."""
    from moekit.offload.trace_split import hit_curves

    layers = moe_layers(spec)
    if options.split is None or plan.fully_resident:
        return {i: plan.slots for i in layers}
    router = spec.layers[layers[0]].ffn.router
    policy = "lru" if options.policy == NO_CACHE else options.policy
    return split_slots(hit_curves(options.split, layers, router.num_experts, policy), plan.slots, router.top_k)


def attach_store(decoder, folder: Path, plan: SlotPlan, options: OffloadOptions, progress=None,
                 quantize: bool = False, verify: bool = True, manifest=None) -> ExpertStore:
    """Wire an ExpertStore into every offloaded RoutedExperts of `decoder` (built with offload_experts=True).
    quantize: float experts are quantized to q8_0 as they load (`--weights int8`). manifest: where
    the experts are when not in folder's moekit-experts.json (a GGUF's; its files are absolute)."""
    from moekit.weights.manifest import load_or_build_manifest
    from moekit.offload.overlay import ExpertOverlay
    from moekit.offload.reader import ExpertReader
    from moekit.offload.substitute import stand_in_bytes, stand_ins

    spec = decoder.spec
    check(Options(paged=True, device=decoder.device.type))  # the store's device (moekit.model.combinations)
    pin_mmap_threshold()
    given = manifest is not None  # its extents decide each expert's bytes, as a packed manifest's
    manifest = manifest if given else load_or_build_manifest(folder, spec, progress=progress)
    rows, d, f = expert_shape(spec)
    probe_up = torch.empty(rows, d, dtype=decoder.dtype, device=decoder.device)
    probe_down = torch.empty(d, f, dtype=decoder.dtype, device=decoder.device)
    kinds = {key: stored_kind(ex) for key, ex in manifest.experts.items()}
    formats = packed_formats(decoder, kinds)  # MXFP4 / FP8 experts: as the resident load keeps them
    reader = ExpertReader(folder, manifest, decoder.dtype, fp8_block=formats["FP8"].block if "FP8" in formats else None,
                          direct=options.direct_io)
    kernels = {kind: formats[kind].kernels if kind in formats else expert_kernels(kind, probe_up, probe_down, quantize)
               for kind in sorted(set(kinds.values()), key=str)}
    read = _ExpertLoader(reader, kinds, kernels, verify=verify)
    load = ExpertOverlay(read, read.lay_out)  # hot-swapped experts read from their own files
    own = manifest.source == "packed" or given or bool(formats)  # the extents decide each expert's bytes
    sizes = held_bytes(spec, decoder.dtype, manifest.experts if own else None, quantize)
    float_name = "int8" if quantize else _FLOAT_NAMES.get(decoder.dtype, ("", str(decoder.dtype)))[1]
    precision = describe({key: _KIND_NAMES.get(kind, float_name) for key, kind in kinds.items()})

    notes: list[str] = []
    # A conversion is news (--weights int8, a packed file's blocks); experts paged as the checkpoint
    # publishes them (MXFP4, FP8) are not, as a bf16 checkpoint's paged at bf16 are not.
    if quantize or any(kind is not None and kind not in formats for kind in kinds.values()):
        notes.append(f"routed experts paged as {precision}")
    if plan.clamped:
        notes.append("the budget is larger than all routed experts: capped at their total")
    layer_slots = slots_by_layer(options, spec, plan)
    pins = read_pins(options.pin, folder, spec) if options.pin is not None else {}
    if any(len(v) > pins_allowed(layer_slots[i]) for i, v in pins.items() if i in layer_slots):
        fewest = min(layer_slots.values())
        notes.append(f"pins capped at {pins_allowed(fewest)} per layer (half of the {fewest} slots)" if options.split is None
                     else f"pins capped at half of each layer's slots ({pins_allowed(fewest)} where it holds {fewest})")
    retain = options.policy != NO_CACHE
    # One intra-op thread per worker: a fresh thread's OpenMP default (every core) made a 0.2 ms
    # weight reorder take 15-75 ms on a busy machine (barrier waits), measured.
    pool = ThreadPoolExecutor(max_workers=max(1, options.workers), thread_name_prefix="moekit-experts",
                              initializer=torch.set_num_threads, initargs=(1,))
    clock = StoreClock()
    stores: dict[int, LayerStore] = {}
    pinned: dict[int, list[int]] = {}
    slotted = [i for i in moe_layers(spec) if all(kinds[i, e] is None for e in range(spec.layers[i].ffn.num_experts))]
    slots = slot_weights(kernels.get(None), (probe_up, probe_down), [layer_slots[i] for i in slotted])
    packed_slots = mxfp4_slots(manifest.experts, layer_slots)
    substitute_bytes = 0
    for i in moe_layers(spec):
        experts: RoutedExperts = decoder.layers[i].ffn.experts
        width = experts.num_experts
        layer_kinds = [kinds[i, e] for e in range(width)]
        layer_pins = pins.get(i, [])[:pins_allowed(layer_slots[i])] if retain else []
        policy = make_policy("lru" if not retain else options.policy)
        cache = SlotCache(layer_slots[i], policy, pinned=layer_pins)
        disk = [manifest.experts[i, e].nbytes for e in range(width)]
        held = [sizes[i, e] for e in range(width)]
        ins = stand_ins(reader, kinds, i, width, verify) if options.substitute else []
        substitute_bytes += stand_in_bytes(ins)
        layer_slots_memory = slots[slotted.index(i)] if slots and i in slotted else packed_slots.get(i, ())
        stores[i] = LayerStore(i, cache, load, disk, held, pool, clock, retain=retain,
                               slots=layer_slots_memory, stand_ins=ins,
                               read_ahead=options.read_ahead, experts=experts)
        # The paged form: several precisions in one layer run each expert with its own pair of kernels.
        experts.form = Paged(kernels[layer_kinds[0]], store=stores[i], packed=experts.packed_format,
                             expert_kernels=None if len(set(layer_kinds)) == 1 else tuple(kernels[k] for k in layer_kinds))
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
        free = min(layer_slots[i] - len(pinned[i]) for i in stores)
        install_prefetch(decoder, stores, extra=options.prefetch_extra, limit=max(1, free))
    return ExpertStore(
        layers=stores,
        pool=pool,
        clock=clock,
        expert_bytes=plan.expert_bytes,
        slots=plan.slots,
        slots_by_layer=layer_slots if options.split is not None else None,
        policy=options.policy,
        prefetch=prefetch,
        pinned=pinned,
        notes=notes,
        precision=precision,
        budget=plan.budget_bytes,
        substitute=options.substitute or "",
        substitute_bytes=substitute_bytes,
        overlay=load,
    )

