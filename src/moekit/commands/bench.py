"""`moekit bench`: speed measured as ratios in one run. torch (and transformers) load inside the command."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from moekit.calc.dtypes import engine_dtype
from moekit.commands.operators_notice import BUILDING, announce_operator_build, operators_to_build, say_progress
from moekit.commands.options import ENGINE_DTYPE, KERNELS, NO_VERIFY, compile_option
from moekit.errors import MoekitError

app = typer.Typer(help="Measure moekit's speed against a named baseline, in one run.", no_args_is_help=True)

DECODE_HELP = """Decode tokens/s of moekit vs transformers' generate (or llama.cpp) on one checkpoint, at batch 1 and 8.

Both run greedy on the same random prompts and dtype, in this process; the table gives the ratio, the bandwidth roofline of this machine (measured memory bandwidth / bytes one decode step reads) and the share of it moekit reaches. moekit's decode steps are its compiled graph (compiled or loaded first, a line says which); --eager measures the eager reference.

  moekit bench decode path/to/checkpoint --vs transformers --batch 1,8 --tokens 32
  moekit bench decode path/to/checkpoint --vs llama.cpp --batch 1,8 --threads 2   (benchmarks/build_llama_cpp.sh first)
"""


def _batches(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise MoekitError(f"--batch: expected comma-separated sizes like 1,8, got {text!r}") from None
    if not sizes:
        raise MoekitError("--batch: give at least one batch size")
    return sizes


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _fmt(value: Optional[float], spec: str) -> str:
    return "—" if value is None else format(value, spec)


@app.command("decode", help=DECODE_HELP)
def decode(
    checkpoint: Optional[Path] = typer.Argument(
        None, help="Checkpoint folder (config.json + *.safetensors). Default: the bundled demo model."
    ),
    vs: Optional[str] = typer.Option(None, "--vs", help="Baseline to compare against: transformers or llama.cpp."),
    weights: str = typer.Option("dtype", "--weights", help="moekit's weights: dtype, int8 or int8-experts "
                                "(--vs llama.cpp: int8 against its q8_0)."),
    llama_cpp_dir: Optional[Path] = typer.Option(None, "--llama-cpp-dir", help="Where benchmarks/build_llama_cpp.sh "
                                                 "built llama.cpp (default: bench-out/llama.cpp); GGUFs go to its gguf/."),
    dtype: str = typer.Option("fp32", "--dtype", help=ENGINE_DTYPE + " Both sides."),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda (both sides)."),
    no_verify: bool = typer.Option(False, "--no-verify", help=NO_VERIFY),
    compile_step: Optional[bool] = compile_option(),
    kernels: str = typer.Option("auto", "--kernels", help=KERNELS),
    batch: str = typer.Option("1,8", "--batch", help="Comma-separated batch sizes."),
    tokens: int = typer.Option(32, "--tokens", help="New tokens per row."),
    prompt_len: int = typer.Option(16, "--prompt-len", help="Prompt tokens per row."),
    repeats: int = typer.Option(3, "--repeats", help="Timed runs per side; the median is reported."),
    warmup: int = typer.Option(1, "--warmup", help="Untimed runs first."),
    threads: Optional[int] = typer.Option(None, "--threads", help="CPU threads for both sides (default: torch's)."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    from moekit.bench.bandwidth import roofline_bandwidth
    from moekit.bench.decode import BASELINES, BenchSettings, bench_decode, decode_baseline
    from moekit.commands.bench_view import decode_in_steps
    from moekit.engine.default_model import default_checkpoint
    from moekit.engine.loader import load_engine
    from moekit import ops

    dtype = engine_dtype(dtype)
    if vs not in (None, *BASELINES):
        raise MoekitError(f"--vs {vs}: the baselines are {', '.join(BASELINES)}")
    checkpoint = checkpoint if checkpoint is not None else default_checkpoint()

    settings = BenchSettings(
        batches=_batches(batch), tokens=tokens, prompt_len=prompt_len, repeats=repeats, warmup=warmup
    )
    if threads is not None:
        if threads < 1:
            raise MoekitError(f"--threads must be at least 1, got {threads}")
        import torch

        torch.set_num_threads(threads)
    from moekit.model.combinations import decode_compiled
    from moekit.ops import operators_used

    compiled = decode_compiled(compile_step, kernels)
    announce_operator_build(operators_used(compiled, weights, dtype, paged=False), kernels)
    engine = load_engine(checkpoint, dtype=dtype, device=device, weights=weights, verify=not no_verify,
                         compile=compiled, kernels=kernels)
    for note in engine.notes:
        typer.echo(note, err=True)
    if engine.decoder.compiled is not None:  # compiled here, with its line and time, not inside a warm-up run
        engine.decoder.compiled.warm_up(tuple(sorted({min(b, 2) for b in settings.batches})), say=say_progress)
    baseline = decode_baseline(vs, engine, weights, llama_cpp_dir)
    bandwidth, source = roofline_bandwidth() if engine.device == "cpu" else (None, "roofline: CPU only for now")
    results = decode_in_steps(lambda s: bench_decode(engine, s, baseline=baseline, bandwidth_bytes_s=bandwidth),
                              settings, vs if baseline is not None else None, lambda line: typer.echo(line, err=True))
    chosen = ops.chosen()
    if chosen:
        typer.echo("gemv operators: " + "; ".join(f"{kind} → {v}" for kind, v in chosen.items()), err=True)
    note = baseline.info().get("note") if baseline is not None else None
    if note:
        typer.echo(f"{vs}: {note}", err=True)

    if json_out:
        typer.echo(
            json.dumps(
                {
                    "checkpoint": str(checkpoint),
                    "model_type": engine.spec.model_type,
                    "dtype": dtype,
                    "weights": weights,
                    "baseline": vs,
                    "baseline_info": baseline.info() if baseline is not None else None,
                    "device": engine.device,
                    "tokens": tokens,
                    "prompt_len": prompt_len,
                    "repeats": repeats,
                    "threads": _threads(),
                    "bandwidth_bytes_s": bandwidth,
                    "bandwidth_source": source,
                    "gemv": chosen,
                    "kernels": kernels,
                    "results": [r.as_dict() for r in results],
                }
            )
        )
        return

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"decode tokens/s · {engine.spec.model_type} · {dtype} on {engine.device}")
    table.add_column("batch", justify="right")
    table.add_column("moekit", justify="right")
    table.add_column(vs or "baseline", justify="right")
    table.add_column("ratio", justify="right")
    table.add_column("MB / step", justify="right")
    table.add_column("roofline", justify="right")
    table.add_column("share of roofline", justify="right")
    table.add_column("same tokens", justify="center")
    for r in results:
        table.add_row(
            str(r.batch),
            f"{r.moekit_tok_s:.1f}",
            _fmt(r.baseline_tok_s, ".1f"),
            _fmt(r.ratio, ".2f") + ("×" if r.ratio else ""),
            f"{r.bytes_per_step / 1e6:.1f}",
            _fmt(r.roofline_tok_s, ".1f"),
            _fmt(r.roofline_share, ".0%"),
            "—" if r.same_tokens is None else ("yes" if r.same_tokens else "NO"),
        )
    console = Console()
    console.print(table)
    bw = f"{bandwidth / 1e9:.1f} GB/s ({source})" if bandwidth else source
    console.print(
        f"memory bandwidth: {bw}; median of {repeats} runs after {warmup} warm-up; "
        f"{tokens} new tokens per row after {prompt_len} prompt tokens; {_threads()} threads"
    )


OFFLOAD_HELP = """Decode tokens/s with routed experts paged under each --expert-memory budget, vs baselines.

