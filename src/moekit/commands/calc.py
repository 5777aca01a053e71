"""`moekit calc`: parameters, memory, roofline and latency budget of any MoE model, without torch."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import List, Optional

import typer

HELP = (
    "Count a Mixture-of-Experts model: total and active parameters (three conventions), memory at a "
    "dtype, bytes read per decoded token, and with --hardware the decode roofline and the latency budget."
    "\n\n"
    "MODELS are preset names (see --list), config.json paths or checkpoint folders; several are shown "
    "side by side. No hardware is assumed unless --hardware names one (`local` measures this machine "
    "in about a second)."
    "\n\n"
    "Examples:\n\n"
    "moekit calc mixtral-8x7b\n\n"
    "moekit calc path/to/config.json --json\n\n"
    "moekit calc deepseek-v3 --hardware h100 --dtype fp8 --context 32768 --batch 8\n\n"
    "moekit calc qwen3-30b-a3b --hardware a100-80gb --sla-ms 50\n\n"
    "moekit calc gpt4-rumored --explain\n\n"
    "moekit calc qwen3-30b-a3b --hardware h100 --batch 32 --cost --price-per-hour 2.49 --api-price 0.20,0.80\n\n"
    "moekit calc a.json b.json --csv"
)


def calc(
    models: Optional[List[str]] = typer.Argument(
        None, help="Preset names, config.json paths or checkpoint folders.", show_default=False
    ),
    hardware: Optional[str] = typer.Option(
        None,
        "--hardware",
        metavar="NAME",
        help="Device for the roofline and --sla-ms (e.g. h100, a100-80gb, mi300x, local); --list shows all. Default: none.",
    ),
    dtype: Optional[str] = typer.Option(
        None, "--dtype", metavar="DTYPE",
        help="Weight storage: fp32, bf16, fp16, fp8, int8, int4, mxfp4 (also float32, bfloat16, float16). Default: "
        "the form the checkpoint stores (a GGUF's tensor type, quantization_config, config.json's dtype), named on "
        "stderr; else bf16.",
    ),
    kv_dtype: Optional[str] = typer.Option(
        None,
        "--kv-dtype",
        metavar="DTYPE",
        help="KV cache dtype: fp32, bf16, fp16, fp8, int8. Default: the weight dtype if 16/32-bit float, else bf16.",
    ),
    context: Optional[str] = typer.Option(
        None, "--context", metavar="TOKENS", show_default=False,
        help="Tokens in each sequence's KV cache when the next is decoded. Default: 4096, or the model's "
             "max_position_embeddings when smaller."),
    batch: str = typer.Option("1", "--batch", metavar="N", help="Sequences decoded together in one step."),
    gpus: str = typer.Option(
        "1", "--gpus", metavar="N", help="Devices of the --hardware kind sharing weights, cache and work evenly."
    ),
    sla_ms: Optional[str] = typer.Option(
        None,
        "--sla-ms",
        metavar="MS",
        help="Per-token latency budget at batch 1: the most parameters a token may touch (needs --hardware).",
    ),
    cost: bool = typer.Option(False, "--cost", help="$ per million output tokens from the roofline at --batch (needs --hardware and --price-per-hour)."),
    price_per_hour: Optional[str] = typer.Option(None, "--price-per-hour", metavar="USD", help="The device's hourly price (all --gpus together)."),
    api_price: Optional[str] = typer.Option(None, "--api-price", metavar="IN,OUT",
                                            help="An API's $ per million input and output tokens, to compare and find the break-even batch."),
    explain: bool = typer.Option(False, "--explain", help="Show the derivation, every step with its numbers."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable JSON (a list when several models)."),
    as_csv: bool = typer.Option(False, "--csv", help="CSV, one row per model."),
    list_known: bool = typer.Option(False, "--list", help="List the bundled presets and known hardware, then exit."),
) -> None:
    from moekit.errors import MoekitError

    if sum([explain, as_json, as_csv]) > 1:
        raise MoekitError("choose one of --explain, --json, --csv")
    if list_known:
        _print_list(as_json)
        return
    if not models:
        raise MoekitError("name a model: a preset (see --list), a config.json or a checkpoint folder")

    from moekit.calc.hardware import get_hardware
    from moekit.calc.report import build_report
    from moekit.calc.request import parse_request
    from moekit.weights.gguf_spec import load_any_spec

    priced = _cost_options(cost, hardware, price_per_hour, api_price)
    specs = [(source, load_any_spec(source)) for source in models]
    reports, device = [], None
    for source, spec in specs:
        stored, where = stored_dtype(source) if dtype is None else (dtype, None)
        planned, note = model_context(spec, context)
        request = parse_request(stored, kv_dtype, planned, batch, hardware, gpus, sla_ms)
        device = device or (get_hardware(request.hardware) if request.hardware else None)
        for line in (note, where and f"{spec.name}: planning at {stored}, as stored ({where}); --dtype plans another"):
            if line:
                typer.echo(f"note: {line}", err=True)
        reports.append(build_report(spec, request, device))

    costs = None
    if priced is not None:
        from moekit.calc.cost import roofline_cost

        costs = [roofline_cost(r, *priced) for r in reports]
    if explain:
        _print_explanations(reports, [source for source, _ in specs])
    elif as_json:
        _print_json(reports, costs)
    elif as_csv:
        _print_csv(reports)
    else:
        from rich.console import Console

        from moekit.calc.table import report_table

        Console().print(report_table(reports))
    if costs is not None and not as_json:
        for (source, _), c in zip(specs, costs):
            typer.echo(f"{source}: {c.line()}", err=as_csv)


def _cost_options(cost: bool, hardware, price_per_hour, api_price):
    """--cost's (price, API price or None), or None without --cost; one line naming what is missing."""
    from moekit.calc.cost import parse_api_price, parse_price
    from moekit.errors import MoekitError

    if not cost:
        if price_per_hour is not None or api_price is not None:
            raise MoekitError("--price-per-hour and --api-price go with --cost")
        return None
    if hardware is None or price_per_hour is None:
        raise MoekitError("--cost needs --hardware (the roofline) and --price-per-hour (the device's price)")
    return parse_price(price_per_hour), None if api_price is None else parse_api_price(api_price)


