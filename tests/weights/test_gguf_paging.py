"""`moekit run x.gguf --expert-memory`: the expert store pages a GGUF's routed experts from the file
itself, each expert's slice of the stacked blk.N.ffn_*_exps tensors, and `moekit checksum x.gguf`
makes every later load of it, resident or paged, verify what it reads.

The GGUFs are llama.cpp's converter's, of a tiny qwen3_moe 256 wide (every matrix whole Q8_0
blocks); Q4_0, Q4_K and Q6_K experts are written by gguf's own writer (gguf_convert.rewrite_gguf).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_runner import moekit, refused
from gguf_convert import convert, rewrite_gguf, tiny_checkpoint
from offload_files import flip_byte

from moekit.engine.loader import load_engine
from moekit.weights.gguf_extents import manifest_path
from moekit.offload.options import OffloadOptions
from moekit.weights.gguf_file import read_gguf

PROMPT = [5, 17, 42, 99, 7, 150, 3, 280]
NEW = 16
RUN = ["--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "6", "--stop", "", "--json"]
SMALL = "25%"  # 2 of 8 experts per layer, top-2: most uses miss


def _q4_0(name, w):
    """Q4_0 experts (gguf's own quantizer); the rest as converted."""
    from gguf import GGMLQuantizationType, quants

    if "_exps" not in name:
        return None
    return quants.quantize(np.ascontiguousarray(w), GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0


def _mxfp4(name, w):
    """MXFP4 experts (gguf's own quantizer) in a family whose kernels do not read them (only gpt-oss's do)."""
    from gguf import GGMLQuantizationType, quants

    if "_exps" not in name:
        return None
    return quants.quantize(np.ascontiguousarray(w), GGMLQuantizationType.MXFP4), GGMLQuantizationType.MXFP4


def _k_quant(qtype: str, block_bytes: int, scale_at: tuple[int, ...], scale: float):
    """K-quant experts: gguf-py dequantizes K-quants but cannot quantize them, so the blocks are random
    bytes with their float16 super-block scale(s) set to `scale` (finite weights of a sane size)."""

    def write(name, w):
        from gguf import GGMLQuantizationType

        if "_exps" not in name:
            return None
        rng = np.random.default_rng(len(name))
        blocks = rng.integers(0, 256, size=(*w.shape[:-1], w.shape[-1] // 256, block_bytes), dtype=np.uint8)
        for at in scale_at:
            blocks[..., at : at + 2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
        return blocks.reshape(*w.shape[:-1], -1), GGMLQuantizationType[qtype]

    return write


_q6_k = _k_quant("Q6_K", 210, (208,), 1e-4)  # ql, qh, int8 scales, then d
_q4_k = _k_quant("Q4_K", 144, (0, 2), 5e-4)  # d, dmin, packed scales, then the nibbles


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    """kind (f32, bf16, q8_0, q4_0, q4_k, q6_k, mxfp4) → a GGUF of the same tiny qwen3_moe, made on first use."""
    folder = tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("paging"), hidden_size=256,
                             moe_intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            out = folder.parent / f"paging-{kind}.gguf"
            if kind in ("f32", "bf16", "q8_0"):
                made[kind] = convert(folder, kind, out)
            else:
                writers = {"q4_0": _q4_0, "q4_k": _q4_k, "q6_k": _q6_k, "mxfp4": _mxfp4}
                made[kind] = rewrite_gguf(get("f32"), out, tensor=writers[kind])
        return made[kind]

    return get


def greedy(engine) -> list[int]:
    return engine.generate([PROMPT], max_new_tokens=NEW, stop_ids=()).token_ids[0]


def expert_bytes(gguf: Path) -> tuple[int, int]:
    """(bytes of every routed expert in the file, experts): the stacked tensors' data."""
    g = read_gguf(gguf)
    stacked = [t for t in g.tensors.values() if "_exps" in t.name]
    layers = {t.name.split(".")[1] for t in stacked}
    return sum(t.n_bytes for t in stacked), len(layers) * stacked[0].shape[0]


@pytest.mark.parametrize("kind, dtype, precision", [("f32", "float32", None), ("bf16", "bfloat16", None),
                                                    ("q8_0", "float32", "16 int8"), ("q4_0", "float32", "16 int4")])
def test_paged_gguf_generates_the_resident_tokens(ggufs, kind, dtype, precision):
    """Floats are cast on load as the resident load casts them; Q8_0 / Q4_0 blocks are multiplied as
    read by the int8 / int4 kernels, the resident load's dequantized float32 weights' values."""
    gguf = ggufs(kind)
    want = greedy(load_engine(gguf, dtype=dtype, compile=False))
    paged = load_engine(gguf, dtype=dtype, offload=OffloadOptions(expert_memory=SMALL), compile=False)
    try:
        assert paged.store is not None and paged.store.slots == 2
        assert greedy(paged) == want
        stats = paged.store.stats()
        total, n = expert_bytes(gguf)
        assert stats["loads"] > 2 * 2  # more than the slots could ever hold: misses
        assert stats["disk_bytes"] == stats["loads"] * total // n  # each miss reads its expert's GGUF bytes
        assert stats["expert_bytes"] == total // n  # held as stored: a block format is not widened to float
        assert precision is None or stats["expert_precision"] == precision
        assert any("read unverified" in note for note in paged.notes), paged.notes  # no manifest yet
    finally:
        paged.close()


@pytest.mark.parametrize("kind, dtype", [("q4_k", "float32"), ("q6_k", "bfloat16")])
def test_k_quant_experts_are_paged_dequantized_as_the_resident_load_dequantizes(ggufs, kind, dtype):
    """A miss reads the K-quant bytes and dequantizes them with gguf-py, as the resident load does;
    the slot holds the expert at the engine dtype."""
    gguf = ggufs(kind)
    resident = load_engine(gguf, dtype=dtype, compile=False)
    want = greedy(resident)
    assert len(set(want)) > 1  # the random blocks make a model that does not just repeat one token
    paged = load_engine(gguf, dtype=dtype, offload=OffloadOptions(expert_memory=SMALL), compile=False)
    try:
        assert greedy(paged) == want
        stats = paged.store.stats()
        total, n = expert_bytes(gguf)
        assert stats["loads"] > 2 * 2 and stats["disk_bytes"] == stats["loads"] * total // n
        d = f = 256
        assert stats["expert_bytes"] == 3 * f * d * (4 if dtype == "float32" else 2)  # held dequantized
        layer = paged.spec.moe_layers[0]
        got = paged.store.layers[layer]._load(layer, 3)  # expert 3 as the store holds it
        hub = resident.decoder.layers[layer].ffn.experts
        want_up, want_down = (kernel.hub(w, k) for kernel, w, k in zip(hub.kernels, hub.resident_weights(3), hub.in_features))
        up_kernel, down_kernel = paged.decoder.layers[layer].ffn.experts.kernels
        assert torch.equal(up_kernel.hub(got[0], d), want_up) and torch.equal(down_kernel.hub(got[1], f), want_down)
    finally:
        paged.close()


@pytest.mark.parametrize("options", [dict(read_ahead=3), dict(read_ahead=3, direct_io=True)], ids=["read-ahead", "o_direct"])
def test_q8_0_experts_read_ahead_of_a_prompt_wider_than_the_slots_give_the_serial_tokens(ggufs, options):
    """Q8_0 experts are held as read (no slot memory): an 8-id prompt needs up to 8 experts a layer
    of 2 slots, so a read-ahead of 3 evicts experts it walked and has not run; they run on their own
    reads. The same tokens, loads and bytes as one inline read after another; O_DIRECT alike."""
    gguf = ggufs("q8_0")
    runs = []
    for opts in (dict(read_ahead=0), options):
        engine = load_engine(gguf, offload=OffloadOptions(SMALL, **opts), compile=False)
        try:
            runs.append((greedy(engine), engine.store.stats()))
        finally:
            engine.close()
    (serial, a), (ahead, b) = runs
    assert ahead == serial
    assert [a[k] for k in ("accesses", "hit_rate", "loads", "disk_bytes")] == [b[k] for k in ("accesses", "hit_rate", "loads", "disk_bytes")]


def test_q8_0_experts_are_the_int8_kernels_bytes(ggufs):
    """The store multiplies the GGUF's Q8_0 blocks as read: the engine is the resident one with its
    experts quantized to q8_0 by moekit (which gives the GGUF's bytes back), logit for logit."""
    import torch

    gguf = ggufs("q8_0")
    ids = torch.tensor([PROMPT])
    logits = []
    for engine in (load_engine(gguf, weights="int8-experts", compile=False), load_engine(gguf, offload=OffloadOptions(SMALL), compile=False)):
        with torch.inference_mode():
            logits.append(engine.decoder(ids, engine.decoder.new_cache(1, len(PROMPT)), torch.arange(len(PROMPT))[None]))
        engine.close()
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-5)


@pytest.fixture
def checksummed(capsys, ggufs, tmp_path):
    """A copy of the F32 GGUF after `moekit checksum`."""
    gguf = shutil.copy(ggufs("f32"), tmp_path / "model.gguf")
    before = hashlib.sha256(gguf.read_bytes()).hexdigest()
    code, out, err = moekit(capsys, "checksum", gguf)
    assert code == 0, err
    assert out.startswith(f"wrote {manifest_path(gguf)}: 16 routed experts and ") and " other tensors checksummed (" in out
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == before  # the .gguf is never written
    return gguf


def failed_while_generating(capsys, *args) -> str:
    """Run `moekit ARGS` expecting an error found after loading (a paged expert is read when a token
    first routes to it): exit 2, nothing on stdout, the load's `note:` lines and then one `error:`
    line on stderr, no traceback. Returns that line."""
    code, out, err = moekit(capsys, *args)
    lines = err.splitlines()
    assert code == 2 and out == "", (code, out, err)
    assert lines[-1].startswith("error: ") and all(line.startswith("note: ") for line in lines[:-1]), err
    return lines[-1]


def _tokens(capsys, *args) -> tuple[list[int], str]:
    code, out, err = moekit(capsys, "run", "--eager", *args, *RUN)
    assert code == 0, err
    return json.loads(out)["token_ids"], err


def test_checksum_then_runs_verify_and_a_second_checksum_only_checks(capsys, ggufs, checksummed):
    want, _ = _tokens(capsys, ggufs("f32"))
    for paged in ([], ["--expert-memory", SMALL]):
        got, err = _tokens(capsys, checksummed, *paged)
        assert got == want and "unverified" not in err
    written = manifest_path(checksummed).read_bytes()
    code, out, _ = moekit(capsys, "checksum", checksummed)
    assert code == 0 and out.startswith(f"{manifest_path(checksummed)}: 16 routed experts and ")
    assert out.rstrip().endswith("; nothing written") and manifest_path(checksummed).read_bytes() == written


def _routed_in_layer_0(gguf: Path) -> int:
    """An expert the prompt's first token uses in layer 0 (every run below reads it)."""
    gen = load_engine(gguf, compile=False).generate([PROMPT], max_new_tokens=1, stop_ids=())
    (layer0,) = [r for r in gen.routing[0].layers if r.layer == 0]
    return int(layer0.topk_ids[0, 0])


def test_a_flipped_expert_byte_is_refused_paged_and_resident(capsys, checksummed):
    e = _routed_in_layer_0(checksummed)
    t = read_gguf(checksummed).tensors["blk.0.ffn_up_exps.weight"]
    start = t.offset + e * (t.n_bytes // t.shape[0])
    flip_byte(checksummed, start + 100)
    line = failed_while_generating(capsys, "run", "--eager", checksummed, *RUN, "--expert-memory", SMALL)
    assert f"layer 0 expert {e}: checksum mismatch in " in line, line
    assert "model.gguf.moekit-experts.json" in line and "moekit pack" not in line  # what to do, for a GGUF
    line = refused(capsys, "run", checksummed, *RUN)  # resident: found while loading
    assert f"layer 0 expert {e} (tensor blk.0.ffn_up_exps.weight): checksum mismatch in model.gguf (bytes {start}.." in line
    line = refused(capsys, "checksum", checksummed)
    assert f"layer 0 expert {e}: checksum mismatch" in line
    for paged in (["--expert-memory", SMALL], []):  # --no-verify reads the changed byte unchecked
        code, _, err = moekit(capsys, "run", "--eager", checksummed, *RUN, *paged, "--no-verify")
        assert code == 0 and "checksums not verified (--no-verify)" in err, err


def test_a_flipped_dense_byte_is_refused_paged_and_resident(capsys, checksummed):
    t = read_gguf(checksummed).tensors["blk.1.attn_output.weight"]
    flip_byte(checksummed, t.offset + t.n_bytes // 3)
    for paged in (["--expert-memory", SMALL], []):
        line = refused(capsys, "run", checksummed, *RUN, *paged)
        assert f"tensor blk.1.attn_output.weight: checksum mismatch in model.gguf (bytes {t.offset}..{t.offset + t.n_bytes})" in line
        assert "model.gguf.moekit-experts.json" in line


def test_a_manifest_of_another_gguf_is_refused(capsys, ggufs, checksummed):
    other = shutil.copy(ggufs("q8_0"), checksummed.with_name("other.gguf"))
    shutil.copy(manifest_path(checksummed), manifest_path(other))
    line = refused(capsys, "run", other, *RUN)
    assert f"{manifest_path(other)} was written for another GGUF" in line and f"moekit checksum {other}" in line


def test_unpageable_experts_are_refused_in_one_line(capsys, converted):
    # The tiny 48-wide model's Q8_0: gate/up rows of 48 are not whole blocks, kept F16; down is Q8_0.
    _, mixed = converted("qwen3_moe", "q8_0")
    line = refused(capsys, "run", mixed, *RUN, "--expert-memory", SMALL)
    assert "layer 0's experts mix types (gate F16, up F16, down Q8_0)" in line


def test_mxfp4_experts_of_another_family_than_gpt_oss_are_refused_in_one_line(capsys, ggufs):
    line = refused(capsys, "run", ggufs("mxfp4"), *RUN, "--expert-memory", SMALL)
    assert "blk.0.ffn_gate_exps.weight is MXFP4, which the expert store pages for gpt-oss only (this is qwen3_moe)" in line


def test_unpageable_experts_are_still_checksummed_whole(capsys, converted, tmp_path):
    gguf = shutil.copy(converted("qwen3_moe", "q8_0")[1], tmp_path / "mixed.gguf")
    code, out, err = moekit(capsys, "checksum", gguf)
    assert code == 0 and "whole tensors only" in err and "mix types" in err
    assert out.startswith(f"wrote {manifest_path(gguf)}: ")
    t = read_gguf(gguf).tensors["blk.1.ffn_down_exps.weight"]
    flip_byte(gguf, t.offset + t.n_bytes - 1)
    line = refused(capsys, "run", gguf, *RUN)
    assert "tensor blk.1.ffn_down_exps.weight: checksum mismatch" in line


def test_pin_is_refused_for_a_gguf(capsys, ggufs, tmp_path):
    """A profile names its model by config.json's sha256, which a GGUF has not."""
    profile = tmp_path / "profile.json"
    profile.write_text("{}")
    line = refused(capsys, "run", ggufs("f32"), *RUN, "--expert-memory", SMALL, "--pin", profile)
    assert "--pin is not supported for a GGUF yet" in line
