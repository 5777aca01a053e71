"""MXFP4 and FP8 checkpoints in the Hub's published layout vs their bf16 originals, ~150M shape:
bytes per token the meter reports, resident expert bytes, and decode tok/s, in one run.

  gpt_oss-150m        random gpt_oss of the benchmark shape (D 512, 8 layers, 32 experts top-4,
                      F 256), bf16, written here by transformers; gpt_oss-150m-mxfp4 its experts
                      as `*_blocks` / `*_scales` (moekit.weights.mxfp4.quantize), as gpt-oss ships.
  deepseek_v3-150m    from benchmarks/make_checkpoints.py; deepseek_v3-150m-fp8 every projection
                      under model.layers but the router as float8_e4m3fn + weight_scale_inv per
                      128×128 block, as DeepSeek-V3 ships.

    .venv/bin/python benchmarks/make_checkpoints.py --sizes 150m --families deepseek_v3
    .venv/bin/python benchmarks/quantized_formats.py [--new 32] [--repeats 3]

Activations in --dtype (bfloat16 default); decode tok/s is the best of --repeats greedy runs of --new tokens
(batch 1, one process, both engines loaded and their runs alternating). bench-out/ is git-ignored.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

GPT_OSS_150M = dict(
    vocab_size=32000, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
    head_dim=64, intermediate_size=256, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 4, max_position_embeddings=4096,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
MXFP4_CONFIG = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
PROMPT = [1, 17, 42, 99, 5, 63, 120, 7, 300, 2048, 11, 12]


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}


def _write(src: Path, dst: Path, tensors: dict, quantization_config: dict) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / extra).is_file():
            (dst / extra).write_bytes((src / extra).read_bytes())


def make_gpt_oss(folder: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt_oss", **GPT_OSS_150M), dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("mlp.router"):  # routers wide enough that routing is not a near-tie
                module.weight.normal_(0, 0.1)
    model.to(torch.bfloat16).save_pretrained(folder)


def make_mxfp4(src: Path, dst: Path) -> None:
    from moekit.weights import mxfp4

    out = {}
    for name, t in _tensors(src).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[f"{name}_blocks"], out[f"{name}_scales"] = mxfp4.quantize(t.transpose(1, 2))  # [E, out, in/32, ...]
        else:
            out[name] = t
    _write(src, dst, out, MXFP4_CONFIG)


def make_fp8(src: Path, dst: Path) -> None:
    from moekit.weights import fp8

    out = {}
    for name, t in _tensors(src).items():
        if name.startswith("model.layers.") and t.dim() == 2 and not name.endswith(".mlp.gate.weight"):
            out[name], out[f"{name}_scale_inv"] = fp8.quantize(t)
        else:
            out[name] = t
    _write(src, dst, out, FP8_CONFIG)


def _engine(folder: Path, dtype: str):
    from moekit.engine.loader import load_engine

    return load_engine(folder, dtype=dtype, compile=False)


def _row(folder: Path, engine, tok_s: float) -> dict:
    gen = engine.generate(PROMPT, max_new_tokens=8, stop_ids=())
    tokens = engine.meter(gen)
    experts = [b.ffn.experts for b in engine.decoder.layers if hasattr(b.ffn, "experts")]
    resident = sum(w.numel() * w.element_size() for ex in experts for e in range(ex.num_experts)
                   for w in ex.resident_weights(e))
    return {
        "checkpoint": folder.name,
        "file_MB": round(sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 1e6, 1),
        "expert_MB": round(resident / 1e6, 1),
        "bytes_per_token_MB": round(sum(t.bytes_touched for t in tokens) / len(tokens) / 1e6, 2),
        "decode_tok_s": round(tok_s, 1),
        "kernel": experts[0].kernels[0].name,
    }


def measure(base: Path, quantized: Path, new: int, repeats: int, dtype: str) -> list[dict]:
    """Both engines loaded, their greedy runs alternating (a noisy neighbour hurts both alike)."""
    engines = [_engine(base, dtype), _engine(quantized, dtype)]
    best = [0.0, 0.0]
    for _ in range(repeats):
        for i, engine in enumerate(engines):
            gen = engine.generate(PROMPT, max_new_tokens=new, stop_ids=())
            best[i] = max(best[i], gen.timing.decode_tok_s)
    a, b = (_row(f, e, t) for f, e, t in zip((base, quantized), engines, best))
    b["bytes_vs_unquantized"] = round(b["bytes_per_token_MB"] / a["bytes_per_token_MB"], 3)
    b["tok_s_vs_unquantized"] = round(b["decode_tok_s"] / a["decode_tok_s"], 3)
    return [a, b]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", default="bench-out/ckpt")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args()
    root = Path(args.ckpt)
    oss, oss_mx = root / "gpt_oss-150m", root / "gpt_oss-150m-mxfp4"
    ds, ds_fp8 = root / "deepseek_v3-150m", root / "deepseek_v3-150m-fp8"
    if not (oss / "config.json").is_file():
        make_gpt_oss(oss)
    if not (oss_mx / "config.json").is_file():
        make_mxfp4(oss, oss_mx)
    if not (ds / "config.json").is_file():
        raise SystemExit(f"{ds}: missing; run benchmarks/make_checkpoints.py --sizes 150m --families deepseek_v3")
    if not (ds_fp8 / "config.json").is_file():
        make_fp8(ds, ds_fp8)
    rows = []
    for base, quantized in ((oss, oss_mx), (ds, ds_fp8)):
        rows += measure(base, quantized, args.new, args.repeats, args.dtype)
    print(f"{args.dtype}, torch threads {torch.get_num_threads()}, {args.new} new tokens, best of {args.repeats}, {time.strftime('%F %T')}")
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
