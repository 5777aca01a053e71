"""Random-weight checkpoints of realistic shape for the decode benchmarks, written by transformers.

Three sizes (~10M, ~150M, ~1B parameters) in two families (qwen3_moe: softmax top-K over many
small experts; deepseek_v3: MLA attention, sigmoid group-limited routing, a shared expert and a
dense first layer). The 150M qwen3_moe has 32 experts, top-4. Weights are random (transformers'
own init; routers widened so routing is not a near-tie everywhere) and saved in bfloat16, as Hub
checkpoints are; the engine and transformers both cast on load. Each folder also gets a real
tokenizer (a byte-level BPE of TOKENIZER_VOCAB ids trained here on the repository's own text; the
config's vocab is larger, the rest of its ids are unused): llama.cpp's converter needs one.

    .venv/bin/python benchmarks/make_checkpoints.py                # all sizes into bench-out/ckpt
    .venv/bin/python benchmarks/make_checkpoints.py --sizes 10m,150m --families qwen3_moe

bench-out/ is git-ignored. Nothing here is imported by moekit.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

VOCAB = 32000
TOKENIZER_VOCAB = 4096
REPO = Path(__file__).resolve().parents[1]

SHAPES: dict[tuple[str, str], dict] = {
    ("qwen3_moe", "10m"): dict(
        vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, intermediate_size=512, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=2,
    ),
    ("qwen3_moe", "150m"): dict(
        vocab_size=VOCAB, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        head_dim=64, intermediate_size=1536, moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4,
    ),
    ("qwen3_moe", "1b"): dict(
        vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=18, num_attention_heads=16, num_key_value_heads=4,
        head_dim=64, intermediate_size=3072, moe_intermediate_size=256, num_experts=64, num_experts_per_tok=8,
    ),
    ("deepseek_v3", "10m"): dict(
        vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=768, moe_intermediate_size=128, n_routed_experts=16, num_experts_per_tok=4,
        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=96,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    ),
    ("deepseek_v3", "150m"): dict(
        vocab_size=VOCAB, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
        intermediate_size=1536, moe_intermediate_size=256, n_routed_experts=32, num_experts_per_tok=4,
        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=128, q_lora_rank=256,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
    ),
    ("deepseek_v3", "1b"): dict(
        vocab_size=VOCAB, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
        intermediate_size=3072, moe_intermediate_size=256, n_routed_experts=64, num_experts_per_tok=6,
        n_group=8, topk_group=4, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=256, q_lora_rank=512,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
    ),
}

COMMON = dict(max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# As the real checkpoints have them, and as llama.cpp reads them (`--vs llama.cpp`): qwen3_moe
# renormalises its top-K weights (llama.cpp's qwen3moe graph does so whatever the config says);
# deepseek_v3 states its sigmoid scoring (transformers implies it; llama.cpp's converter reads
# `scoring_func` and falls back to DeepSeek-V2's softmax without it).
FAMILY_EXTRA = {"deepseek_v3": dict(num_nextn_predict_layers=0, routed_scaling_factor=2.5, rope_scaling=None,
                                    scoring_func="sigmoid", topk_method="noaux_tc"),
                "qwen3_moe": dict(norm_topk_prob=True)}


def build(family: str, size: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(family, **COMMON, **FAMILY_EXTRA.get(family, {}), **SHAPES[(family, size)])
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, module in model.named_modules():
            if type(module).__name__.lower().endswith(("router", "topkrouter")):
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.1)
                if hasattr(module, "e_score_correction_bias"):
                    module.e_score_correction_bias.copy_(torch.randn(module.e_score_correction_bias.shape, generator=gen) * 0.1)
    return model


def _repository_text():
    for pattern in ("docs/*.md", "src/moekit/**/*.py"):
        for path in sorted(REPO.glob(pattern)):
            yield path.read_text(errors="replace")


def write_tokenizer(folder: Path, vocab_size: int = TOKENIZER_VOCAB) -> None:
    """tokenizer.json + tokenizer_config.json by the trainer the demo model's tokenizer came from:
    ids 0, 1, 2 are pad, bos, eos, as in COMMON."""
    from moekit.train.tokenizer import save_tokenizer, train_tokenizer

    save_tokenizer(train_tokenizer(_repository_text(), vocab_size), folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-out/ckpt")
    parser.add_argument("--sizes", default="10m,150m,1b")
    parser.add_argument("--families", default="qwen3_moe,deepseek_v3")
    args = parser.parse_args()
    for family in args.families.split(","):
        for size in args.sizes.split(","):
            folder = Path(args.out) / f"{family}-{size}"
            if (folder / "config.json").is_file():
                if not (folder / "tokenizer.json").is_file():
                    write_tokenizer(folder)
                print(f"{folder}: exists, kept")
                continue
            model = build(family, size)
            params = sum(p.numel() for p in model.parameters())
            model.to(torch.bfloat16).save_pretrained(folder)
            write_tokenizer(folder)
            (folder / "moekit-bench.json").write_text(json.dumps({"family": family, "size": size, "params": params}))
            print(f"{folder}: {params / 1e6:.1f}M params")
            del model


if __name__ == "__main__":
    main()
