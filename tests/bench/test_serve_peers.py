"""`moekit bench serve CKPT --vs ...`: the workload every engine gets, the engines named on the
command line, the ratio table, a missing baseline's one-line error before any server starts, and a
real run of the harness against a real `moekit serve` it starts itself (no peer in tests)."""

from __future__ import annotations

import json

import pytest

from cli_runner import moekit
from moekit.bench import vllm_cpu
from moekit.bench.serve import RequestResult, summarize
from moekit.bench.serve_peers import (EngineChoice, EngineRun, ServeSetup, Workload, checkpoint_vocab, engine_command,
                                      markdown_table, parse_vs, ratio_pairs, ratio_rows, round_order, run_peers)
from moekit.errors import MoekitError


def test_the_workload_is_the_issues_and_the_same_ids_for_every_engine():
    w = Workload()
    assert w.level_names() == ["c=1", "c=4", "c=16", "c=16 + 4x512-token arrivals"]
    assert w.context == 512 + 64  # a row holds the longest prompt and its output
    short, long = w.prompts(vocab=32000)
    assert len(short) == 4 * 2 + 4 * (1 + 4 + 16 + 16) and all(len(p) == 8 for p in short)  # warm-ups and 4 x c a level
    assert len(long) == 4 and all(len(p) == 512 for p in long)
    assert all(3 <= t < 32000 for p in short + long for t in p)  # no pad, bos or eos
    assert (short, long) == w.prompts(vocab=32000)
    assert w.prompts(vocab=32000) != Workload(seed=1).prompts(vocab=32000)


def test_no_prompt_is_sent_twice_in_a_run():
    """Each level's warm-up and requests get prompts of their own: a repeated prompt would be
    answered from llama-server's prompt cache (a slot's prompt KV), not prefilled."""
    w = Workload()
    short, _ = w.prompts(vocab=32000)
    cut = w.level_prompts(short)
    assert [(len(warm), len(asked)) for warm, asked in cut] == [(2, 4), (2, 16), (2, 64), (2, 64)]
    sent = [tuple(p) for warm, asked in cut for p in warm + asked]
    assert sorted(sent) == sorted(map(tuple, short)) and len(set(sent)) == len(sent)


def test_a_workload_without_arrivals_has_only_the_concurrency_levels():
    w = Workload(concurrency=(1, 2), arrival_count=0)
    assert w.level_names() == ["c=1", "c=2"] and w.context == 8 + 64 and w.prompts(100)[1] == []
    with pytest.raises(MoekitError, match="integers >= 1"):
        Workload(concurrency=(0,))
    with pytest.raises(MoekitError, match="no ordinary token id"):
        w.prompts(vocab=3)


def test_vs_names_the_subject_first_then_each_baseline():
    engines = parse_vs("llama-server, vllm,moekit:--compile --kernels reference", "--eager")
    assert [e.name for e in engines] == ["moekit --eager", "llama-server", "vllm", "moekit --compile --kernels reference"]
    assert engines[3] == EngineChoice("moekit", ("--compile", "--kernels", "reference"))
    assert [e.name for e in parse_vs("")] == ["moekit"]
    with pytest.raises(MoekitError, match="the baselines are llama-server, vllm"):
        parse_vs("sglang")
    with pytest.raises(MoekitError, match="the baselines are"):
        parse_vs("vllm:--enforce-eager")
    with pytest.raises(MoekitError, match="twice"):
        parse_vs("vllm,vllm")


def test_each_round_rotates_the_engines():
    engines = parse_vs("llama-server,vllm")
    assert [[e.kind for e in round_order(engines, r)] for r in range(4)] == [
        ["moekit", "llama-server", "vllm"], ["llama-server", "vllm", "moekit"],
        ["vllm", "moekit", "llama-server"], ["moekit", "llama-server", "vllm"]]


def _level(tok_s: float, ttft: float = 0.05, itl=(0.01,), errors: int = 0):
    """A level whose output tok/s is `tok_s` (one second of wall time)."""
    good = [RequestResult(ok=True, ttft_s=ttft, itl_s=list(itl), e2e_s=0.5, output_tokens=int(tok_s))]
    return summarize(good + [RequestResult(ok=False, error="HTTP 500")] * errors, 1.0, 1, None)


def _run(engine: str, **levels) -> EngineRun:
    return EngineRun(engine, 1.0, {name.replace("_", "="): level for name, level in levels.items()})


