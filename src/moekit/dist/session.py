"""One expert-parallel generation: join the ranks, load, agree, shard the experts, generate, report.

`moekit run ... --expert-parallel` lands in `run_expert_parallel`: under torchrun each rank runs it;
otherwise this process starts the other ranks (group.py) and is rank 0. Every rank loads the whole
checkpoint's dense weights and keeps only its own routed experts (or, with --expert-memory, an
expert store that is only ever asked for them). Before generating, the ranks exchange a
fingerprint of the checkpoint and of the request: a rank given other weights or another prompt
stops every rank with one line instead of computing garbage. Rank 0 prints; the others are quiet.
"""

from __future__ import annotations

import hashlib
import json
import resource
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Optional

from moekit.dist.group import Rank, host_store, join, leave, threads_per_rank, torchrun_rank
from moekit.dist.placement import Placement, check_placement, linear_placement, read_placement
from moekit.errors import MoekitError

DEFAULT_TIMEOUT_S = 120.0
WORKER_GRACE_S = 10.0  # after rank 0 is done, how long the other ranks get to finish before a kill


@dataclass(frozen=True)
class Job:
    """What every rank needs to run the same request (a self-launched worker gets it as JSON)."""

    checkpoint: str
    dtype: str = "float32"
    device: str = "cpu"
    prompt: Optional[str] = None
    prompt_ids: Optional[list] = None
    max_new_tokens: int = 64
    sampling: dict = field(default_factory=dict)  # moekit.engine.sampling.SamplingParams fields
    stop_ids: Optional[list] = None  # None: the model's eos
    offload: Optional[dict] = None  # moekit.offload.options.OffloadOptions fields (pin as a str)
    placement: Optional[str] = None  # a `moekit placement` file; None: linear
    timeout_s: float = DEFAULT_TIMEOUT_S

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Job":
        return cls(**json.loads(text))


@dataclass
class Sharded:
    """An engine whose routed experts are spread over the ranks: `engine.generate` runs as usual."""

    engine: object  # moekit.engine.loader.Engine
    me: Rank
    placement: Placement
    layers: dict  # MoE layer → its ExpertParallelLayer
    rss_after_shard: Optional[int] = None  # bytes resident once the other ranks' experts are dropped

    def stats(self) -> dict:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "rank": self.me.rank,
            "experts": {str(l): len(p.local(self.me.rank)) for l, p in self.placement.layers.items()},
            "peak_rss_bytes": usage.ru_maxrss * 1024,  # the load's peak: every expert, before the drop
            "rss_after_shard_bytes": self.rss_after_shard,
            "layers": {str(l): layer.stats.as_dict() for l, layer in self.layers.items()},
        }


def shard(engine, me: Rank, placement: Placement, timeout_s: float) -> Sharded:
    """Install an ExpertParallelLayer on every MoE layer of a loaded engine (resident or paged)."""
    from moekit.dist.layer import ExpertParallelLayer, take_local
    from moekit.dist.rank_memory import own_storage

    layers = {}
    tables = placement.tables()
    for i in engine.spec.moe_layers:
        experts = engine.decoder.layers[i].ffn.experts
        inner = experts.store  # an expert store's LayerStore, or None for resident weights
        local = placement.layers[i].local(me.rank)
        weights = None if inner is not None else take_local(experts, local)
        layers[i] = ExpertParallelLayer(i, me.rank, me.world, tables[i], weights=weights, inner=inner,
                                        timeout_s=timeout_s)
        experts.store = layers[i]
    if any(layer.weights is not None for layer in layers.values()):
        own_storage(engine.decoder)  # the one buffer a loader may have filled goes with the others' experts
    return Sharded(engine=engine, me=me, placement=placement, layers=layers, rss_after_shard=_rss())


def _rss() -> Optional[int]:
    """This process's resident bytes now (Linux /proc), after a collection; None elsewhere.

    The other ranks' experts were freed into the C heap, where glibc keeps them: malloc_trim hands
    them back to the system (the ~140M checkpoint at 2 ranks: 774 MiB resident per rank without the
    trim, 581 with it, measured; docs/SCALING.md)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the memory is reused by this process, just not returned
    return resident_bytes()


def resident_bytes() -> Optional[int]:
    """This process's resident bytes now (Linux /proc; None elsewhere): cheap, nothing collected."""
    import os

    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def choose_placement(engine, path: Optional[str], world: int) -> Placement:
    return placement_for(engine.spec, engine.folder, path, world)


def placement_for(spec, folder, path: Optional[str], world: int) -> Placement:
    """The linear placement, or the file's checked against this model and rank count."""
    from moekit.engine.trace import trace_model

    facts = trace_model(spec, folder)
    experts = dict(facts.experts)
    model = {"model": facts.name, "model_type": facts.model_type, "config_sha256": facts.config_sha256}
    if not experts:
        raise MoekitError(f"{spec.name}: a dense model has no routed experts to shard; drop --expert-parallel")
    if path is None:
        return linear_placement(experts, world, model)
    placement = read_placement(path)
    check_placement(placement, experts, world, model, str(path))
    return placement


