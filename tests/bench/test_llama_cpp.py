"""`moekit bench decode --vs llama.cpp`: precision to GGUF type, naming, the command lines, refusals.

The pure parts run everywhere. The end-to-end check (both sides write the same greedy tokens at
fp32) needs the llama.cpp build, so it is not a test that would skip on every clean CI clone: every
`moekit bench decode --vs llama.cpp` run performs it and reports it ("same tokens").
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moekit.bench import llama_cpp
from moekit.bench.child import ChildCrashed
from moekit.bench.llama_cpp import LlamaCppBaseline, LlamaCppBuild, find_build, gguf_type, worker_command
from moekit.bench.llama_cpp_worker import context_cells, parse_rows
from moekit.errors import MoekitError


@pytest.mark.parametrize("dtype, weights, want", [("float32", "dtype", "f32"), ("bfloat16", "dtype", "bf16"),
                                                  ("float32", "int8", "q8_0"), ("bfloat16", "int8", "q8_0")])
def test_each_precision_meets_the_gguf_type_that_holds_the_same_weights(dtype, weights, want):
    assert gguf_type(dtype, weights) == want


def test_int8_experts_have_no_gguf_counterpart():
    with pytest.raises(MoekitError, match="int8-experts"):
        gguf_type("float32", "int8-experts")


def test_a_gguf_is_named_by_checkpoint_folder_and_type_and_two_folders_never_share_one(tmp_path):
    build = LlamaCppBuild(tmp_path / "llama.cpp")
    a, b = tmp_path / "x" / "qwen3_moe-150m", tmp_path / "y" / "qwen3_moe-150m"
    path = build.gguf_path(a, "q8_0")
    assert path.parent == tmp_path / "llama.cpp" / "gguf"
    assert path.name.startswith("qwen3_moe-150m-") and path.name.endswith("-q8_0.gguf")
    assert build.gguf_path(a, "q8_0") == path and build.gguf_path(b, "q8_0") != path
    assert build.gguf_path(a, "f32") != path


def test_a_missing_build_is_one_error_naming_the_build_script(tmp_path):
    with pytest.raises(MoekitError, match="benchmarks/build_llama_cpp.sh"):
        find_build(tmp_path / "nothing-here")


def test_the_worker_runs_under_the_builds_python_with_the_same_threads_and_prompt(tmp_path):
    build = LlamaCppBuild(tmp_path)
    argv = worker_command(build, tmp_path / "m.gguf", [[1, 17, 42]], new_tokens=8, threads=2)
    assert argv[0] == str(tmp_path / "venv" / "bin" / "python")
    assert argv[1:3] == ["-m", "moekit.bench.llama_cpp_worker"]
    assert argv[argv.index("--prompt-ids") + 1] == "1,17,42"
    assert argv[argv.index("--threads") + 1] == "2" and argv[argv.index("--new-tokens") + 1] == "8"


def test_every_prompt_row_reaches_the_worker_and_comes_back_as_the_same_rows(tmp_path):
    rows = [[1, 17, 42], [5, 0, 31999], [7, 7, 7]]
    argv = worker_command(LlamaCppBuild(tmp_path), tmp_path / "m.gguf", rows, new_tokens=8, threads=2)
    assert argv[argv.index("--prompt-ids") + 1] == "1,17,42;5,0,31999;7,7,7"
    assert parse_rows(argv[argv.index("--prompt-ids") + 1]) == rows


def test_the_single_row_form_is_one_row():
    assert parse_rows("1,2,3") == [[1, 2, 3]] and parse_rows("1,2,3;") == [[1, 2, 3]]


@pytest.mark.parametrize("text", ["", ";", "1,2;3", "1,x;3,4"])
def test_the_worker_refuses_empty_ragged_or_non_integer_rows(text):
    with pytest.raises(MoekitError, match="--prompt-ids"):
        parse_rows(text)


@pytest.mark.parametrize("kwargs", [dict(rows=[]), dict(rows=[[]]), dict(rows=[[1, 2], [3]]), dict(new_tokens=1),
                                    dict(threads=0)])
def test_bad_worker_requests_are_refused_before_a_child_starts(tmp_path, kwargs):
    args = dict(rows=[[1, 2]], new_tokens=4, threads=1) | kwargs
    with pytest.raises(MoekitError):
        worker_command(LlamaCppBuild(tmp_path), tmp_path / "m.gguf", **args)


@pytest.mark.parametrize("batch, prompt_len, new_tokens", [(1, 16, 32), (8, 16, 16), (3, 300, 500)])
def test_each_sequence_gets_its_whole_prompt_and_new_tokens_of_context(batch, prompt_len, new_tokens):
    # llama.cpp splits n_ctx evenly over n_seq_max sequences, each share a multiple of 256 cells
    cells = context_cells(batch, prompt_len, new_tokens)
    assert cells % batch == 0 and (cells // batch) % 256 == 0
    assert cells // batch >= prompt_len + new_tokens


def test_the_baseline_runs_every_batch_and_answers_one_token_list_per_prompt_row(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    asked = []

    def fake_run(build, gguf, rows, new_tokens, threads, warmup=1, repack=True):
        asked.append((rows, warmup))
        return {"tokens_per_s": 10.0, "token_ids": [[row[0]] * (new_tokens + 1) for row in rows]}

    monkeypatch.setattr(llama_cpp, "run_llama_cpp", fake_run)
    baseline = LlamaCppBaseline(LlamaCppBuild(tmp_path), tmp_path / "m.gguf", threads=2)
    assert all(baseline.supports(b) for b in (1, 2, 8, 64))
    prompts = torch.tensor([[3, 4], [5, 6], [7, 8]])  # [B, P]
    assert baseline.timer(prompts, 4)() == 10.0
    assert baseline.tokens(prompts, 4) == [[3] * 4, [5] * 4, [7] * 4]
    assert asked == [(((3, 4), (5, 6), (7, 8)), 1)]  # the timed run's tokens, no second child
    assert baseline.tokens(prompts[:1], 4) == [[3] * 4] and asked[-1] == (((3, 4),), 0)


def test_a_crash_with_repacked_weights_is_retried_once_without_and_said(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    asked = []

    def crashes_when_repacked(build, gguf, rows, new_tokens, threads, warmup=1, repack=True):
        asked.append(repack)
        if repack:
            raise ChildCrashed("the llama.cpp baseline crashed (signal 11)")
        return {"tokens_per_s": 10.0, "token_ids": [[1] * (new_tokens + 1) for _ in rows]}

    monkeypatch.setattr(llama_cpp, "run_llama_cpp", crashes_when_repacked)
    baseline = LlamaCppBaseline(LlamaCppBuild(tmp_path), tmp_path / "m.gguf", threads=2)
    assert baseline.timer(torch.tensor([[3, 4]]), 4)() == 10.0
    assert baseline.timer(torch.tensor([[5, 6]]), 4)() == 10.0
    assert asked == [True, False, False]  # one crash, then never repacked again
    info = baseline.info()
    assert info["repack"] is False and "signal 11" in info["note"] and "without repacking" in info["note"]


def test_a_crash_without_repacking_is_an_error():
    def always_crashes(*args, **kwargs):
        raise ChildCrashed("the llama.cpp baseline crashed (signal 11)")

    baseline = LlamaCppBaseline(LlamaCppBuild(Path("/nonexistent")), Path("m.gguf"), threads=1)
    baseline.repack = False
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(llama_cpp, "run_llama_cpp", always_crashes)
        with pytest.raises(ChildCrashed):
            baseline._run(((1, 2),), 4)


def test_no_repack_reaches_the_worker_only_when_asked(tmp_path):
    build = LlamaCppBuild(tmp_path)
    assert "--no-repack" not in worker_command(build, tmp_path / "m.gguf", [[1, 2]], new_tokens=4, threads=1)
    assert worker_command(build, tmp_path / "m.gguf", [[1, 2]], new_tokens=4, threads=1, repack=False)[-1] == "--no-repack"


def test_a_worker_answer_with_the_wrong_number_of_rows_is_one_error():
    with pytest.raises(MoekitError, match="2 rows"):
        llama_cpp.token_rows({"token_ids": [1, 2, 3]}, 2)


def test_the_converter_runs_under_this_python_with_the_asked_type(tmp_path):
    argv = llama_cpp.convert_command(LlamaCppBuild(tmp_path), tmp_path / "ckpt", "bf16", tmp_path / "o.gguf")
    assert argv[0] == sys.executable and argv[argv.index("--outtype") + 1] == "bf16"
    with pytest.raises(MoekitError, match="q8_0"):
        llama_cpp.convert_command(LlamaCppBuild(tmp_path), tmp_path / "ckpt", "q4_k", tmp_path / "o.gguf")


def test_a_checkpoint_without_a_tokenizer_is_refused_before_converting(tmp_path):
    with pytest.raises(MoekitError, match="tokenizer.json"):
        llama_cpp.ensure_gguf(LlamaCppBuild(tmp_path), tmp_path, "f32")


def test_neither_side_of_the_baseline_imports_torch():
    code = ("import sys, moekit.bench.llama_cpp, moekit.bench.llama_cpp_worker; "
            "print(sorted(m for m in ('torch', 'transformers', 'llama_cpp') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