Each configuration runs in its own process: moekit fully resident, moekit with no cache (every
expert read on every use) at the smallest budget, moekit at each budget without and with prefetch, and with --vs accelerate
transformers + accelerate's disk offload at the same memory (moekit's dense weights + the budget).
Reports hit rate, prefetch precision/recall, disk bytes per token, stall share and peak RSS growth
against the bound (dense + budget) × 1.1. moekit runs its eager decode step here (each configuration
is a fresh process, and compiling in each would dwarf a short run).

  moekit bench offload models/moekit-demo --expert-memory 12.5%,25%,50%,100% --vs accelerate
"""


@app.command("offload", help=OFFLOAD_HELP)
def offload(
    checkpoint: Optional[Path] = typer.Argument(None, help="Checkpoint folder. Default: the bundled demo model."),
    expert_memory: str = typer.Option("12.5%,25%,50%,100%", "--expert-memory", help="Comma-separated budgets."),
    vs: Optional[str] = typer.Option(None, "--vs", help="Also run this baseline at the same memory: accelerate."),
    cache: str = typer.Option("lru", "--cache", help="Cache policy for moekit's runs."),
    prefetch_extra: int = typer.Option(4, "--prefetch-extra", help="Experts guessed per token beyond K in the prefetch runs."),
    prompt: str = typer.Option("def parse_args(argv):\n    parser = argparse.ArgumentParser(", "--prompt",
                               help="Text prompt (needs tokenizer.json); else --prompt-len random ids."),
    prompt_len: int = typer.Option(16, "--prompt-len", help="Random prompt ids when the folder has no tokenizer."),
    tokens: int = typer.Option(32, "--tokens", help="New tokens (greedy)."),
    dtype: str = typer.Option("bf16", "--dtype", help=ENGINE_DTYPE + " Every run."),
    threads: int = typer.Option(1, "--threads", help="CPU threads for every run."),
    json_path: Optional[Path] = typer.Option(None, "--json-out", help="Also write every run's raw result here."),
    json_out: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    wide: bool = typer.Option(False, "--wide", help="Every column (stall share, the prefetch runs); default: what fits."),
) -> None:
    from moekit.commands.bench_view import check_offload_request
    from moekit.engine.default_model import default_checkpoint
    from moekit.bench.offload import OffloadBench, run_bench, summary_rows

    dtype = engine_dtype(dtype)
    if vs not in (None, "accelerate"):
        raise MoekitError(f"--vs {vs}: the only baseline here is accelerate")
    if tokens < 2 or threads < 1:
        raise MoekitError("--tokens must be at least 2 and --threads at least 1")
    folder = checkpoint if checkpoint is not None else default_checkpoint()
    budgets = tuple(b.strip() for b in expert_memory.split(",") if b.strip())
    if not budgets:
        raise MoekitError("--expert-memory: give at least one budget, e.g. 25%,50%")
    minimum = check_offload_request(folder, dtype, budgets, cache, vs)  # before any run, not after the first
    ids = _offload_prompt(folder, prompt.replace("\\n", "\n"), prompt_len)
    bench = OffloadBench(folder=str(folder), budgets=budgets, policy=cache, prefetch_extra=prefetch_extra,
                         prompt_ids=tuple(ids), new_tokens=tokens, threads=threads, dtype=dtype,
                         vs_accelerate=vs == "accelerate")
    from rich.console import Console

    from moekit.ops import operators_used

    console = Console(stderr=True)
    building = operators_to_build(operators_used(False, "dtype", dtype, paged=True))
    with console.status("starting" + (f": {BUILDING}" if building else "")) as status:
        results = run_bench(bench, minimum, on_start=lambda what: status.update(f"running: {what}"))
    rows = summary_rows(bench, results)
    if json_path is not None:
        json_path.write_text(json.dumps({"settings": vars(bench) | {"prompt_ids": list(ids)}, "results": results,
                                         "rows": rows}, indent=1) + "\n")
    if json_out:
        typer.echo(json.dumps({"rows": rows, "resident_tokens_per_s": results["resident"]["tokens_per_s"],
                               "no_cache_tokens_per_s": results["no-cache"]["tokens_per_s"]}))
        return
    _print_offload_table(bench, results, rows, wide)


def _offload_prompt(folder: Path, text: str, length: int) -> list[int]:
    import random

    from moekit.engine.loader import load_tokenizer
    from moekit.weights.gguf_spec import load_any_spec

    tokenizer = load_tokenizer(folder)
    if tokenizer is not None:
        return list(tokenizer.encode(text).ids)
    vocab = load_any_spec(folder).vocab_size
    rng = random.Random(0)
    return [rng.randrange(3, vocab) for _ in range(length)]


def _print_offload_table(bench, results: dict, rows: list[dict], wide: bool = False) -> None:
    from rich.console import Console

    from moekit.calc.units import nbytes
    from moekit.commands.bench_view import offload_notes, offload_table, print_wide_or_fitted

    resident, no_cache = results["resident"], results["no-cache"]
    table = offload_table(f"decode tokens/s under an expert budget · {bench.dtype} · {bench.threads} thread(s) · "
                          f"{bench.policy}", rows, bench.vs_accelerate, wide)
    console = Console()
    print_wide_or_fitted(console, table, wide)
    console.print(f"baselines: resident {resident['tokens_per_s']:.1f} tok/s; no cache "
                  f"{no_cache['tokens_per_s']:.1f} tok/s at the minimum budget ({nbytes(int(no_cache['budget_bytes']))})")
    for note in offload_notes(rows, wide):
        console.print(f"note: {note}")
