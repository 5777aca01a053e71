"""The baseline a user reaches for first: transformers with accelerate's disk offload at the same memory.

`moekit bench offload --vs accelerate` measures moekit's tiered expert store against this. The run
happens in a child process (`measure_accelerate`) so that its peak RSS is its own and nothing it
loads stays in the caller:

    python -m moekit.bench.accelerate_baseline --folder F --memory-bytes N \
        --prompt-ids 1,2,3 --new-tokens 16 --threads 1 --json

How the cap becomes real: `device_map="auto"` with `max_memory={"cpu": N}` and no GPU makes
accelerate keep the leading modules in RAM up to N (less room for one offloaded decoder layer,
which it reserves to page it in) and mark the rest "disk". Those parameters stay on the meta
device; a hook reads each one from its safetensors file before its module's forward and drops it
after, on every forward. Plain weights are read from the checkpoint's own files; MoE experts,
which transformers fuses at load time ([E, 2F, D] per layer), are rewritten once into the offload
folder. Whole decoder layers move to disk (they are `_no_split_modules`), so unlike moekit's
store, accelerate pages all E experts of a layer, not the K a token routes to.

transformers and accelerate are test/bench dependencies, never runtime ones: imported lazily.
No torch import at module level either; the parent side only spawns and parses.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

from moekit.errors import MoekitError
from moekit.bench.child import json_main, parse_ids, run_json_child

DTYPES = ("float32", "bfloat16")
MISSING_LIBRARIES = "the accelerate baseline needs transformers and accelerate: pip install accelerate transformers"


def _require_libraries():
    try:
        import accelerate  # noqa: F401  (transformers' device_map dispatch imports it too)
        import transformers
    except ImportError:
        raise MoekitError(MISSING_LIBRARIES) from None
    return transformers


def check_request(folder: Path, memory_bytes: int, prompt_ids: Sequence[int], new_tokens: int, threads: int, dtype: str):
    if not (folder / "config.json").is_file():
        raise MoekitError(f"{folder}: no config.json, not a checkpoint folder")
    if memory_bytes <= 0:
        raise MoekitError(f"memory must be a positive number of bytes, got {memory_bytes}")
    if not prompt_ids:
        raise MoekitError("no prompt ids given")
    if new_tokens < 1:
        raise MoekitError(f"new tokens must be at least 1, got {new_tokens}")
    if threads < 1:
        raise MoekitError(f"threads must be at least 1, got {threads}")
    if dtype not in DTYPES:
        raise MoekitError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def device_map_summary(device_map: dict) -> dict[str, int]:
    """How many device-map entries (modules or parameters) sit on each device, e.g. {"cpu": 5, "disk": 12}."""
    return dict(sorted(Counter(str(device) for device in device_map.values()).items()))


def offloaded_bytes(model) -> int:
    """Bytes of the parameters accelerate left on disk: they sit on the meta device between forwards."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "meta")


class _TokenClock:
    """A generate() streamer that timestamps each put: the first holds the prompt, each later one a new token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _peak_rss_bytes() -> int:
    from moekit.offload.report import peak_rss_bytes

    return peak_rss_bytes()


def _reset_peak_rss() -> bool:
    """Restart the kernel's high-water mark (Linux: "5" to clear_refs), so a later peak is the decode's own."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _high_water_rss_bytes() -> Optional[int]:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _experts_implementation(folder: Path, dtype) -> dict:
    """transformers' default grouped-GEMM experts need 16-byte row strides; where a width breaks that
    (the demo model's 52-wide experts in bf16: 104 bytes) its own eager loop is the way it runs."""
    import torch

    config = json.loads((Path(folder) / "config.json").read_text())
    size = torch.empty((), dtype=dtype).element_size()
    widths = [config.get("moe_intermediate_size") or config.get("intermediate_size") or 0, config.get("hidden_size", 0)]
    return {} if all(w * size % 16 == 0 for w in widths) else {"experts_implementation": "eager"}