def test_ratios_are_taken_within_a_round_then_ranged():
    rounds = [
        {"moekit": _run("moekit", c_1=_level(120)), "llama-server": _run("llama-server", c_1=_level(100)),
         "vllm": _run("vllm", c_1=_level(60))},
        # the machine slowed down for everybody: ratios, not absolute figures, are what compare
        {"moekit": _run("moekit", c_1=_level(60)), "llama-server": _run("llama-server", c_1=_level(40)),
         "vllm": _run("vllm", c_1=_level(30))},
    ]
    (row,) = ratio_rows(rounds)
    assert row.level == "c=1"
    assert row.ratios == {"moekit ÷ llama-server": "1.20–1.50×", "moekit ÷ vllm": "2.00×"}
    assert row.figures["moekit"] == "60–120 (50, 10.0/10.0)"
    table = markdown_table([row]).splitlines()
    assert table[0] == "| level | moekit | llama-server | vllm | moekit ÷ llama-server | moekit ÷ vllm |"
    assert table[2].startswith("| c=1 | 60–120 (50, 10.0/10.0) | 40–100 ")


def test_a_level_with_errors_gives_no_ratio():
    rounds = [{"moekit": _run("moekit", c_1=_level(120, errors=1)), "vllm": _run("vllm", c_1=_level(60))}]
    assert ratio_rows(rounds)[0].ratios == {"moekit ÷ vllm": "—×"}


def test_every_moekit_engine_is_put_beside_every_peer_and_the_subject_beside_its_variants():
    assert ratio_pairs(["moekit", "llama-server", "moekit --compile", "vllm"]) == [
        ("moekit", "llama-server"), ("moekit", "vllm"), ("moekit --compile", "llama-server"),
        ("moekit --compile", "vllm"), ("moekit", "moekit --compile")]


def _folder(tmp_path, vocab=150):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "vocab_size": vocab}))
    return folder


def test_a_baseline_not_built_is_one_line_naming_its_build_script_before_any_server(tmp_path):
    setup = ServeSetup(_folder(tmp_path))
    empty = tmp_path / "nothing-built"
    with pytest.raises(MoekitError, match=r"--vs vllm needs vllm-cpu 0\.32\.0 .*run benchmarks/build_vllm_cpu\.sh"):
        run_peers(parse_vs("vllm"), setup, Workload(), roots={"vllm": empty})
    with pytest.raises(MoekitError, match=r"run benchmarks/build_llama_cpp\.sh"):
        run_peers(parse_vs("llama-server"), setup, Workload(), roots={"llama-server": empty})


def test_vllm_runs_like_the_others_or_says_why_not(tmp_path):
    build = vllm_cpu.VllmCpuBuild(tmp_path)
    command = vllm_cpu.server_command(build, tmp_path, 8123, "bfloat16", max_batch=16, max_model_len=576, threads=2)
    argv = " ".join(command.argv)
    assert "-m vllm.entrypoints.openai.api_server" in argv and "--skip-tokenizer-init" in argv
    assert "--max-num-seqs 16 --max-model-len 576" in argv and "--dtype bfloat16" in argv
    assert command.env == {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "2"}
    assert command.url == "http://127.0.0.1:8123"
    assert command.min_available_gib == pytest.approx(2 + 1.5)  # no weights in tmp_path


def test_a_server_that_needs_more_memory_than_there_is_is_not_started():
    from moekit.bench.server_launch import ServerCommand, running

    huge = ServerCommand("vllm", ("/bin/false",), 9, min_available_gib=1e9)
    with pytest.raises(MoekitError, match=r"vllm: not started: it needs about 1000000000\.0 GiB"):
        with running(huge):
            pass
    assert vllm_cpu.vllm_dtype("fp32") == "float32"
    with pytest.raises(MoekitError, match="no weight form like --weights int8"):
        vllm_cpu.vllm_dtype("float32", "int8")


def test_every_engine_gets_the_same_rows_threads_and_context(tmp_path):
    setup = ServeSetup(_folder(tmp_path), "bfloat16", threads=2, max_batch=16)
    argv = engine_command(EngineChoice("moekit", ("--compile",)), setup, Workload(), 8000).argv
    flags = dict(zip(argv[5::2], argv[6::2]))
    assert flags["--max-batch"] == "16" and flags["--threads"] == "2" and flags["--max-context"] == "576"
    assert flags["--dtype"] == "bfloat16" and argv[-1] == "--compile"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--vs", "vllm"], "--vs needs a checkpoint folder"),
        (["--vs", "sglang"], "the baselines are llama-server, vllm"),
        (["--vs", "llama-server", "--rate", "2"], "the workload is fixed"),
        (["--rounds", "0"], "--rounds must be at least 1"),
    ],
)
def test_bad_peer_arguments_are_one_line(args, message, tmp_path, capsys):
    target = str(tmp_path / "no-such-folder") if "needs a checkpoint" in message else str(_folder(tmp_path))
    code, out, err = moekit(capsys, "bench", "serve", target, *args)
    assert code == 2 and message in err and "Traceback" not in err


