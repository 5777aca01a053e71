"""What a model IS: ModelSpec, its adapters per Hugging Face model_type, and bundled presets."""

from moekit.spec.loading import list_presets, load_spec, spec_from_config, supported_model_types
from moekit.spec.model_spec import (
    AttentionSpec,
    LayerSpec,
    MambaSpec,
    MLPSpec,
    ModelSpec,
    MoESpec,
    Multipliers,
    NormSpec,
    RopeSpec,
    RouterSpec,
)

__all__ = [
    "AttentionSpec",
    "LayerSpec",
    "MLPSpec",
    "MambaSpec",
    "ModelSpec",
    "MoESpec",
    "Multipliers",
    "NormSpec",
    "RopeSpec",
    "RouterSpec",
    "list_presets",
    "load_spec",
    "spec_from_config",
    "supported_model_types",
]
