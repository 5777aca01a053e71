"""The compiled step's graphs kept on disk with how to call them, so that a later process runs them
without Dynamo.

Why: with Inductor's caches warm, a `moekit run` still spent ~4.3 s of its ~8.5 s on the first
step (idle machine, qwen3_moe-150m fp32; benchmarks/compile_startup.py): Dynamo tracing the ~745-op
step (1.8 s), the AOTAutograd cache's key over the traced graph (~1.3 s) and loading the generated
module (~1 s). A DirectGraph (moekit.model.direct_graph) already says how to call a compiled graph
without Dynamo; this keeps it, beside the graph's compiled form, in the model's cache folder
(moekit.model.compile_cache), and a later process loads it and calls it: only the module load is left.

What keeps a saved graph from running anything it was not compiled for:
- the folder's key: torch's version, the CPU's flags, moekit's sources, the decoder's shape,
  dtype and weight form (compile_cache.step_key);
- in each record, what the trace read as constants (StepConstants: the kernel chosen per kind of
  weight, which operators are loaded, the thread count) and the step's StepRouting; a record made
  under other constants is not used;
- each tensor the graph keeps, by name, with its dtype, size and stride: a decoder whose tensor
  differs does not get the graph;
- at each call, the graph's own shape guards and each input's kind, as in the process that traced it.
A graph that calls an operator taking a `handle` (the expert store's, a routing policy's, expert
parallelism's: a key into one process's objects) is never saved. A record that cannot be read or
loaded is passed over: the step then compiles as before (Inductor's caches still help).

The compiled form is torch's own serialisation of the compiled graph (a pickle, as every file of
Inductor's caches beside it is), written by moekit into the user's own cache folder and read only
from there; moekit never reads a pickle from a checkpoint or a download.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from moekit.model.direct_graph import HELD, INPUT, DirectGraph, Source, compile_guards
from moekit.ops.torch_private import deserialize_compiled, serialize_compiled

FORMAT = 1
FOLDER = "direct"  # under the model's cache folder


@dataclass(frozen=True)
class SavedGraph:
    """One record on disk, read but not loaded: enough to tell whether a call's inputs are its own."""

    artefact: Path  # torch's serialised compiled graph
    routing: tuple  # the StepRouting's fields
    sources: tuple  # JSON rows: ("held", name, dtype, size, stride) | ("input"|"size"|"stride", index, dim)
    kinds: tuple  # each per-call input's (dtype, device, inference, requires_grad)
    guard_source: Optional[str]

    def __post_init__(self):
        # The graph's checks without its compiled code: DirectGraph.accepts runs them.
        object.__setattr__(self, "_checks", DirectGraph(None, (), compile_guards(self.guard_source),
                                                        tuple(_decode_kind(k) for k in self.kinds), self.guard_source))

    def accepts(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Whether inputs pass this graph's kinds and shape guards, before its code is loaded."""
        return self._checks.accepts(inputs)


def step_constants(values: dict, decoder: torch.nn.Module) -> dict:
    """The constants a trace baked in (CompiledStep names them), the thread count, and a digest of
    every value the decoder's modules hold besides tensors (decoder_state), as JSON."""
    return {**{k: v if isinstance(v, (bool, int, str)) else repr(v) for k, v in values.items()},
            "threads": torch.get_num_threads(), "decoder": decoder_state(decoder)}


def decoder_state(decoder: torch.nn.Module) -> str:
    """A hash of what the decoder's modules hold besides tensors and modules: the family's constants
    (rope theta, norms' eps, scalings, each router's spec and K), routing knobs, kernel choices.
    Dynamo reads them while tracing and bakes them into the graph, but the compiled step does not
    guard on modules (CompiledStep says why), and a saved graph is not traced again: two decoders of
    one shape that differ in one of these must not share a graph. Tensors are checked apart (save)."""
    digest = hashlib.sha256()
    for name, module in decoder.named_modules():
        for key, value in sorted(vars(module).items()):
            if not key.startswith("_") and not isinstance(value, torch.nn.Module):
                digest.update(f"{name}.{key}={_state(value)}\0".encode())
    return digest.hexdigest()[:16]


def _state(value, depth: int = 0) -> str:
    """value written so that equal states read alike in every process (no addresses, no tensor data)."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return f"tensor({value.dtype}, {tuple(value.shape)})"
    if depth > 4:
        return type(value).__qualname__
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_state(v, depth + 1) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_state(v, depth + 1)}" for k, v in sorted(value.items(), key=repr)) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ", ".join(f"{f.name}={_state(getattr(value, f.name), depth + 1)}" for f in dataclasses.fields(value))
        return f"{type(value).__qualname__}({fields})"
    if isinstance(value, enum.Enum):
        return repr(value)
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    return type(value).__qualname__  # an object of the process (a policy's seat, the compiled step)


def keeps_process_objects(gm: torch.fx.GraphModule) -> bool:
    """Whether gm calls an operator that finds an object of this process by a `handle` argument."""
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is not None and any(a.name == "handle" for a in schema.arguments):
            return True
    return False


def save(folder: Path, graph: DirectGraph, routing: tuple, constants: dict, names: dict[int, str]) -> Optional[Path]:
    """Write graph's record under folder/direct; names: each held tensor's name by id
    (direct_graph.named_held, inverted). Returns the record's path, or None where the graph cannot
    be saved (its compiled form does not serialise, a held tensor has no name)."""
    sources = []
    for s in graph.sources:
        if s.kind == HELD:
            name = names.get(id(s.tensor))
            if name is None:
                return None
            sources.append([HELD, name, str(s.tensor.dtype), list(s.tensor.shape), list(s.tensor.stride())])
        else:
            sources.append([s.kind, s.index, s.dim])
    data = serialize_compiled(graph.run)
    if data is None:
        return None
    record = {"format": FORMAT, "routing": list(routing), "constants": constants, "sources": sources,
              "kinds": [_encode_kind(k) for k in graph.kinds], "guards": graph.guard_source}
    name = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:20]
    where = folder / FOLDER
    where.mkdir(parents=True, exist_ok=True)
    _write(where / f"{name}.bin", data)
    _write(where / f"{name}.json", json.dumps({**record, "artefact": f"{name}.bin"}, indent=1).encode())
    return where / f"{name}.json"


def saved(folder: Optional[Path], constants: dict) -> list[SavedGraph]:
    """The records under folder/direct made under these constants (unreadable ones passed over)."""
    where = None if folder is None else folder / FOLDER
    if where is None or not where.is_dir():
        return []
    found = []
    for path in sorted(where.glob("*.json")):
        try:
            record = json.loads(path.read_text())
            if record.get("format") != FORMAT or record.get("constants") != constants:
                continue
            found.append(SavedGraph(where / record["artefact"], tuple(record["routing"]),
                                    tuple(tuple(s) for s in record["sources"]),
                                    tuple(tuple(k) for k in record["kinds"]), record["guards"]))
        except (OSError, ValueError, KeyError, TypeError, SyntaxError):
            continue
    return found


def load(graph: SavedGraph, named: dict[str, torch.Tensor]) -> Optional[DirectGraph]:
    """The DirectGraph of a record, its compiled form loaded (call it inside the model's cache
    folder: compile_cache.compiling_into), or None where the decoder's tensors do not match it."""
    sources = []
    for row in graph.sources:
        if row[0] == HELD:
            _, name, dtype, size, stride = row
            t = named.get(name)
            if t is None or str(t.dtype) != dtype or list(t.shape) != size or list(t.stride()) != stride:
                return None
            sources.append(Source(HELD, tensor=t))
        else:
            kind, index, dim = row
            sources.append(Source(kind, index=index, dim=dim))
    run = deserialize_compiled(graph.artefact.read_bytes())
    checks = graph._checks
    return DirectGraph(run, tuple(sources), checks.guards, checks.kinds, checks.guard_source)


def _encode_kind(kind: tuple) -> list:
    dtype, device, inference, requires_grad = kind
    return [str(dtype).removeprefix("torch."), str(device), bool(inference), bool(requires_grad)]


def _decode_kind(kind: Sequence) -> tuple:
    dtype, device, inference, requires_grad = kind
    return getattr(torch, dtype), torch.device(device), inference, requires_grad


def _write(path: Path, data: bytes) -> None:
    """Write whole or not at all: another process may be reading the folder."""
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_bytes(data)
    os.replace(partial, path)

