"""cache-sim: size an expert cache from a routing trace, without running the model.

A trace (engine/trace.py) lists every real token's experts at every MoE layer. Per (step, layer)
the distinct experts of all its tokens form one layer forward, replayed as a SlotCache (the
class the live store uses) counts them under `call` (moekit.analysis.replay, the same walk in one
loop, held to SlotCache by its tests): the prefill (step 0) is one forward of all prompt tokens of
all rows, each decode step one forward of one token per running row. So a live run without
prefetch, at the same slots and policy, reports the hit rate simulated here.

Belady's MIN replays the same forwards knowing the future: no policy can have more hits, which
tells how much room a smarter policy has left.

No torch here: the trace is read with pyarrow and grouped with numpy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import numpy as np

from moekit.analysis.replay import REPLAYED, Replay
from moekit.engine.trace import TraceModel, read_trace_model
from moekit.errors import MoekitError
from moekit.offload.policies import LIVE_POLICIES, POLICIES, Belady, Policy
from moekit.offload.slot_cache import SlotCache, most_pins

SIM_POLICIES: tuple[str, ...] = LIVE_POLICIES + ("belady",)
NEEDED_COLUMNS = ("step", "row", "layer", "expert_ids")


@dataclass(frozen=True)
class TraceCalls:
    """A trace as the forwards the store would see: per layer, per step, the distinct experts."""

    layers: tuple[int, ...]
    calls: dict[int, list[tuple[int, ...]]]  # layer -> one ascending tuple of experts per forward
    prefill: dict[int, bool]  # layer -> its first forward is the prefill (step 0)
    max_expert: int  # highest expert id seen
    trace_rows: int
    generated_tokens: int  # one per row from the prefill, one per (step >= 1, row)
    decode_tokens: int  # the (step >= 1, row) pairs
    model: Optional[TraceModel] = None  # the model's facts from the trace's metadata (None: an older trace)

    @property
    def accesses(self) -> int:
        return sum(len(c) for calls in self.calls.values() for c in calls)

    def sequence(self, layer: int) -> list[int]:
        """The layer's expert accesses in the order SlotCache.call makes them (Belady's future)."""
        return [e for c in self.calls[layer] for e in c]


def read_trace(path: str | Path) -> TraceCalls:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise MoekitError(f"{path}: no such trace file (write one with `moekit run ... --trace t.parquet`)")
    try:
        names = pq.read_schema(path).names
        missing = [c for c in NEEDED_COLUMNS if c not in names]
        if missing:
            raise MoekitError(f"{path}: not a routing trace, missing column(s) {', '.join(missing)}")
        table = pq.read_table(path, columns=list(NEEDED_COLUMNS))  # the weights are not needed
    except (pa.ArrowInvalid, OSError) as err:
        raise MoekitError(f"{path}: not a Parquet trace ({str(err).splitlines()[0]})") from None
    model = read_trace_model(table.schema.metadata, str(path))
    calls = trace_calls(table, str(path))
    if model is not None:
        unknown = sorted(set(calls.layers) - set(model.experts))
        if unknown:
            raise MoekitError(f"{path}: layer(s) {', '.join(map(str, unknown))} are not MoE layers of {model.name}")
        if calls.max_expert >= model.num_experts:
            raise MoekitError(f"{path}: routes to expert {calls.max_expert}, but {model.name} has {model.num_experts}")
    return replace(calls, model=model)


def trace_calls(table, name: str = "trace") -> TraceCalls:
    """Group a trace table into forwards; numpy does the grouping so 100k rows take milliseconds."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if table.num_rows == 0:
        raise MoekitError(f"{name}: the trace has no rows")
    try:
        step, row, layer = (_ints(table[col], col) for col in ("step", "row", "layer"))
        ids = table["expert_ids"].combine_chunks()
        if not pa.types.is_list(ids.type) and not pa.types.is_large_list(ids.type):
            raise TypeError("expert_ids is not a list column")
        parent = pc.list_parent_indices(ids).to_numpy(zero_copy_only=False)
        flat = ids.flatten()
        if flat.null_count:
            raise TypeError("expert_ids holds nulls")
        expert = flat.to_numpy(zero_copy_only=False).astype(np.int64)
    except (TypeError, ValueError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
        raise MoekitError(f"{name}: unreadable trace columns ({err})") from None
    if len(expert) == 0:
        raise MoekitError(f"{name}: the trace routes no token to any expert")
    if step.min() < 0 or row.min() < 0 or expert.min() < 0:
        raise MoekitError(f"{name}: negative step, row or expert id in the trace")

    layers, layer_index = np.unique(layer, return_inverse=True)
    n_layers, n_experts = len(layers), int(expert.max()) + 1
    # One int64 per (step, layer, expert): sorted, they run by step, then layer, then expert.
    forward = step.astype(np.int64)[parent] * n_layers + layer_index[parent]
    keys = np.sort(forward * n_experts + expert)
    keys = keys[np.concatenate(([True], keys[1:] != keys[:-1]))]  # np.unique, without its hashing
    forward_of_key = keys // n_experts
    starts = np.flatnonzero(np.diff(forward_of_key)) + 1
    bounds = [0, *starts.tolist(), len(keys)]
    experts_of_key = (keys % n_experts).tolist()
    forward_ids = forward_of_key[bounds[:-1]].tolist()

    calls: dict[int, list[tuple[int, ...]]] = {int(l): [] for l in layers}
    prefill: dict[int, bool] = {int(l): False for l in layers}
    for f, begin, end in zip(forward_ids, bounds[:-1], bounds[1:]):
        s, li = divmod(f, n_layers)
        lay = int(layers[li])
        if s == 0:
            prefill[lay] = True
        calls[lay].append(tuple(experts_of_key[begin:end]))

    steps_rows = np.unique(step.astype(np.int64) * (int(row.max()) + 1) + row)
    decode = int(np.count_nonzero(steps_rows > row.max()))  # step >= 1
    prefill_rows = len(steps_rows) - decode
    return TraceCalls(
        layers=tuple(int(l) for l in layers),
        calls=calls,
        prefill=prefill,
        max_expert=n_experts - 1,
        trace_rows=table.num_rows,
        generated_tokens=decode + prefill_rows,
        decode_tokens=decode,
    )


def _ints(column, name: str) -> np.ndarray:
    if column.null_count:
        raise TypeError(f"{name} holds nulls")
    values = column.to_numpy()
    if not np.issubdtype(values.dtype, np.integer):
        raise TypeError(f"{name} holds {values.dtype}, not integers")
    return values.astype(np.int64)


# --- what to simulate ------------------------------------------------------------------------


def parse_policies(text: str) -> list[str]:
    names = [p.strip().lower() for p in text.split(",") if p.strip()]
    if not names:
        raise MoekitError(f"--policy {text!r}: name at least one of {', '.join(SIM_POLICIES)}")
    unknown = [n for n in names if n not in SIM_POLICIES]
    if unknown:
        raise MoekitError(f"--policy: unknown policy {unknown[0]!r}; choose from {', '.join(SIM_POLICIES)}")
    return list(dict.fromkeys(names))


NO_EXPERT_COUNT = (
    "this trace does not record the model's experts per layer (written before moekit kept them in its "
    "metadata); give --num-experts E, or count slots (--slots 4,8)"
)


def parse_slots(text: str, num_experts: Optional[int], notes: Optional[list[str]] = None) -> list[int]:
    """'4,8,16' or '25%,50%' (of num_experts, rounded down, as a live --expert-memory share is) ->
    ascending distinct slot counts. More slots than experts hold nothing more: capped at
    num_experts, with a line in `notes`. Shares need num_experts (None: unknown, refused)."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        share = part.endswith("%")
        if share and num_experts is None:
            raise MoekitError(f"--slots {part}: a share needs the expert count, and {NO_EXPERT_COUNT}")
        try:
            slots = int(float(part[:-1]) * num_experts / 100) if share else int(part)
        except ValueError:
            raise MoekitError(f"--slots {text!r}: expected whole numbers or shares, e.g. 4,8,16 or 25%,50%") from None
        if slots < 1:
            of = f" ({num_experts} experts)" if num_experts is not None else ""
            raise MoekitError(f"--slots {part}: a cache needs at least 1 slot per layer{of}")
        if num_experts is not None and slots > num_experts:
            if notes is not None:
                notes.append(f"--slots {part}: capped at {num_experts}, every expert of a layer (more slots hold nothing more)")
            slots = num_experts
        out.append(slots)
    if not out:
        raise MoekitError(f"--slots {text!r}: give at least one slot count, e.g. 4,8,16 or 25%")
    return sorted(set(out))


def read_pins(path: str | Path) -> dict[int, list[int]]:
    """The "pins" of a profile file: {"<layer>": [expert ids]}; everything else is ignored."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise MoekitError(f"{path}: no such pin file (write one with `moekit profile ... --out profile.json`)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise MoekitError(f"{path}: not a JSON profile ({err})") from None
    pins = doc.get("pins") if isinstance(doc, dict) else None
    if not isinstance(pins, dict):
        raise MoekitError(f'{path}: no "pins" object (expected {{"pins": {{"<layer>": [expert ids]}}}})')
    out: dict[int, list[int]] = {}
    for key, ids in pins.items():
        try:
            layer = int(key)
            if not isinstance(ids, list) or any(isinstance(e, bool) or not isinstance(e, int) or e < 0 for e in ids):
                raise ValueError
        except ValueError:
            raise MoekitError(f'{path}: pins must map layer numbers to lists of expert ids, got "{key}": {ids!r}') from None
        out[layer] = list(dict.fromkeys(ids))
    return out


# --- the simulation --------------------------------------------------------------------------


@dataclass
class LayerResult:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    decode_hits: int = 0
    decode_misses: int = 0

    @property
    def accesses(self) -> int:
        return self.hits + self.misses

    def as_dict(self) -> dict:
        return {
            "accesses": self.accesses,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "hit_rate": _rate(self.hits, self.accesses),
            "decode_hit_rate": _rate(self.decode_hits, self.decode_hits + self.decode_misses),
        }


@dataclass
class SimResult:
    policy: str
    slots: int
    layers: dict[int, LayerResult]
    pinned: dict[int, list[int]] = field(default_factory=dict)

    def total(self) -> LayerResult:
        out = LayerResult()
        for r in self.layers.values():
            for name in vars(out):
                setattr(out, name, getattr(out, name) + getattr(r, name))
        return out


def _rate(part: int, whole: int) -> Optional[float]:
    return part / whole if whole else None


def _policy(name: str, trace: TraceCalls, layer: int) -> Policy:
    return Belady(trace.sequence(layer)) if name == "belady" else POLICIES[name]()


def cap_pins(pins: dict[int, list[int]], slots: int) -> dict[int, list[int]]:
    """At most most_pins(slots) per layer, as the live store keeps them: the profile's first ones."""
    cap = most_pins(slots)
    return {layer: ids[:cap] for layer, ids in pins.items() if ids[:cap]}


def simulate_layer(calls: list[tuple[int, ...]], cache: SlotCache, first_is_prefill: bool) -> LayerResult:
    """The reference walk: every forward through the live store's SlotCache."""
    prefill_hits = prefill_misses = 0
    for i, needed in enumerate(calls):
        cache.call(needed)
        if i == 0 and first_is_prefill:
            prefill_hits, prefill_misses = cache.hits, cache.misses
    return _layer_result(cache, prefill_hits, prefill_misses)


def replay_layer(calls: list[tuple[int, ...]], replay: Replay, first_is_prefill: bool) -> LayerResult:
    """simulate_layer's counts by moekit.analysis.replay (the same walk in one loop)."""
    prefill_hits = prefill_misses = 0
    if first_is_prefill and calls:
        replay.run(calls[:1])
        prefill_hits, prefill_misses = replay.hits, replay.misses
        calls = calls[1:]
    replay.run(calls)
    return _layer_result(replay, prefill_hits, prefill_misses)


def _layer_result(walk: SlotCache | Replay, prefill_hits: int, prefill_misses: int) -> LayerResult:
    """A walk's counts (SlotCache's or Replay's), the decode's being those after the prefill's."""
    return LayerResult(hits=walk.hits, misses=walk.misses, evictions=walk.evictions,
                       decode_hits=walk.hits - prefill_hits, decode_misses=walk.misses - prefill_misses)


def simulate(trace: TraceCalls, policy: str, slots: int, pins: dict[int, list[int]] | None = None) -> SimResult:
    """Replay every layer's forwards through its own cache. `pins` must fit (see cap_pins). The
    policies moekit.analysis.replay knows run there (2-5× faster); any other through SlotCache."""
    if policy not in REPLAYED:
        return simulate_reference(trace, policy, slots, pins)
    pins = pins or {}
    layers = {}
    for layer in trace.layers:
        future = trace.sequence(layer) if policy == "belady" else None
        replay = Replay(slots, policy, pins.get(layer, ()), future)
        layers[layer] = replay_layer(trace.calls[layer], replay, trace.prefill[layer])
    return SimResult(policy, slots, layers, {l: list(p) for l, p in pins.items() if l in layers})


def simulate_reference(trace: TraceCalls, policy: str, slots: int, pins: dict[int, list[int]] | None = None) -> SimResult:
    """simulate through SlotCache and the policy classes, the live store's code: what simulate is
    held to (tests/analysis/test_replay.py)."""
    pins = pins or {}
    layers = {}
    for layer in trace.layers:
        cache = SlotCache(slots, _policy(policy, trace, layer), pinned=pins.get(layer, ()))
        layers[layer] = simulate_layer(trace.calls[layer], cache, trace.prefill[layer])
    return SimResult(policy, slots, layers, {l: list(p) for l, p in pins.items() if l in layers})


def result_dict(result: SimResult, trace: TraceCalls, num_experts: Optional[int]) -> dict:
    total = result.total()
    return {
        "policy": result.policy,
        "slots": result.slots,
        "slots_share": result.slots / num_experts if num_experts else None,
        "pinned": sum(len(p) for p in result.pinned.values()),
        "accesses": total.accesses,
        "hits": total.hits,
        "misses": total.misses,
        "evictions": total.evictions,
        "hit_rate": _rate(total.hits, total.accesses),
        "decode_hit_rate": _rate(total.decode_hits, total.decode_hits + total.decode_misses),
        # The prompt's forward is counted apart: divided by a few generated tokens, its misses would read
        # as more experts per token than a token can touch.
        "prefill_misses": total.misses - total.decode_misses,
        "decode_misses": total.decode_misses,
        "decode_misses_per_token": _rate(total.decode_misses, trace.decode_tokens),
        "layers": {str(l): r.as_dict() for l, r in result.layers.items()},
    }


@dataclass(frozen=True)
class SimRequest:
    policies: list[str]
    slots: list[int]
    num_experts: Optional[int]  # None: an older trace without the model's facts, and no --num-experts
    pins: dict[int, list[int]]  # as the pin file gave them, before capping
    pin_file: Optional[str] = None
    notes: tuple[str, ...] = ()  # what parsing the request capped


def most_touched_per_token(model: Optional[TraceModel]) -> Optional[int]:
    """The bound of decode misses per decoded token: a token touches K experts in each MoE layer."""
    return sum(model.top_k.values()) if model is not None else None


def run_cache_sim(trace: TraceCalls, request: SimRequest) -> dict:
    """Every policy × slots; the report as one JSON-ready dict (notes say what was capped)."""
    notes = list(request.notes)
    unknown = sorted(set(request.pins) - set(trace.layers))
    if unknown:
        notes.append(f"pins for layer(s) {', '.join(map(str, unknown))} ignored: not MoE layers of the trace")
    results = []
    for slots in request.slots:
        pins = cap_pins(request.pins, slots)
        capped = sorted(l for l in request.pins if l in trace.layers and len(pins.get(l, [])) < len(request.pins[l]))
        if capped:
            notes.append(
                f"--slots {slots}: pins capped at {most_pins(slots)} per layer (half the slots, as a live "
                f"run keeps them) in layer(s) {', '.join(map(str, capped))}"
            )
        for policy in request.policies:
            results.append(result_dict(simulate(trace, policy, slots, pins), trace, request.num_experts))
    return {
        "trace_rows": trace.trace_rows,
        "model": trace.model.to_json() if trace.model is not None else None,
        "layers": list(trace.layers),
        "num_experts": request.num_experts,
        "generated_tokens": trace.generated_tokens,
        "decode_tokens": trace.decode_tokens,
        "max_misses_per_decoded_token": most_touched_per_token(trace.model),
        "forwards": sum(len(c) for c in trace.calls.values()),
        "accesses": trace.accesses,
        "pin_file": request.pin_file,
        "notes": notes,
        "results": results,
    }


def check_request(trace: TraceCalls, num_experts: Optional[int], pins: dict[int, list[int]]) -> Optional[int]:
    """The experts per layer: the trace's own (its metadata) or --num-experts, never a guess from
    the highest id a trace happens to contain; checked against the trace and the pins. None when
    neither says (an older trace): counts of slots still work, shares do not."""
    known = trace.model.num_experts if trace.model is not None else None
    if num_experts is not None and known is not None and num_experts != known:
        raise MoekitError(f"--num-experts {num_experts}: the trace was written by {trace.model.name}, "
                          f"which has {known} experts per layer (drop --num-experts)")
    if num_experts is not None and num_experts <= trace.max_expert:
        raise MoekitError(f"--num-experts {num_experts}: the trace routes to expert {trace.max_expert}")
    num_experts = known if known is not None else num_experts
    for layer, ids in pins.items():
        if ids and num_experts is not None and max(ids) >= num_experts:
            raise MoekitError(f"pins: layer {layer} pins expert {max(ids)}, but the model has {num_experts} experts")
    return num_experts
