"""A served request's bytes per token are what `moekit run --json` meters for the same prompt, with
int8 (a `moekit pack --precision int8` checkpoint) and MXFP4 (gpt-oss's published layout) experts
counted at the bytes they hold, not at the engine dtype's: in the usage the OpenAI client reads and
in the Prometheus counter."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest


from cli_runner import moekit
from hf_tiny import write_checkpoint
from moekit.engine.meter import params_per_token
from moekit.spec import load_spec
from quantized_files import write_mxfp4

openai = pytest.importorskip("openai")

PROMPT = [1, 17, 42, 99, 5, 63, 120]
NEW = 8
NAME = "tiny"


def served(server) -> float:
    """Bytes per generated token in the usage of one greedy completion, and on /metrics."""
    client = openai.OpenAI(base_url=server.v1, api_key="unused", timeout=120.0, max_retries=0)
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=NEW, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == NEW
    per_token = out.usage.model_extra["moe"]["bytes_read_per_token"]
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    total = next(float(line.split()[1]) for line in metrics.splitlines()
                 if line.startswith("moekit:generation_weight_bytes_total "))
    assert total == per_token * NEW
    return per_token


def run_json(capsys, folder: Path, *args: str) -> float:
    """Mean bytes_touched over the tokens of `moekit run --json` on the same prompt."""
    code, out, err = moekit(capsys, "run", "--eager", folder, "--prompt-ids", ",".join(map(str, PROMPT)),
                            "--max-new-tokens", NEW, "--stop", "", "--json", *args)
    assert code == 0, err
    tokens = json.loads(out)["activation"]
    assert len(tokens) == NEW
    return sum(t["bytes_touched"] for t in tokens) / NEW


def expert_dims(folder: Path) -> tuple[int, int]:
    expert = next(layer.ffn.expert for layer in load_spec(folder).layers if layer.is_moe)
    return expert.hidden_size, expert.width


def test_int8_experts_are_served_at_their_q8_0_bytes(tmp_path, capsys, serve_process):
    folder = write_checkpoint("qwen3_moe", tmp_path / "fp32")
    packed = tmp_path / "int8"
    code, _, err = moekit(capsys, "pack", folder, "--precision", "int8", "--out", packed)
    assert code == 0, err
    fp32 = served(serve_process("--eager", folder, "--served-model-name", NAME))
    int8 = served(serve_process("--eager", packed, "--served-model-name", NAME))
    assert fp32 == run_json(capsys, folder)
    assert int8 == run_json(capsys, packed)

    # Every token reads K distinct experts a layer; each q8_0 (34 bytes per 32 weights, last block
    # of a row padded) instead of fp32, everything else as before.
    counts = params_per_token(load_spec(folder))
    d, f = expert_dims(folder)
    q8_0 = 2 * f * math.ceil(d / 32) * 34 + d * math.ceil(f / 32) * 34  # gate_up [2F, D], down [D, F]
    pairs = sum(counts.top_k.values())
    assert fp32 == counts.touched(counts.typical()) * 4
    assert int8 == fp32 - pairs * ((2 * f * d + d * f) * 4 - q8_0)
    assert int8 / fp32 < 0.75


def test_mxfp4_experts_are_served_at_their_packed_bytes(tmp_path, capsys, serve_process):
    folder = write_mxfp4(tmp_path / "mxfp4")
    got = served(serve_process("--eager", folder, "--served-model-name", NAME, "--dtype", "bfloat16"))
    assert got == run_json(capsys, folder, "--dtype", "bfloat16")

    # 4.25 bits a weight (FP4 codes and an E8M0 scale per 32) and bf16 biases, against bf16 weights.
    counts = params_per_token(load_spec(folder))
    d, f = expert_dims(folder)
    packed = (2 * f * d + d * f) * 17 // 32 + (2 * f + d) * 2
    routed = sum(counts.expert_each[layer] * k for layer, k in counts.top_k.items())
    bf16 = counts.touched(counts.typical()) * 2
    assert got == bf16 - routed * 2 + sum(counts.top_k.values()) * packed
    assert got < bf16


def test_serve_weights_int8_meters_every_q8_0_projection(tmp_path, capsys, serve_process):
    """`moekit serve --weights int8`: the tokens and the bytes `moekit run --weights int8` gives, and
    less than the int8-experts figure (the attention projections and the head are q8_0 too)."""
    folder = write_checkpoint("qwen3_moe", tmp_path / "fp32")
    server = serve_process("--eager", folder, "--served-model-name", NAME, "--weights", "int8")
    got = served(server)
    assert got == run_json(capsys, folder, "--weights", "int8")
    assert got < run_json(capsys, folder, "--weights", "int8-experts")
    body = {"prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    ids = httpx.post(server.v1 + "/completions", json=body, timeout=120.0).json()["choices"][0]["token_ids"]
    code, out, err = moekit(capsys, "run", "--eager", folder, "--prompt-ids", ",".join(map(str, PROMPT)), "--weights", "int8",
                            "--max-new-tokens", NEW, "--stop", "", "--json")
    assert code == 0, err
    assert ids == json.loads(out)["token_ids"]
