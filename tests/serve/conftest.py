"""tests/serve: real server processes (server_process.py), tiny checkpoints from tests/engine's hf_tiny."""

from __future__ import annotations

import pytest

from server_process import Server, start_server

from moekit.engine.default_model import bundled_model_path  # noqa: E402
from moekit.engine.loader import load_engine  # noqa: E402


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


@pytest.fixture(scope="module")
def server():
    """The bundled model served (max batch 16) to one test module; it must exit 0 on SIGTERM."""
    s = start_server("--eager", "--max-batch", "16")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def engine():
    """The bundled model in this process: the oracle for what the server answers."""
    return load_engine(bundled_model_path(), compile=False)


@pytest.fixture(scope="module")
def client(server):
    """The official OpenAI client, pointed at `server`."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.v1, api_key="unused", timeout=120.0, max_retries=0)
