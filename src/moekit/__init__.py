"""moekit: count, run and fit Mixture-of-Experts language models.

`moekit.load(path)` returns the engine (imports torch); the calculator in `moekit.calc` and the
specs in `moekit.spec` import without torch.
"""

__version__ = "0.1.0"


def load(path, dtype: str = "float32", device: str = "cpu", expert_memory=None, weights: str = "dtype",
         verify: bool = True, compile: bool = False, kernels: str = "auto", **offload):
    """Load a Hugging Face MoE checkpoint folder into the native engine.

    expert_memory ("25%", "2GiB", or bytes) pages routed experts from disk under that budget;
    `offload` takes the rest of moekit.offload.options.OffloadOptions (policy, pin, prefetch, ...).
    Call `engine.close()` when done with an offloaded engine (it stops the reader threads).
    weights="int8" quantizes every projection to int8 (one scale per 32 inputs) once at load;
    "int8-experts" the routed experts only. verify=False skips checking the weights against the
    checksums of moekit-experts.json (checked on every load when one lies beside the checkpoint).
    compile=True runs the decode steps as one compiled graph (engine.notes says when it cannot).
    kernels="reference" never loads moekit's C++ operators: every product the plain PyTorch way."""
    from moekit.engine.loader import load_engine

    options = None
    if expert_memory is not None:
        from moekit.offload.options import OffloadOptions

        options = OffloadOptions(expert_memory=str(expert_memory), **offload)
    return load_engine(path, dtype=dtype, device=device, offload=options, weights=weights, verify=verify,
                       compile=compile, kernels=kernels)