def run_accelerate(
    folder,
    memory_bytes: int,
    prompt_ids: list[int],
    new_tokens: int,
    threads: int,
    dtype: str = "bfloat16",
    offload_root: Optional[str] = None,
) -> dict:
    """Load `folder` under a RAM cap of `memory_bytes` (the rest on disk) and time greedy decode at batch 1.

    Runs in the calling process: use `measure_accelerate` for a peak RSS that belongs to this run.
    `offload_root` is where the temporary offload folder goes (default: the system temp dir); it
    should be on the same kind of storage the moekit run reads its experts from.
    """
    import tempfile

    folder = Path(folder)
    check_request(folder, memory_bytes, prompt_ids, new_tokens, threads, dtype)
    transformers = _require_libraries()
    import torch

    torch.set_num_threads(threads)
    transformers.utils.logging.set_verbosity_error()  # its "offloaded to the disk" notice is the point here
    transformers.utils.logging.disable_progress_bar()
    rss_libraries = _peak_rss_bytes()  # torch + transformers alone: a floor no cap can go under

    with tempfile.TemporaryDirectory(prefix="moekit-accelerate-", dir=offload_root) as offload_dir:
        start = time.perf_counter()
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder,
            device_map="auto",
            max_memory={"cpu": int(memory_bytes)},
            offload_folder=offload_dir,
            dtype=getattr(torch, dtype),
            **_experts_implementation(folder, getattr(torch, dtype)),
        ).eval()
        load_s = time.perf_counter() - start
        device_map = dict(getattr(model, "hf_device_map", {}) or {"": "cpu"})
        # No eos: every run decodes exactly new_tokens, as moekit's run with no stop tokens does.
        # (min_new_tokens alone would forbid eos, which a free-running engine may choose.)
        model.generation_config.eos_token_id = None

        # transformers fuses each layer's experts in RAM before writing them to the offload folder,
        # so loading peaks far above the cap; the decode's own peak is measured apart.
        peak_load = _peak_rss_bytes()
        decode_peak_known = _reset_peak_rss()
        ids = torch.tensor([list(prompt_ids)], dtype=torch.int64)
        clock = _TokenClock()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
                streamer=clock,
            )
        end = time.perf_counter()
        peak_generate = _high_water_rss_bytes() if decode_peak_known else None

    token_ids = out[0, ids.shape[1] :].tolist()
    # clock.times[0]: the prompt is handed over; [1]: the first new token, after the prefill.
    prefill_s = clock.times[1] - start if len(clock.times) > 1 else end - start
    decode_s = clock.times[-1] - clock.times[1] if len(clock.times) > 2 else 0.0
    decode_steps = len(token_ids) - 1  # forwards after the prefill, as moekit's Timing counts them
    return {
        "tokens_per_s": decode_steps / decode_s if decode_s > 0 else float("nan"),
        "new_tokens": len(token_ids),
        "token_ids": token_ids,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "generate_s": end - start,
        "load_s": load_s,
        "memory_bytes": int(memory_bytes),
        "offloaded_bytes": offloaded_bytes(model),
        "resident_param_bytes": sum(
            p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta"
        ),
        "device_map_summary": device_map_summary(device_map),
        "threads": threads,
        "dtype": dtype,
        "peak_rss_bytes": max(peak_load, _peak_rss_bytes()),
        "peak_rss_before_load_bytes": rss_libraries,
        # From the end of loading: starts at the RSS loading left behind. None where it cannot be reset.
        "peak_rss_generate_bytes": peak_generate,
    }


def child_command(
    folder,
    memory_bytes: int,
    prompt_ids: Sequence[int],
    new_tokens: int,
    threads: int,
    dtype: str = "bfloat16",
    offload_root: Optional[str] = None,
) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "moekit.bench.accelerate_baseline",
        "--folder",
        str(folder),
        "--memory-bytes",
        str(int(memory_bytes)),
        "--prompt-ids",
        ",".join(str(int(t)) for t in prompt_ids),
        "--new-tokens",
        str(int(new_tokens)),
        "--threads",
        str(int(threads)),
        "--dtype",
        dtype,
        "--json",
    ]
    if offload_root is not None:
        argv += ["--offload-root", str(offload_root)]
    return argv


def measure_accelerate(
    folder,
    memory_bytes: int,
    prompt_ids: Sequence[int],
    new_tokens: int,
    threads: int = 1,
    dtype: str = "bfloat16",
    offload_root: Optional[str] = None,
    timeout_s: Optional[float] = None,
) -> dict:
    """`run_accelerate` in a child process: its memory is isolated and its peak RSS is its own."""
    check_request(Path(folder), memory_bytes, prompt_ids, new_tokens, threads, dtype)
    argv = child_command(folder, memory_bytes, prompt_ids, new_tokens, threads, dtype, offload_root)
    return run_json_child(argv, "accelerate baseline", timeout_s)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moekit.bench.accelerate_baseline",
        description="Greedy decode with transformers + accelerate disk offload under a RAM cap; prints one JSON line.",
    )
    parser.add_argument("--folder", required=True)
    parser.add_argument("--memory-bytes", type=int, required=True)
    parser.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    parser.add_argument("--offload-root", default=None, help="where the temporary offload folder is made")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line (the default too)")
    args = parser.parse_args(argv)
    return json_main(lambda: run_accelerate(
        args.folder,
        args.memory_bytes,
        parse_ids(args.prompt_ids),
        args.new_tokens,
        args.threads,
        args.dtype,
        args.offload_root,
    ))

if __name__ == "__main__":
    sys.exit(main())
