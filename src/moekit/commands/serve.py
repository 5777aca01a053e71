"""`moekit serve`: the OpenAI-compatible server (moekit.serve) on a loopback port by default."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import typer

from moekit.calc.dtypes import engine_dtype
from moekit.commands.operators_notice import announce_operator_build, say_progress
from moekit.commands.options import ENGINE_DTYPE, KERNELS, NO_VERIFY, WEIGHTS, compile_option, expert_parallel_options
from moekit.errors import MoekitError

DEFAULT_PREFIX_MEMORY = "1GiB"  # a few thousand prompt tokens of a 30B model's KV; far more of the demo's

EP_OPTIONS = expert_parallel_options()  # --expert-parallel, --placement, --ep-timeout

HELP = """Serve a checkpoint over OpenAI's HTTP API, with continuous batching, expert-budget tiers and Prometheus metrics.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health (503 while loading), GET /metrics.
A request may carry "moe": {"tier": "S"|"A"|"B"} (the model's K, half of it, one expert), {"top_k": k} or {"routing": "adaptive:0.85"}; its usage then has a "moe" object with the active share, expert bytes and FLOPs it used.
Tiers take latency targets and a routing policy: --tier S=ttft:200ms,itl:50ms --tier A=ttft:2s,adaptive:0.85; a request that cannot start within its tier's TTFT target gets 429 (--sla-action reject) or a lower tier (demote).
A request's "priority" (default 0) orders its tier's queue: lower is admitted first.
Prompt prefixes' KV is kept across requests (--prefix-cache-memory); usage.prompt_tokens_details.cached_tokens says how much a request reused.
The decode steps run as one compiled graph, compiled (first run of a model here) or loaded before /health says ready, with a line saying which and its time; --eager serves the eager reference.

  moekit serve                                    # the bundled model on 127.0.0.1:8000
  moekit serve path/to/checkpoint --port 8001 --max-batch 16 --dtype bfloat16
  moekit serve path/to/checkpoint --expert-memory 25%   # routed experts paged from disk
  moekit serve model.gguf --expert-memory 1GiB --pin profile.json --prefetch
  moekit serve path/to/checkpoint --expert-parallel 2 --placement plan.json   # experts over 2 ranks
  torchrun --nnodes 2 --nproc-per-node 1 --rdzv-endpoint HOST:29400 -m moekit serve CKPT --expert-parallel auto
"""


def _graceful_server(config):
    """uvicorn's Server, except that after a SIGTERM's graceful stop the process exits 0 (uvicorn
    re-raises the signal, which a supervisor would read as a crash)."""
    import signal
    import threading
    from contextlib import contextmanager

    import uvicorn

    class Server(uvicorn.Server):
        @contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server(config)


def _listen(host: str, port: int):
    """The listening socket, bound here so that a port in use is one clear line, not a log record."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise MoekitError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    sock.set_inheritable(True)
    return sock


def _tiers(options: list[str], action: str, spec) -> dict:
    """--tier values, each tier's policy checked against the model's K before the port opens."""
    from moekit.analysis.policy_eval import model_experts, model_k
    from moekit.model.routing import parse_policy
    from moekit.serve.sla import ACTIONS, parse_tiers

    if action not in ACTIONS:
        raise MoekitError(f"--sla-action must be one of {', '.join(ACTIONS)}, got {action!r}")
    tiers = parse_tiers(options)
    for name, targets in tiers.items():
        if targets.routing is not None:
            parse_policy(targets.routing, model_k(spec), model_experts(spec))
    return tiers


def serve(
    checkpoint: Optional[Path] = typer.Argument(
        None, help="Checkpoint folder (config.json + *.safetensors [+ tokenizer.json]) or a .gguf file. "
        "Default: the bundled model."
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (loopback by default)."),
    port: int = typer.Option(8000, "--port", help="TCP port (0: any free port, printed at start)."),
    dtype: str = typer.Option("fp32", "--dtype", help=ENGINE_DTYPE),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    weights: str = typer.Option("dtype", "--weights", help=WEIGHTS),
    no_verify: bool = typer.Option(False, "--no-verify", help=NO_VERIFY),
    compile_step: Optional[bool] = compile_option(),
    kernels: str = typer.Option("auto", "--kernels", help=KERNELS),
    max_batch: int = typer.Option(16, "--max-batch", help="Rows decoded together (KV-cache slots)."),
    max_context: Optional[int] = typer.Option(None, "--max-context", help="Tokens per row, prompt + output. Default: the model's context."),
    queue_limit: int = typer.Option(256, "--queue-limit", help="Waiting requests per tier before answering 429."),
    max_prefill_tokens: int = typer.Option(
        128, "--max-prefill-tokens", help="Prompt tokens one scheduler step prefills; a longer prompt is prefilled "
        "in chunks of this many, one per step, while the running requests decode (chunked prefill); compiled, a "
        "chunk rides in their decode forward, at most 32 tokens less the running requests (at least 16)."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", help="The model id clients send. Default: the folder's name."),
    expert_memory: Optional[str] = typer.Option(None, "--expert-memory", help="Memory for routed experts (25% or 2GiB); the rest is paged from disk."),
    cache: str = typer.Option("lru", "--cache", help="Expert cache policy with --expert-memory: lru, lfu, lfu-aging, lfru."),
    pin: Optional[Path] = typer.Option(None, "--pin", help="With --expert-memory: a profile from `moekit profile`; "
                                       "its experts stay resident."),
    prefetch: bool = typer.Option(False, "--prefetch/--no-prefetch", help="With --expert-memory: guess each layer's "
                                  "experts ahead of it and read them on worker threads (as `moekit run --prefetch`)."),
    prefetch_extra: int = typer.Option(4, "--prefetch-extra", help="Experts guessed per token beyond its K when prefetching."),
    read_ahead: int = typer.Option(2, "--read-ahead", help="With --expert-memory: misses read in parallel on worker "
                                   "threads behind the compute (a prompt keeps N reads ahead); 0 reads them one by one."),
    expert_split: Optional[Path] = typer.Option(
        None, "--expert-split", metavar="TRACE", help="With --expert-memory: split the budget's slots across layers "
        "by the hit rate each scores on a routing trace (`moekit run --trace`) instead of equally."),
    direct_io: bool = typer.Option(False, "--direct-io", help="With --expert-memory: read experts with O_DIRECT, "
                                   "so the page cache holds no second copy of them."),
    prefix_cache_memory: str = typer.Option(
        DEFAULT_PREFIX_MEMORY, "--prefix-cache-memory", help="Memory for the KV of prompt prefixes reused across "
        "requests (automatic prefix caching, blocks of 16 tokens, least recently used evicted); 0 turns it off."),
    threads: Optional[int] = typer.Option(
        None, "--threads", help="torch threads for the model's arithmetic, on the engine thread. Default: one per core."),
    share_cores: bool = typer.Option(
        False, "--share-cores", help="For a machine whose cores other work also uses: idle torch threads sleep "
        "between parallel regions instead of spinning (the HTTP thread is counted as an OpenMP thread). On 2 busy "
        "cores with --threads 2 it turned 4-7 tok/s into 33-38; on idle cores it costs ~30% (docs/BENCHMARKS.md, Serving)."),
    grace: float = typer.Option(30.0, "--grace", help="Seconds SIGTERM waits for running requests before stopping."),
    max_body: int = typer.Option(1 << 20, "--max-body-bytes", help="Largest request body accepted (413 beyond)."),
    log_level: str = typer.Option("warning", "--log-level", help="uvicorn's log level: warning, info, debug."),
    tier: list[str] = typer.Option([], "--tier", metavar="TIER=ITEMS",
                                   help="A tier's targets and routing: S=ttft:200ms,itl:50ms or A=adaptive:0.85 (repeatable)."),
    sla_action: str = typer.Option("reject", "--sla-action", help="A request over its tier's TTFT target: reject (429) or demote (to the next tier)."),
    admin_token: Optional[str] = typer.Option(
        None, "--admin-token", help="Enable POST /admin/experts/{layer}/{expert} (hot swap) for this bearer token."),
    expert_parallel: Optional[str] = EP_OPTIONS[0],
    placement: Optional[Path] = EP_OPTIONS[1],
    ep_timeout: float = EP_OPTIONS[2],
    warm_up: bool = typer.Option(
        False, "--warm-up", help="Compile (or load) every graph this server would use, its prefill graphs too, into "
        "the cache (~/.cache/moekit/compile), then exit without serving: a later `moekit serve` with the same options "
        "is ready in seconds. Without it a first start compiles its decode graphs before it answers (tens of seconds "
        "on 2 cores) and its prefill graphs while it answers (prompts run eagerly until then)."),
) -> None:

    from moekit.engine.default_model import default_checkpoint
    from moekit.engine.loader import WEIGHTS as WEIGHT_CHOICES
    from moekit.serve.app import ServeConfig
    from moekit.weights.gguf_spec import load_any_spec

    from moekit.offload.budget import parse_size

    folder = Path(checkpoint) if checkpoint is not None else default_checkpoint()
    gguf = folder.suffix.lower() == ".gguf" and folder.is_file()
    if not gguf and not (folder / "config.json").is_file():
        raise MoekitError(f"{folder}: not a checkpoint folder (no config.json) nor a .gguf file")
    spec = load_any_spec(folder)  # a config the engine cannot describe fails here, before the port opens
    dtype = engine_dtype(dtype)
    if weights not in WEIGHT_CHOICES:
        raise MoekitError(f"--weights must be one of {', '.join(WEIGHT_CHOICES)}, got {weights!r}")
    if not 0 <= port <= 65535:
        raise MoekitError(f"--port must be in 0..65535, got {port}")
    for name, value in (("--max-batch", max_batch), ("--queue-limit", queue_limit), ("--max-body-bytes", max_body),
                        ("--max-prefill-tokens", max_prefill_tokens)):
        if value < 1:
            raise MoekitError(f"{name} must be at least 1, got {value}")
    if max_context is not None and not 2 <= max_context <= spec.max_position_embeddings:
        raise MoekitError(f"--max-context must be in 2..{spec.max_position_embeddings} (the model's context), got {max_context}")
    if grace < 0:
        raise MoekitError(f"--grace must be >= 0 seconds, got {grace}")
    prefix_cache_bytes = parse_size(prefix_cache_memory, "--prefix-cache-memory")
    tiers = _tiers(tier, sla_action, spec)
    offload = None
    if expert_memory is not None:
        from moekit.offload.options import OffloadOptions

        offload = OffloadOptions(expert_memory=expert_memory, policy=cache, pin=pin, prefetch=prefetch,
                                 prefetch_extra=prefetch_extra, read_ahead=read_ahead, split=expert_split, direct_io=direct_io)
        if pin is not None and not pin.is_file():
            raise MoekitError(f"--pin {pin}: no such file (make one with `moekit profile`)")
        if expert_split is not None and not expert_split.is_file():
            raise MoekitError(f"--expert-split {expert_split}: no such trace file (write one with `moekit run ... --trace t.parquet`)")
    from moekit.model.combinations import Options, check, decode_compiled, store_flags

    compiled = decode_compiled(compile_step, kernels)
    check(Options(compile=compile_step is True, paged=offload is not None, device=device, weights=weights,
                  store_flags=store_flags(cache=cache, pin=pin, prefetch=prefetch, split=expert_split, direct_io=direct_io)))
    from moekit.ops import operators_used

    if warm_up and not compiled:
        raise MoekitError("--warm-up compiles the decode step; with --eager or --kernels reference there is nothing to compile")
    if warm_up and (expert_parallel is not None or placement is not None):
        raise MoekitError("--warm-up is for a server of one process; an --expert-parallel server compiles on its ranks")
    ranks = None
    if expert_parallel is not None or placement is not None:
        ranks = _sharding(expert_parallel, placement, ep_timeout, folder, dtype, device, offload, weights,
                          no_verify, admin_token, threads)
        if not ranks.leads:
            ranks.follow()  # a torchrun rank other than 0: no HTTP here
            return
        threads = ranks.threads
    announce_operator_build(operators_used(compiled, weights, dtype, paged=offload is not None), kernels)
    config = ServeConfig(
        checkpoint=folder,
        model_name=served_model_name or (folder.stem if gguf else folder.resolve().name),
        dtype=dtype,
        device=device,
        weights=weights,
        max_batch=max_batch,
        max_context=max_context,
        queue_limit=queue_limit,
        max_prefill_tokens=max_prefill_tokens,
        max_body_bytes=max_body,
        offload=offload,
        threads=threads,
        share_cores=share_cores,
        admin_token=admin_token,
        verify=not no_verify,
        compile=compiled,
        prefix_cache_bytes=prefix_cache_bytes,
        kernels=kernels,
        tiers=tiers,
        sla_action=sla_action,
        progress=say_progress,
    )
    if warm_up:
        from moekit.serve.app import warm_up_ahead

        typer.echo(f"loading {folder} ...", err=True)
        warm_up_ahead(config)
        typer.echo(f"warmed up: `moekit serve` of {config.model_name!r} with these options loads its graphs from the cache", err=True)
        return
    sock = _listen(host, port)
    backend = None
    if ranks is not None:  # started once the port is ours: a port in use costs no launch
        backend = config.backend = ranks.start()
        for rank, proc in enumerate(backend.workers, start=1):
            typer.echo(f"started expert-parallel rank {rank} (pid {proc.pid})", err=True)
    try:
        state = _run_server(config, sock, host, port, grace, log_level, max_batch, dtype, folder)
    finally:
        if backend is not None:
            from moekit.serve.sharded import stop_ranks

            stop_ranks(backend, grace_s=10.0)
    if state.error is not None:
        raise MoekitError(f"{folder}: {state.error}")
    if state.fault is not None:
        raise MoekitError(state.fault)


def _run_server(config, sock, host, port, grace, log_level, max_batch, dtype, folder):
    """uvicorn on the bound socket until it stops. → the app's ServerState."""
    import uvicorn

    from moekit.serve.app import create_app
    from moekit.serve.http_stack import http_stack

    bound = sock.getsockname()
    stack = http_stack()  # uvloop + httptools; asyncio / h11 where one is missing, with a note

    def ready(state) -> None:
        for note in state.engine.notes:
            typer.echo(f"note: {note}", err=True)
        typer.echo(
            f"serving {config.model_name!r} on http://{bound[0]}:{bound[1]}/v1 "
            f"(max batch {max_batch}, context {state.scheduler.max_len}, {dtype}, {state.threads} torch threads, "
            f"{stack.loop} + {stack.http})",
            err=True,
        )

    app = create_app(config, on_ready=ready)
    for note in stack.notes:
        typer.echo(f"note: {note}", err=True)
    server = _graceful_server(
        uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=grace, access_log=False,
                       loop=stack.loop, http=stack.http)
    )
    state = app.state.moekit
    state.on_fatal = lambda message: setattr(server, "should_exit", True)
    typer.echo(f"loading {folder} ...", err=True)
    server.run(sockets=[sock])
    if state.prefill_graphs is not None and state.prefill_graphs.is_alive():
        # Stopped while a prefill graph compiles (moekit.serve.app): torch's compile cannot be interrupted, and a
        # process that exits under it aborts (exit 134, "terminate called without an active exception"). The
        # requests are done, the graphs compiled so far are saved: leave at once.
        typer.echo("stopped while compiling a prefill graph; the next start compiles it", err=True)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(0)
    return state


def _sharding(expert_parallel, placement, timeout_s, folder, dtype, device, offload, weights, no_verify,
              admin_token, threads):
    """--expert-parallel's checks, made before any rank starts. → moekit.serve.sharded.Sharding"""
    from moekit.dist.cli import offload_fields, parse_ranks
    from moekit.dist.session import Job, placement_for
    from moekit.serve.sharded import sharding
    from moekit.weights.gguf_spec import load_any_spec

    if expert_parallel is None:
        raise MoekitError("--placement needs --expert-parallel N (or auto under torchrun)")
    from moekit.model.combinations import Options, check

    check(Options(paged=offload is not None, expert_parallel=True, weights=weights,  # the server's step compiles sharded
                  no_verify=no_verify, admin_token=admin_token is not None, device=device, served=True))
    if timeout_s <= 0:
        raise MoekitError(f"--ep-timeout must be positive, got {timeout_s:g}")
    if placement is not None and not placement.is_file():
        raise MoekitError(f"--placement {placement}: no such file (make one with `moekit placement`)")
    job = Job(checkpoint=str(folder), dtype=dtype, device=device, offload=offload_fields(offload),
              placement=None if placement is None else str(placement), timeout_s=timeout_s)
    plan = sharding(parse_ranks(expert_parallel), job, threads)
    placement_for(load_any_spec(folder), folder, job.placement, plan.world)
    return plan
