"""/openapi.json is true to the request models, and schemathesis (a real client that reads it)
finds no server error in a bounded run: examples per route and wall time capped."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server_process import start_server
from moekit.serve.openapi import BODIES

TIMEOUT = httpx.Timeout(60.0)


@pytest.fixture(scope="module")
def server():
    # A short context bounds what a generated max_tokens or n can cost.
    s = start_server("--eager", "--max-batch", "8", "--max-context", "40")
    yield s
    assert s.stop() == 0


def test_the_published_schema_is_the_request_models(server):
    doc = httpx.get(server.url + "/openapi.json", timeout=TIMEOUT).json()
    assert doc["openapi"].startswith("3.1")
    schemas = doc["components"]["schemas"]
    for model in BODIES:
        own = model.model_json_schema(ref_template="#/components/schemas/{model}")
        nested = own.pop("$defs", {})
        assert schemas[model.__name__] == own
        for name, schema in nested.items():
            assert schemas[name] == schema
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}
    for path in ("/v1/chat/completions", "/tokenize", "/detokenize", "/tokenizer_info", "/v1/models/{model_id}"):
        assert path in doc["paths"]


# The default run's fuzz is capped at 60 s of one worker; `./dev test --all` adds a longer one.
@pytest.mark.parametrize("examples, seconds", [(12, 60), pytest.param(40, 300, marks=pytest.mark.slow)],
                         ids=["60s", "300s"])
def test_schemathesis_finds_no_server_error(server, tmp_path, examples, seconds):
    st = Path(sys.executable).with_name("st")
    if not st.exists():
        st = Path(shutil.which("st") or "st")
    cmd = [str(st), "run", server.url + "/openapi.json", "--checks", "not_a_server_error", "--max-examples", str(examples),
           "--max-time", str(seconds), "--request-timeout", "60", "--workers", "1", "--seed", "36", "--no-shrink",
           "--report-dir", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 250, cwd=tmp_path)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail
    assert "passed" in tail.lower()
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200
