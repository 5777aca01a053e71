"""`moekit serve --expert-parallel`: the server's engine loaded and stepped over ranks.

A ShardedBackend is what ServeConfig.backend holds on rank 0 (moekit.dist.serving has the
protocol). It loads rank 0's share of the checkpoint once the other ranks run (started here, or
torchrun's), steps the scheduler as `Scheduler.run` does, pings the others while idle, and on the
first failed exchange, or a self-launched rank that exits, marks the server unavailable: every
request in flight and every new one gets a 503 naming the rank, /health answers 503, and the
server stops, so that the process exits non-zero and takes its ranks with it. A drained stop
(SIGTERM) tells the other ranks to leave.

ShardedCollector puts every rank's exchange into /metrics: the engine thread gathers them from the
ranks between two steps, once a second, so that a scrape never waits on the engine.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Optional

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

FAULT_LINGER_S = 3.0  # after a rank failed: answering 503 this long, then stopping (SIGTERM cuts it short)
CANNOT = "the server cannot serve without its experts"
FIGURES_EVERY_S = 1.0  # how often the engine thread gathers every rank's figures for /metrics, between steps


@dataclass
class ShardedBackend:
    job: object  # moekit.dist.session.Job: what every rank loads
    me: object  # moekit.dist.group.Rank: rank 0 of the world
    workers: list = field(default_factory=list)  # self-launched ranks' processes (rank r at r - 1)
    leader: Optional[object] = None  # moekit.dist.serving.Leader, once loaded
    last_figures: list = field(default_factory=list)  # every rank's RankCounters, as last gathered
    gathered_at: float = 0.0  # time.monotonic() of that gather
    store: Optional[object] = None  # the TCPStore self-launched ranks joined (alive while they run)
    watch: Optional[object] = None  # moekit.dist.heartbeat.Watch: the followers' signs of life

    @property
    def ping_s(self) -> float:
        return min(1.0, self.job.timeout_s / 4)  # well inside the followers' wait

    def load(self, cfg):
        from moekit.dist.heartbeat import Watch
        from moekit.dist.serving import lead, start

        sharded = start(self.job, self.me, compile=cfg.compile)
        self.watch = Watch(self.me, self.job.timeout_s).start()
        self.leader = lead(sharded, self.job.timeout_s, self.culprit)
        return sharded.engine

    def culprit(self) -> Optional[str]:
        """A line naming the rank at fault, or None: a self-launched rank killed by a signal, else the
        rank whose sign of life stopped first (the ranks that waited on it stop later), else a
        self-launched rank that exited. Waits a moment for a dying one."""
        from moekit.dist.heartbeat import beat_period, first_silent

        deadline = time.monotonic() + 1.0
        while True:
            codes = {rank: proc.poll() for rank, proc in enumerate(self.workers, start=1)}
            killed = [r for r, c in codes.items() if c is not None and c < 0]
            if killed:
                return f"expert-parallel rank {killed[0]} was killed by signal {-codes[killed[0]]}: {CANNOT}"
            silent = self.watch.silent() if self.watch is not None else {}
            rank = first_silent(silent, max(1.0, 4 * beat_period(self.job.timeout_s)))
            if rank is not None:
                how = f"exited with code {codes[rank]}" if codes.get(rank) is not None else "stopped answering"
                return f"expert-parallel rank {rank} {how} (no sign of life for {silent[rank]:.0f}s): {CANNOT}"
            exited = [r for r, c in codes.items() if c is not None]
            if exited:
                return f"expert-parallel rank {exited[0]} exited with code {codes[exited[0]]}: {CANNOT}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def silent_rank(self) -> Optional[str]:
        """A line naming a follower silent for longer than --ep-timeout, or None. While rank 0 is idle
        its broadcasts to a stopped rank still succeed (into socket buffers): this is how it notices."""
        from moekit.dist.heartbeat import first_silent

        silent = self.watch.silent() if self.watch is not None else {}
        rank = first_silent(silent, self.job.timeout_s)
        if rank is None:
            return None
        return (f"expert-parallel rank {rank} stopped answering (no sign of life for {silent[rank]:.0f}s, "
                f"--ep-timeout {self.job.timeout_s:g}): {CANNOT}")

    def run(self, state, stop) -> None:
        """The engine thread's loop once loaded: steps; while idle, a watch on the ranks."""
        leader = self.leader
        leader.on_broken = lambda message: setattr(state, "fault", message)  # before any failed row reports
        try:
            while not stop.is_set() and leader.broken is None:
                busy = state.scheduler.step_or_wait()
                if leader.broken is None and time.monotonic() - self.gathered_at > FIGURES_EVERY_S:
                    self.gather()
                if busy or leader.broken is not None:
                    continue
                silent = self.silent_rank()
                if silent is not None:
                    leader.fail(silent)
                elif any(proc.poll() is not None for proc in self.workers):
                    leader.fail("an expert-parallel rank exited")
                elif time.monotonic() - leader.last_order > self.ping_s:
                    try:
                        leader.ping()
                    except Exception:  # noqa: BLE001 - the leader is broken now; handled below
                        pass
        finally:
            if self.watch is not None:
                self.watch.stop()
            if leader.broken is not None:
                state.scheduler.abort_all(leader.broken, reason="error")
                stop.wait(FAULT_LINGER_S)  # clients and /health probes hear the 503 before the port closes
                if state.on_fatal is not None:
                    state.on_fatal(leader.broken)
            else:
                try:
                    leader.stop()
                except Exception:  # noqa: BLE001 - a rank gone at the very end: reaped by the launcher
                    pass

    def attach(self, state) -> None:
        state.metrics.registry.register(ShardedCollector(self, state))

    def gather(self) -> None:
        """On the engine thread: every rank's counters, kept for /metrics (a failure breaks the leader)."""
        try:
            self.last_figures = self.leader.gather()
        except Exception:  # noqa: BLE001 - the leader is broken now; the run loop ends
            pass
        self.gathered_at = time.monotonic()


