"""Peers as named baselines: `moekit bench serve CKPT --vs llama-server,vllm` (no torch).

The harness starts each engine on the same checkpoint, one at a time, on a free loopback port,
drives it with the same workload through the same load generator (moekit.bench.serve), stops it,
and prints moekit's ratio to each baseline from the same run. With several rounds the engines'
order rotates, so none is always the first to run on a machine whose speed drifts.

The workload (issue 35's):
  - levels c = 1, 4, 16: c clients, 4 x c streamed completions of 8-token id prompts, 64 tokens each;
  - arrivals: the c = 16 level again, with 512-token prompts arriving during it (their prefill is
    what stalls a server's running rows: it shows in the short requests' ITL p99).

Engines: "moekit" (`moekit serve`, with --moekit-args), "moekit:FLAGS" (another moekit variant,
e.g. moekit:--eager), "llama-server" (the GGUF llama.cpp's own converter makes of the
checkpoint: f32, bf16 or q8_0 for --weights int8) and "vllm" (vLLM's CPU build).
"""

from __future__ import annotations

import json
import random
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from moekit.bench.serve import (Arrivals, LevelResult, LoadPlan, first_model, run_arrivals_level, run_level,
                                summarize)
from moekit.bench.server_launch import ServerCommand, ServerExited, free_port, running
from moekit.errors import MoekitError

BASELINES = ("llama-server", "vllm")
ID_FLOOR = 3  # ids below this are special tokens (pad, bos, eos) in the benchmark checkpoints


