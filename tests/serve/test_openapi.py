"""/openapi.json is true to the request models, and schemathesis (a real client that reads it)
finds no server error on any route in a run of at most 12 generated requests per route and phase."""

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


# The default run: every route fuzzed (schemathesis's fuzzing and stateful phases, up to 12 cases a route,
# valid and invalid bodies), to the end. Its coverage phase (each field's boundary and invalid values: ~1100
# requests here, a few of them n = 255 continuations) is `./dev test --all`'s, capped at 300 s. A --max-time
# is not a count: schemathesis fuzzes until it is spent, and a capped run whose coverage phase comes
# first spent it there (3 of the 9 routes tested in 60 s on a busy machine, no fuzzing).
@pytest.mark.parametrize("phases, examples, seconds",
                         [("examples,fuzzing,stateful", 12, None),
                          pytest.param("examples,coverage,fuzzing,stateful", 40, 300, marks=pytest.mark.slow)],
                         ids=["fuzz", "coverage"])
def test_schemathesis_finds_no_server_error(server, tmp_path, phases, examples, seconds):
    st = Path(sys.executable).with_name("st")
    if not st.exists():
        st = Path(shutil.which("st") or "st")
    cmd = [str(st), "run", server.url + "/openapi.json", "--checks", "not_a_server_error", "--phases", phases,
           "--max-examples", str(examples), "--request-timeout", "60", "--workers", "1", "--seed", "36", "--no-shrink",
           "--report-dir", str(tmp_path)] + ([] if seconds is None else ["--max-time", str(seconds)])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=(seconds or 300) + 250, cwd=tmp_path)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, tail
    assert "passed" in tail.lower()
    if seconds is None:  # run to its end: every route tested
        doc = httpx.get(server.url + "/openapi.json", timeout=TIMEOUT).json()
        routes = sum(len(methods) for methods in doc["paths"].values())
        assert f"Tested: {routes}\n" in tail and "Skipped:" not in tail, tail
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200
