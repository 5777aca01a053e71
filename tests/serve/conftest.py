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


@pytest.fixture(scope="session")
def server():
    """The bundled model served (max batch 16) to every module of a worker's session that asks for it:
    one start-up (~3 s of a core) instead of one per module. Its tests hold it to what a client sees
    of its own requests (their tokens, counters read before and after, a routing policy no other
    test sends), so none depends on what ran before it. It must exit 0 on SIGTERM."""
    s = start_server("--eager", "--max-batch", "16")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="session")
def engine():
    """The bundled model in this process: the oracle for what the server answers (generate leaves
    no state behind, so the modules share one)."""
    return load_engine(bundled_model_path(), compile=False)


@pytest.fixture(scope="module")
def client(server):
    """The official OpenAI client, pointed at `server`."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.v1, api_key="unused", timeout=120.0, max_retries=0)
