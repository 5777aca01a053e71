"""Tiny random checkpoints of every family, written by transformers' own save_pretrained.

Routers are re-initialised with a large std (the default 0.02 leaves router logits nearly tied, so
top-K comparisons would hinge on rounding) and DeepSeek gets a non-zero selection bias. Every
config is small enough that a 24-token greedy run takes well under a second.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 160
MAX_POS = 256
# Router weights this wide put router logits a few units apart: top-K is decided by the model,
# not by the last bit of rounding (the default 0.02 leaves them nearly tied).
ROUTER_STD = 1.5

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=MAX_POS,
    initializer_range=0.06,  # wider than the default: logits far enough apart for stable argmax
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

FAMILIES: dict[str, dict] = {
    "mixtral": dict(intermediate_size=32, num_hidden_layers=2, num_local_experts=6, num_experts_per_tok=2),
    "qwen3_moe": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        head_dim=12,
    ),
    "qwen2_moe": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_hidden_layers=3,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        mlp_only_layers=[1],  # a dense layer between MoE layers
    ),
    "olmoe": dict(intermediate_size=32, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2),
    "granitemoe": dict(
        intermediate_size=32,
        num_hidden_layers=2,
        num_local_experts=6,
        num_experts_per_tok=2,
        embedding_multiplier=4.0,
        residual_multiplier=0.5,
        attention_multiplier=0.1,
        logits_scaling=2.0,
    ),
    "gpt_oss": dict(
        intermediate_size=32,
        num_hidden_layers=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        head_dim=12,
        sliding_window=8,  # shorter than prompt + new tokens, so the window matters
        layer_types=["sliding_attention", "full_attention"],
    ),
    "deepseek_v3": dict(
        intermediate_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        n_shared_experts=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        routed_scaling_factor=2.5,
        num_nextn_predict_layers=0,
    ),
    "phimoe": dict(
        intermediate_size=32,
        num_hidden_layers=2,
        num_local_experts=6,
        num_experts_per_tok=2,
        router_jitter_noise=0.01,
        attention_bias=True,
        lm_head_bias=True,
    ),
    "dbrx": dict(
        d_model=48,
        n_heads=4,
        n_layers=2,
        max_seq_len=256,
        attn_config=dict(kv_n_heads=2, clip_qkv=0.25, rope_theta=10000.0),  # small enough to clip
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=6, moe_top_k=2, moe_normalize_expert_weights=1.0),
    ),
    "llama4_text": dict(
        intermediate_size=32,  # experts and the shared expert
        intermediate_size_mlp=64,  # the dense layers
        num_hidden_layers=4,
        head_dim=12,
        num_local_experts=6,
        num_experts_per_tok=2,  # Llama 4 routes one; two exercise the sum over K and the tiers
        interleave_moe_layer_step=2,  # layers 1 and 3 MoE, 0 and 2 dense
        no_rope_layers=[1, 1, 0, 1],  # layer 2 NoPE: full attention, temperature-tuned queries
        attention_chunk_size=5,  # shorter than prompt + new tokens, so chunks matter
        floor_scale=4,  # the query temperature changes every 4 positions (8192 would never here)
        attn_scale=0.5,
    ),
    "llama": dict(intermediate_size=64, num_hidden_layers=2),
    "qwen3": dict(intermediate_size=64, num_hidden_layers=2, head_dim=12),
}

MOE_FAMILIES = (
    "mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "granitemoe", "gpt_oss", "deepseek_v3", "phimoe", "dbrx", "llama4_text",
)
DENSE_FAMILIES = ("llama", "qwen3")

# For tests/model/test_compiled_step.py, whose cost is cold compiles of the decode step (they grow
# with the layers: its DeepSeek-V3 and Llama 4 cases took 0.7x the CPU with these, docs/TESTING.md),
# and whose checks do not depend on the count: each kind of layer once. DeepSeek-V3's dense layer and
# one MoE layer (first_k_dense_replace = 1; latent attention in both); Llama 4's dense layer with
# chunked attention and a MoE layer with NoPE attention (no_rope_layers: 1 = RoPE); Qwen2-MoE's MoE
# layer and its dense one (mlp_only_layers = [1]). The other families have two layers already.
# DeepSeek-V3's and Llama 4's MoE layer stays layer 1, after a dense one: a MoE layer's index is
# still not its rank among the MoE layers.
FEWER_LAYERS = {
    "deepseek_v3": dict(num_hidden_layers=2),
    "llama4_text": dict(num_hidden_layers=2, no_rope_layers=[1, 0]),
    "qwen2_moe": dict(num_hidden_layers=2),
}


def tiny_config(family: str, **overrides):
    from transformers import AutoConfig

    kwargs = {**COMMON, **FAMILIES[family], **overrides}
    return AutoConfig.for_model(family, **kwargs)


def _spread_routers(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, module in model.named_modules():
        if not type(module).__name__.lower().endswith(("router", "topkrouter")):
            continue
        if not hasattr(module, "weight"):
            module = module.layer  # DBRX's router holds its Linear as .layer
        with torch.no_grad():
            w = module.weight
            w.copy_(torch.randn(w.shape, generator=gen) * ROUTER_STD)
            if getattr(module, "bias", None) is not None and isinstance(module.bias, torch.Tensor):
                module.bias.copy_(torch.randn(module.bias.shape, generator=gen) * ROUTER_STD)
            if hasattr(module, "e_score_correction_bias"):
                b = module.e_score_correction_bias
                b.copy_(torch.randn(b.shape, generator=gen) * 0.3)


def build_reference(family: str, seed: int = 0, **overrides):
    """The transformers model (fp32, eager attention): the oracle."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    _spread_routers(model, seed + 1)
    return model


