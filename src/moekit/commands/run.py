"""`moekit run`: generate from a checkpoint folder with the native engine, metering every token.

torch is imported only inside `run` (through moekit.engine), so registering this command costs
nothing for `moekit calc`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

from moekit.calc.dtypes import engine_dtype
from moekit.commands.operators_notice import announce_operator_build, say_progress
from moekit.commands.options import ENGINE_DTYPE, KERNELS, NO_VERIFY, WEIGHTS, compile_option, expert_parallel_options
from moekit.errors import MoekitError

EP_OPTIONS = expert_parallel_options()  # --expert-parallel, --placement, --ep-timeout

HELP = """Generate tokens from a Hugging Face MoE checkpoint with the native engine.

CHECKPOINT is a folder with config.json and *.safetensors (tokenizer.json optional: without it, give --prompt-ids). Without one (or when the first argument is not an existing folder) moekit runs its bundled demo model, models/moekit-demo.

The decode steps run as one compiled graph: the first run of a model on this machine compiles it (a line says so, and its time), later runs load it. --eager runs the eager reference instead.

Examples:

  moekit run "def parse_args(argv):"                      # the bundled model

  moekit run path/to/checkpoint "def fibonacci(n):" --max-new-tokens 64

  moekit run path/to/checkpoint --prompt-ids 1,17,42 --max-new-tokens 24 --temperature 0 --json

  moekit run path/to/checkpoint "Hello" --top-p 0.95 --seed 0    # --top-p / --top-k sample (temperature 1)

  moekit run path/to/checkpoint "Hello" --show-activation

  moekit run path/to/checkpoint "Hello" --eager                    # the eager reference path, no compile

  moekit run path/to/checkpoint "Hello" --expert-memory 25%        # routed experts paged from disk

  moekit run path/to/checkpoint "Hello" --expert-memory 1GiB --cache lfu --pin profile.json --prefetch
"""


def parse_ids(text: Optional[str], what: str) -> Optional[list[int]]:
    """'1,17, 42' -> [1, 17, 42]; one clear line on anything else."""
    if text is None:
        return None
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise MoekitError(f"{what}: no token ids given")
    try:
        return [int(p) for p in parts]
    except ValueError:
        raise MoekitError(f"{what}: expected comma-separated integer token ids, got {text!r}") from None


def looks_like_path(text: str) -> bool:
    """A lone argument that may have been meant as a checkpoint rather than a prompt: one line that has
    a path separator, starts with ~, or names a file. Never raises, whatever the string."""
    from moekit.engine.default_model import is_existing

    seps = {"/", "\\"} | ({os.altsep} if os.altsep else set())
    return "\n" not in text and (any(sep in text for sep in seps) or text.startswith("~") or is_existing(text, "file"))


def shown_prompt(text: str, width: int = 60) -> str:
    """A prompt as the notes quote it: whole when short, else its start and its size (a pasted page
    would drown the line)."""
    if len(text) <= width:
        return repr(text)
    return f"{text[:width]!r}… ({len(text.encode('utf-8', 'surrogatepass')):,} bytes)"


def sampling_temperature(temperature: Optional[float], top_p: Optional[float], top_k: Optional[int]) -> float:
    """--top-p and --top-k sample: unless --temperature says otherwise they imply temperature 1. An
    explicit --temperature 0 with either would silently ignore it, so it is refused."""
    filters = [name for name, value in (("--top-p", top_p), ("--top-k", top_k)) if value is not None]
    if temperature is None:
        return 1.0 if filters else 0.0
    if temperature == 0 and filters:
        them = "them" if len(filters) > 1 else "it"
        raise MoekitError(f"{' and '.join(filters)} sample{'' if len(filters) > 1 else 's'}, but --temperature 0 is "
                          f"greedy and would ignore {them}: drop one (a positive --temperature samples)")
    return temperature


def describe_sampling(sampling) -> str:
    """How tokens are chosen, in words: the demo's output states its setting."""
    if sampling.greedy:
        return "greedy"
    parts = [f"temperature {sampling.temperature:g}"]
    if sampling.top_k:
        parts.append(f"top-k {sampling.top_k}")
    if sampling.top_p is not None and sampling.top_p < 1:
        parts.append(f"top-p {sampling.top_p:g}")
    parts.append(f"seed {sampling.seed}" if sampling.seed is not None else "unseeded")
    return "sampling at " + ", ".join(parts)


