"""Joining the ranks of an expert-parallel run: under torchrun, or ranks this process starts itself.

Under torchrun every rank finds RANK, WORLD_SIZE and LOCAL_RANK in its environment (the only
environment moekit reads, and only to know it is one rank of many); torch's env:// rendezvous reads
MASTER_ADDR and MASTER_PORT. `moekit run --expert-parallel N` instead hosts a TCPStore on a free
loopback port (the OS picks it: no race for a port) and starts N - 1 worker processes
(`python -m moekit.dist.worker`) that join it; the launching process is rank 0.

Every wait is bounded by `timeout_s`: joining, and each collective of the exchange (gloo's own
timeout), so a dead or hung rank makes the others fail with one clear line, never hang.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

from moekit.errors import MoekitError

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Rank:
    rank: int
    world: int
    local_rank: int = 0
    store_port: Optional[int] = None  # a self-launched run's TCPStore; None: torchrun's env://


def torchrun_rank() -> Optional[Rank]:
    """This process's place under torchrun, or None when torchrun did not start it."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    if not all(n in os.environ for n in names):
        return None
    try:
        rank, world, local = (int(os.environ[n]) for n in names)
    except ValueError:
        raise MoekitError(f"torchrun's RANK/WORLD_SIZE/LOCAL_RANK are not integers: "
                          f"{[os.environ[n] for n in names]}") from None
    return Rank(rank=rank, world=world, local_rank=local)


def host_store(world: int, timeout_s: float):
    """A TCPStore on a loopback port the OS chooses, for `world` ranks to rendezvous at."""
    from torch.distributed import TCPStore

    return TCPStore(LOOPBACK, 0, world, is_master=True, timeout=timedelta(seconds=timeout_s),
                    wait_for_workers=False)


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def join(me: Rank, timeout_s: float, device: str = "cpu"):
    """Initialise the default process group for `me`; one clear line if the others never come."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    try:
        if me.store_port is None:
            dist.init_process_group(backend_for(device), init_method="env://", rank=me.rank, world_size=me.world,
                                    timeout=timeout)
        else:
            from torch.distributed import TCPStore

            store = TCPStore(LOOPBACK, me.store_port, me.world, is_master=False, timeout=timeout)
            dist.init_process_group(backend_for(device), store=store, rank=me.rank, world_size=me.world,
                                    timeout=timeout)
    except (RuntimeError, ValueError, dist.DistError) as err:
        detail = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise MoekitError(f"rank {me.rank}: could not join the other {me.world - 1} rank(s) within {timeout_s:g}s "
                          f"({detail})") from None


def leave() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def threads_per_rank(world: int) -> int:
    """Cores shared evenly by the ranks of one machine (oversubscribed OpenMP threads spin and wait)."""
    return max(1, (os.cpu_count() or 1) // world)