def write_checkpoint(family: str, folder: Path, seed: int = 0, save_kwargs: dict | None = None, **overrides) -> Path:
    model = build_reference(family, seed, **overrides)
    model.save_pretrained(folder, **(save_kwargs or {}))
    return folder


CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Mixture of experts routes each token.",
    "naïve café, déjà vu, Grüße, 日本語のテキスト, emoji ✓ and π ≈ 3.14159",
] * 20


def train_tokenizer(path: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE trained here (no hub): ids 0, 1, 2 are <pad>, <s>, </s> like the configs above."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<pad>", "<s>", "</s>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(path))
    return path


def reference_routing(model, ids: list[int]) -> dict[int, list[list[int]]]:
    """Expert ids transformers chose, per MoE layer, per token of one forward over `ids`.

    Every MoE block of every family calls `self.experts(hidden, topk_ids, topk_weights)`, so a
    pre-hook on each `...layers.N.<block>.experts` (DBRX: `blocks.N`) module sees the choice whatever the router.
    llama4's experts see every token pre-weighed instead: its router's top-K of its logits is the choice.
    """
    chosen: dict[int, list[list[int]]] = {}
    hooks = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if type(module).__name__ == "Llama4Router":
            layer = int(parts[parts.index("layers") + 1])

            def llama4_hook(mod, args, output, layer=layer):
                chosen[layer] = torch.topk(output[1], mod.top_k, dim=1).indices.tolist()

            hooks.append(module.register_forward_hook(llama4_hook))
            continue
        stack = "layers" if "layers" in parts else "blocks"  # DBRX's transformer.blocks.N
        if parts[-1] != "experts" or stack not in parts or type(module).__name__ == "Llama4TextExperts":
            continue
        layer = int(parts[parts.index(stack) + 1])

        def hook(mod, args, kwargs, layer=layer):
            topk = args[1] if len(args) > 1 else next(iter(v for k, v in kwargs.items() if "ind" in k))
            chosen[layer] = topk.reshape(-1, topk.shape[-1]).tolist()

        hooks.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return chosen


def assert_engine_matches_reference(family: str, folder: Path, prompt: list[int], new: int = 20, seed: int = 0, **overrides):
    """Write the reference of `family` to `folder` with save_pretrained, load it with moekit, and hold
    moekit to it: greedy tokens equal, last-position logits within 1e-4."""
    from moekit.engine.loader import load_engine

    model = build_reference(family, seed, **overrides)
    model.save_pretrained(folder)
    model.generation_config.eos_token_id = None
    engine = load_engine(folder, compile=False)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new, pad_token_id=0)
        want_logits = model(ids).logits[0, -1]
        got_logits = engine.decoder(ids, engine.decoder.new_cache(1, len(prompt)), torch.arange(len(prompt))[None])[0, -1]
    assert engine.generate([prompt], max_new_tokens=new, stop_ids=()).token_ids[0] == want[0, len(prompt) :].tolist()
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
