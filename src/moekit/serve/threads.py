"""How the server's threads share the cores: the engine thread's torch (OpenMP) team beside the
HTTP event loop.

torch's CPU wheels run their parallel regions on GNU OpenMP (libgomp). After each region, libgomp
keeps the team's idle threads spinning for 300,000 pauses (milliseconds), unless the process has
more OpenMP threads than CPUs, when they spin 100 and then sleep (the GCC manual, GOMP_SPINCOUNT).
A decode step is hundreds of short regions with Python between them, so with one torch thread per
core the idle threads spin through every gap and hold the cores that the event loop, streaming each
token, and any other process need; the thread the kernel then preempts is missing at the next
region, which waits for it. On 2 cores shared with other work that made `moekit serve --threads 2`
4-7 tok/s where `--threads 1` made 28-38 (issue 35).

libgomp reads its wait policy (OMP_WAIT_POLICY, GOMP_SPINCOUNT) from the environment once, when
torch loads it, and offers no call to change it later. What a running process can change is how
many OpenMP threads it has: `seat_http_thread` parks a team of two (its own thread and one worker
that sleeps), so that the HTTP thread counts as an OpenMP thread. When the compute threads and the
HTTP thread together outnumber the CPUs, libgomp then waits politely; with a core to spare it still
spins, as it would without the server.
"""

from __future__ import annotations

import threading
from typing import Optional

# Elements of the one region the parked team runs: above ATen's grain size (32,768), so that the
# region is split over the team's two threads rather than run on the calling thread alone.
SEAT_REGION_NUMEL = 1 << 16


def engine_threads(requested: Optional[int]) -> int:
    """Give the calling thread's torch ops `requested` threads (None: torch's default, one per
    core). torch's thread count belongs to the thread that sets it (OpenMP's nthreads is per
    thread), so the engine thread that runs the steps calls this itself. → the count in force."""
    import torch

    if requested:
        torch.set_num_threads(requested)
    return torch.get_num_threads()


def seat_http_thread(stop: threading.Event, engine: int) -> threading.Thread:
    """Park a two-thread OpenMP team until `stop` (see the module's docstring). `engine`: the
    engine thread's torch threads, put back as torch's process-wide default once the team exists
    (torch.set_num_threads sets that default too, for threads that have not run an op yet).
    → the parked thread."""
    seated = threading.Event()

    def park() -> None:
        import torch

        try:
            torch.set_num_threads(2)
            torch.ones(SEAT_REGION_NUMEL).add_(1.0)  # [N]: one region; this thread's team now exists
            torch.set_num_threads(engine)
        finally:
            seated.set()
        stop.wait()  # the team lives as long as this thread

    thread = threading.Thread(target=park, name="moekit-http-seat", daemon=True)
    thread.start()
    seated.wait()
    return thread