class ShardedCollector:
    """Per rank: tokens each expert served, bytes sent and received, time in the exchange, memory;
    per MoE layer: the live balancedness (mean ÷ max of the pairs each rank computed)."""

    def __init__(self, backend: ShardedBackend, state):
        self.backend, self.state = backend, state

    def collect(self):
        from moekit.dist.serving import balancedness

        ranks = list(self.backend.last_figures)
        served = CounterMetricFamily("moekit:ep_expert_tokens", "Tokens each logical expert computed on each rank "
                                     "(a replicated expert's tokens are split between its copies).",
                                     labels=["rank", "layer", "expert"])
        sent = CounterMetricFamily("moekit:ep_sent_bytes", "Bytes this rank sent, by kind: dispatch (hidden rows to "
                                   "the experts' ranks), combine (outputs back), all_gather (home chunks) and broadcast "
                                   "(rank 0's copy of each MoE layer's tokens and routing).", labels=["rank", "kind"])
        received = CounterMetricFamily("moekit:ep_received_bytes", "Bytes this rank received, by kind.",
                                       labels=["rank", "kind"])
        seconds = CounterMetricFamily("moekit:ep_exchange_seconds", "Time in the expert-parallel layers (collectives "
                                      "and this rank's experts).", labels=["rank"])
        steps = CounterMetricFamily("moekit:ep_steps", "Model forwards (prefills and decode steps) run.", labels=["rank"])
        rss = GaugeMetricFamily("moekit:ep_resident_memory_bytes", "Resident memory of each rank's process.", labels=["rank"])
        weights = GaugeMetricFamily("moekit:ep_weight_bytes", "Weights each rank holds, by kind: dense (embeddings, "
                                    "head, norms, attention, routers, shared experts and dense layers: rank 0 only) and "
                                    "experts (the routed experts it holds).", labels=["rank", "kind"])
        balance = GaugeMetricFamily("moekit:ep_balancedness", "Mean over max of the (token, expert) pairs each rank "
                                    "computed since start, per MoE layer (1: even).", labels=["layer"])
        for r in ranks:
            rank = str(r["rank"])
            for layer, counts in r["served"].items():
                for expert, n in enumerate(counts):
                    if n:
                        served.add_metric([rank, layer, str(expert)], n)
            for kind, n in r["sent_bytes"].items():
                sent.add_metric([rank, kind], n)
            for kind, n in r["received_bytes"].items():
                received.add_metric([rank, kind], n)
            seconds.add_metric([rank], r["exchange_seconds"])
            steps.add_metric([rank], r["steps"])
            if r.get("rss_bytes") is not None:
                rss.add_metric([rank], r["rss_bytes"])
            for kind, n in r["weight_bytes"].items():
                weights.add_metric([rank, kind], n)
        for layer, loads in (ranks[0]["loads"].items() if ranks else ()):
            value = balancedness(loads)
            if value is not None:
                balance.add_metric([layer], value)
        yield from (served, sent, received, seconds, steps, rss, weights, balance)


