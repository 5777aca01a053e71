"""A graph that torch.compile made, called again without Dynamo: the compiled decode step's entry.

Why: each call of a Dynamo-compiled function first checks the function's guards, then fetches every
graph input anew through Python objects (for the decode step, ~80 weights through the decoder's
modules), then calls the code Inductor generated. For a ~140M model that is ~0.2 ms of a 2.4 ms
bf16 step on a CPU (measured), paid on every token. The step's weights keep their identity for the
decoder's life (a hot swap writes into them in place), so where each input comes from can be
worked out once, while Dynamo compiles, and the generated code called with the same arguments.

What stands in for Dynamo's guards, so that a graph only ever runs inputs it was compiled for:
- the graph's shape guards, over the per-call inputs, as Inductor's own FX-graph cache checks them
  (`ShapeEnv.produce_guards_expression` with `ignore_static=False`: every static size and stride
  too, and the relations between dynamic sizes, e.g. a cache that is full gets a graph of its own);
- each input's dtype, device and whether it is an inference tensor (what Dynamo's tensor guards
  check besides shapes).
Inputs that pass none of a step's direct graphs go through Dynamo, which may compile a new graph
(and record it here). A graph whose inputs cannot all be traced to a held tensor or a per-call
input, or whose guards cannot be written, is not recorded: Dynamo keeps running it.

Both checks run on every token, so they run as one Python function written from them once
(compile_check: each input's size(), stride() and storage_offset() read once, where the guard text
reads them once per term), and so does filling in the graph's arguments (compile_fill); the guard
text evaluated as it is stays beside it as the reference (DirectGraph.accepts_reference).

What the backend hands back calls Inductor's code through AOTAutograd's runtime wrappers (a chain
of ~6 Python calls, a metrics context, the aliasing and mutation epilogue): ~0.1 ms of a ~4 ms
decode step on 2 cores, since the ~140M model's ~90 MB of weights a token leave little of that
Python in cache (benchmarks/scheduler_step_parts.py: 115 → 71 µs a call around the generated code). A decode or prefill graph needs none of it (its outputs
are fresh tensors; it writes the cache in place itself), so once one run of each way gave the same
results, bit for bit (DirectGraph.confirm, on a scratch step), the graph calls Inductor's code
directly; a graph never confirmed keeps the wrappers.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from types import CodeType
from typing import Callable, Optional, Sequence

import torch

from moekit.ops.torch_private import SYMPY_INTERP, detect_fake_mode, inductor_callable

HELD, INPUT, SIZE, STRIDE = "held", "input", "size", "stride"


@dataclass(frozen=True)
class Source:
    """Where one flat argument of the generated code comes from on each call."""

    kind: str  # HELD: the same tensor every call; INPUT: per-call input `index`; SIZE / STRIDE: its dim
    tensor: Optional[torch.Tensor] = None  # HELD only
    index: int = 0
    dim: int = 0


def _kind(t: torch.Tensor) -> tuple:
    return t.dtype, t.device, t.is_inference(), t.requires_grad


@dataclass(frozen=True)
class DirectGraph:
    """One compiled graph and how to call it from the per-call inputs alone."""

    run: Callable  # what the backend returned to Dynamo: the compiled graph, flat arguments
    sources: tuple[Source, ...]
    guards: Optional[CodeType]  # the shape guards over inputs t0, t1, ...; None: there are none
    kinds: tuple  # _kind() of each per-call input
    guard_source: Optional[str] = None  # the text `guards` was compiled from (moekit.model.saved_graphs keeps it)

    def __post_init__(self):
        # A call copies the held tensors' list and fills in the rest (~80 arguments, ~10 per call).
        object.__setattr__(self, "_template", [s.tensor for s in self.sources])
        object.__setattr__(self, "_fill", compile_fill(self.sources))
        object.__setattr__(self, "_check", compile_check(self.kinds, self.guard_source))
        object.__setattr__(self, "_inner", None)  # Inductor's code, once confirm() found it the same
        object.__setattr__(self, "confirmed", False)  # confirm() has run

    def accepts(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Whether this graph was compiled for inputs: accepts_reference's answer, from one function."""
        if len(inputs) != len(self.kinds):
            return False
        if self._check is None:  # a guard text compile_check does not take: the reference
            return self.accepts_reference(inputs)
        return self._check(*inputs)

    def accepts_reference(self, inputs: Sequence[torch.Tensor]) -> bool:
        """accepts, plainly: each input's kind, then the guard text evaluated as Dynamo wrote it."""
        if len(inputs) != len(self.kinds) or any(_kind(t) != k for t, k in zip(inputs, self.kinds)):
            return False
        if self.guards is None:
            return True
        return bool(eval(self.guards, SYMPY_INTERP, {"L": {f"t{i}": t for i, t in enumerate(inputs)}}))

    def args(self, inputs: Sequence[torch.Tensor]) -> list:
        """The graph's flat arguments for these per-call inputs: the held tensors, the inputs, their sizes."""
        args = list(self._template)
        self._fill(args, inputs)
        return args

    def __call__(self, inputs: Sequence[torch.Tensor]) -> list:
        """The traced function's results on `inputs` (which accepts() passed), as a list."""
        inner = self._inner
        return self.run(*self.args(inputs)) if inner is None else inner(self.args(inputs))

    @property
    def calls_inner(self) -> bool:
        """Whether calls go to Inductor's code directly (confirm found it the same as the wrappers)."""
        return self._inner is not None

    def confirm(self, inputs: Sequence[torch.Tensor]) -> list:
        """Run inputs through the wrappers, then through Inductor's code alone, and from then on call
        the latter if it gave the same results (as many, each of the same dtype and shape, equal bit
        for bit). The graph runs twice: only for a step whose second run changes nothing the first
        did not (a scratch step: it writes the same cache slots again). → the wrappers' results."""
        results = list(self.run(*self.args(inputs)))
        object.__setattr__(self, "confirmed", True)
        inner = inductor_callable(self.run)
        if inner is not None:
            again = list(inner(self.args(inputs)))  # the generated code empties the list it is given
            if _same(results, again):
                object.__setattr__(self, "_inner", inner)
        return results


