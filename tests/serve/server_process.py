"""A real `moekit serve` process on a free loopback port, for tests to talk to over HTTP.

The server is started with --port 0 and tells its address on stderr once the model is loaded;
whoever starts one stops it (Server.stop sends SIGTERM, then kills after a timeout).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import pytest

START_TIMEOUT_S = 120


@dataclass
class Server:
    proc: subprocess.Popen
    url: str = ""  # http://127.0.0.1:PORT
    log: list[str] = field(default_factory=list)

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(*args: str, timeout: float = START_TIMEOUT_S, threads: int = 1, env: Optional[dict] = None) -> Server:
    """`moekit serve ARGS --port 0 --threads THREADS`, returned once it serves (or failing with its stderr);
    env: its environment, if not this process's."""
    cmd = [sys.executable, "-m", "moekit", "serve", *map(str, args), "--host", "127.0.0.1", "--port", "0",
           "--threads", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    server = Server(proc)
    ready = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            server.log.append(line.rstrip())
            if line.startswith("serving "):
                server.url = line.split(" on ", 1)[1].split("/v1", 1)[0]
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.2):
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"moekit serve did not start in {timeout} s: {server.log}")
    if not server.url:
        proc.wait(10)
        pytest.fail(f"moekit serve exited {proc.returncode}: {server.log}")
    return server
