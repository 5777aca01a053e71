"""Where an offloaded run's resident memory goes: /proc/self/status sampled on a thread, split by kind.

VmHWM says how high a run went, not what it held. `RssSampler` reads /proc/self/status every few
milliseconds and keeps the sample at the highest VmRSS with its parts (RssAnon: the process's own
memory, the expert store's included; RssFile: pages of mapped files, the shared libraries and any
mmapped checkpoint; RssShmem), the highest of each part, and what the caller's probes read at that
moment (the store's resident expert bytes, glibc's heap). `mark(name)` keeps the figures at a phase's
end (loaded, warmed, generated). A sample between two reads can miss a peak that lasts less than
the interval; VmHWM, which the kernel keeps, is reported beside it. No torch here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")


def read_status(path: str = "/proc/self/status") -> dict[str, int]:
    """FIELDS of a /proc status file, in bytes (a field the kernel does not report is left out)."""
    out: dict[str, int] = {}
    try:
        with open(path) as fh:
            for line in fh:
                name, _, rest = line.partition(":")
                if name in FIELDS:
                    out[name] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def malloc_figures() -> dict[str, int]:
    """glibc's heap (mallinfo2, every arena): bytes in brk/arena heaps, of which in use and free,
    and in blocks served by their own mmap. Empty where the C library has no mallinfo2."""
    libc = _libc()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None
    if fn is None:
        return {}
    fn.restype = _Mallinfo2
    m = fn()
    return {"heap": m.arena, "heap_in_use": m.uordblks, "heap_free": m.fordblks, "mmapped_blocks": m.hblkhd}


@dataclass
class RssSampler:
    """A thread sampling this process's RSS; `probes` name → a callable read at every sample."""

    interval_s: float = 0.005
    probes: dict[str, Callable[[], int]] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)  # the sample with the highest VmRSS (probes included)
    highest: dict[str, int] = field(default_factory=dict)  # each field's own maximum over the samples
    marks: dict[str, dict] = field(default_factory=dict)  # name → {"at": its sample + heap, "peak": the phase's peak sample}
    samples: int = 0
    _phase_peak: dict[str, int] = field(default_factory=dict)  # the highest-VmRSS sample since the last mark
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: Optional[threading.Thread] = None

    def sample(self) -> dict[str, int]:
        now = read_status()
        for name, probe in list(self.probes.items()):
            try:
                now[name] = int(probe())
            except Exception:  # a probe of something not built yet (the store before the load)
                pass
        self.samples += 1
        if now.get("VmRSS", 0) >= self.peak.get("VmRSS", -1):
            self.peak = dict(now)
        if now.get("VmRSS", 0) >= self._phase_peak.get("VmRSS", -1):
            self._phase_peak = dict(now)
        for k, v in now.items():
            self.highest[k] = max(self.highest.get(k, v), v)
        return now

    def mark(self, name: str) -> dict:
        """The figures now, and the peak sample since the previous mark (the phase that ends here)."""
        at = self.sample() | malloc_figures()
        self.marks[name] = {"at": at, "peak": self._phase_peak}
        self._phase_peak = {}
        return self.marks[name]

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> "RssSampler":
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    def report(self) -> dict:
        """Bytes: the peak sample, each field's maximum, the phase marks, VmHWM (the kernel's peak)."""
        return {"peak_sample": self.peak, "highest": self.highest, "marks": self.marks, "samples": self.samples,
                "vm_hwm": read_status().get("VmHWM")}