@dataclass(frozen=True)
class Workload:
    prompt_len: int = 8
    max_tokens: int = 64
    requests_per_client: int = 4
    concurrency: tuple[int, ...] = (1, 4, 16)
    arrival_prompt_len: int = 512  # 0: no arrivals level
    arrival_count: int = 4
    arrival_concurrency: int = 16
    warmup: int = 2
    seed: int = 0

    def __post_init__(self):
        if self.prompt_len < 1 or self.max_tokens < 1 or self.requests_per_client < 1:
            raise MoekitError("prompt length, output tokens and requests per client must each be at least 1")
        if not self.concurrency or min(self.concurrency) < 1:
            raise MoekitError(f"concurrency levels must be integers >= 1, got {self.concurrency}")
        if self.arrival_prompt_len < 0 or self.arrival_count < 0 or self.arrival_concurrency < 1:
            raise MoekitError("arrivals: prompt length and count must be >= 0, their concurrency >= 1")

    @property
    def has_arrivals(self) -> bool:
        return self.arrival_prompt_len > 0 and self.arrival_count > 0

    @property
    def context(self) -> int:
        """Tokens one row can hold: the longest prompt and its output."""
        longest = max(self.prompt_len, self.arrival_prompt_len if self.has_arrivals else 0)
        return longest + self.max_tokens

    def level_names(self) -> list[str]:
        names = [f"c={c}" for c in self.concurrency]
        if self.has_arrivals:
            names.append(f"c={self.arrival_concurrency} + {self.arrival_count}x{self.arrival_prompt_len}-token arrivals")
        return names

    @property
    def level_clients(self) -> list[int]:
        """Each level's clients, the arrivals level last."""
        return [*self.concurrency, *([self.arrival_concurrency] if self.has_arrivals else [])]

    def prompts(self, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
        """Short prompts, one per request the run sends (each level's warm-up, then its requests;
        level_prompts cuts them), and the arrivals' long ones: random ids in [ID_FLOOR, vocab), the
        same for every engine. No prompt is sent twice, so no engine's prompt cache answers one
        (llama-server reuses a slot's prompt KV whatever its length; moekit's and vLLM's prefix
        caches keep blocks of 16 tokens, which an 8-token prompt never fills)."""
        if vocab <= ID_FLOOR:
            raise MoekitError(f"a vocabulary of {vocab} leaves no ordinary token id to prompt with")
        rng = random.Random(self.seed)
        draw = lambda n: [rng.randrange(ID_FLOOR, vocab) for _ in range(n)]  # noqa: E731
        sent = sum(self.warmup + self.requests_per_client * c for c in self.level_clients)
        short = [draw(self.prompt_len) for _ in range(sent)]
        long = [draw(self.arrival_prompt_len) for _ in range(self.arrival_count)] if self.has_arrivals else []
        return short, long

    def level_prompts(self, short: list[list[int]]) -> list[tuple[list[list[int]], list[list[int]]]]:
        """`short` (from prompts) cut into each level's (warm-up prompts, its requests' prompts), in
        level_clients' order."""
        cut, at = [], 0
        for c in self.level_clients:
            warm, asked = at + self.warmup, at + self.warmup + self.requests_per_client * c
            cut.append((short[at:warm], short[warm:asked]))
            at = asked
        return cut


@dataclass(frozen=True)
class EngineChoice:
    kind: str  # "moekit", "llama-server" or "vllm"
    flags: tuple[str, ...] = ()  # moekit serve flags of a moekit variant

    @property
    def name(self) -> str:
        return " ".join(("moekit", *self.flags)) if self.kind == "moekit" else self.kind


def parse_vs(text: str, moekit_flags: str = "") -> list[EngineChoice]:
    """'llama-server,vllm,moekit:--compile' → the subject (moekit with `moekit_flags`) first, then
    each baseline once."""
    engines = [EngineChoice("moekit", tuple(shlex.split(moekit_flags)))]
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        kind, _, flags = item.partition(":")
        if kind not in (*BASELINES, "moekit") or (flags and kind != "moekit"):
            raise MoekitError(f"--vs {item!r}: the baselines are {', '.join(BASELINES)} and moekit:FLAGS "
                              "(another moekit serve, e.g. moekit:--eager)")
        choice = EngineChoice(kind, tuple(shlex.split(flags)))
        if choice in engines:
            raise MoekitError(f"--vs names {choice.name} twice (or the subject itself)")
        engines.append(choice)
    return engines


@dataclass(frozen=True)
class ServeSetup:
    """What every engine is given alike."""

    checkpoint: Path
    dtype: str = "float32"
    weights: str = "dtype"
    threads: int = 2
    max_batch: int = 16


def moekit_command(setup: ServeSetup, workload: Workload, flags: tuple[str, ...], port: int) -> ServerCommand:
    argv = (sys.executable, "-m", "moekit", "serve", str(setup.checkpoint), "--host", "127.0.0.1", "--port", str(port),
            "--dtype", setup.dtype, "--weights", setup.weights, "--max-batch", str(setup.max_batch),
            "--max-context", str(workload.context), "--threads", str(setup.threads), *flags)
    return ServerCommand(" ".join(("moekit", *flags)), argv, port)


def llama_server_command(setup: ServeSetup, workload: Workload, port: int, llama_root: Optional[Path] = None,
                         repack: bool = True) -> ServerCommand:
    """llama-server with one slot per row (-np), each of the workload's context; the GGUF is made once
    (a checkpoint that is a GGUF already is served as it is: moekit serves the same file). repack=False:
    --no-repack, no extra buffer types (its weight repacking and its AMX q8_0 path)."""
    from moekit.bench.llama_cpp import ensure_gguf, find_build, gguf_type

    build = find_build(llama_root)
    if not build.server.exists():
        raise MoekitError(f"--vs llama-server needs {build.server}: run benchmarks/build_llama_cpp.sh server")
    if setup.checkpoint.suffix == ".gguf" and setup.checkpoint.is_file():
        gguf = setup.checkpoint
    else:
        gguf = ensure_gguf(build, setup.checkpoint, gguf_type(_long_dtype(setup.dtype), setup.weights))
    threads = str(setup.threads)
    argv = (str(build.server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(setup.max_batch), "-c", str(setup.max_batch * workload.context), "-t", threads, "-tb", threads,
            "--no-warmup", "-cb", *(() if repack else ("--no-repack",)))
    return ServerCommand("llama-server", argv, port)


def vllm_command(setup: ServeSetup, workload: Workload, port: int, vllm_root: Optional[Path] = None) -> ServerCommand:
    from moekit.bench import vllm_cpu

    dtype = vllm_cpu.vllm_dtype(setup.dtype, setup.weights)
    return vllm_cpu.server_command(vllm_cpu.find_build(vllm_root), setup.checkpoint, port, dtype, setup.max_batch,
                                   workload.context, setup.threads)


def _long_dtype(dtype: str) -> str:
    return {"fp32": "float32", "bf16": "bfloat16"}.get(dtype, dtype)


def engine_command(choice: EngineChoice, setup: ServeSetup, workload: Workload, port: int,
                   roots: Optional[dict[str, Path]] = None, llama_repack: bool = True) -> ServerCommand:
    """The engine's server command; a missing build or an unmatched dtype fails here, before any run."""
    roots = roots or {}
    if choice.kind == "moekit":
        return moekit_command(setup, workload, choice.flags, port)
    if choice.kind == "llama-server":
        return llama_server_command(setup, workload, port, roots.get("llama-server"), llama_repack)
    return vllm_command(setup, workload, port, roots.get("vllm"))


@dataclass
class EngineRun:
    """One engine's run of the whole workload: its ready time and a result per level."""

    engine: str
    ready_s: float
    levels: dict[str, LevelResult] = field(default_factory=dict)
    arrivals: Optional[LevelResult] = None  # the long prompts of the arrivals level
    failed: str = ""  # why the engine stopped short (its levels so far are kept)
    note: str = ""  # how it was run if not as asked (llama-server without repacking)

    def as_dict(self) -> dict:
        return {"engine": self.engine, "ready_s": self.ready_s, "levels": {k: v.as_dict() for k, v in self.levels.items()},
                "arrivals": self.arrivals.as_dict() if self.arrivals else None, "failed": self.failed,
                "note": self.note}


def run_workload(url: str, engine: str, ready_s: float, workload: Workload, vocab: int,
                 progress: Callable[[str], None] = lambda line: None) -> EngineRun:
    """Every level of the workload against one ready server."""
    short, long = workload.prompts(vocab)
    model = first_model(url)
    plan = lambda prompts: LoadPlan(url=url, prompts=prompts, max_tokens=workload.max_tokens, model=model)  # noqa: E731
    run = EngineRun(engine, ready_s)
    names = workload.level_names()
    cut = workload.level_prompts(short)
    for i, (name, c, (warm, asked)) in enumerate(zip(names, workload.level_clients, cut)):
        if warm:  # one at a time, not counted
            run_level(plan(warm), len(warm), concurrency=1)
        if workload.has_arrivals and i == len(names) - 1:
            run.levels[name], run.arrivals = run_arrivals_level(plan(asked), len(asked), c,
                                                                Arrivals(plan(long), workload.arrival_count))
            progress(f"{engine} {name}: {level_line(run.levels[name])}; arrivals' TTFT p50 "
                     f"{_ms(run.arrivals.ttft_s['p50'])} ms")
        else:
            run.levels[name] = run_level(plan(asked), len(asked), concurrency=c)
            progress(f"{engine} {name}: {level_line(run.levels[name])}")
    return run


def level_line(level: LevelResult) -> str:
    return (f"{level.output_tok_s:.1f} tok/s, TTFT p50 {_ms(level.ttft_s['p50'])} ms, ITL p50/p99 "
            f"{_ms(level.itl_s['p50'], 1)}/{_ms(level.itl_s['p99'], 1)} ms, errors {level.errors}")


def _ms(seconds: float, digits: int = 0) -> str:
    return "—" if seconds != seconds else f"{seconds * 1000:.{digits}f}"


def round_order(engines: list[EngineChoice], round_index: int) -> list[EngineChoice]:
    """Round r runs the engines rotated by r, so each takes its turn first."""
    k = round_index % len(engines)
    return engines[k:] + engines[:k]


def run_peers(engines: list[EngineChoice], setup: ServeSetup, workload: Workload, rounds: int = 1,
              roots: Optional[dict[str, Path]] = None, progress: Callable[[str], None] = lambda line: None
              ) -> list[dict[str, EngineRun]]:
    """Every engine over the whole workload, `rounds` times, one server at a time; the results by round and engine."""
    if rounds < 1:
        raise MoekitError(f"--rounds must be at least 1, got {rounds}")
    vocab = checkpoint_vocab(setup.checkpoint)
    for choice in engines:  # every build and GGUF first: a missing baseline fails before any timing
        engine_command(choice, setup, workload, 0, roots)
    out: list[dict[str, EngineRun]] = []
    llama_repack = True
    for r in range(rounds):
        runs: dict[str, EngineRun] = {}
        for choice in round_order(engines, r):
            command = engine_command(choice, setup, workload, free_port(), roots, llama_repack)
            progress(f"round {r + 1}: starting {command.name}")
            try:
                runs[command.name] = _run_engine(command, workload, vocab, progress)
            except ServerExited as err:  # only llama-server killed by a signal with its weights repacked
                # Its AMX q8_0 path segfaulted at start-up on an Intel Xeon here (ldtilecfg): this and every
                # later llama-server run go without extra buffer types, as the decode benchmark does.
                llama_repack = False
                progress(f"{command.name} crashed on start ({err}); again with --no-repack")
                command = engine_command(choice, setup, workload, free_port(), roots, llama_repack)
                runs[command.name] = _run_engine(command, workload, vocab, progress)
            if choice.kind == "llama-server" and not llama_repack:
                runs[command.name].note = "crashed on start with its weights repacked; run with --no-repack"
        out.append({choice.name: runs[choice.name] for choice in engines})
    return out


def _run_engine(command: ServerCommand, workload: Workload, vocab: int, progress: Callable[[str], None]) -> EngineRun:
    """One engine's run; a peer that dies (out of memory, say) after it was ready costs its own row, not the run,
    and one that dies before is raised as ServerExited for the caller to retry or record."""
    try:
        with running(command) as server:
            progress(f"{command.name} ready in {server.ready_s:.0f} s")
            return run_workload(server.url, command.name, server.ready_s, workload, vocab, progress)
    except ServerExited as err:
        if command.name == "llama-server" and "--no-repack" not in command.argv and err.returncode < 0:
            raise
        progress(f"{command.name} failed: {err}")
        return EngineRun(command.name, float("nan"), failed=str(err))
    except MoekitError as err:
        progress(f"{command.name} failed: {err}")
        return EngineRun(command.name, float("nan"), failed=str(err))


def checkpoint_vocab(checkpoint: Path) -> int:
    if Path(checkpoint).suffix == ".gguf" and Path(checkpoint).is_file():  # its config is in its header
        from moekit.weights.gguf_spec import spec_from_gguf

        return spec_from_gguf(Path(checkpoint)).vocab_size
    config = Path(checkpoint) / "config.json"
    if not config.is_file():
        raise MoekitError(f"{checkpoint}: not a checkpoint folder (no config.json)")
    try:
        text = json.loads(config.read_text())
        vocab = text.get("vocab_size") or (text.get("text_config") or {}).get("vocab_size")
    except (json.JSONDecodeError, AttributeError):
        raise MoekitError(f"{config}: not a JSON object") from None
    if not isinstance(vocab, int):
        raise MoekitError(f"{config}: no integer vocab_size")
    return vocab


@dataclass(frozen=True)
class RatioRow:
    """One level: each engine's figures (a range over rounds), and each moekit engine's ratio to each
    peer (and the subject's to each other moekit variant)."""

    level: str
    figures: dict[str, str]  # engine → "tok/s (TTFT p50 ms, ITL p50/p99 ms)"
    ratios: dict[str, str]  # "moekit ÷ vllm" → output tok/s over output tok/s, a range over rounds


def _span(values: list[float], fmt: str) -> str:
    good = [v for v in values if v == v]
    if not good:
        return "—"
    lo, hi = min(good), max(good)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{format(lo, fmt)}–{format(hi, fmt)}"


def ratio_pairs(engines: list[str]) -> list[tuple[str, str]]:
    """(numerator, denominator): every moekit engine over every peer, then the subject (the first)
    over each other moekit variant."""
    ours = [e for e in engines if e.split()[0] == "moekit"]
    peers = [e for e in engines if e not in ours]
    return [(a, b) for a in ours for b in peers] + [(engines[0], b) for b in ours if b != engines[0]]


def ratio_rows(rounds: list[dict[str, EngineRun]]) -> list[RatioRow]:
    """The table's rows: ratios are taken within a round (the same machine state), then ranged."""
    if not rounds:
        return []
    engines = list(rounds[0])
    rows = []
    for level in next((run.levels for run in rounds[0].values() if run.levels), {}):
        figures = {}
        for engine in engines:
            runs = [r[engine].levels.get(level, _MISSING) for r in rounds]
            figures[engine] = (f"{_span([x.output_tok_s for x in runs], '.0f')} "
                               f"({_span([x.ttft_s['p50'] * 1e3 for x in runs], '.0f')}, "
                               f"{_span([x.itl_s['p50'] * 1e3 for x in runs], '.1f')}/"
                               f"{_span([x.itl_s['p99'] * 1e3 for x in runs], '.1f')})")
        ratios = {f"{a} ÷ {b}": _span([_ratio(r[a].levels.get(level, _MISSING), r[b].levels.get(level, _MISSING))
                                       for r in rounds], ".2f") + "×"
                  for a, b in ratio_pairs(engines)}
        rows.append(RatioRow(level, figures, ratios))
    return rows


_MISSING = summarize([], 0.0, None, None)  # a level an engine that failed never reached: NaN everywhere


def _ratio(subject: LevelResult, baseline: LevelResult) -> float:
    if subject.errors or baseline.errors or not baseline.output_tok_s > 0:
        return float("nan")
    return subject.output_tok_s / baseline.output_tok_s


def markdown_table(rows: list[RatioRow]) -> str:
    """The results page's form: a level per row, each engine's figures, then the ratios."""
    if not rows:
        return ""
    engines, baselines = list(rows[0].figures), list(rows[0].ratios)
    head = ["level", *engines, *baselines]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row.level, *(row.figures[e] for e in engines), *(row.ratios[b] for b in baselines)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
