"""A resident model's weights in transparent huge pages (Linux).

Why: a decode step streams every weight it uses from memory once, ~140 MB a step on the ~140M
benchmark shapes: ~35,000 pages of 4 KB a step, or ~70 of 2 MB, and so far fewer TLB misses. On this
project's benchmark machine (THP set to `madvise`, so that ordinary allocations get 4 KB pages) the
compiled step ran 2–4% faster with its weights in huge pages (same process, alternating, measured
in docs/BENCHMARKS.md). llama.cpp gets the same effect from mapping its GGUF file.

How: each weight storage is copied into one anonymous mapping advised MADV_HUGEPAGE, and every
tensor that used it (parameters, buffers, and tensors a module holds as attributes, such as the
q8_0 expert stacks) is re-pointed in place (`Tensor.set_`) at the same offset and strides, so that
views of one storage stay views of one storage (a hot-swapped expert still reaches every reader).
A storage that something outside the modules also holds is left where it is: moving it would split
that alias. Nothing is copied twice: each old storage is freed as soon as its tensors have moved.
The cost is one copy of the weights at load (2.04 GB took 5.1 s here, on a busy machine). Where the
platform has no MADV_HUGEPAGE nothing moves; where THP is off the weights move but keep 4 KB pages.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from typing import Optional

import torch

from moekit.model.expert_forms import ExpertsForm, Paged
from moekit.ops.torch_private import storage_use_count

HUGE_PAGE = 2 << 20
MIN_BYTES = 64 << 10  # smaller storages stay put: they sit in a few pages either way
ALIGN = 64  # a cache line, and a multiple of every element size


@dataclass
class Moved:
    storages: int = 0
    bytes: int = 0
    kept: list[str] = field(default_factory=list)  # why a storage stayed where it was


def supported() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE")


def module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every distinct tensor object the module tree holds: parameters, buffers, and tensors kept as
    plain attributes, alone or in (nested) tuples and lists, or in a resident ExpertsForm (its
    per-expert views and stacks: RoutedExperts.form), and the bases of the views among them."""
    seen, out = set(), []
    for m in module.modules():
        found = list(m._parameters.values()) + list(m._buffers.values())
        found += [v for k, v in vars(m).items() if k not in ("_parameters", "_buffers", "_modules")]
        while found:
            t = found.pop()
            if isinstance(t, (tuple, list)):
                found.extend(t)
            elif isinstance(t, ExpertsForm) and not isinstance(t, Paged):  # a store's tensors are its own
                found.extend((t.gate_up, t.down, getattr(t, "stacks", ())))
            # oneDNN's packed weights (its bf16 kernel, where it measures fastest) have an opaque
            # layout with no storage to move: they stay in oneDNN's own allocation.
            elif isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
                if t._base is not None:  # a view keeps its base alive, and the base its storage
                    found.append(t._base)
    return out


def by_storage(tensors: list[torch.Tensor]) -> dict[int, list[torch.Tensor]]:
    """The tensors grouped by the storage they view (keyed by its address), large storages only."""
    groups: dict[int, list[torch.Tensor]] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() >= MIN_BYTES:
            groups.setdefault(storage.data_ptr(), []).append(t)
    return groups


def _repoint(t: torch.Tensor, storage, offset: int) -> None:
    """t, with its size and strides, now viewing `storage` from element `offset` (set_ changes the
    tensor object itself, so every reference to it follows)."""
    with torch.inference_mode(t.is_inference()), torch.no_grad():
        t.set_(storage, offset, t.size(), t.stride())


def huge_page_arena(nbytes: int, advice: Optional[int] = None) -> torch.Tensor:
    """nbytes of zeroed memory, uint8, starting on a huge page boundary, from one anonymous mapping
    advised MADV_HUGEPAGE (or `advice`; none where the platform has no such flag). Pages are
    only backed as they are first written, so RSS grows with what is used, not with nbytes."""
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if advice is not None or supported():
        area.madvise(mmap.MADV_HUGEPAGE if advice is None else advice)
    whole = torch.frombuffer(area, dtype=torch.uint8)  # keeps `area` mapped while any view lives
    at = (-whole.data_ptr()) % HUGE_PAGE
    return whole[at : at + nbytes]


def move_to_huge_pages(module: torch.nn.Module, advice: Optional[int] = None) -> Moved:
    """Move the module's large CPU weight storages into one mapping advised MADV_HUGEPAGE (see the
    module docstring); returns what moved and what stayed. advice: another madvise flag for the
    mapping (benchmarks/huge_pages_ab.py passes MADV_NOHUGEPAGE for its 4 KB side)."""
    moved = Moved()
    if not supported():
        moved.kept.append("this platform has no MADV_HUGEPAGE")
        return moved
    groups = by_storage(module_tensors(module))
    if not groups:
        return moved
    sizes = {key: ts[0].untyped_storage().nbytes() for key, ts in groups.items()}
    arena = huge_page_arena(sum(-(-n // ALIGN) * ALIGN for n in sizes.values()), advice)
    at = 0
    target, base = arena.untyped_storage(), arena.storage_offset()  # the mapping's start is not the arena's
    for key, tensors in groups.items():
        old = tensors[0].untyped_storage()
        n = sizes[key]
        arena[at : at + n].copy_(torch.empty(0, dtype=torch.uint8).set_(old, 0, (n,), (1,)))
        offsets = [t.storage_offset() for t in tensors]
        for t, offset in zip(tensors, offsets):
            _repoint(t, target, (base + at) // t.element_size() + offset)
        # Our `old` is one reference; any other means a holder outside the modules (a view, a
        # store): put the tensors back so that it still shares their memory.
        if storage_use_count(old) > 1:
            for t, offset in zip(tensors, offsets):
                _repoint(t, old, offset)
            moved.kept.append(f"a {n / 1e6:.1f} MB storage is also held outside the model")
            continue
        moved.storages += 1
        moved.bytes += n
        at += -(-n // ALIGN) * ALIGN
    return moved
