"""Server processes for serving benchmarks: started on a free loopback port, waited for, stopped.

A benchmark starts each engine (moekit serve, llama-server, vLLM) as its own process, loads it,
and stops it before the next starts, so two servers never share the two cores. A server's stderr
goes to a log file, and its last line is what a failed start reports. No torch.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from moekit.errors import MoekitError


def free_port() -> int:
    """A loopback port nobody listens on now (the server binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ServerCommand:
    """How to start one engine's OpenAI-compatible server on `port`."""

    name: str  # what tables call it: "moekit", "moekit --compile", "llama-server", "vllm"
    argv: tuple[str, ...]
    port: int
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    ready_timeout_s: float = 600.0
    min_available_gib: float = 0.0  # not started when the machine has less memory available than this

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(nothing on stderr)"


def available_gib() -> float:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), in GiB; inf elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("inf")


class ServerExited(MoekitError):
    """The server's process ended before it was ready; `returncode` is negative when a signal killed it."""

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 300.0, log: Path | None = None) -> float:
    """Seconds until GET /health answers 200 with every graph loaded (moekit's "graphs": "ready"; a peer's
    200 without the field is ready): a benchmark times the steady server, not prompts run by the modules'
    forward while the prefill graphs load after ready. A MoekitError if the process exits or time runs out."""
    import httpx

    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if proc.poll() is not None:
            why = f": {last_line(log)}" if log is not None else ""
            raise ServerExited(f"the server at {url} exited with {proc.returncode} before it was ready{why}", proc.returncode)
        try:
            answer = httpx.get(url + "/health", timeout=2)
            if answer.status_code == 200 and _graphs_ready(answer):
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise MoekitError(f"the server at {url} was not ready in {timeout_s:.0f} s")


def _graphs_ready(answer) -> bool:
    try:
        body = answer.json()
    except ValueError:  # vLLM's /health answers an empty body
        return True
    return not isinstance(body, dict) or body.get("graphs", "ready") == "ready"


def stop(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`; waits for the process either way."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class RunningServer:
    command: ServerCommand
    proc: subprocess.Popen
    ready_s: float

    @property
    def url(self) -> str:
        return self.command.url


@contextmanager
def running(command: ServerCommand) -> Iterator[RunningServer]:
    """The server, started and ready; stopped when the block ends, however it ends."""
    if command.min_available_gib > 0 and (have := available_gib()) < command.min_available_gib:
        # A server that would push a shared machine into the OOM killer takes others' processes with it.
        raise MoekitError(f"{command.name}: not started: it needs about {command.min_available_gib:.1f} GiB of memory "
                          f"and {have:.1f} GiB is available now")
    with tempfile.TemporaryDirectory(prefix="moekit-bench-") as tmp:
        log = Path(tmp) / "stderr.log"
        with log.open("w") as err:
            try:
                proc = subprocess.Popen(list(command.argv), stdout=subprocess.DEVNULL, stderr=err,
                                        env={**os.environ, **command.env})
            except OSError as e:
                raise MoekitError(f"{command.name}: cannot start {command.argv[0]}: {e.strerror}") from None
            try:
                try:
                    ready_s = wait_ready(command.url, proc, command.ready_timeout_s, log)
                except ServerExited as e:
                    raise ServerExited(f"{command.name}: {e}", e.returncode) from None
                except MoekitError as e:
                    raise MoekitError(f"{command.name}: {e}") from None
                yield RunningServer(command, proc, ready_s)
            finally:
                stop(proc)
