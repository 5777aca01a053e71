"""A random-weight qwen3_moe checkpoint of about 2 GB (bf16) whose routed experts are >= 90% of the bytes.

The model for `moekit bench offload`: big enough that an expert-memory budget of 25% is a real
cap on this machine, fine-grained like Qwen3-30B-A3B (128 experts, top-8, renormalised), small
enough to write in a minute. Written in the Hub's format (config.json, sharded
model-0000i-of-0000n.safetensors, model.safetensors.index.json; the per-expert tensor names
transformers' save_pretrained writes for Qwen3MoeForCausalLM), shard by shard with safetensors'
save_file, so writing needs one shard of RAM, not the model.

    .venv/bin/python benchmarks/make_offload_checkpoint.py                  # bench-out/ckpt/offload-2g
    .venv/bin/python benchmarks/make_offload_checkpoint.py --size small     # bench-out/ckpt/offload-small

The arithmetic of "2g" (D hidden 1024, L 16 layers, E 128 experts of width F 160, K 8, GQA 16 q /
4 kv heads of 64, vocab 32000, untied head):
  routed experts  L * E * 3 * D * F      = 16 * 128 * 3 * 1024 * 160 = 1,006,632,960
  attention       L * (2 * D*1024 + 2 * D*256 + 2*64)                =    41,945,088
  routers         L * E * D                                          =     2,097,152
  embed + head    2 * 32000 * D                                      =    65,536,000
  norms           L * 2 * D + D                                      =        33,792
  total                                                              = 1,116,244,992 params
  = 2.23 GB (2.08 GiB) in bf16; routed experts 90.2% of it, active per token K/E of them.
`moekit calc bench-out/ckpt/offload-2g` shows the same count; this script checks its own tensor
list against moekit's calculator before writing anything.

Weights are N(0, initializer_range) from a torch.Generator seeded per tensor name (the bytes of a
tensor do not depend on the sharding), norms are ones, and the routers are wider (ROUTER_STD) so
routing is decided by the weights rather than near-ties. Routing of random weights is still
near-uniform over experts: known and fine for paging benchmarks. No tokenizer: prompts are ids.
bench-out/ is git-ignored. Nothing here is imported by moekit.
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path

import torch

# Router logits = h . w with RMS-normed h: std ~ sqrt(D) * ROUTER_STD, i.e. 3.2 at D=1024 and 2.3
# at D=512; with initializer_range (0.02) they would sit within ~0.6 of each other.
ROUTER_STD = 0.1
DTYPE = torch.bfloat16
BYTES_PER_PARAM = 2

SHAPES: dict[str, dict] = {
    "2g": dict(
        vocab_size=32000, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
        head_dim=64, moe_intermediate_size=160, num_experts=128, num_experts_per_tok=8, intermediate_size=3072,
    ),
    # ~111 MB: the same structure for quick checks (6 layers of 64 experts, 85% of the bytes routed).
    "small": dict(
        vocab_size=4096, hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, moe_intermediate_size=80, num_experts=64, num_experts_per_tok=8, intermediate_size=1536,
    ),
    # ~420 MB, 95% routed: big enough that the RSS bound (dense + budget + 10%) is about the model's
    # weights, not the interpreter's working memory (tests/offload/test_rss_bound.py).
    "medium": dict(
        vocab_size=4096, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
        head_dim=64, moe_intermediate_size=256, num_experts=64, num_experts_per_tok=4, intermediate_size=1536,
    ),
}
DEFAULT_OUT = {"2g": "bench-out/ckpt/offload-2g", "small": "bench-out/ckpt/offload-small",
               "medium": "bench-out/ckpt/offload-medium"}
MAX_SHARD_BYTES = 500 * 1000 * 1000


def hub_config(size: str) -> dict:
    """config.json as Qwen/Qwen3-30B-A3B writes it, with this size's shape."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **SHAPES[size],
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }


