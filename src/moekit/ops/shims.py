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
}


def declaration(name: str, suffix: str) -> str:
    """The C declaration of one operator's entry point in a build whose names end in suffix."""
    return f"AOTITorchError aoti_torch_cpu_{name}{suffix}({C_ARGS[name]}, AtenTensorHandle* ret0)"
