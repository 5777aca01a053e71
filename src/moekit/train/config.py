"""A training run's settings: one TOML file with a [model] table (Hub config.json fields) and a [train] table.

The [model] table is merged over the family's defaults below and becomes the run's config.json, so the
model trained is exactly the model `moekit calc` counts and transformers loads.
"""

from __future__ import annotations

import hashlib
import json
import math
import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from moekit.errors import MoekitError


class TrainConfigError(MoekitError):
    """A training config that cannot be trained: unreadable, unknown keys, sizes that do not fit."""


# What transformers needs beyond the sizes; a [model] table overrides any of it.
FAMILY_DEFAULTS: dict[str, dict] = {
    "qwen3_moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "attention_bias": False,
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "use_cache": True,
        "router_aux_loss_coef": 0.01,
        "output_router_logits": False,
    },
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "hidden_act": "silu",
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 0,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "rope_interleave": True,
        "attention_bias": False,
    },
}
REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts_per_tok",
            "moe_intermediate_size", "max_position_embeddings")


@dataclass(frozen=True)
class TrainSettings:
    corpus: str = "data/corpus"
    seed: int = 0
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # the cosine ends at lr × this
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    aux_loss_coef: float = 0.01  # Switch load-balancing loss
    z_loss_coef: float = 0.001  # router z-loss (ST-MoE)
    router_jitter: float = 0.0  # multiplicative noise on router inputs, uniform in [1-j, 1+j]
    capacity_factor: float = 1.25  # slots per expert = ceil(cf · T·K / E); 0 = no dropping
    bias_balance_rate: float = 0.0  # DeepSeek-style selection-bias update per step; 0 = off
    # Each (token, expert) assignment dropped with this probability, the kept ones × 1/(1-p) as
    # dropout does, so inference (every expert) needs no change; 0 = off.
    expert_dropout: float = 0.0
    # + coef × the mean per-token entropy of the router's distribution (nats): > 0 sharpens the
    # router (confident top-1s, what adaptive routing drops experts on), < 0 flattens it; 0 = off.
    entropy_coef: float = 0.0
    domain_mix: str = "sqrt"  # how often each domain is sampled: "uniform", "size" or "sqrt" (of its tokens)
    log_every: int = 10
    checkpoint_every: int = 200
    device: str = "cpu"
    threads: int = 0  # torch CPU threads; 0 = torch's default
    save_dtype: str = "bfloat16"  # dtype of the exported Hub checkpoint


OFF_BY_DEFAULT = ("expert_dropout", "entropy_coef")


@dataclass(frozen=True)
class TrainConfig:
    model: dict  # the Hub config.json this run trains
    train: TrainSettings

    def identity(self) -> str:
        """What makes two runs the same run (steps may grow on --resume; logging/saving cadence may change)."""
        train = {k: v for k, v in asdict(self.train).items()
                 if k not in ("steps", "log_every", "checkpoint_every", "device", "threads", "corpus")
                 and not (k in OFF_BY_DEFAULT and v == 0.0)}  # runs from before these settings stay the same runs
        blob = json.dumps({"model": self.model, "train": train}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _settings(table: dict, where: str) -> TrainSettings:
    known = {f.name: f for f in fields(TrainSettings)}
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise TrainConfigError(f"{where}: unknown [train] key {unknown[0]!r} (known: {', '.join(known)})")
    values = {}
    for key, value in table.items():
        want = type(getattr(TrainSettings(), key))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, want) or isinstance(value, bool) != (want is bool):
            raise TrainConfigError(f"{where}: [train] {key} must be {want.__name__}, got {value!r}")
        values[key] = value
    return TrainSettings(**values)