def _agree(me: Rank, fingerprint: str, request: str, seed: Optional[int], timeout_s: float) -> Optional[int]:
    """Every rank's (checkpoint, request) fingerprints; any difference stops every rank. → rank 0's seed."""
    import torch.distributed as dist

    from moekit.dist.layer import ExchangeError

    theirs: list = [None] * me.world
    try:
        dist.all_gather_object(theirs, (fingerprint, request, seed))
    except (RuntimeError, dist.DistError) as err:
        raise ExchangeError(f"rank {me.rank}: the ranks could not compare checkpoints within {timeout_s:g}s: "
                            f"a peer rank died or hung ({str(err).strip()[:160]})") from None
    if len({t[:2] for t in theirs}) > 1:
        try:  # every rank has read every fingerprint before any of them leaves (and closes its sockets)
            dist.barrier()
        except (RuntimeError, dist.DistError):
            pass
    other = [r for r, t in enumerate(theirs) if t[0] != theirs[0][0]]
    if other:
        raise MoekitError(f"rank {me.rank}: rank {other[0]} loaded a different checkpoint than rank 0 "
                          f"(fingerprints {theirs[0][0][:12]} vs {theirs[other[0]][0][:12]}): give every rank the same one")
    other = [r for r, t in enumerate(theirs) if t[1] != theirs[0][1]]
    if other:
        raise MoekitError(f"rank {me.rank}: rank {other[0]} was given a different request (prompt, length, sampling, "
                          f"dtype or placement) than rank 0: every rank must run the same one")
    return theirs[0][2]


def load_sharded(job: Job, me: Rank, progress=None, compile: bool = False) -> Sharded:
    """Load the checkpoint on this rank (process group joined), agree with the others, shard."""
    from moekit.engine.loader import load_engine

    offload = None
    if job.offload is not None:
        from moekit.offload.options import OffloadOptions

        if job.offload.get("prefetch"):
            raise MoekitError("--prefetch with --expert-parallel is not supported: the guesses would read other ranks' experts")
        offload = OffloadOptions(**job.offload)
        _manifest_first(job, me, progress)
    # compile: rank 0 of a server only; its step calls the exchange as an opaque op (graph_exchange)
    engine = load_engine(job.checkpoint, dtype=job.dtype, device=job.device, offload=offload, progress=progress,
                         compile=compile)
    try:
        placement = choose_placement(engine, job.placement, me.world)
        return shard(engine, me, placement, job.timeout_s)
    except BaseException:
        engine.close()
        raise


def _manifest_first(job: Job, me: Rank, progress) -> None:
    """Rank 0 writes the expert store's checksum manifest (on a first paged run) before the others
    read it: N ranks writing the same file at once could leave a torn one."""
    import torch.distributed as dist

    from moekit.dist.layer import ExchangeError
    from moekit.weights.manifest import load_or_build_manifest
    from moekit.weights.gguf_spec import load_any_spec

    if me.rank == 0:
        load_or_build_manifest(job.checkpoint, load_any_spec(job.checkpoint), progress)
    try:
        dist.barrier()
    except (RuntimeError, dist.DistError) as err:
        raise ExchangeError(f"rank {me.rank}: rank 0 did not finish the expert manifest within {job.timeout_s:g}s "
                            f"({str(err).strip()[:160]})") from None


def _request_key(job: Job, prompt_ids: list) -> str:
    keep = {k: v for k, v in asdict(job).items() if k not in ("checkpoint", "prompt", "timeout_s")}
    keep["prompt_ids"] = prompt_ids
    placement = None if job.placement is None else hashlib.sha256(open(job.placement, "rb").read()).hexdigest()
    keep["placement"] = placement
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()


Report = Callable[[object, object], None]  # (engine, SamplingParams) → runs and prints the generation