def _same(a: list, b: list) -> bool:
    """Whether two result lists hold the same tensors (dtype, shape and every bit) in the same order."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            if x is not y and x != y:
                return False
        elif x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            return False
    return True


def named_held(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the module tree holds (parameters, buffers, plain tensor attributes and tuples or
    lists of them) under a name that is the same in every process building the same decoder
    ("module path:attribute:index"); a tensor held twice keeps its first name."""
    named, seen = {}, set()
    for prefix, m in module.named_modules():
        for key, value in [*m.__dict__.items(), *m._parameters.items(), *m._buffers.items()]:
            for i, t in enumerate(value if isinstance(value, (tuple, list)) else (value,)):
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    named[f"{prefix}:{key}:{i}"] = t
    return named


def held_tensors(module: torch.nn.Module) -> dict[int, torch.Tensor]:
    """named_held's tensors by id: the only tensors a direct graph may keep between calls."""
    return {id(t): t for t in named_held(module).values()}


def direct_graph(gm: torch.fx.GraphModule, example_inputs: Sequence, run: Callable,
                 inputs: Sequence[torch.Tensor], held: dict[int, torch.Tensor], outputs: int) -> Optional[DirectGraph]:
    """The DirectGraph of `run` (compiled from gm, whose placeholders Dynamo filled with
    example_inputs, the tensors of the call being traced), or None where it cannot be built safely.
    inputs: that call's per-call tensors, in the order DirectGraph.accepts will be given them;
    outputs: how many tensors the traced function returns (a flat tuple of them), which the graph
    must return as they are, in that order: then its list of results is the function's."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs) or not _returns(gm, outputs):
        return None
    position = {id(t): i for i, t in enumerate(inputs)}
    fakes: dict[int, object] = {}  # input index → its fake tensor in the graph
    for node, example in zip(placeholders, example_inputs):
        if isinstance(example, torch.Tensor) and id(example) in position:
            fakes[position[id(example)]] = node.meta.get("example_value")
    if len(fakes) != len(inputs) or any(f is None for f in fakes.values()):
        return None
    sources = []
    for node, example in zip(placeholders, example_inputs):
        if isinstance(example, torch.Tensor):
            if id(example) in position:
                sources.append(Source(INPUT, index=position[id(example)]))
            elif id(example) in held:
                sources.append(Source(HELD, tensor=held[id(example)]))
            else:
                return None
        else:
            found = _symbol_source(node.meta.get("example_value"), fakes)
            if found is None:
                return None
            sources.append(found)
    guard_source = _guards([fakes[i] for i in range(len(inputs))])
    if guard_source is False:
        return None
    return DirectGraph(run, tuple(sources), compile_guards(guard_source), tuple(_kind(t) for t in inputs), guard_source)


def _returns(gm: torch.fx.GraphModule, outputs: int) -> bool:
    """Whether gm returns `outputs` distinct values it computes (none of them an input as it is,
    which Dynamo would return from outside the graph)."""
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    values = list(out) if isinstance(out, (tuple, list)) else [out]
    return (len(values) == outputs and len({id(v) for v in values}) == outputs
            and all(isinstance(v, torch.fx.Node) and v.op != "placeholder" for v in values))


def _symbol_source(value, fakes: dict[int, object]) -> Optional[Source]:
    """A size placeholder's source: the first input size or stride that is the same symbol."""
    if not isinstance(value, torch.SymInt):
        return None
    symbol = value.node.expr
    for index, fake in sorted(fakes.items()):
        for kind, dims in ((SIZE, fake.shape), (STRIDE, fake.stride())):
            for dim, s in enumerate(dims):
                if isinstance(s, torch.SymInt) and s.node.expr == symbol:
                    return Source(kind, index=index, dim=dim)
    return None


