"""A graph recorded while Dynamo compiles, called again without Dynamo (moekit.model.direct_graph).

It must compute what the Dynamo-compiled function computes, on every input its guards accept, and
accept nothing that graph was not compiled for: another static size, a dynamic size outside the
graph's assumptions, another dtype, a normal tensor where an inference tensor was traced.
"""

from __future__ import annotations

import pytest
import torch

from moekit.model.direct_graph import HELD, INPUT, SIZE, DirectGraph, compile_check, compile_guards, direct_graph, held_tensors


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 4)
        self.register_buffer("offset", torch.arange(4.0))
        self.pair = (torch.full((4,), 0.5), torch.ones(4))  # a tuple of plain tensors, as int8 stacks are


def _forward(model: Scaled, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # x [B, 8], mask [B, S] bool with S dynamic: Σ_s mask · proj(x) + offset, scaled by the pair
    counted = mask.float().sum(-1, keepdim=True)  # [B, 1]
    return (model.proj(x) * counted + model.offset) * model.pair[0] + model.pair[1]


@pytest.fixture(scope="module")
def recorded():
    """(model, the Dynamo-compiled function, the graphs recorded, a call function that records)."""
    model = Scaled().eval()
    graphs, tracing = [], {}

    def backend(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        run = compile_fx(gm, example_inputs)
        graphs.append(direct_graph(gm, example_inputs, run, tracing["inputs"], held_tensors(model), outputs=1))
        return run

    compiled = torch.compile(_forward, backend=backend, fullgraph=True, dynamic=False)

    def call(x, mask):
        torch._dynamo.mark_dynamic(mask, 1)
        tracing["inputs"] = (x, mask)
        return compiled(model, x, mask)

    return model, graphs, call


def _inputs(batch=2, length=5, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        x = torch.randn(batch, 8, generator=gen).to(dtype)
        mask = torch.rand(batch, length, generator=gen) > 0.3
    return x, mask


def test_a_recorded_graph_computes_what_dynamo_computes_at_every_accepted_length(recorded):
    model, graphs, call = recorded
    with torch.inference_mode():
        want = call(*_inputs())
        assert len(graphs) == 1 and graphs[0] is not None
        graph = graphs[0]
        kinds = [s.kind for s in graph.sources]
        assert kinds.count(INPUT) == 2 and SIZE in kinds and HELD in kinds
        for length, seed in ((5, 0), (9, 1), (300, 2)):
            inputs = _inputs(length=length, seed=seed)
            assert graph.accepts(inputs), length
            (got,) = graph(inputs)
            torch.testing.assert_close(got, _forward(model, *inputs), rtol=1e-6, atol=1e-6)
        assert torch.equal(graph(_inputs())[0], want)


def _unconfirmed(graph: DirectGraph, run=None) -> DirectGraph:
    return DirectGraph(run or graph.run, graph.sources, graph.guards, graph.kinds, graph.guard_source)


def test_a_confirmed_graph_calls_inductors_code_alone_and_computes_what_dynamo_computes(recorded):
    """confirm runs the wrapped graph and Inductor's code on the same inputs; they agree bit for bit
    here, so later calls skip AOTAutograd's wrappers, with the same results at every accepted length."""
    model, graphs, call = recorded
    with torch.inference_mode():
        want = call(*_inputs())
        graph = _unconfirmed(graphs[0])
        assert not graph.confirmed and not graph.calls_inner
        assert torch.equal(graph.confirm(_inputs())[0], want)
        assert graph.confirmed and graph.calls_inner
        for length, seed in ((5, 0), (9, 1), (300, 2)):
            inputs = _inputs(length=length, seed=seed)
            assert torch.equal(graph(inputs)[0], graphs[0].run(*graphs[0].args(inputs))[0])
            torch.testing.assert_close(graph(inputs)[0], _forward(model, *inputs), rtol=1e-6, atol=1e-6)


def test_a_graph_whose_inner_code_answers_otherwise_keeps_the_wrappers(recorded):
    model, graphs, call = recorded
    with torch.inference_mode():
        want = call(*_inputs())
        wrapped = graphs[0].run

        def run(*args):
            return wrapped(*args)

        run.current_callable = lambda args: [torch.zeros_like(want)]  # what Inductor's code would be
        graph = _unconfirmed(graphs[0], run)
        assert torch.equal(graph.confirm(_inputs())[0], want)  # the wrappers' results
        assert graph.confirmed and not graph.calls_inner
        assert torch.equal(graph(_inputs())[0], want)


def test_a_recorded_graph_reads_the_weights_in_place(recorded):
    model, graphs, call = recorded
    with torch.inference_mode():
        call(*_inputs())
        inputs = _inputs(seed=3)
        (before,) = graphs[0](inputs)
        with torch.no_grad():
            model.offset.add_(1.0)  # written in place, as a hot swap writes an expert
        try:
            torch.testing.assert_close(graphs[0](inputs)[0], before + 0.5)
        finally:
            model.offset.sub_(1.0)


@pytest.mark.parametrize(
    "what, inputs",
    [
        ("another static batch size", lambda: _inputs(batch=3)),
        ("a dynamic size Dynamo specialises (1)", lambda: _inputs(length=1)),
        ("another dtype", lambda: _inputs(dtype=torch.float64)),
        ("a normal tensor where an inference tensor was traced", lambda: tuple(t.clone() for t in _inputs())),
        ("a transposed (strided) input", lambda: (_inputs()[0].t().contiguous().t(), _inputs()[1])),
    ],
)
def test_a_recorded_graph_refuses_inputs_it_was_not_compiled_for(recorded, what, inputs):
    _, graphs, call = recorded
    with torch.inference_mode():
        call(*_inputs())
    assert not graphs[0].accepts(inputs()), what
    assert not graphs[0].accepts_reference(inputs()), what


def _kind(t: torch.Tensor) -> tuple:
    return t.dtype, t.device, t.is_inference(), t.requires_grad


# A guard text as Dynamo writes them: static sizes, strides as products of sizes, an offset, a
# relation between two inputs' dynamic sizes, one of them named twice in a term.
GUARDS = ("L['t0'].size()[0] == 2 and L['t0'].stride()[0] == 8 and L['t0'].storage_offset() == 0 and "
          "L['t1'].stride()[0] == L['t1'].size()[1] and L['t1'].size()[0] == L['t0'].size()[0] and "
          "(4*L['t1'].size()[1]) != (4*L['t2'].size()[0]) and 2 <= L['t1'].size()[1] and L['t1'].size()[1] <= L['t2'].size()[0]")


def _guarded(*inputs) -> tuple:
    with torch.inference_mode():
        return tuple(t.clone() for t in inputs)


def _views(first, second, third, view_second, view_first=lambda t: t) -> tuple:
    """Inference tensors, the first two through the given views (an offset, a stride the guards refuse)."""
    first, second, third = _guarded(first, second, third)
    return view_first(first), view_second(second), third


@pytest.mark.parametrize(
    "what, inputs, accepted",
    [
        ("as traced", lambda: _guarded(torch.ones(2, 8), torch.ones(2, 5, dtype=torch.bool), torch.ones(9)), True),
        ("another length", lambda: _guarded(torch.ones(2, 8), torch.ones(2, 8, dtype=torch.bool), torch.ones(12)), True),
        ("another static size", lambda: _guarded(torch.ones(3, 8), torch.ones(3, 5, dtype=torch.bool), torch.ones(9)), False),
        ("a relation broken (equal lengths)", lambda: _guarded(torch.ones(2, 8), torch.ones(2, 9, dtype=torch.bool), torch.ones(9)), False),
        ("a relation broken (longer)", lambda: _guarded(torch.ones(2, 8), torch.ones(2, 10, dtype=torch.bool), torch.ones(9)), False),
        ("a dynamic size below its least", lambda: _guarded(torch.ones(2, 8), torch.ones(2, 1, dtype=torch.bool), torch.ones(9)), False),
        ("a strided input", lambda: _views(torch.ones(2, 8), torch.ones(2, 10, dtype=torch.bool), torch.ones(9), lambda t: t[:, :5]), False),
        ("an offset input", lambda: _views(torch.ones(3, 8), torch.ones(2, 5, dtype=torch.bool), torch.ones(9), lambda t: t, lambda t: t[1:]), False),
        ("another dtype", lambda: _guarded(torch.ones(2, 8, dtype=torch.float64), torch.ones(2, 5, dtype=torch.bool), torch.ones(9)), False),
        ("a normal tensor", lambda: _guarded(torch.ones(2, 8), torch.ones(2, 5, dtype=torch.bool))[:2] + (torch.ones(9),), False),
        ("one input short", lambda: _guarded(torch.ones(2, 8), torch.ones(2, 5, dtype=torch.bool)), False),
    ],
)
def test_the_compiled_check_answers_as_the_guard_text_evaluated(what, inputs, accepted):
    """DirectGraph.accepts (compile_check: one function, each size and stride read once) against
    accepts_reference (the guard text evaluated as Dynamo wrote it), on inputs either side of each guard."""
    traced = _guarded(torch.ones(2, 8), torch.ones(2, 5, dtype=torch.bool), torch.ones(9))
    graph = DirectGraph(None, (), compile_guards(GUARDS), tuple(_kind(t) for t in traced), GUARDS)
    assert graph.accepts_reference(inputs()) is accepted, what
    assert graph.accepts(inputs()) is accepted, what


def test_a_guard_text_read_some_other_way_falls_back_to_the_reference():
    """compile_check takes only size(), stride() and storage_offset() of an input: other reads of L
    (none Dynamo writes today) leave the graph to the guard text evaluated as it is."""
    text = "L['t0'].dim() == 1"
    kinds = (_kind(_guarded(torch.ones(3))[0]),)
    assert compile_check(kinds, text) is None
    graph = DirectGraph(None, (), compile_guards(text), kinds, text)
    assert graph.accepts(_guarded(torch.ones(3))) and not graph.accepts(_guarded(torch.ones(3, 1)))
    assert compile_check(kinds, None)(*_guarded(torch.ones(3)))  # no guards: the kinds alone


def test_a_graph_reading_a_tensor_the_model_does_not_hold_is_not_recorded():
    model, outside, graphs = Scaled().eval(), torch.ones(4), []

    def backend(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        run = compile_fx(gm, example_inputs)
        graphs.append(direct_graph(gm, example_inputs, run, (x,), held_tensors(model), outputs=1))
        return run

    x = torch.randn(2, 8)
    fn = torch.compile(lambda m, x: m.proj(x) + outside, backend=backend, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        fn(model, x)
    assert graphs == [None]


def test_held_tensors_are_parameters_buffers_attributes_and_tuples_of_them():
    model = Scaled()
    held = held_tensors(model)
    for t in (model.proj.weight, model.proj.bias, model.offset, *model.pair):
        assert id(t) in held
    assert len(held) == 5


@pytest.mark.parametrize("returns", [lambda m, x: (x, m.proj(x)), lambda m, x: (m.proj(x),) * 2])
def test_a_graph_that_returns_an_input_or_one_value_twice_is_not_recorded(returns):
    """Dynamo rebuilds such results outside the graph: the graph's own list would not be them."""
    model, graphs = Scaled().eval(), []
    x = torch.randn(2, 8)

    def backend(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        run = compile_fx(gm, example_inputs)
        graphs.append(direct_graph(gm, example_inputs, run, (x,), held_tensors(model), outputs=2))
        return run

    with torch.inference_mode():
        torch.compile(returns, backend=backend, fullgraph=True, dynamic=False)(model, x)
    assert graphs == [None]