def check_trace_path(trace: Path) -> None:
    if trace.suffix.lower() != ".parquet":
        raise MoekitError(f"--trace {trace}: the trace is written as Parquet; name the file *.parquet "
                          f"(e.g. {trace.with_suffix('.parquet').name})")
    if not trace.parent.exists():
        raise MoekitError(f"--trace {trace}: folder {trace.parent} does not exist")


def _expert_summary(act, width: int = 60) -> str:
    text = " ".join(f"L{layer}:{','.join(map(str, ids))}" for layer, ids in act.experts.items())
    return text if len(text) <= width else text[: width - 1] + "…"


def _token_text(engine, token_id: int) -> str:
    if engine.tokenizer is None:
        return str(token_id)
    text = engine.tokenizer.decode([token_id])
    if not text or "\ufffd" in text:  # part of a multi-byte character: show the raw piece
        text = engine.tokenizer.id_to_token(token_id) or str(token_id)
    return repr(text)[1:-1]


def _activation_table(engine, acts):
    """One row per generated token. Parameters touched and the share are a column only when they
    vary (mixed expert sizes, dense layers); the same for every token, they are said once."""
    from rich.table import Table

    spec = engine.spec
    moe = bool(spec.moe_layers)
    varies = len({(a.params_touched, a.share) for a in acts}) > 1
    notes = []
    if not varies and acts:
        notes.append(f"every token touches {acts[0].params_touched:,} parameters ({acts[0].share:.2%} active share)")
    if moe:
        slots = sum(spec.layers[i].ffn.num_experts for i in spec.moe_layers)
        notes.append(f"distinct experts: running total of the different experts used so far (the prompt's included), of "
                     f"{len(spec.moe_layers)} MoE layers × {slots // len(spec.moe_layers)} experts = {slots:,}")
    table = Table(title="activation per generated token", show_lines=False, caption="\n".join(notes) or None,
                  caption_justify="left")
    table.add_column("#", justify="right")
    table.add_column("token")
    if moe:
        table.add_column("experts (layer:ids)")
    if varies:
        table.add_column("params touched", justify="right")
        table.add_column("active share", justify="right")
    if moe:
        table.add_column("distinct experts", justify="right")
    for a in acts:
        cells = [str(a.index), _token_text(engine, a.token_id)]
        if moe:
            cells.append(_expert_summary(a))
        if varies:
            cells += [f"{a.params_touched:,}", f"{a.share:.2%}"]
        if moe:
            cells.append(str(a.distinct_experts_total))
        table.add_row(*cells)
    return table


