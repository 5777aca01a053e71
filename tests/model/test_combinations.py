"""moekit.model.combinations: which options combine, decided in one place. Each refused combination
is one line (the run and serve commands: exit 2, no traceback); a decoder whose step cannot be
compiled says why, from its experts' form."""

from __future__ import annotations

import pytest

from cli_runner import refused
from moekit.model.combinations import Options, compile_refusal, refusal, store_flags

EP = {"expert_parallel": True}
REFUSED = [
    (Options(store_flags=("--cache", "--prefetch")), "the expert store's flags (--cache, --prefetch) need --expert-memory"),
    (Options(paged=True, device="cuda"), "--expert-memory runs on CPU only in this version"),
    (Options(compile=True, **EP), "--compile with --expert-parallel is not supported yet"),
    (Options(weights="int8", **EP), "--weights int8 with --expert-parallel is not supported yet"),
    (Options(routing=True, **EP), "--routing with --expert-parallel is not supported yet"),
    (Options(no_verify=True, **EP), "--no-verify with --expert-parallel is not supported yet"),
    (Options(admin_token=True, paged=True, **EP), "--admin-token with --expert-memory with --expert-parallel"),
]
COMBINE = [
    Options(), Options(compile=True, paged=True), Options(compile=True, routing=True), Options(paged=True, routing=True),
    Options(paged=True, store_flags=("--pin",)), Options(admin_token=True, **EP), Options(paged=True, **EP),
    Options(weights="int8", paged=True, compile=True),
    Options(compile=True, served=True, **EP),  # the server's sharded step compiles (dist.graph_exchange)
]


@pytest.mark.parametrize("options, says", REFUSED)
def test_each_refused_combination_has_its_one_line(options, says):
    line = refusal(options)
    assert line is not None and says in line and "\n" not in line


@pytest.mark.parametrize("options", COMBINE)
def test_combinations_the_engine_runs_are_not_refused(options):
    assert refusal(options) is None


def test_store_flags_are_those_given_away_from_their_defaults():
    assert store_flags() == ()
    assert store_flags(cache="lfu", pin="p.json", prefetch=True, substitute="int4") == ("--cache", "--pin", "--prefetch", "--substitute")


@pytest.mark.parametrize("args, says", [
    (("--cache", "lfu", "--prefetch"), "(--cache, --prefetch) need --expert-memory"),
    (("--expert-parallel", "2", "--compile"), "--compile with --expert-parallel is not supported yet"),
    (("--expert-parallel", "2", "--weights", "int8"), "--weights int8 with --expert-parallel is not supported yet"),
    (("--expert-parallel", "2", "--routing", "adaptive:0.85"), "--routing with --expert-parallel is not supported yet"),
    (("--expert-parallel", "2", "--no-verify"), "--no-verify with --expert-parallel is not supported yet"),
    (("--expert-memory", "50%", "--device", "cuda"), "--expert-memory runs on CPU only"),
])
def test_the_run_command_refuses_each_in_one_line(capsys, tiny_checkpoints, args, says):
    line = refused(capsys, "run", tiny_checkpoints("qwen3_moe"), "--prompt-ids", "1,2", "--max-new-tokens", "2", *args)
    assert says in line, line


@pytest.mark.parametrize("args, says", [
    (("--pin", "p.json"), "(--pin) need --expert-memory"),
    (("--expert-parallel", "2", "--no-verify"), "--no-verify with --expert-parallel is not supported yet"),
])
def test_the_serve_command_refuses_each_in_one_line(capsys, tiny_checkpoints, args, says):
    line = refused(capsys, "serve", tiny_checkpoints("qwen3_moe"), *args)
    assert says in line, line


def test_a_decoders_compile_refusal_comes_from_its_experts_form(tiny_checkpoints):
    """An eager load lays experts out for the eager kernels (fp32: transposed), which the compiled
    step does not read; a load for compile keeps the Hub-layout stacks it does."""
    from moekit.engine.loader import load_engine
    from moekit.model.expert_forms import PerExpert, Stacks

    folder = tiny_checkpoints("qwen3_moe")
    eager, hub = load_engine(folder, compile=False).decoder, load_engine(folder, compile=True, kernels="reference").decoder
    forms = {type(b.ffn.experts.form) for b in eager.layers if hasattr(b.ffn, "experts")}
    reason = compile_refusal(eager)
    assert reason is not None and "\n" not in reason
    if forms == {PerExpert}:  # every projection is laid out too: which comes first is the projections'
        assert "Hub layout" in reason or "eager kernels" in reason
    assert {type(b.ffn.experts.form) for b in hub.layers if hasattr(b.ffn, "experts")} == {Stacks}
    assert compile_refusal(hub) is None


def test_a_paged_decoder_compiles_once_its_store_is_attached_and_python_hooks_do_not(tiny_checkpoints):
    """The expert store's layers and prefetch guesses are opaque ops in the step
    (moekit.offload.graph_store); a decoder built paged but not yet given its store, or with a plain
    Python hook, is refused in one line."""
    from moekit.engine.loader import load_engine
    from moekit.model.decoder import Decoder
    from moekit.offload.options import OffloadOptions

    folder = tiny_checkpoints("qwen3_moe")
    paged = load_engine(folder, compile=True, kernels="reference", offload=OffloadOptions("25%", prefetch=True))
    try:
        decoder = paged.decoder
        assert decoder.layers[1].before_attn is not None and compile_refusal(decoder) is None
        decoder.layers[0].before_ffn = lambda x: x
        reason = compile_refusal(decoder)
        assert "hook" in reason and "\n" not in reason
    finally:
        paged.close()
    bare = Decoder(paged.spec, offload_experts=True)
    assert compile_refusal(bare) == "routed experts are paged and the expert store is not attached yet"


def test_packed_experts_compile_where_their_operator_is_loaded(tmp_path, monkeypatch):
    """MXFP4 experts kept packed are read by the compiled step (moekit::experts_mxfp4); a process
    without that operator gets one line naming it, and the engine stays eager."""
    from moekit import ops
    from moekit.engine.loader import load_engine
    from quantized_files import write_mxfp4

    decoder = load_engine(write_mxfp4(tmp_path / "mxfp4"), compile=True).decoder
    assert compile_refusal(decoder) is None
    monkeypatch.setattr(ops, "available", lambda name="rows_gemv", namespace="moekit": name != "experts_mxfp4")
    reason = compile_refusal(decoder)
    assert reason is not None and "\n" not in reason and "MXFP4" in reason and "moekit::experts_mxfp4" in reason
