"""Every private torch API moekit still calls, in one place, each with why and what would replace it.
A torch upgrade that moves one breaks here, not in the middle of the model."""

from __future__ import annotations

import torch
# The namespace Dynamo's guard expressions are evaluated in: direct_graph evaluates a graph's shape
# guards itself, to call it without Dynamo. Replace with: a public guard-evaluation API.
from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP  # noqa: F401


def assume_constant_result(fn):
    """Dynamo evaluates fn once while tracing and bakes its answer into the graph (the kernel choice
    per kind of weight, measured before tracing). Why: the choice is a Python value read from a JSON
    file, which Dynamo cannot trace. Replace with: passing the choice into the step as a constant
    argument once the forward pass is one function over a config (issue 34, item 4)."""
    return torch._dynamo.assume_constant_result(fn)


def mark_dynamic(t: torch.Tensor, dim: int, **kwargs) -> None:
    """Mark a tensor's dimension as dynamic before Dynamo sees it (batch and cache length), so one
    graph serves every length. Replace with: torch.compile's public dynamic-shape hints
    (torch.export.Dim-style markers for torch.compile) once they cover a held cache stack."""
    torch._dynamo.mark_dynamic(t, dim, **kwargs)


def compile_fx(gm, example_inputs, **kwargs):
    """Inductor's entry point, called by the compiled step's recording backend so that it can keep
    how to call a graph without Dynamo (moekit.model.direct_graph). Replace with: a public backend
    hook that hands back the compiled callable with its guards."""
    from torch._inductor.compile_fx import compile_fx as inductor_compile_fx

    return inductor_compile_fx(gm, example_inputs, **kwargs)


def inductor_callable(run):
    """The code Inductor generated for a compiled graph (it takes the flat arguments as one list and
    returns the outputs), under the AOTAutograd runtime wrappers that `run`, what the backend handed
    Dynamo, calls it through; None where `run` does not carry it. Why: on an inference graph whose
    inputs and outputs need no handling (no aliasing, no mutation left to the wrapper) those wrappers
    only cost time: ~0.1 ms of a ~4 ms decode step here (moekit.model.direct_graph calls this once
    a run of both gave the same results). Replace with: a public way to call a compiled graph's code."""
    return getattr(run, "current_callable", None)


def detect_fake_mode():
    """The fake tensor mode of the inputs Dynamo passes a backend (direct_graph tells fake inputs
    from real ones). Replace with: a public accessor on the backend's inputs."""
    return torch._guards.detect_fake_mode()


def cpu_has_avx512_bf16() -> bool:
    """Whether the CPU multiplies bf16 pairs (AVX512-BF16): the kernel choice keeps that build for
    bf16 unless another is clearly faster. Replace with: torch.backends.cpu's capability string once
    it names AVX512-BF16."""
    return bool(torch.cpu._is_avx512_bf16_supported())


def onednn_bf16_supported() -> bool:
    """Whether oneDNN has bf16 kernels on this CPU (the ONEDNN kernel for bf16 weights). Replace
    with: a public torch.backends.mkldnn query."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_reorder(weight: torch.Tensor) -> torch.Tensor:
    """A weight in oneDNN's own blocked layout, once at load. Replace with: torch.ao's public
    prepacked linear for bf16 once it exists on CPU."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias) -> torch.Tensor:
    """F.linear on a weight onednn_reorder laid out. Replace with: as onednn_reorder."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def storage_use_count(t) -> int:
    """How many tensors share t's storage (huge_pages refuses to move a weight still shared). Replace
    with: a public storage reference count, or tracking the views moekit makes itself."""
    return torch._C._storage_Use_Count(t._cdata)  # t: a tensor or an untyped storage


def inductor_cache_dir(directory: str):
    """A context in which Inductor's on-disk caches (FX-graph, AOTAutograd, the C++ it compiles) are
    in `directory`: moekit.model.compile_cache's kernels folder, shared by every model of a build (it
    sends the FX-graph and AOTAutograd caches back to each model's own folder), not torch's default
    under /tmp. Why private: torch has no public setting for it besides its environment variable, which
    this sets for the block and restores. Replace with: a public cache-directory option of
    torch.compile."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    return temporary_cache_dir(directory)


def grouped_mm(x: torch.Tensor, weights_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [N, in] (rows grouped by expert), weights_t [E, in, out], offsets [E] int32 (each group's
    end row) → [N, out]: every group's rows times its expert's weight, in one call. On CPU torch
    runs each group's product as the one-expert GEMM (bit for bit F.linear's, tested), in one op
    instead of one per expert. Replace with: torch's public grouped GEMM once it has one."""
    return torch._grouped_mm(x, weights_t, offs=offsets)


def serializable_compile():
    """A context in which Inductor's compiled graphs can be serialised whole (serialize_compiled):
    AOTAutograd bundles the compiled code into its cache entry instead of a key to Inductor's.
    Why private: torch's own precompile (torch.compile(...).aot_compile) serialises Dynamo's guards
    and bytecode too and needs its own backend, but the step keeps its own guards
    (moekit.model.direct_graph). Replace with: a public option of torch.compile to return
    serialisable compiled graphs from a custom backend."""
    return torch._functorch.config.patch(bundled_autograd_cache=True)


def serialize_compiled(run) -> bytes | None:
    """The bytes of a graph compile_fx returned under serializable_compile (None where it cannot be
    serialised). Replace with: as serializable_compile."""
    if getattr(run, "serialize", None) is None:
        return None
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Bundled

    return Bundled.serialize_compile_artifacts(Bundled(run))


def deserialize_compiled(data: bytes):
    """The callable serialize_compiled's bytes hold (flat arguments, as compile_fx's). Replace with:
    as serializable_compile."""
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Bundled

    return Bundled.deserialize_compile_artifacts(data)


def inductor_options(options: dict):
    """A context in which Inductor's config has `options` (its dotted names: "cpp.vec_isa_ok"): for
    loading a saved graph under the options it was compiled with (moekit.model.saved_graphs). Why
    private: torch._inductor.config is Inductor's own module. Replace with: a public options argument
    on loading compiled artefacts."""
    from torch._inductor import config

    return config.patch(options)