def _guards(fakes: list) -> str | None | bool:
    """The shape guards over the inputs' fake tensors, as an expression over L["t0"], L["t1"], ...;
    None where there are none; False where no shape environment can be found (then the graph is not
    called directly)."""
    mode = detect_fake_mode()
    if mode is None or mode.shape_env is None:
        return False
    return mode.shape_env.produce_guards_expression(fakes, ignore_static=False)


def compile_guards(source: Optional[str]) -> Optional[CodeType]:
    """A guard expression (as _guards writes it) ready for DirectGraph.accepts_reference; None stays None."""
    return None if source is None else compile(source, "<direct graph guards>", "eval")


_READS = ("size", "stride", "storage_offset")  # what a guard asks of an input tensor


class _Reads(ast.NodeTransformer):
    """Rewrites each L['tN'].size() (stride(), storage_offset()) of a guard text as a local read once."""

    def __init__(self):
        self.reads: dict[str, tuple[int, str]] = {}  # local name → (input index, method)

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        f = node.func
        if (node.args or node.keywords or not isinstance(f, ast.Attribute) or f.attr not in _READS
                or not isinstance(f.value, ast.Subscript) or not isinstance(f.value.value, ast.Name)
                or f.value.value.id != "L" or not isinstance(f.value.slice, ast.Constant)):
            return node
        key = f.value.slice.value
        if not (isinstance(key, str) and key[:1] == "t" and key[1:].isdigit()):
            return node
        name = f"{f.attr}_{key[1:]}"
        self.reads[name] = (int(key[1:]), f.attr)
        return ast.copy_location(ast.Name(name, ast.Load()), node)


def compile_check(kinds: tuple, source: Optional[str]) -> Optional[Callable[..., bool]]:
    """DirectGraph.accepts_reference's test as one function of the inputs t0, t1, ... (as many as
    kinds): each input's kind, then the guard text with each tensor's size(), stride() and
    storage_offset() read once, up front (they have no side effects, so reading them before the
    terms that short-circuit changes no answer). None where the text reads an input some other way
    (then the reference runs)."""
    names = [f"t{i}" for i in range(len(kinds))]
    terms = [f"({n}.dtype, {n}.device, {n}.is_inference(), {n}.requires_grad) == _k{i}" for i, n in enumerate(names)]
    lines = []
    if source is not None:
        reads = _Reads()
        tree = reads.visit(ast.parse(source, mode="eval"))
        if any(isinstance(node, ast.Name) and node.id == "L" for node in ast.walk(tree)):
            return None
        if any(index >= len(kinds) for index, _ in reads.reads.values()):
            return None
        lines = [f"    {name} = t{index}.{method}()" for name, (index, method) in sorted(reads.reads.items())]
        lines.append(f"    return bool({ast.unparse(tree)})")
    code = (f"def check({', '.join(names)}):\n"
            f"    if not ({' and '.join(terms) or 'True'}):\n        return False\n" + "\n".join(lines or ["    return True"]))
    namespace = {**SYMPY_INTERP, **{f"_k{i}": k for i, k in enumerate(kinds)}}
    exec(compile(code, "<direct graph check>", "exec"), namespace)
    return namespace["check"]


def compile_fill(sources: Sequence[Source]) -> Callable[[list, Sequence[torch.Tensor]], None]:
    """The function that writes a call's per-call arguments into the list of the held ones: each
    INPUT, SIZE and STRIDE source's value from the inputs, as one assignment each."""
    lines = []
    for at, s in enumerate(sources):
        if s.kind == INPUT:
            lines.append(f"    args[{at}] = inputs[{s.index}]")
        elif s.kind in (SIZE, STRIDE):  # the kinds are the tensor methods' names
            lines.append(f"    args[{at}] = inputs[{s.index}].{s.kind}({s.dim})")
    namespace: dict = {}
    exec(compile("def fill(args, inputs):\n" + "\n".join(lines or ["    pass"]), "<direct graph fill>", "exec"), namespace)
    return namespace["fill"]