# Stored forms a checkpoint states, in the dtype vocabulary (GGUF tensor types, quantization_config methods).
STORED_FORMS = {"Q8_0": "int8", "Q4_0": "int4", "BF16": "bf16", "F16": "fp16", "F32": "fp32", "MXFP4": "mxfp4",
                "mxfp4": "mxfp4", "fp8": "fp8"}


def stored_dtype(source: str) -> tuple[str, Optional[str]]:
    """(dtype, where it is stated) of the form a checkpoint stores its weights in: a GGUF's most common
    tensor type among the routed experts' (else all), a quantization_config (mxfp4, fp8 blocks), or
    config.json's torch_dtype / dtype; bf16 (stated nowhere) for a preset or a config that says none."""
    from collections import Counter

    from moekit.calc.claims import raw_config
    from moekit.calc.dtypes import canonical_dtype
    from moekit.spec import list_presets

    path = Path(source)
    if path.suffix == ".gguf" and path.is_file():
        from moekit.weights.gguf_file import read_gguf

        tensors = read_gguf(path).tensors.values()
        experts = [t.qtype for t in tensors if "_exps" in t.name] or [t.qtype for t in tensors]
        qtype = Counter(experts).most_common(1)[0][0] if experts else None
        if qtype in STORED_FORMS:
            return STORED_FORMS[qtype], f"its GGUF tensors are {qtype}"
        return "bf16", None
    config = raw_config(source, list_presets()) or {}
    qc = config.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method in STORED_FORMS:
        return STORED_FORMS[method], f"quantization_config: {method}"
    stated = config.get("torch_dtype") or config.get("dtype")
    if source not in list_presets() and isinstance(stated, str) and canonical_dtype(stated) in ("fp32", "bf16", "fp16"):
        return canonical_dtype(stated), f"config.json: {stated}"
    return "bf16", None


def model_context(spec, context: Optional[str]) -> tuple[object, Optional[str]]:
    """(--context to plan, a note): the model's own limit when it is below the 4,096 default, and a
    word when a given --context exceeds what the model was built for."""
    from moekit.calc.request import DEFAULT_CONTEXT, positive_int

    limit = spec.max_position_embeddings
    if context is None:
        if limit < DEFAULT_CONTEXT:
            return limit, f"{spec.name}: planning a {limit:,}-token context, its max_position_embeddings"
        return DEFAULT_CONTEXT, None
    if positive_int("--context", context) > limit:
        return context, (f"{spec.name}: --context {int(context):,} exceeds its max_position_embeddings ({limit:,}); "
                         f"planned anyway, though the model was not built for it")
    return context, None


def _print_explanations(reports, sources) -> None:
    from moekit.calc.claims import claims_from_config, raw_config
    from moekit.calc.explain import explain
    from moekit.spec import list_presets

    presets = list_presets()
    texts = []
    for report, source in zip(reports, sources):
        config = raw_config(source, presets)
        claims = claims_from_config(config, source) if config is not None else None
        texts.append(explain(report, claims))
    typer.echo("\n".join(texts), nl=False)


def _print_json(reports, costs=None) -> None:
    from moekit.calc.report import report_dict

    data = [report_dict(r) for r in reports]
    for d, c in zip(data, costs or []):
        d["cost"] = c.as_dict()
    typer.echo(json.dumps(data[0] if len(data) == 1 else data, indent=2))


def _print_csv(reports) -> None:
    from moekit.calc.report import flatten, report_dict

    rows = [flatten(report_dict(r)) for r in reports]
    columns = list(dict.fromkeys(key for row in rows for key in row))
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    typer.echo(out.getvalue(), nl=False)


def _print_list(as_json: bool) -> None:
    from moekit.calc.hardware import catalog_entries
    from moekit.spec import list_presets

    presets = list_presets()
    devices = [
        {"name": e["name"], "aliases": e["aliases"], "label": e["label"]} for e in catalog_entries()
    ] + [{"name": "local", "aliases": [], "label": "this machine, measured when asked"}]
    if as_json:
        typer.echo(json.dumps({"presets": presets, "hardware": devices}, indent=2))
        return
    typer.echo("presets:")
    for name in presets:
        typer.echo(f"  {name}")
    typer.echo("hardware:")
    for d in devices:
        aka = f" (also: {', '.join(d['aliases'])})" if d["aliases"] else ""
        typer.echo(f"  {d['name']:<12} {d['label']}{aka}")
