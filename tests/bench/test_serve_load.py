"""`moekit bench serve`: its arithmetic on known inputs, and a real run against a real moekit server
whose own /metrics must count exactly the requests and tokens the load generator reports."""

from __future__ import annotations

import json

import httpx
import pytest


from cli_runner import moekit
from hf_tiny import write_checkpoint
from moekit.bench.serve import RequestResult, load_prompts, percentiles, summarize, token_count
from moekit.errors import MoekitError
from server_process import start_server


def test_percentiles_interpolate_between_ranks():
    p = percentiles([float(v) for v in range(1, 101)])  # 1..100
    assert p["p50"] == pytest.approx(50.5) and p["p90"] == pytest.approx(90.1) and p["p99"] == pytest.approx(99.01)
    assert p["mean"] == pytest.approx(50.5)
    assert percentiles([3.0]) == {"mean": 3.0, "p50": 3.0, "p90": 3.0, "p99": 3.0}


def test_every_chunk_before_the_closing_one_is_a_token_even_with_empty_text():
    assert token_count({"choices": [{"text": "", "finish_reason": None}]}) == 1  # half a UTF-8 character
    assert token_count({"choices": [{"text": "", "finish_reason": "length"}]}) == 0
    assert token_count({"choices": [{"text": "", "token_ids": [4, 5], "finish_reason": None}]}) == 2
    assert token_count({"choices": [], "usage": {"completion_tokens": 3}}) == 0


def test_summary_counts_only_good_requests_and_pools_every_gap():
    results = [
        RequestResult(ok=True, ttft_s=0.1, itl_s=[0.01, 0.03], e2e_s=0.2, output_tokens=3, active_share=0.1),
        RequestResult(ok=True, ttft_s=0.3, itl_s=[0.02], e2e_s=0.4, output_tokens=2, active_share=0.3),
        RequestResult(ok=False, error="HTTP 429: full"),
    ]
    level = summarize(results, wall_s=0.5, concurrency=2, rate=None)
    assert (level.requests, level.errors, level.output_tokens) == (3, 1, 5)
    assert level.output_tok_s == pytest.approx(10.0)
    assert level.itl_s["p50"] == pytest.approx(0.02) and level.ttft_s["mean"] == pytest.approx(0.2)
    assert level.mean_active_share == pytest.approx(0.2) and level.first_error == "HTTP 429: full"


def test_prompts_from_a_file_random_ids_and_bad_files(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text('plain text\\nline\n{"prompt": [1, 2, 3]}\n\n{"prompt": "json text"}\n')
    assert load_prompts(f, None, 0, 0, 0) == ["plain text\nline", [1, 2, 3], "json text"]
    ids = load_prompts(None, 5, 100, 3, seed=1)
    assert len(ids) == 3 and all(len(p) == 5 and all(1 <= t < 100 for t in p) for p in ids)
    assert ids == load_prompts(None, 5, 100, 3, seed=1)  # the same ids for every server compared
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(MoekitError, match="holds no prompt"):
        load_prompts(tmp_path / "empty.txt", None, 0, 0, 0)
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(MoekitError, match=r'bad.jsonl:1: a JSON line needs a "prompt" field'):
        load_prompts(tmp_path / "bad.jsonl", None, 0, 0, 0)


def _metric(url: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics").text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


@pytest.mark.processes  # a server process and the load generator's clients
def test_a_load_run_matches_what_the_server_counted(tmp_path, capsys):
    folder = write_checkpoint("qwen3_moe", tmp_path / "tiny", seed=2)
    server = start_server("--eager", folder, "--max-batch", "4")
    try:
        code, out, err = moekit(
            capsys, "bench", "serve", server.url, "--concurrency", "1,3", "--requests", "6", "--max-tokens", "5",
            "--random-ids", "4", "--vocab", "150", "--warmup", "1", "--tier", "B", "--json",
        )
        assert code == 0, err
        report = json.loads(out)
        assert report["model"] == "tiny" and [lvl["concurrency"] for lvl in report["levels"]] == [1, 3]
        for level in report["levels"]:
            assert (level["requests"], level["errors"], level["output_tokens"]) == (6, 0, 30)
            assert level["itl_s"]["p50"] > 0 and level["ttft_s"]["p99"] >= level["ttft_s"]["p50"]
            assert 0 < level["mean_active_share"] < 1
        assert _metric(server.url, "moekit:request_success_total") == 2 * 6 + 2  # + the warm-ups
        assert _metric(server.url, "moekit:generation_tokens_total") == (2 * 6 + 2) * 5
        code, out, err = moekit(capsys, "bench", "serve", server.url, "--concurrency", "2", "--requests", "2", "--max-tokens",
                                "3", "--random-ids", "4", "--vocab", "150", "--warmup", "0", "--routing", "topk:1", "--json")
        assert code == 0 and json.loads(out)["levels"][0]["errors"] == 0, err
        # every request routed by the policy: 4 prompt tokens + 2 decode passes, per MoE layer
        layers = 2
        assert _metric(server.url, "moekit:routing_decisions_total") == 2 * (4 + 2) * layers
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--concurrency", "1,x"], "--concurrency: expected comma-separated integers"),
        (["--concurrency", "0"], "integers >= 1"),
        (["--rate", "-2"], "--rate must be a positive number"),
        (["--tier", "Z"], "--tier must be S, A or B"),
        (["--max-tokens", "0"], "must be at least 1"),
    ],
)
def test_bad_arguments_are_one_line_before_any_load(args, message, capsys):
    code, out, err = moekit(capsys, "bench", "serve", "http://127.0.0.1:9", *args)
    assert code == 2 and message in err and "Traceback" not in err


def test_no_server_there_is_one_line(capsys):
    code, out, err = moekit(capsys, "bench", "serve", "http://127.0.0.1:9", "--requests", "1")
    assert code == 2 and "no OpenAI-compatible server answers there" in err
