"""Decoder.prepare (run by load_checkpoint): fast layouts and fused projections change no result,
and no weight stays resident in two layouts."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from moekit.model.decoder import Decoder
from moekit.model.experts import RoutedExperts
from moekit.model.linear import PLAIN, Linear
from moekit.model.loading import load_into
from moekit.spec import load_spec
from moekit.weights.checkpoint import open_checkpoint
from moekit.ops.torch_private import onednn_bf16_supported
from tiny_checkpoints import CASES, prompt, write_checkpoint

pytest.importorskip("transformers")

BY_ID = {c.id: c for c in CASES}
# qk head norm, full q/k norm with clipping, biases + sinks + window, a tied head, shared experts
IDS = ["qwen3_moe-a", "olmoe-b", "gpt_oss-window", "mixtral-b", "qwen2_moe-dense-layer"]


@pytest.fixture(scope="module", params=IDS)
def folder(request, tmp_path_factory):
    case = BY_ID[request.param]
    path = tmp_path_factory.mktemp(case.id)
    write_checkpoint(case, path)
    return case, path


def _unprepared(path, dtype) -> Decoder:
    decoder = Decoder(load_spec(path), dtype=dtype)
    load_into(decoder, open_checkpoint(path))  # what load_checkpoint does, minus prepare()
    return decoder


def _decode(decoder: Decoder, ids: torch.Tensor) -> torch.Tensor:
    """Prefill 8 tokens of each row, then one-token steps: [B, T, V], both the grouped and one-token
    paths, through the modules' forward (an unprepared decoder has no decode step: Decoder.steps_in_form;
    tests/model/test_decode_step.py holds the step to this forward)."""
    b, t = ids.shape
    cache = decoder.new_cache(b, t)
    out = [decoder.forward_modules(ids[:, :8], cache, torch.arange(8).expand(b, 8))]
    for i in range(8, t):
        out.append(decoder.forward_modules(ids[:, i : i + 1], cache, torch.full((b, 1), i)))
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("batch", [1, 3])
def test_prepared_decoder_computes_what_the_plain_one_does(folder, batch):
    case, path = folder
    ids = torch.cat([prompt(case.seed + i) for i in range(batch)])
    plain = _unprepared(path, torch.float32)
    fast = _unprepared(path, torch.float32)
    fast.prepare()
    with torch.no_grad():
        want, got = _decode(plain, ids), _decode(fast, ids)
    assert want.abs().max() > 0.5  # the logits are not all near zero
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.skipif(not onednn_bf16_supported(), reason="no oneDNN bf16 on this CPU")
def test_prepared_bf16_decoder_rounds_as_the_plain_one(folder):
    case, path = folder
    ids = prompt(case.seed)
    plain = _unprepared(path, torch.bfloat16)
    fast = _unprepared(path, torch.bfloat16)
    fast.prepare()
    with torch.no_grad():
        want, got = _decode(plain, ids), _decode(fast, ids)
    # oneDNN's packed GEMM is F.linear's own bf16 backend; only fp32 routers sum in another order.
    assert (got - want).abs().max().item() < 1e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_prepare_keeps_one_layout_of_every_weight(folder):
    _, path = folder
    decoder = _unprepared(path, torch.float32)
    count = sum(p.numel() for p in decoder.parameters())
    hub = [(m, 0, weakref.ref(m.weight)) for m in decoder.modules() if isinstance(m, Linear)]
    hub += [(m, i, weakref.ref(t)) for m in decoder.modules() if isinstance(m, RoutedExperts) for i, t in
            enumerate((m.gate_up, m.down))]
    decoder.prepare()
    gc.collect()
    relaid = 0
    for module, i, ref in hub:
        kernel = module.kernel if isinstance(module, Linear) else module.kernels[i]
        if kernel is PLAIN:  # this kernel reads the Hub layout: the one copy stays
            assert ref() is not None
        else:
            assert ref() is None, f"{type(module).__name__}: Hub-layout weight alive next to the prepared one"
            relaid += 1
    assert relaid >= len(hub) // 2  # most weights did move (fp32: all with out >= in)
    assert sum(p.numel() for p in decoder.parameters()) == count


def test_a_prepared_decoder_refuses_a_second_load(folder):
    _, path = folder
    decoder = Decoder(load_spec(path))
    decoder.load_checkpoint(open_checkpoint(path))
    with pytest.raises(RuntimeError, match="prepared"):
        decoder.load_checkpoint(open_checkpoint(path))
