"""The C entry points (csrc/shims.cpp) that Inductor's generated C++ calls instead of the boxed
dispatcher: their declarations, for Inductor's aot_inductor.custom_ops_to_c_shims."""

from __future__ import annotations

# The operators the compiled step calls, with the arguments of their C entry points.
C_ARGS = {
    "rows_gemv": "AtenTensorHandle x, AtenTensorHandle w, int32_t grouped",
    "experts_gemv": "AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle ids, int32_t grouped",
    "rows_q8": "AtenTensorHandle x, AtenTensorHandle w, int32_t grouped",
    "experts_q8": "AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle ids, int32_t grouped",
    "latent_attend": "AtenTensorHandle query, AtenTensorHandle cached, AtenTensorHandle visible, double scale, int64_t r",
    "attend": "AtenTensorHandle query, AtenTensorHandle keys, AtenTensorHandle values, AtenTensorHandle allowed, double scale",
    "rows_tiles": "AtenTensorHandle x, AtenTensorHandle w",
    "experts_tiles": "AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle ids",
    "experts_mxfp4": "AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle ids",
    "experts_fp8": "AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle ids, int64_t block",
}


def declaration(name: str, suffix: str) -> str:
    """The C declaration of one operator's entry point in a build whose names end in suffix."""
    return f"AOTITorchError aoti_torch_cpu_{name}{suffix}({C_ARGS[name]}, AtenTensorHandle* ret0)"


class ShimTable(dict):
    """aot_inductor.custom_ops_to_c_shims: operator → [its C declaration]. A dict that pickles by the
    operators' names: Inductor's FX-graph and AOTAutograd caches hash the config by pickling it, and
    an OpOverload pickles by value (its pybind11 handles), which made every compile of the step
    bypass both caches (measured: `fxgraph_cache_bypass`, ~35 s of Inductor each process)."""

    def __reduce__(self):
        return _shim_table, (tuple(sorted((op.name(), shims) for op, shims in self.items())),)


def _shim_table(named: tuple) -> ShimTable:
    """A ShimTable from (qualified operator name, declarations) pairs (the inverse of its __reduce__)."""
    import torch

    table = ShimTable()
    for name, shims in named:
        space, rest = name.split("::", 1)
        op_name, _, overload = rest.partition(".")
        table[getattr(getattr(getattr(torch.ops, space), op_name), overload or "default")] = list(shims)
    return table
