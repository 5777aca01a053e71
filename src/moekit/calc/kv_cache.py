"""KV cache and recurrent state: what a decoder keeps per token, and per sequence at a context.

- MHA / GQA layers cache K and V: 2 · kv_heads · head_dim elements per token.
- MLA layers (DeepSeek) cache the compressed latent plus the shared rope key:
  kv_lora_rank + qk_rope_head_dim elements per token, as DeepSeek's inference code and vLLM do
  (transformers' own cache stores the decompressed K and V, which is far larger).
- Sliding-window layers keep at most `sliding_window` tokens; chunked-attention layers (llama4)
  at most `chunk_size`.
- Mamba layers keep a constant state per sequence: conv state d_inner · d_conv plus SSM state
  d_inner · d_state (the shapes of transformers' Jamba cache), whatever the context.
"""

from __future__ import annotations

from dataclasses import dataclass

from moekit.calc.dtypes import DType
from moekit.spec.model_spec import AttentionSpec, MambaSpec, ModelSpec


def kv_elems_per_token(attention: AttentionSpec) -> int:
    """Cached elements one token adds to one attention layer."""
    if attention.kind == "mla":
        return attention.kv_lora_rank + attention.qk_rope_head_dim
    return 2 * attention.num_kv_heads * attention.head_dim


def cached_tokens(attention: AttentionSpec, context: int) -> int:
    """Tokens a layer attends over (and keeps) at `context`."""
    caps = [c for c in (attention.sliding_window, attention.chunk_size) if c]
    return min([context, *caps])


def mamba_state_elems(mamba: MambaSpec) -> int:
    return mamba.d_inner * (mamba.d_conv + mamba.d_state)


@dataclass(frozen=True)
class KVCache:
    dtype: str
    context: int
    batch: int
    bytes_per_token: int  # one more token in every attention layer, before window caps
    attention_bytes_per_sequence: int  # at `context`, windows capped
    state_bytes_per_sequence: int  # mamba layers, independent of context
    bytes_per_sequence: int
    total_bytes: int  # × batch


def kv_cache(spec: ModelSpec, dtype: DType, context: int, batch: int) -> KVCache:
    per_token = attention_elems = state_elems = 0
    for layer in spec.layers:
        mixer = layer.mixer
        if isinstance(mixer, AttentionSpec):
            per_token += kv_elems_per_token(mixer)
            attention_elems += kv_elems_per_token(mixer) * cached_tokens(mixer, context)
        else:
            state_elems += mamba_state_elems(mixer)
    attention_bytes = dtype.bytes_for(attention_elems)
    state_bytes = dtype.bytes_for(state_elems)
    return KVCache(
        dtype=dtype.name,
        context=context,
        batch=batch,
        bytes_per_token=dtype.bytes_for(per_token),
        attention_bytes_per_sequence=attention_bytes,
        state_bytes_per_sequence=state_bytes,
        bytes_per_sequence=attention_bytes + state_bytes,
        total_bytes=(attention_bytes + state_bytes) * batch,
    )