def tensor_plan(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of Qwen3MoeForCausalLM's Hub checkpoint, (name, shape), in save_pretrained's order."""
    D, E, F = config["hidden_size"], config["num_experts"], config["moe_intermediate_size"]
    hd, q_heads, kv_heads = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    plan = [("model.embed_tokens.weight", (config["vocab_size"], D))]
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        plan += [
            (f"{p}.input_layernorm.weight", (D,)),
            (f"{p}.self_attn.q_proj.weight", (q_heads * hd, D)),
            (f"{p}.self_attn.k_proj.weight", (kv_heads * hd, D)),
            (f"{p}.self_attn.v_proj.weight", (kv_heads * hd, D)),
            (f"{p}.self_attn.o_proj.weight", (D, q_heads * hd)),
            (f"{p}.self_attn.q_norm.weight", (hd,)),
            (f"{p}.self_attn.k_norm.weight", (hd,)),
            (f"{p}.post_attention_layernorm.weight", (D,)),
            (f"{p}.mlp.gate.weight", (E, D)),
        ]
        for expert in range(E):
            plan += [
                (f"{p}.mlp.experts.{expert}.gate_proj.weight", (F, D)),
                (f"{p}.mlp.experts.{expert}.up_proj.weight", (F, D)),
                (f"{p}.mlp.experts.{expert}.down_proj.weight", (D, F)),
            ]
    plan += [("model.norm.weight", (D,)), ("lm_head.weight", (config["vocab_size"], D))]
    return plan


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


def plan_bytes(plan) -> int:
    return sum(numel(shape) for _, shape in plan) * BYTES_PER_PARAM


def routed_expert_bytes(plan) -> int:
    return sum(numel(shape) for name, shape in plan if ".mlp.experts." in name) * BYTES_PER_PARAM


def shards(plan, max_shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive runs of the plan, each at most max_shard_bytes (or one tensor if that alone is bigger)."""
    out: list[list] = [[]]
    size = 0
    for name, shape in plan:
        nbytes = numel(shape) * BYTES_PER_PARAM
        if out[-1] and size + nbytes > max_shard_bytes:
            out.append([])
            size = 0
        out[-1].append((name, shape))
        size += nbytes
    return out


def make_tensor(name: str, shape: tuple[int, ...], config: dict, seed: int) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=DTYPE)
    std = ROUTER_STD if name.endswith(".mlp.gate.weight") else config["initializer_range"]
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen).mul_(std).to(DTYPE)


def check_with_calculator(config: dict, plan) -> dict:
    """moekit's calculator must count exactly the parameters this script writes."""
    from moekit.calc.params import count_params
    from moekit.spec import spec_from_config

    counts = count_params(spec_from_config(config, "offload-bench"))
    written = sum(numel(shape) for _, shape in plan)
    if counts.total_params != written:
        raise SystemExit(f"calculator counts {counts.total_params} params, the tensor plan has {written}")
    return {
        "total_params": counts.total_params,
        "active_params": counts.active_params,
        "routed_expert_params": counts.breakdown.routed_experts_total,
    }


def write_checkpoint(out: Path, size: str, seed: int = 0, max_shard_bytes: int = MAX_SHARD_BYTES) -> dict:
    """Write the checkpoint into `out` (created); returns the summary also saved as moekit-bench.json."""
    from safetensors.torch import save_file

    config = hub_config(size)
    plan = tensor_plan(config)
    counts = check_with_calculator(config, plan)
    out.mkdir(parents=True, exist_ok=True)
    parts = shards(plan, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for i, part in enumerate(parts, start=1):
        filename = f"model-{i:05d}-of-{len(parts):05d}.safetensors"
        tensors = {name: make_tensor(name, shape, config, seed) for name, shape in part}
        save_file(tensors, str(out / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, filename))
        del tensors  # one shard in RAM at a time
    index = {"metadata": {"total_size": plan_bytes(plan)}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    summary = {
        "family": "qwen3_moe",
        "size": size,
        "seed": seed,
        **counts,
        "total_bytes": plan_bytes(plan),
        "routed_expert_bytes": routed_expert_bytes(plan),
        "shards": len(parts),
    }
    (out / "moekit-bench.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SHAPES), default="2g")
    parser.add_argument("--out", default=None, help="folder to write (default: bench-out/ckpt/offload-<size>)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-mb", type=int, default=MAX_SHARD_BYTES // 1_000_000)
    args = parser.parse_args()
    # Each tensor is small; on a shared machine a thread pool's barrier costs more than it saves.
    torch.set_num_threads(1)
    out = Path(args.out or DEFAULT_OUT[args.size])
    if (out / "model.safetensors.index.json").is_file():
        print(f"{out}: exists, kept")
        return
    s = write_checkpoint(out, args.size, args.seed, args.max_shard_mb * 1_000_000)
    print(
        f"{out}: {s['total_params'] / 1e6:.1f}M params, {s['total_bytes'] / 1e9:.2f} GB bf16 in {s['shards']} shards, "
        f"routed experts {100 * s['routed_expert_bytes'] / s['total_bytes']:.1f}% of the bytes"
    )


if __name__ == "__main__":
    main()