def run(
    first: Optional[str] = typer.Argument(
        None,
        metavar="CHECKPOINT",
        help="Checkpoint folder: config.json + *.safetensors (+ tokenizer.json). Default: the bundled model.",
    ),
    second: Optional[str] = typer.Argument(
        None, metavar="PROMPT", help="Text prompt (needs tokenizer.json in the folder)."
    ),
    prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help="Comma-separated token ids instead of text."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens to generate at most."),
    dtype: str = typer.Option("fp32", "--dtype", help=ENGINE_DTYPE),
    weights: str = typer.Option("dtype", "--weights", help=WEIGHTS),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    no_verify: bool = typer.Option(False, "--no-verify", help=NO_VERIFY),
    compile_step: Optional[bool] = compile_option(),
    kernels: str = typer.Option("auto", "--kernels", help=KERNELS),
    temperature: Optional[float] = typer.Option(
        None, "--temperature", show_default=False,
        help="0 = greedy. Default: 0, or 1 when --top-p or --top-k is given (they sample)."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus sampling mass in (0, 1]; implies sampling."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Sample among the k most likely tokens; implies sampling."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for sampling (reproducible runs)."),
    stop: Optional[str] = typer.Option(None, "--stop", help="Comma-separated stop token ids (default: the model's eos; '' never stops early)."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Write the routing trace to this Parquet file (*.parquet)."),
    show_activation: bool = typer.Option(
        False, "--show-activation", help="Per token: experts chosen, params touched, share of all params."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    expert_memory: Optional[str] = typer.Option(
        None, "--expert-memory", help="Memory for routed experts: a share of all expert bytes (25%) or bytes (2GiB); "
        "the rest stays on disk. Default: all resident."),
    cache: str = typer.Option("lru", "--cache", help="Expert cache policy: lru, lfu, lfu-aging, lfru (or none: read on every use)."),
    pin: Optional[Path] = typer.Option(None, "--pin", help="Profile from `moekit profile`: its experts stay resident."),
    prefetch: bool = typer.Option(False, "--prefetch/--no-prefetch", help="Guess each layer's experts ahead of it and read them "
                                  "on worker threads (off by default: see docs/BENCHMARKS.md)."),
    prefetch_extra: int = typer.Option(4, "--prefetch-extra", help="Experts guessed per token beyond its K when prefetching."),
    read_ahead: int = typer.Option(2, "--read-ahead", help="With --expert-memory: misses read in parallel on worker "
                                   "threads behind the compute (a prompt keeps N reads ahead); 0 reads them one by one."),
    expert_split: Optional[Path] = typer.Option(
        None, "--expert-split", metavar="TRACE", help="With --expert-memory: split the budget's slots across layers "
        "by the hit rate each scores on a routing trace (`moekit run --trace`) instead of equally."),
    direct_io: bool = typer.Option(False, "--direct-io", help="With --expert-memory: read experts with O_DIRECT, "
                                   "so the page cache holds no second copy of them."),
    substitute: Optional[str] = typer.Option(None, "--substitute", metavar="int4", help="With --expert-memory: keep an "
                                             "int4 copy of every expert resident and run it on a miss instead of "
                                             "waiting, the full copy read behind (HOBBIT; docs/ROUTING.md)."),
    expert_parallel: Optional[str] = EP_OPTIONS[0],
    placement: Optional[Path] = EP_OPTIONS[1],
    ep_timeout: float = EP_OPTIONS[2],
    routing: Optional[str] = typer.Option(
        None, "--routing", metavar="POLICY", help="A routing policy instead of the family's exact routing: topk:k "
        "(k up to E), adaptive:τ, topp:p, ema:α, reuse, temp:T, gumbel:σ[:seed] (else --seed), minconf:c, split:k:w, "
        "cache:N[:q], loadaware:Δ[:f[:decay]], capacity:f:drop|reroute, P+reset:N (their cost: moekit "
        "eval-routing, docs/ROUTING.md)."),
) -> None:
    from moekit.engine.default_model import split_checkpoint_and_prompt
    from moekit.engine.loader import load_engine
    from moekit.engine.sampling import SamplingParams, check_sampling

    dtype = engine_dtype(dtype)
    ids = parse_ids(prompt_ids, "--prompt-ids")
    checkpoint, prompt = split_checkpoint_and_prompt(first, second, ids_given=ids is not None)
    if prompt is None and ids is None and first is not None:
        what = "a checkpoint folder" if (checkpoint / "config.json").is_file() else "a folder, though no checkpoint (no config.json)"
        raise MoekitError(f"{first!r} is {what}, so it was read as CHECKPOINT and no PROMPT follows: give a text "
                          "PROMPT or --prompt-ids after it")
    if (prompt is None) == (ids is None):
        raise MoekitError("give either a text PROMPT or --prompt-ids, not both and not neither")
    if second is None and prompt is not None and looks_like_path(prompt):
        typer.echo(f"note: {shown_prompt(prompt)} is no checkpoint folder, so it is the prompt for the bundled model "
                   f"({checkpoint}); name an existing folder to run your own", err=True)
    if max_new_tokens <= 0:
        raise MoekitError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    sampling = SamplingParams(temperature=sampling_temperature(temperature, top_p, top_k), top_k=top_k, top_p=top_p,
                              seed=seed)
    check_sampling(sampling)
    stop_ids = () if stop is not None and not stop.strip() else parse_ids(stop, "--stop")
    if trace is not None:
        check_trace_path(trace)

    offload = None
    if expert_memory is not None:
        from moekit.offload.options import OffloadOptions

        from moekit.offload.substitute import parse_substitute

        offload = OffloadOptions(expert_memory=expert_memory, policy=cache, pin=pin, prefetch=prefetch,
                                 prefetch_extra=prefetch_extra, read_ahead=read_ahead, split=expert_split, direct_io=direct_io,
                                 substitute=parse_substitute(substitute) if substitute is not None else None)
    from moekit.model.combinations import Options, check, decode_compiled, store_flags

    compiled = decode_compiled(compile_step, kernels)
    check(Options(compile=compile_step is True, paged=offload is not None, expert_parallel=expert_parallel is not None or placement is not None,
                  weights=weights, routing=routing is not None, no_verify=no_verify, device=device,
                  store_flags=store_flags(cache=cache, pin=pin, prefetch=prefetch, substitute=substitute, split=expert_split, direct_io=direct_io)))
    if expert_parallel is not None or placement is not None:
        from moekit.dist.cli import run_sharded

        if compiled:  # the default (an explicit --compile was refused above)
            typer.echo("note: decode steps run eager: `run --expert-parallel` does not compile its step yet "
                       "(`serve --expert-parallel` does)", err=True)
        run_sharded(expert_parallel, placement, ep_timeout, checkpoint, prompt, ids, dtype, device, offload, max_new_tokens,
                    sampling, stop_ids, report=lambda engine, sampling: _generate_and_report(
                        engine, ids, prompt, max_new_tokens, sampling, stop_ids, trace, show_activation, json_out))
        return
    from moekit.ops import operators_used

    announce_operator_build(operators_used(compiled, weights, dtype, paged=offload is not None), kernels)
    engine = load_engine(checkpoint, dtype=dtype, device=device, offload=offload, progress=_manifest_progress(),
                         weights=weights, verify=not no_verify, compile=compiled, kernels=kernels)
    try:
        for note in engine.notes:
            typer.echo(f"note: {note}", err=True)
        prompt_tokens = engine.encode(prompt) if ids is None else ids  # a refusal here waits on no compile
        policy = _routing_policy(engine, routing, seed)
        if engine.decoder.compiled is not None:
            engine.decoder.compiled.warm_up((1,), say=say_progress)  # before the clock starts: the timing line is decode only
        _generate_and_report(engine, prompt_tokens, prompt, max_new_tokens, sampling, stop_ids, trace, show_activation,
                             json_out, policy)
    finally:
        engine.close()


def _manifest_progress():
    """A progress bar for the one-off checksum pass over every expert (first offloaded run)."""
    state = {}

    def progress(done: int, total: int) -> None:
        from rich.progress import Progress

        if "bar" not in state:
            state["bar"] = Progress(transient=True, console=None)
            state["bar"].start()
            state["task"] = state["bar"].add_task("checksumming experts (once)", total=total)
        state["bar"].update(state["task"], completed=done)
        if done >= total:
            state["bar"].stop()

    return progress


def _routing_policy(engine, text: Optional[str], seed: Optional[int] = None):
    """--routing's policy, checked against the model's K and E; None keeps the family's routing.
    gumbel:σ without a seed of its own takes --seed."""
    if text is None:
        return None
    from dataclasses import replace

    from moekit.analysis.policy_eval import model_experts, model_k
    from moekit.model.routing import parse_policy
    from moekit.model.routing_policies import Gumbel

    policy = parse_policy(text, model_k(engine.spec), model_experts(engine.spec))
    if isinstance(policy, Gumbel) and policy.seed is None and seed is not None:
        return replace(policy, seed=seed)
    return policy


def _generate_and_report(engine, ids, prompt, max_new_tokens, sampling, stop_ids, trace, show_activation, json_out,
                         policy=None):
    """ids: the prompt's token ids, or None to encode the text `prompt` here."""
    from moekit.engine.detokenize import TextStream

    prompt_tokens = engine.encode(prompt) if ids is None else ids
    out = sys.stdout

    on_token = None
    stream = None
    if not json_out:
        if engine.tokenizer is not None:
            stream = TextStream(engine.tokenizer)

            def on_token(step, row_ids):
                if row_ids[0] is not None:
                    out.write(stream.push(row_ids[0]))
                    out.flush()

        else:

            def on_token(step, row_ids):
                if row_ids[0] is not None:
                    out.write(("" if step == 0 else " ") + str(row_ids[0]))
                    out.flush()

    if on_token is not None:
        # Said once the engine accepted the request (a refused one stays a one-line error).
        given = shown_prompt(prompt) if prompt is not None else f"{len(prompt_tokens)} token ids"
        header, streamed = f"{engine.spec.name} · {describe_sampling(sampling)} · prompt {given}:", on_token

        def on_token(step, row_ids):
            if step == 0:
                typer.echo(header, err=True)
            streamed(step, row_ids)

    snapshot = {}
    if engine.store is not None:
        shown = on_token

        def on_token(step, row_ids):
            if step == 0:
                snapshot.update(engine.store.stats())
            if shown is not None:
                shown(step, row_ids)

    from contextlib import nullcontext

    from moekit.engine.router_health import watch_entropy

    with watch_entropy(engine.decoder) if trace is not None else nullcontext():  # the trace's entropy column
        gen = engine.generate(prompt_tokens, max_new_tokens=max_new_tokens, sampling=sampling, stop_ids=stop_ids,
                              on_token=on_token, **({} if policy is None else {"policy": policy}))
    acts = engine.meter(gen)
    offload = None
    if engine.store is not None:
        from moekit.offload.report import offload_report

        offload = offload_report(snapshot, engine.store.stats(), gen.timing.decode_tokens, gen.timing.decode_s)
    if trace is not None:
        from moekit.engine.trace import trace_model, write_trace

        rows = write_trace(gen, trace, trace_model(engine.spec, engine.folder))
    generated = gen.token_ids[0]

    if json_out:
        payload = {
            "token_ids": generated,
            "text": engine.decode(generated) if engine.tokenizer is not None else None,
            "stopped": gen.stopped[0],
            "activation": [a.as_dict() for a in acts],
            "timing": gen.timing.as_dict(),
        }
        if offload is not None:
            payload["offload"] = offload
        if engine.tokenizer is None:
            del payload["text"]
        out.write(json.dumps(payload) + "\n")
        return

    if stream is not None:
        out.write(stream.flush())
    out.write("\n")
    out.flush()
    t = gen.timing
    typer.echo(
        f"[{len(generated)} tokens · prefill {t.prefill_s * 1e3:.1f} ms · decode {t.decode_tok_s:.1f} tok/s"
        f" · {engine.dtype} on {engine.device}]",
        err=True,
    )
    if offload is not None:
        typer.echo(paging_summary(offload), err=True)
    if trace is not None:
        typer.echo(f"routing trace: {rows} rows -> {trace}", err=True)
    if show_activation:
        from rich.console import Console

        console = Console(file=out, width=max(100, Console().width))
        console.print(_activation_table(engine, acts))
        if offload is not None:
            console.print(_offload_table(offload))


def paging_summary(report: dict) -> str:
    """The expert store's decode figures in one line, as `--json` has them under "decode"."""
    from moekit.calc.units import nbytes

    d = report["decode"]
    hit = "—" if report["decode_hit_rate"] is None else f"{report['decode_hit_rate']:.1%}"
    disk = "—" if d["disk_bytes_per_token"] is None else nbytes(d["disk_bytes_per_token"])
    stall = "—" if d["stall_s_per_token"] is None else f"{d['stall_s_per_token'] * 1e3:.2f} ms"
    return (f"[expert store · {report['policy']}, {report['slots_per_layer']} slots per layer · decode hit rate {hit}"
            f" · disk {disk} per token · stall {stall} per token]")


def _offload_table(report: dict):
    from rich.table import Table

    from moekit.calc.units import nbytes as format_bytes

    d = report["decode"]
    table = Table(title=f"expert store: {report['policy']}, {report['slots_per_layer']} slots per layer, "
                        f"prefetch {'on' if report['prefetch'] else 'off'}")
    table.add_column("figure")
    table.add_column("value", justify="right")

    def pct(x):
        return "—" if x is None else f"{x:.1%}"

    rows = [
        ("decode hit rate", pct(report["decode_hit_rate"])),
        *((f"  layer {l}", pct(h)) for l, h in d["hit_rate_per_layer"].items()),
        ("disk bytes per decoded token", "—" if d["disk_bytes_per_token"] is None else format_bytes(d["disk_bytes_per_token"])),
        ("stall per decoded token", "—" if d["stall_s_per_token"] is None else f"{d['stall_s_per_token'] * 1e3:.2f} ms"),
        ("stall share of decode time", pct(d["stall_share"])),
        ("prefetch precision / recall", f"{pct(report['prefetch_precision'])} / {pct(report['prefetch_recall'])}"),
        ("prefill loads", f"{report['prefill']['loads']} ({format_bytes(report['prefill']['disk_bytes'])})"),
        ("peak resident expert bytes", format_bytes(report["peak_resident_expert_bytes"])),
        ("process peak RSS", format_bytes(report["peak_rss_bytes"])),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table