def model_config(table: dict, where: str) -> dict:
    family = table.get("model_type")
    if family not in FAMILY_DEFAULTS:
        raise TrainConfigError(f"{where}: [model] model_type must be one of {', '.join(FAMILY_DEFAULTS)}, got {family!r}")
    missing = [k for k in REQUIRED if k not in table]
    experts_key = "n_routed_experts" if family == "deepseek_v3" else "num_experts"
    if experts_key not in table:
        missing.append(experts_key)
    if missing:
        raise TrainConfigError(f"{where}: [model] is missing {', '.join(missing)}")
    config = {**FAMILY_DEFAULTS[family], **table}
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config.setdefault("intermediate_size", config["moe_intermediate_size"] * 4)
    return config


def check_sizes(config: dict, train: TrainSettings, where: str) -> None:
    """The combinations that would fail deep inside a forward, said in one line up front."""
    def fail(msg: str):
        raise TrainConfigError(f"{where}: {msg}")

    experts = config.get("num_experts", config.get("n_routed_experts"))
    k = config["num_experts_per_tok"]
    if not 1 <= k <= experts:
        fail(f"num_experts_per_tok (K={k}) must be between 1 and the number of experts (E={experts})")
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    if heads % kv:
        fail(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})")
    head_dim = config.get("head_dim")
    if head_dim is None and config["hidden_size"] % heads:
        fail(f"hidden_size ({config['hidden_size']}) is not divisible by num_attention_heads ({heads}); set head_dim")
    if head_dim is not None and head_dim % 2:
        fail(f"head_dim ({head_dim}) must be even for rotary embeddings")
    if config.get("n_group", 1) > 1 and experts % config["n_group"]:
        fail(f"n_routed_experts ({experts}) is not divisible by n_group ({config['n_group']})")
    if train.seq_len > config["max_position_embeddings"]:
        fail(f"seq_len ({train.seq_len}) exceeds max_position_embeddings ({config['max_position_embeddings']})")
    if config["vocab_size"] < 259:
        fail(f"vocab_size ({config['vocab_size']}) must be at least 259 (256 bytes + 3 special tokens)")
    for name in ("steps", "batch_size", "seq_len", "log_every", "checkpoint_every"):
        if getattr(train, name) < 1:
            fail(f"[train] {name} must be at least 1")
    if train.capacity_factor < 0 or train.router_jitter < 0 or not 0 <= train.router_jitter < 1:
        fail("[train] capacity_factor must be >= 0 and router_jitter in [0, 1)")
    if not 0 <= train.expert_dropout < 1:
        fail(f"[train] expert_dropout must be in [0, 1), got {train.expert_dropout}")
    if not math.isfinite(train.entropy_coef):
        fail(f"[train] entropy_coef must be a finite number, got {train.entropy_coef}")
    if train.domain_mix not in ("uniform", "size", "sqrt"):
        fail(f"[train] domain_mix must be uniform, size or sqrt, got {train.domain_mix!r}")
    if train.save_dtype not in ("float32", "bfloat16"):
        fail(f"[train] save_dtype must be float32 or bfloat16, got {train.save_dtype!r}")
    if train.bias_balance_rate > 0 and config["model_type"] != "deepseek_v3":
        fail("bias_balance_rate needs a family whose checkpoint keeps a selection bias (deepseek_v3)")


def parse_config(text: str, where: str) -> TrainConfig:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise TrainConfigError(f"{where}: invalid TOML ({err})") from None
    unknown = sorted(set(data) - {"model", "train"})
    if unknown:
        raise TrainConfigError(f"{where}: unknown table [{unknown[0]}] (expected [model] and [train])")
    if "model" not in data:
        raise TrainConfigError(f"{where}: no [model] table")
    train = _settings(data.get("train", {}), where)
    config = model_config(data["model"], where)
    check_sizes(config, train, where)
    return TrainConfig(model=config, train=train)


def load_config(path: Path) -> TrainConfig:
    path = Path(path)
    if not path.is_file():
        raise TrainConfigError(f"{path}: no such config file")
    return parse_config(path.read_text(), str(path))
