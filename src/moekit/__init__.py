"""moekit: count, run and fit Mixture-of-Experts language models.

`moekit.load(path)` returns the engine (imports torch); the calculator in `moekit.calc` and the
specs in `moekit.spec` import without torch.
"""

__version__ = "0.1.0"


def load(path, dtype: str = "float32", device: str = "cpu"):
    """Load a Hugging Face MoE checkpoint folder into the native engine."""
    from moekit.engine.loader import load_engine

    return load_engine(path, dtype=dtype, device=device)
