"""`moekit run` as a user runs it: streamed text, --json, --show-activation, --trace, bad input.

Most cases call the CLI's own `main()` in-process (importing torch once); one runs the real console
script to prove an error is one line on stderr with exit 2 and no traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli_runner import moekit
from hf_tiny import MAX_POS, train_tokenizer, write_checkpoint

MOEKIT = Path(sys.executable).parent / "moekit"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))


@pytest.fixture(scope="module")
def ckpt_with_tokenizer(tmp_path_factory) -> Path:
    folder = write_checkpoint("mixtral", tmp_path_factory.mktemp("mixtral_tok"), vocab_size=300)
    train_tokenizer(folder / "tokenizer.json", vocab_size=300)
    return folder


def fails(capsys, *args: str) -> str:
    code, out, err = moekit(capsys, *args)
    assert code == 2, (out, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_json_gives_the_engines_greedy_tokens_and_activation(capsys, ckpt):
    from moekit.engine.loader import load_engine

    code, out, _ = moekit(capsys, "run", "--eager", ckpt, "--prompt-ids", "1,17,42", "--max-new-tokens", "12", "--temperature", "0", "--stop", "", "--json")
    assert code == 0
    data = json.loads(out)
    expected = load_engine(ckpt, compile=False).generate([1, 17, 42], max_new_tokens=12, stop_ids=()).token_ids[0]
    assert data["token_ids"] == expected
    assert len(data["activation"]) == 12
    first = data["activation"][0]
    assert 0 < first["share"] < 1 and first["params_touched"] > 0
    assert sorted(first["experts"]) == ["0", "1"] and all(len(v) == 2 for v in first["experts"].values())
    assert data["timing"]["decode_steps"] == 11 and data["timing"]["decode_tok_s"] > 0
    assert "text" not in data  # no tokenizer.json in this folder


def test_text_prompt_streams_text(capsys, ckpt_with_tokenizer):
    from tokenizers import Tokenizer

    code, out, err = moekit(capsys, "run", "--eager", ckpt_with_tokenizer, "def fibonacci(n):", "--max-new-tokens", "16", "--stop", "")
    assert code == 0
    code, js, _ = moekit(capsys, "run", "--eager", ckpt_with_tokenizer, "def fibonacci(n):", "--max-new-tokens", "16", "--stop", "", "--json")
    data = json.loads(js)
    tok = Tokenizer.from_file(str(ckpt_with_tokenizer / "tokenizer.json"))
    assert data["text"] == tok.decode(data["token_ids"])
    assert out == data["text"] + "\n"
    assert "16 tokens" in err and "tok/s" in err


def test_show_activation_prints_a_row_per_token(capsys, ckpt):
    code, out, _ = moekit(capsys, "run", "--eager", ckpt, "--prompt-ids", "1,17,42", "--max-new-tokens", "5", "--stop", "", "--show-activation")
    assert code == 0
    lines = out.splitlines()
    assert len(lines[0].split()) == 5  # the streamed ids
    assert "share" in out and "experts" in out
    assert sum(1 for line in lines if "L0:" in line) == 5  # the share is the same for all: said once below


def test_trace_is_written(capsys, ckpt, tmp_path):
    import pyarrow.parquet as pq

    path = tmp_path / "t.parquet"
    code, _, err = moekit(capsys, "run", "--eager", ckpt, "--prompt-ids", "1,17,42", "--max-new-tokens", "4", "--stop", "", "--trace", path)
    assert code == 0 and "trace" in err
    assert pq.read_table(path).num_rows == (3 + 4 - 1) * 2  # fed tokens x MoE layers


def test_a_seed_makes_sampling_repeat(capsys, ckpt):
    args = ("run", "--eager", ckpt, "--prompt-ids", "1,17,42", "--max-new-tokens", "12", "--stop", "", "--temperature", "1.0", "--json")
    runs = [json.loads(moekit(capsys, *args, "--seed", str(s))[1])["token_ids"] for s in (3, 3, 4)]
    assert runs[0] == runs[1] != runs[2]


def test_stop_ids_end_generation(capsys, ckpt):
    free = json.loads(moekit(capsys, "run", "--eager", ckpt, "--prompt-ids", "1,17,42", "--max-new-tokens", "10", "--stop", "", "--json")[1])
    stop = free["token_ids"][3]
    data = json.loads(moekit(capsys, "run", "--eager", ckpt, "--prompt-ids", "1,17,42", "--max-new-tokens", "10", "--stop", str(stop), "--json")[1])
    assert data["token_ids"] == free["token_ids"][: free["token_ids"].index(stop) + 1]
    assert data["stopped"]


def test_help_names_the_bundled_default():
    result = subprocess.run([str(MOEKIT), "run", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "bundled" in result.stdout.lower() and "--prompt-ids" in result.stdout


def test_an_error_is_one_line_without_traceback(tmp_path):
    result = subprocess.run([str(MOEKIT), "run", "--eager", str(tmp_path), "--prompt-ids", "1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "config.json" in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_bad_checkpoints_are_refused(capsys, ckpt, tmp_path):
    assert "config.json" in fails(capsys, "run", "--eager", tmp_path, "--prompt-ids", "1")
    assert "no such" in fails(capsys, "run", "--eager", tmp_path / "nope", "--prompt-ids", "1")

    truncated = _copy(ckpt, tmp_path / "truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "truncated" in fails(capsys, "run", "--eager", truncated, "--prompt-ids", "1")

    wrong = _copy(ckpt, tmp_path / "wrong_shape")
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["moe_intermediate_size"] = 40
    (wrong / "config.json").write_text(json.dumps(cfg))
    assert "shape" in fails(capsys, "run", "--eager", wrong, "--prompt-ids", "1")

    unknown = _copy(ckpt, tmp_path / "unknown")
    cfg["model_type"] = "not_a_model"
    (unknown / "config.json").write_text(json.dumps(cfg))
    assert "not_a_model" in fails(capsys, "run", "--eager", unknown, "--prompt-ids", "1")


def test_a_missing_shard_is_named(capsys, tmp_path):
    folder = write_checkpoint("olmoe", tmp_path / "sharded", save_kwargs={"max_shard_size": "100KB"})
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    assert shards[-1].name in fails(capsys, "run", "--eager", folder, "--prompt-ids", "1")


@pytest.mark.parametrize(
    "args, message",
    [
        (("--prompt-ids", "1,999"), "vocabulary"),
        (("--prompt-ids", "1,x"), "integer"),
        (("--prompt-ids", "1", "--max-new-tokens", "0"), "max-new-tokens"),
        (("--prompt-ids", ",".join(["5"] * (MAX_POS - 4)), "--max-new-tokens", "10"), "context"),
        (("some text",), "tokenizer"),
        ((), "PROMPT or --prompt-ids"),
        (("text", "--prompt-ids", "1"), "PROMPT or --prompt-ids"),
        (("--prompt-ids", "1", "--dtype", "float64"), "dtype"),
        (("--prompt-ids", "1", "--top-p", "1.5"), "top-p"),
    ],
)
def test_bad_requests_are_refused(capsys, ckpt, args, message):
    assert message in fails(capsys, "run", "--eager", ckpt, *args)


def test_bench_decode_reports_ratio_and_roofline(capsys, ckpt):
    code, out, _ = moekit(
        capsys, "bench", "decode", "--eager", ckpt, "--vs", "transformers", "--batch", "1,2", "--tokens", "4",
        "--prompt-len", "4", "--repeats", "1", "--warmup", "0", "--json",
    )
    assert code == 0
    data = json.loads(out)
    bandwidth = data["bandwidth_bytes_s"]  # measured now: a rate, never asserted
    assert data["bandwidth_source"].startswith("measured: ") and f"at {data['threads']} threads" in data["bandwidth_source"]
    assert isinstance(data["gemv"], dict)  # the operators' builds where this process registered them
    assert [r["batch"] for r in data["results"]] == [1, 2]
    for r in data["results"]:
        assert r["same_tokens"] is True
        # the report's arithmetic on whatever this run measured: roofline = B x bandwidth / bytes per step
        assert r["roofline_tok_s"] == pytest.approx(r["batch"] * bandwidth / r["bytes_per_step"], rel=1e-12)
        assert r["roofline_share"] == pytest.approx(r["moekit_tok_s"] / r["roofline_tok_s"], rel=1e-12)
        assert r["ratio"] == pytest.approx(r["moekit_tok_s"] / r["baseline_tok_s"], rel=1e-12)
    # every row reads the same dense weights; a batch of 2 reads at least one row's experts, at most twice
    one, two = (r["bytes_per_step"] for r in data["results"])
    assert one < two <= 2 * one


def test_bench_refuses_an_unknown_baseline(capsys, ckpt):
    assert "transformers, llama.cpp" in fails(capsys, "bench", "decode", "--eager", ckpt, "--vs", "vllm")


@pytest.mark.parametrize("kind", ["mxfp4", "fp8"])
def test_the_default_run_compiles_experts_kept_packed_and_gives_the_eager_tokens(capsys, tmp_path, kind):
    """`moekit run` (compiled by default) on a checkpoint whose routed experts are MXFP4 (gpt-oss's
    published layout) or block-scaled FP8 (DeepSeek-V3's), kept packed: one compiled graph, whose
    generated C++ calls moekit::experts_mxfp4 / experts_fp8 through their C entry points, and the
    `--eager` run's tokens."""
    from quantized_files import write_fp8, write_mxfp4

    folder = (write_mxfp4 if kind == "mxfp4" else write_fp8)(tmp_path / kind)
    runs = []
    for flags in (("--eager",), ()):
        code, out, err = moekit(capsys, "run", folder, "--prompt-ids", "1,17,42,99,5,63", "--max-new-tokens", 10,
                                "--stop", "", "--json", *flags)
        assert code == 0, err
        runs.append((json.loads(out)["token_ids"], err))
    assert "decode steps run as one compiled graph" in runs[1][1], runs[1][1]
    assert len(runs[0][0]) == 10 and runs[1][0] == runs[0][0]