@pytest.mark.processes  # the harness starts a real moekit serve
def test_the_harness_starts_moekit_and_runs_the_whole_workload(tiny_checkpoints, capsys):
    folder = tiny_checkpoints("qwen3_moe")
    code, out, err = moekit(capsys, "bench", "serve", str(folder), "--moekit-args", "--eager", "--concurrency", "1,2", "--max-tokens", "4",
                            "--arrivals", "1", "--arrival-tokens", "16", "--warmup", "0", "--threads", "1",
                            "--max-batch", "4", "--json")
    assert code == 0, err
    report = json.loads(out)
    (run,) = report["rounds"][0].values()
    assert run["engine"] == "moekit --eager" and list(run["levels"]) == ["c=1", "c=2", "c=2 + 1x16-token arrivals"]
    for name, level in run["levels"].items():
        clients = 1 if name == "c=1" else 2
        assert (level["requests"], level["errors"], level["output_tokens"]) == (4 * clients, 0, 4 * 4 * clients)
    assert (run["arrivals"]["requests"], run["arrivals"]["errors"], run["arrivals"]["output_tokens"]) == (1, 0, 4)


def test_an_engine_that_failed_keeps_its_column_with_no_figures():
    failed = EngineRun("vllm", float("nan"), failed="vllm: the server exited with -9 before it was ready")
    (row,) = ratio_rows([{"moekit": _run("moekit", c_1=_level(120)), "vllm": failed}])
    assert row.figures["vllm"] == "— (—, —/—)" and row.ratios == {"moekit ÷ vllm": "—×"}


def test_a_gguf_checkpoint_is_served_by_llama_server_as_it_is(tmp_path):
    from moekit.bench.llama_cpp import LlamaCppBuild

    build = LlamaCppBuild(tmp_path / "llama.cpp")
    for path in (build.python, build.vendor / "convert_hf_to_gguf.py", build.server):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    argv = engine_command(EngineChoice("llama-server"), ServeSetup(gguf, "bfloat16"), Workload(), 8080,
                          roots={"llama-server": build.root}).argv
    assert argv[argv.index("-m") + 1] == str(gguf)  # no conversion: moekit serves this same file
    assert not (build.root / "gguf").exists()


def test_a_gguf_checkpoints_vocabulary_comes_from_its_header(tmp_path):
    """`bench serve FILE.gguf --vs llama-server` draws prompt ids below the GGUF's own vocabulary."""
    from moekit.bench.make_checkpoint import make_checkpoint

    shape = dict(model_type="gpt_oss", vocab_size=384, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                 sliding_window=4, layer_types=["sliding_attention"], tie_word_embeddings=False)
    gguf = make_checkpoint(shape, "gguf-mxfp4", tmp_path / "m.gguf", seed=1).path
    assert checkpoint_vocab(gguf) == 384


@pytest.mark.processes  # real processes stand in for llama-server's start-up: one killed by a signal, one exiting
def test_a_llama_server_killed_on_start_is_run_again_without_repacking(tmp_path):
    """llama.cpp's AMX q8_0 path segfaulted at start-up on an Intel Xeon here: the harness says so and runs
    llama-server again with --no-repack (and says that too), rather than losing the baseline."""
    from moekit.bench.llama_cpp import LlamaCppBuild
    from moekit.bench.make_checkpoint import make_checkpoint

    build = LlamaCppBuild(tmp_path / "llama.cpp")
    for path in (build.python, build.vendor / "convert_hf_to_gguf.py"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    build.server.parent.mkdir(parents=True, exist_ok=True)
    # Repacked: killed by SIGSEGV, as the real one was; --no-repack: exits 3, so no workload runs.
    build.server.write_text('#!/bin/sh\ncase "$*" in *--no-repack*) echo "no-repack start" >&2; exit 3;; esac\n'
                            'kill -SEGV $$\n')
    build.server.chmod(0o755)
    shape = dict(model_type="gpt_oss", vocab_size=384, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                 sliding_window=4, layer_types=["sliding_attention"], tie_word_embeddings=False)
    gguf = make_checkpoint(shape, "gguf-mxfp4", tmp_path / "m.gguf", seed=1).path
    said: list[str] = []
    (runs,) = run_peers(parse_vs("llama-server")[1:], ServeSetup(gguf), Workload(concurrency=(1,), arrival_count=0),
                        roots={"llama-server": build.root}, progress=said.append)
    run = runs["llama-server"]
    assert any("crashed on start" in line and "-11" in line and "--no-repack" in line for line in said)
    assert "exited with 3" in run.failed and "no-repack start" in run.failed
    assert run.note == "crashed on start with its weights repacked; run with --no-repack"
