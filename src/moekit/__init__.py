"""moekit: count, run and fit Mixture-of-Experts language models.

`moekit.load(path)` returns the engine (imports torch); the calculator in `moekit.calc` and the
specs in `moekit.spec` import without torch.
"""

from typing import Optional

__version__ = "0.1.0"


def load(path, dtype: str = "float32", device: str = "cpu", expert_memory=None, weights: str = "dtype",
         verify: bool = True, compile: Optional[bool] = None, kernels: str = "auto", **offload):
    """Load a Hugging Face MoE checkpoint folder into the native engine.

    expert_memory ("25%", "2GiB", or bytes) pages routed experts from disk under that budget;
    `offload` takes the rest of moekit.offload.options.OffloadOptions (policy, pin, prefetch, ...).
    Call `engine.close()` when done with an offloaded engine (it stops the reader threads).
    weights="int8" quantizes every projection to int8 (one scale per 32 inputs) once at load;
    "int8-experts" the routed experts only. verify=False skips checking the weights against the
    checksums of moekit-experts.json (checked on every load when one lies beside the checkpoint).
    The decode steps run as one compiled graph (moekit.model.compiled_step; the first step of a
    model on this machine compiles it, minutes, later processes load it from ~/.cache/moekit/compile),
    or eagerly where the model or options do not compile (engine.notes says why). compile=False runs
    them eagerly, the reference path; so does kernels="reference" (never loading moekit's C++
    operators: every product the plain PyTorch way) unless compile=True."""
    from moekit.engine.loader import load_engine

    options = None
    if expert_memory is not None:
        from moekit.offload.options import OffloadOptions

        options = OffloadOptions(expert_memory=str(expert_memory), **offload)
    return load_engine(path, dtype=dtype, device=device, offload=options, weights=weights, verify=verify,
                       compile=compile, kernels=kernels)
