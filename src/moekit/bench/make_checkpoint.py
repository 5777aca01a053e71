"""`moekit bench make-checkpoint`: a random-weight checkpoint at a published shape, streamed to disk.

No hub is reachable here, so the 21B and 30B shapes users download are built with random weights
in the formats users download them in:

  safetensors-bf16  the Hub's layout, one safetensors shard per layer + model.safetensors.index.json
  mxfp4             gpt-oss as published: experts' *_blocks / *_scales (uint8), bf16 rest
  gguf-q8_0         llama.cpp's file, every matrix Q8_0 (codes drawn directly), 1-D tensors F32
  gguf-mxfp4        llama.cpp's gpt-oss file: MXFP4 experts, BF16 matrices, F32 1-D tensors

One layer (safetensors) or one tensor (GGUF) is in memory at a time. gpt-oss's experts are drawn as
MXFP4 codes in every format (the bf16 form is their exact dequantization), so its three formats of
one seed hold the same weights; gguf-q8_0 draws its own int8 codes. Folders get a tokenizer.json and
GGUFs a tokenizer.ggml.* vocabulary: the minimal byte-level BPE of moekit.bench.gguf_layout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import groupby
from pathlib import Path
from typing import Callable

from moekit.bench.checkpoint_layout import TensorPlan, float_values, full_config, random_bytes, tensor_plan
from moekit.bench.gguf_layout import (ARCH, EOT, GGUFTensorPlan, expert_names, ggml_mxfp4, gguf_name,
                                      hub_tokenizer, metadata, minimal_vocab)
from moekit.errors import MoekitError

FORMATS = ("safetensors-bf16", "mxfp4", "gguf-q8_0", "gguf-mxfp4")
MXFP4_CONFIG = {  # as gpt-oss-20b's config.json has it
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    "quant_method": "mxfp4",
}
# E8M0 scales of the drawn MXFP4 blocks: 2^-9 .. 2^-6, so |w| ≤ 6·2^-6 ≈ 0.09, std ≈ 0.02 like the rest.
SCALE_RANGE = (118, 122)
Q8_SCALE = 0.02 / 74  # int8 codes uniform in [-128, 127] have std ≈ 74: values of std ≈ 0.02


@dataclass(frozen=True)
class Written:
    path: Path  # the folder (safetensors) or the .gguf file
    nbytes: int
    params: int


def _check_format(model_type: str, fmt: str) -> None:
    if fmt not in FORMATS:
        raise MoekitError(f"--format {fmt}: the formats are {', '.join(FORMATS)}")
    if "mxfp4" in fmt and model_type != "gpt_oss":
        raise MoekitError(f"--format {fmt} is gpt-oss's form; {model_type} is written as safetensors-bf16 or gguf-q8_0")
    if fmt == "gguf-q8_0" and model_type == "gpt_oss":
        raise MoekitError("--format gguf-q8_0: gpt-oss's GGUF keeps its experts in MXFP4; use gguf-mxfp4")


def mxfp4_experts(t: TensorPlan, seed: int):
    """gpt-oss experts tensor t (Hub x @ W shape [E, in, out]) drawn as MXFP4:
    (blocks uint8 [E, out, in/32, 16], scales uint8 [E, out, in/32]), the published layout."""
    import torch

    e, k, rows = t.shape
    blocks = torch.from_numpy(random_bytes(seed, t.name, (e, rows, k // 32, 16)))
    scales = torch.from_numpy(random_bytes(seed, t.name + ":scales", (e, rows, k // 32), *SCALE_RANGE))
    return blocks, scales


def q8_0_bytes(name: str, shape: tuple[int, ...], seed: int):
    """Random Q8_0 data of `shape` (numpy order, last dim a multiple of 32) as uint8 [..., cols/32 * 34]."""
    import numpy as np

    *lead, cols = shape
    n = int(np.prod(lead, dtype=np.int64)) * (cols // 32)
    block = random_bytes(seed, name, (n, 34))  # per block: f16 scale, 32 int8 codes (uniform: std ≈ 73.9)
    scale = random_bytes(seed, name + ":scales", (n,)).astype(np.float32) / 255 + 0.5  # [0.5, 1.5)
    block[:, :2] = (scale * Q8_SCALE).astype(np.float16).view(np.uint8).reshape(n, 2)
    return block.reshape(*lead, cols // 32 * 34)


def _hub_tensors(t: TensorPlan, config: dict, fmt: str, seed: int) -> dict:
    """t as the tensors a safetensors checkpoint of `fmt` stores (the experts of mxfp4 as two)."""
    if t.kind == "experts" and config["model_type"] == "gpt_oss":
        from moekit.weights.mxfp4 import dequantize_stack

        blocks, scales = mxfp4_experts(t, seed)
        if fmt == "mxfp4":
            return {f"{t.name}_blocks": blocks, f"{t.name}_scales": scales}
        import torch

        return {t.name: dequantize_stack(blocks, scales, torch.bfloat16)}
    return {t.name: float_values(t, seed)}


def write_safetensors(config: dict, out: Path, fmt: str, seed: int, progress: bool) -> Written:
    """One shard per layer (embedding first, final norm and head last) and the index."""
    from safetensors.torch import save_file

    plan = tensor_plan(config)
    groups = [list(g) for _, g in groupby(plan, key=lambda t: t.layer)]  # embedding, each layer, norm + head
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    with _bar(progress, sum(_hub_nbytes(t, config, fmt) for t in plan), f"{out.name}") as advance:
        for i, group in enumerate(groups):
            shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            tensors = {}
            for t in group:
                tensors.update(_hub_tensors(t, config, fmt, seed))
            save_file(tensors, str(out / shard), metadata={"format": "pt"})
            nbytes = sum(v.numel() * v.element_size() for v in tensors.values())
            total += nbytes
            advance(nbytes)
            weight_map.update({name: shard for name in tensors})
    saved = dict(config, quantization_config=MXFP4_CONFIG) if fmt == "mxfp4" else config
    (out / "config.json").write_text(json.dumps(saved, indent=1))
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    hub_tokenizer(config["vocab_size"]).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOT, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return Written(out, total, sum(_params(t) for t in plan))


def _params(t: TensorPlan) -> int:
    n = 1
    for s in t.shape:
        n *= s
    return n


def _hub_nbytes(t: TensorPlan, config: dict, fmt: str) -> int:
    if fmt == "mxfp4" and t.kind == "experts":
        return _params(t) * 17 // 32
    return _params(t) * 2


class _bar:
    """A rich progress bar over bytes written (nothing when progress is off): `with _bar(...) as advance`."""

    def __init__(self, progress: bool, total: int, label: str):
        self.progress, self.total, self.label = progress, total, label

    def __enter__(self) -> Callable[[int], None]:
        if not self.progress:
            return lambda n: None
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

        self.bar = Progress("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                            TimeRemainingColumn())
        self.bar.start()
        task = self.bar.add_task(self.label, total=self.total)
        return lambda n: self.bar.advance(task, n)

    def __exit__(self, *exc) -> None:
        if self.progress:
            self.bar.stop()


def gguf_plan(config: dict, fmt: str, seed: int) -> list[GGUFTensorPlan]:
    """Every GGUF tensor, with the function that makes its data (called when it is written)."""
    model_type = config["model_type"]
    out: list[GGUFTensorPlan] = []
    plan = tensor_plan(config)
    for t in plan:
        if t.kind == "experts":
            out.extend(_gguf_experts(t, config, fmt, seed))
        elif t.kind == "bias" and ".experts." in t.name:
            out.extend(_gpt_oss_expert_bias(t, seed))
        else:
            out.append(_gguf_dense(model_type, t, fmt, seed))
    return out


def _gguf_dense(model_type: str, t: TensorPlan, fmt: str, seed: int) -> GGUFTensorPlan:
    import numpy as np
    import torch

    name = gguf_name(model_type, t.name)
    if len(t.shape) == 1:
        return GGUFTensorPlan(name, t.shape, "F32", lambda: float_values(t, seed).float().numpy())
    if fmt == "gguf-q8_0":
        return GGUFTensorPlan(name, t.shape, "Q8_0", lambda: q8_0_bytes(t.name, t.shape, seed))
    return GGUFTensorPlan(name, t.shape, "BF16",
                          lambda: float_values(t, seed).view(torch.int16).numpy().view(np.uint8))


def _gguf_experts(t: TensorPlan, config: dict, fmt: str, seed: int) -> list[GGUFTensorPlan]:
    names = expert_names(t.layer)
    if config["model_type"] == "qwen3_moe":  # one Hub tensor per expert and projection: stack once per layer
        proj = t.name.split(".")[-2].removesuffix("_proj")
        if ".experts.0." not in t.name:
            return []
        e, (rows, cols) = config["num_experts"], t.shape
        name = names[proj] + ".weight"
        return [GGUFTensorPlan(name, (e, rows, cols), "Q8_0", lambda: q8_0_bytes(name, (e, rows, cols), seed))]
    e, k, rows = t.shape  # gpt_oss: x @ W [E, in, out]; GGUF rows are `out`

    def part(pick: slice) -> Callable[[], object]:
        def make():
            blocks, scales = mxfp4_experts(t, seed)
            return ggml_mxfp4(blocks[:, pick], scales[:, pick])
        return make

    if t.name.endswith("gate_up_proj"):
        half = rows // 2
        return [GGUFTensorPlan(names["gate"] + ".weight", (e, half, k), "MXFP4", part(slice(0, None, 2))),
                GGUFTensorPlan(names["up"] + ".weight", (e, half, k), "MXFP4", part(slice(1, None, 2)))]
    return [GGUFTensorPlan(names["down"] + ".weight", (e, rows, k), "MXFP4", part(slice(None)))]


def _gpt_oss_expert_bias(t: TensorPlan, seed: int) -> list[GGUFTensorPlan]:
    names = expert_names(t.layer)
    values = lambda pick: (lambda: float_values(t, seed).float()[:, pick].contiguous().numpy())  # noqa: E731
    if "gate_up" in t.name:
        e, two_f = t.shape
        return [GGUFTensorPlan(names["gate"] + ".bias", (e, two_f // 2), "F32", values(slice(0, None, 2))),
                GGUFTensorPlan(names["up"] + ".bias", (e, two_f // 2), "F32", values(slice(1, None, 2)))]
    return [GGUFTensorPlan(names["down"] + ".bias", t.shape, "F32", values(slice(None)))]


def _stored_nbytes(t: GGUFTensorPlan) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[t.qtype]]
    n = 1
    for s in t.shape:
        n *= s
    return n // block * size


def write_gguf(config: dict, out: Path, fmt: str, seed: int, progress: bool) -> Written:
    """Header, metadata and tensor infos first (every size is known), then each tensor's data in turn."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType

    model_type = config["model_type"]
    plan = gguf_plan(config, fmt, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(out), ARCH[model_type])
    writer.add_name(f"moekit random {model_type} (seed {seed})")
    writer.add_file_type(LlamaFileType.MOSTLY_Q8_0 if fmt == "gguf-q8_0" else LlamaFileType.MOSTLY_MXFP4_MOE)
    for key, value in metadata(config).items():
        _add_kv(writer, key, value)
    tokens, types = minimal_vocab(config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(("Ġ", "Ġ"))])
    eot = tokens.index(EOT)
    writer.add_bos_token_id(eot)
    writer.add_eos_token_id(eot)
    writer.add_add_bos_token(False)
    for t in plan:
        qtype = GGMLQuantizationType[t.qtype]
        dtype = np.float32 if t.qtype == "F32" else np.uint8
        writer.add_tensor_info(t.name, _byte_shape(t), np.dtype(dtype), _stored_nbytes(t),
                               raw_dtype=None if t.qtype == "F32" else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    total = sum(_stored_nbytes(t) for t in plan)
    with _bar(progress, total, out.name) as advance:
        for t in plan:
            data = t.make()
            writer.write_tensor_data(data)
            advance(data.nbytes)
    writer.close()
    params = sum(_params(t) for t in tensor_plan(config))
    return Written(out, out.stat().st_size, params)


def _byte_shape(t: GGUFTensorPlan) -> tuple[int, ...]:
    if t.qtype == "F32":
        return t.shape
    *lead, cols = t.shape
    return (*lead, _stored_nbytes(GGUFTensorPlan(t.name, (cols,), t.qtype, t.make)))


def _add_kv(writer, key: str, value: object) -> None:
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_uint32(key, int(value))


def make_checkpoint(config: dict, fmt: str, out: Path, seed: int = 0, progress: bool = False) -> Written:
    """Write `config`'s checkpoint (a preset's or a config.json's dict) in `fmt` to `out`
    (a folder for safetensors forms, a .gguf path for GGUF ones)."""
    full = full_config(config)
    _check_format(full["model_type"], fmt)
    if fmt.startswith("gguf"):
        if out.suffix != ".gguf":
            raise MoekitError(f"--out {out}: a GGUF format is written to a file named *.gguf")
        return write_gguf(full, out, fmt, seed, progress)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MoekitError(f"--out {out}: exists and is not an empty folder")
    return write_safetensors(full, out, fmt, seed, progress)
