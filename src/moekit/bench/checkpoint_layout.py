"""What a random-weight checkpoint at a published shape holds: every Hub tensor's name, shape and kind.

`make-checkpoint` (moekit.bench.make_checkpoint) writes checkpoints of the 21B and 30B shapes that
no hub can be reached for here; this module says, from a config, which tensors the Hub's files
have (the names transformers' save_pretrained and moekit's loader use), in the order they are
written, and draws each tensor's values from its own generator (seeded by the run's seed and the
tensor's name), so one tensor is in memory at a time and two formats of one seed hold the same
values wherever both store the same form.

Families: qwen3_moe (per-expert gate/up/down_proj) and gpt_oss (stacked, interleaved gate_up_proj
with biases, attention sinks); the two shapes issue 38 measures. Routing is uniform in law: every
router row is drawn alike, so no expert is favoured (the worst case for an expert cache).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator, Literal

from moekit.errors import MoekitError

Kind = Literal["matrix", "norm", "bias", "sinks", "experts"]
FAMILIES = ("qwen3_moe", "gpt_oss")
DEFAULTED = ("rms_norm_eps", "rope_parameters", "max_position_embeddings", "hidden_act", "initializer_range",
             "swiglu_limit", "sliding_window", "layer_types", "attention_bias", "head_dim", "architectures")
STD = 0.02  # the init scale of the families' configs (initializer_range)


@dataclass(frozen=True)
class TensorPlan:
    name: str  # the Hub name
    shape: tuple[int, ...]
    kind: Kind
    layer: int = -1  # -1: not in a layer (embedding, final norm, head)


def full_config(config: dict) -> dict:
    """`config` completed with transformers' defaults for its model_type (what config.json holds)."""
    import transformers

    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise MoekitError(f"make-checkpoint: model_type {model_type!r} is not one it writes "
                          f"(it writes {', '.join(FAMILIES)})")
    fields = {k: v for k, v in config.items() if k != "model_type"}
    defaults = transformers.CONFIG_MAPPING[model_type](**fields).to_dict()
    # The Hub's key names (transformers 5 renames some, e.g. num_experts): the config as given, plus
    # the defaults a reader needs that a preset leaves out.
    full = dict(config)
    for key in DEFAULTED:
        if defaults.get(key) is not None:
            full.setdefault(key, defaults[key])
    full.setdefault("rope_theta", (defaults.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    full["torch_dtype"] = "bfloat16"
    return full


def _attention(config: dict, layer: int, bias: bool) -> Iterator[TensorPlan]:
    d, hd = config["hidden_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    pre = f"model.layers.{layer}.self_attn"
    for proj, rows, cols in (("q_proj", q, d), ("k_proj", kv, d), ("v_proj", kv, d), ("o_proj", d, q)):
        yield TensorPlan(f"{pre}.{proj}.weight", (rows, cols), "matrix", layer)
        if bias:
            yield TensorPlan(f"{pre}.{proj}.bias", (rows,), "bias", layer)


def _qwen3_layer(config: dict, layer: int) -> Iterator[TensorPlan]:
    d, f, e, hd = config["hidden_size"], config["moe_intermediate_size"], config["num_experts"], config["head_dim"]
    pre = f"model.layers.{layer}"
    yield from _attention(config, layer, bias=bool(config.get("attention_bias")))
    yield TensorPlan(f"{pre}.self_attn.q_norm.weight", (hd,), "norm", layer)
    yield TensorPlan(f"{pre}.self_attn.k_norm.weight", (hd,), "norm", layer)
    yield TensorPlan(f"{pre}.mlp.gate.weight", (e, d), "matrix", layer)
    for j in range(e):
        for proj, shape in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f))):
            yield TensorPlan(f"{pre}.mlp.experts.{j}.{proj}.weight", shape, "experts", layer)
    yield TensorPlan(f"{pre}.input_layernorm.weight", (d,), "norm", layer)
    yield TensorPlan(f"{pre}.post_attention_layernorm.weight", (d,), "norm", layer)


def _gpt_oss_layer(config: dict, layer: int) -> Iterator[TensorPlan]:
    d, f, e = config["hidden_size"], config["intermediate_size"], config["num_local_experts"]
    pre = f"model.layers.{layer}"
    yield TensorPlan(f"{pre}.self_attn.sinks", (config["num_attention_heads"],), "sinks", layer)
    yield from _attention(config, layer, bias=True)
    yield TensorPlan(f"{pre}.mlp.router.weight", (e, d), "matrix", layer)
    yield TensorPlan(f"{pre}.mlp.router.bias", (e,), "bias", layer)
    # x @ W layout, gate and up interleaved along 2F (transformers' GptOssExperts)
    yield TensorPlan(f"{pre}.mlp.experts.gate_up_proj", (e, d, 2 * f), "experts", layer)
    yield TensorPlan(f"{pre}.mlp.experts.gate_up_proj_bias", (e, 2 * f), "bias", layer)
    yield TensorPlan(f"{pre}.mlp.experts.down_proj", (e, f, d), "experts", layer)
    yield TensorPlan(f"{pre}.mlp.experts.down_proj_bias", (e, d), "bias", layer)
    yield TensorPlan(f"{pre}.input_layernorm.weight", (d,), "norm", layer)
    yield TensorPlan(f"{pre}.post_attention_layernorm.weight", (d,), "norm", layer)


def tensor_plan(config: dict) -> list[TensorPlan]:
    """Every tensor of the Hub checkpoint of `config` (a full_config), in the order written."""
    d, v = config["hidden_size"], config["vocab_size"]
    layer_tensors = _qwen3_layer if config["model_type"] == "qwen3_moe" else _gpt_oss_layer
    plan = [TensorPlan("model.embed_tokens.weight", (v, d), "matrix")]
    for layer in range(config["num_hidden_layers"]):
        plan.extend(layer_tensors(config, layer))
    plan.append(TensorPlan("model.norm.weight", (d,), "norm"))
    if not config.get("tie_word_embeddings"):
        plan.append(TensorPlan("lm_head.weight", (v, d), "matrix"))
    return plan


def _seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def generator(seed: int, name: str):
    """A torch generator of its own for one tensor: the values do not depend on the write order."""
    import torch

    g = torch.Generator()
    g.manual_seed(_seed(seed, name))
    return g


def random_bytes(seed: int, name: str, shape: tuple[int, ...], low: int = 0, high: int = 256):
    """uint8 codes uniform in [low, high) of one tensor (numpy's generator: ~10x torch's for bytes)."""
    import numpy as np

    return np.random.default_rng(_seed(seed, name)).integers(low, high, size=shape, dtype=np.uint8)


def float_values(t: TensorPlan, seed: int):
    """t's values in bfloat16: norms 1, everything else normal(0, STD) (sinks and biases too)."""
    import torch

    if t.kind == "norm":
        return torch.ones(t.shape, dtype=torch.bfloat16)
    return (torch.randn(t.shape, generator=generator(seed, t.name)) * STD).to(torch.bfloat16)
