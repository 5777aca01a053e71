"""tests/serve: real server processes (server_process.py), tiny checkpoints from tests/engine's hf_tiny."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from server_process import Server, start_server  # noqa: E402


@pytest.fixture
def serve_process():
    """Start servers with serve_process(ARGS...); all are stopped at the end of the test."""
    started: list[Server] = []

    def start(*args: str) -> Server:
        server = start_server(*args)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
