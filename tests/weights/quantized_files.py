"""Tiny checkpoints in the Hub's published quantized layouts, written here from hf_tiny's models.

  write_mxfp4   gpt_oss as gpt-oss-20b ships: experts' `gate_up_proj_blocks` [E, 2F, D/32, 16] and
                `_scales` [E, 2F, D/32] (uint8), `down_proj_blocks` / `_scales` likewise, the
                transpose of the bf16 tensors; everything else bf16-as-saved; quantization_config
                {"quant_method": "mxfp4", "modules_to_not_convert": [...]} as published.
  write_fp8     deepseek_v3 as DeepSeek-V3 ships: every 2-D weight under model.layers except the
                router (`mlp.gate`) as float8_e4m3fn with `weight_scale_inv` per 128×128 block.

Both start from transformers' own save_pretrained (so the names are the Hub's) and rewrite the file.
`dequantized_copy` writes the plain fp32 checkpoint the quantized one stands for, dequantized by
`obvious_fp8_dequantize` below (a loop over blocks, from the format's definition).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


from hf_tiny import build_reference
from moekit.weights import fp8, mxfp4

MXFP4_CONFIG = {
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    "quant_method": "mxfp4",
}
FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}

# gpt_oss with widths that are whole MXFP4 blocks (hf_tiny's D = 48 is not a multiple of 32).
MXFP4_SHAPE = dict(hidden_size=64, intermediate_size=64, head_dim=16)
# deepseek_v3 whose every FP8 weight is whole 128×128 blocks: transformers' dequantization needs
# that (it derives the block from the grid), and rope = nope = 128 makes kv_a and kv_b whole too.
FP8_WHOLE = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_attention_heads=2,
                 num_key_value_heads=2, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=128,
                 qk_rope_head_dim=128, v_head_dim=128, initializer_range=0.06)
# ... and one whose every FP8 weight has partial blocks at its edges.
FP8_PARTIAL = dict(hidden_size=192, intermediate_size=160, moe_intermediate_size=96, num_attention_heads=2,
                   num_key_value_heads=2, q_lora_rank=136, kv_lora_rank=72, qk_nope_head_dim=24,
                   qk_rope_head_dim=16, v_head_dim=40, initializer_range=0.06)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}


def _rewrite(folder: Path, tensors: dict[str, torch.Tensor], quantization_config: dict) -> Path:
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"] = quantization_config
    path.write_text(json.dumps(config, indent=2))
    return folder


def write_mxfp4(folder: Path, seed: int = 0, **overrides) -> Path:
    build_reference("gpt_oss", seed, **{**MXFP4_SHAPE, **overrides}).save_pretrained(folder)
    out = {}
    for name, t in _tensors(folder).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4.quantize(t.transpose(1, 2))  # [E, out, in/32, 16], [E, out, in/32]
            out[f"{name}_blocks"], out[f"{name}_scales"] = blocks, scales
        else:
            out[name] = t.to(torch.bfloat16) if t.is_floating_point() else t
    return _rewrite(folder, out, MXFP4_CONFIG)


def is_fp8(name: str, t: torch.Tensor) -> bool:
    """DeepSeek-V3's rule: every projection under model.layers but the router is FP8."""
    return name.startswith("model.layers.") and t.dim() == 2 and not name.endswith(".mlp.gate.weight")


def write_fp8(folder: Path, seed: int = 0, shape: dict = FP8_WHOLE, block=(128, 128), **overrides) -> Path:
    build_reference("deepseek_v3", seed, **{**shape, **overrides}).save_pretrained(folder)
    out = {}
    for name, t in _tensors(folder).items():
        if is_fp8(name, t):
            out[name], out[f"{name}_scale_inv"] = fp8.quantize(t, block)
        else:
            out[name] = t.to(torch.bfloat16) if t.is_floating_point() and not name.endswith("e_score_correction_bias") else t
    config = dict(FP8_CONFIG, weight_block_size=list(block))
    return _rewrite(folder, out, config)


def obvious_fp8_dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block) -> torch.Tensor:
    """w[r, c] = fp8[r, c] × scale_inv[r // bo, c // bi], block by block, partial edges included."""
    out = weight.to(torch.float32).clone()
    rows, cols = out.shape
    for i in range(math.ceil(rows / block[0])):
        for j in range(math.ceil(cols / block[1])):
            out[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] *= scale_inv[i, j].float()
    return out


def dequantized_copy(src: Path, dst: Path) -> Path:
    """The plain fp32 checkpoint `src` (FP8 or MXFP4) stands for, without quantization_config.
    MXFP4 goes through transformers' own convert_moe_packed_tensors."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    block = config["quantization_config"].get("weight_block_size")
    del config["quantization_config"]
    tensors = _tensors(src)
    out = {}
    for name, t in tensors.items():
        if name.endswith(("_scale_inv", "_scales")):
            continue
        if name.endswith("_blocks"):
            base = name[: -len("_blocks")]
            out[base] = convert_moe_packed_tensors(t, tensors[f"{base}_scales"], dtype=torch.float32)
        elif t.dtype == torch.float8_e4m3fn:
            out[name] = obvious_fp8_dequantize(t, tensors[f"{name}_scale_inv"], block)
        else:
            out[name] = t.float() if t.is_floating_point() else t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ("generation_config.json",):
        if (src / extra).is_file():
            (dst / extra).write_text((src / extra).read_text())
    return dst


def reference_model(folder):
    """transformers' model of `folder` in fp32 with eager attention, never stopping early: the oracle."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    return model


def assert_engine_equals(engine, model, prompt: list[int], new: int) -> None:
    """moekit's engine against transformers' model: the same greedy tokens, logits within 1e-5."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=new, pad_token_id=0)[0, len(prompt):].tolist()
        want_logits = model(ids).logits[0]  # [T, V]
        got_logits = engine.decoder(ids, engine.decoder.new_cache(1, len(prompt)), torch.arange(len(prompt))[None])[0]
    assert len(set(want)) >= 3  # a continuation that says something, not one token repeated
    assert engine.generate(prompt, max_new_tokens=new, stop_ids=()).token_ids[0] == want
    assert (got_logits - want_logits).abs().max().item() < 1e-5