def run_rank(job: Job, me: Rank, report: Optional[Report] = None, progress=None) -> dict:
    """This rank's whole part: join, load, agree, generate (rank 0 through `report`), gather the
    stats. → every rank's stats on rank 0 ({} elsewhere)."""
    import random

    import torch.distributed as dist

    from moekit.dist.fingerprint import checkpoint_fingerprint
    from moekit.engine.sampling import SamplingParams

    join(me, job.timeout_s, job.device)
    try:
        sharded = load_sharded(job, me, progress)
        engine = sharded.engine
        try:
            prompt_ids = engine.prompt_ids(job.prompt if job.prompt is not None else job.prompt_ids)
            sampling = SamplingParams(**job.sampling)
            seed = sampling.seed if sampling.seed is not None or sampling.greedy else random.randrange(2**31)
            seed = _agree(me, checkpoint_fingerprint(job.checkpoint), _request_key(job, prompt_ids), seed, job.timeout_s)
            sampling = replace(sampling, seed=seed)  # unseeded sampling: rank 0's draw, so ranks stay in step
            if me.rank == 0 and report is not None:
                report(engine, sampling)
            else:
                stop = None if job.stop_ids is None else tuple(job.stop_ids)
                engine.generate(prompt_ids, max_new_tokens=job.max_new_tokens, sampling=sampling, stop_ids=stop)
            gathered: list = [None] * me.world
            dist.all_gather_object(gathered, sharded.stats())
        finally:
            engine.close()
    finally:
        leave()
    return {"ranks": gathered} if me.rank == 0 else {}


def launch(job: Job, world: int, report: Optional[Report] = None, progress=None) -> dict:
    """Run `job` on `world` ranks of this machine: this process is rank 0, the others are workers."""
    import torch

    if world < 1:
        raise MoekitError(f"--expert-parallel needs at least 1 rank, got {world}")
    from pathlib import Path

    from moekit.weights.gguf_spec import load_any_spec

    # The checks every rank would make, made once before any rank starts: bad input costs no launch.
    placement_for(load_any_spec(job.checkpoint), Path(job.checkpoint), job.placement, world)
    torch.set_num_threads(threads_per_rank(world))
    store = host_store(world, job.timeout_s)
    workers: list = []
    try:
        spawn_workers(job, world, store.port, workers)
        result = run_rank(job, Rank(0, world, 0, store.port), report, progress)
    finally:
        codes = reap(workers)
    failed = [(r, c) for r, c in enumerate(codes, start=1) if c != 0]
    if failed:
        raise MoekitError(f"rank {failed[0][0]} exited with code {failed[0][1]}")
    return result


def spawn_workers(job: Job, world: int, port: int, into: list, **order) -> list:
    """Start ranks 1..world-1 (`python -m moekit.dist.worker`), each told its part on stdin; `into`
    holds each process as soon as it runs (so a caller's cleanup finds every one). order: more
    fields for the worker (serve, threads)."""
    for rank in range(1, world):
        proc = subprocess.Popen([sys.executable, "-m", "moekit.dist.worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL)
        into.append(proc)
        proc.stdin.write(json.dumps({"job": asdict(job), "rank": rank, "world": world, "port": port, **order}).encode())
        proc.stdin.close()
    return into


def reap(workers: list, grace_s: float = WORKER_GRACE_S) -> list[int]:
    """Wait a little for each worker, then kill the ones still running: none outlives the launcher."""
    codes = []
    for proc in workers:
        try:
            codes.append(proc.wait(timeout=grace_s))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    return codes


def run_expert_parallel(job: Job, ranks: Optional[int], report: Optional[Report] = None, progress=None) -> dict:
    """`--expert-parallel [N]`: under torchrun, this rank's part (N, if given, must match the world);
    otherwise launch N ranks here. → the gathered stats on rank 0."""
    me = torchrun_rank()
    if me is None:
        if not ranks:
            raise MoekitError("--expert-parallel without a rank count needs torchrun (torchrun --nproc-per-node N -m "
                              "moekit run ...); or give the count: --expert-parallel 2")
        return launch(job, ranks, report, progress)
    if ranks and ranks != me.world:
        raise MoekitError(f"rank {me.rank}: --expert-parallel {ranks}, but torchrun started {me.world} ranks")
    return run_rank(job, me, report, progress)


def summary(result: dict) -> str:
    """The stats of every rank in one line: experts held, bytes sent per decoded token, peak RSS."""
    from moekit.calc.units import nbytes

    ranks = result["ranks"]
    held, sent, gather, rss = [], [], [], []
    for r in ranks:
        held.append(str(sum(r["experts"].values())))
        layers = list(r["layers"].values())
        decode_tokens = sum(layers[0]["tokens"][1:]) if layers else 0
        moved = sum(sum(l["dispatch_bytes"][1:]) + sum(l["combine_bytes"][1:]) for l in layers)
        gathered = sum(sum(l["gather_bytes"][1:]) for l in layers)
        sent.append(nbytes(moved / decode_tokens) if decode_tokens else "—")
        gather.append(nbytes(gathered / decode_tokens) if decode_tokens else "—")
        rss.append(nbytes(r["peak_rss_bytes"]))
    return (f"[expert parallel · {len(ranks)} ranks · routed experts held per rank, all layers {', '.join(held)} · "
            f"sent per decoded token (dispatch + combine) {', '.join(sent)} · output all-gather {', '.join(gather)} · "
            f"peak RSS {', '.join(rss)}]")
