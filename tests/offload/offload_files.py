"""Checkpoint folders for the expert-store tests: tiny ones in other dtypes and shardings, byte-level
damage, and read-only copies a process really cannot write (root ignores permission bits, so a
root test runs the command without the capability that lets it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import pytest

from hf_tiny import build_reference
from moekit.engine.loader import load_engine

MOEKIT = Path(sys.executable).parent / "moekit"
# The capabilities that let root write into a folder whose mode forbids it.
_OVERRIDES = "-dac_override,-dac_read_search"


def write_tiny(family: str, folder: Path, dtype=None, max_shard_size: Optional[str] = None, seed: int = 0) -> Path:
    """hf_tiny's checkpoint of `family`, optionally cast (torch.bfloat16) or split into shards."""
    model = build_reference(family, seed)
    if dtype is not None:
        model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x5A]))


@contextmanager
def readonly_copy(src: Path) -> Iterator[Path]:
    """A copy of checkpoint `src` whose folder and files are read-only (mode 555 / 444)."""
    base = Path(tempfile.mkdtemp(prefix="moekit-readonly-"))
    folder = base / src.name
    shutil.copytree(src, folder)
    for p in folder.iterdir():
        p.chmod(0o444)
    folder.chmod(0o555)
    try:
        yield folder
    finally:
        folder.chmod(0o755)
        shutil.rmtree(base)


def run_unprivileged(args: list[str]) -> subprocess.CompletedProcess:
    """Run `args` so that file permission bits apply to it, even when the tests run as root."""
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: permission bits cannot be enforced")
        args = [setpriv, f"--inh-caps={_OVERRIDES}", f"--bounding-set={_OVERRIDES}", *args]
    return subprocess.run(args, capture_output=True, text=True, timeout=300)


def write_llama4_mxfp4(folder: Path, seed: int = 0) -> Path:
    """llama4_text with its experts stored as MXFP4 the way gpt-oss publishes them (`*_blocks`,
    `*_scales`, tests/weights/quantized_files.py): a published format in a layout the expert store
    does not page (only gpt_oss's is), so its manifest has whole-tensor checksums only."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    from moekit.weights import mxfp4

    build_reference("llama4_text", seed, hidden_size=64, intermediate_size=64, head_dim=16).save_pretrained(folder)
    path = folder / "model.safetensors"
    with safe_open(str(path), framework="pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    out = {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out[f"{name}_blocks"], out[f"{name}_scales"] = mxfp4.quantize(t.transpose(1, 2))  # [E, out, in/32, ...]
        else:
            out[name] = t
    save_file(out, str(path), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


PROMPTS = [[5, 17, 42, 9, 77, 3, 101], [8, 64, 12]]  # two lengths: a left-padded batch


def greedy_runs(folder, offload=None, dtype: str = "float32", prompts=PROMPTS, new: int = 20):
    """(each prompt alone, the prompts as one batch, the store's stats or None): greedy token ids of
    one engine, resident (offload None) or paged, closed afterwards."""
    engine = load_engine(folder, dtype=dtype, offload=offload, compile=False)
    try:
        single = [engine.generate(p, max_new_tokens=new, stop_ids=()).token_ids[0] for p in prompts]
        batch = engine.generate(prompts, max_new_tokens=new, stop_ids=()).token_ids
        stats = engine.store.stats() if engine.store is not None else None
    finally:
        engine.close()
    return single, batch, stats