@dataclass(frozen=True)
class Sharding:
    """`--expert-parallel [N]`, checked: this process's place among the ranks."""

    job: object  # moekit.dist.session.Job
    world: int
    threads: int  # torch threads of every rank
    me: Optional[object] = None  # torchrun's Rank for this process; None: ranks are started here

    @property
    def leads(self) -> bool:
        return self.me is None or self.me.rank == 0

    def follow(self) -> None:
        """A torchrun rank other than 0: follow rank 0 until it stops."""
        from moekit.dist.serving import follower

        follower(self.job, self.me)

    def start(self) -> ShardedBackend:
        """Rank 0's backend; ranks 1..N-1 started here unless torchrun started them."""
        if self.me is not None:
            return ShardedBackend(job=self.job, me=self.me)
        return launch_ranks(self.job, self.world, self.threads)


def sharding(ranks: Optional[int], job, threads: Optional[int]) -> Sharding:
    """Under torchrun, its world (N, if given, must equal it); otherwise N ranks started here."""
    from moekit.dist.group import threads_per_rank, torchrun_rank
    from moekit.errors import MoekitError

    me = torchrun_rank()
    if me is None and not ranks:
        raise MoekitError("--expert-parallel auto takes torchrun's ranks (torchrun --nproc-per-node N -m moekit "
                          "serve ... --expert-parallel auto); without torchrun give the count: --expert-parallel 2")
    if me is not None and ranks and ranks != me.world:
        raise MoekitError(f"rank {me.rank}: --expert-parallel {ranks}, but torchrun started {me.world} ranks")
    world = me.world if me is not None else ranks
    return Sharding(job=job, world=world, threads=threads or threads_per_rank(world), me=me)


def launch_ranks(job, world: int, threads: int):
    """Rank 0's backend with ranks 1..world-1 started here on a loopback TCPStore (kept alive by the
    backend for the group's life)."""
    from moekit.dist.group import Rank, host_store
    from moekit.dist.session import spawn_workers

    store = host_store(world, job.timeout_s)
    backend = ShardedBackend(job=job, me=Rank(0, world, 0, store.port), store=store)
    spawn_workers(job, world, store.port, backend.workers, serve=True, threads=threads)
    return backend


def stop_ranks(backend: ShardedBackend, grace_s: float) -> list[int]:
    """After the server: every self-launched rank gone (those still running after `grace_s` are
    killed). → their exit codes."""
    from moekit.dist.group import leave
    from moekit.dist.session import reap

    if backend.leader is None or backend.leader.broken is None:
        leave()
    else:
        for proc in backend.workers:  # a broken group: the others cannot finish anything
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.send_signal(signal.SIGCONT)  # a stopped rank acts on the SIGTERM only once running
    return reap(backend.workers, grace_s)
