"""tests/serve: real server processes (server_process.py), tiny checkpoints from tests/engine's hf_tiny."""

from __future__ import annotations

import pytest

from server_process import Server, start_server


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
