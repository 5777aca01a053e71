"""Two README promises of `moekit run --expert-memory`, at the command line: `--prefetch` (and
`--prefetch-extra`) give token for token what the run without them gives, and a corrupted expert is
one line naming file, layer and expert, exit 2, never wrong weights."""

from __future__ import annotations

import json
import shutil

import pytest

from cli_runner import moekit
from hf_tiny import write_checkpoint
from offload_files import flip_byte
from moekit.weights.manifest import load_or_build_manifest
from moekit.offload.options import OffloadOptions
from moekit.spec import load_spec

RUN = ["--prompt-ids", "1,17,42,99,5", "--max-new-tokens", "10", "--stop", "", "--json"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint("qwen3_moe", tmp_path_factory.mktemp("cli_prefetch"), seed=2)


def _run(capsys, folder, *args):
    code, out, err = moekit(capsys, "run", "--eager", folder, *RUN, *args)
    assert code == 0, err
    return json.loads(out)


def _in_process_stats(folder, extra):
    """What the store reports for the same request through the Python API."""
    from moekit.engine.loader import load_engine

    engine = load_engine(folder, offload=OffloadOptions("25%", prefetch=True, prefetch_extra=extra), compile=False)
    try:
        engine.generate([1, 17, 42, 99, 5], max_new_tokens=10, stop_ids=())
        return engine.store.stats()["layers"]
    finally:
        engine.close()


SCORED = ("accesses", "hits", "loads", "prefetch_precision", "prefetch_recall")


def test_prefetch_from_the_cli_gives_the_same_tokens(capsys, ckpt):
    want = _run(capsys, ckpt)["token_ids"]
    assert _run(capsys, ckpt, "--expert-memory", "25%")["token_ids"] == want
    layers = {}
    for extra in ("0", "6"):
        got = _run(capsys, ckpt, "--expert-memory", "25%", "--prefetch", "--prefetch-extra", extra)
        assert got["token_ids"] == want, extra
        report = got["offload"]
        assert report["prefetch"] is True and 0 < report["prefetch_recall"] <= 1
        layers[extra] = {l: {k: v[k] for k in SCORED} for l, v in report["layers"].items()}
        # --prefetch-extra reaches the store: the CLI's guesses are the Python API's for that value
        want_layers = _in_process_stats(ckpt, int(extra))
        assert layers[extra] == {l: {k: v[k] for k in SCORED} for l, v in want_layers.items()}, extra
    assert layers["0"] != layers["6"]  # and the value changes what is guessed


def test_a_corrupted_expert_is_one_line_naming_file_layer_and_expert_exit_2(capsys, ckpt, tmp_path):
    folder = shutil.copytree(ckpt, tmp_path / "damaged")
    resident = _run(capsys, folder)
    layer, expert = 1, resident["activation"][0]["experts"]["1"][0]  # the prefill routes to it
    extent = load_or_build_manifest(folder, load_spec(str(folder))).experts[layer, expert].down[0]
    flip_byte(folder / extent.file, extent.offset + extent.length // 2)

    code, out, err = moekit(capsys, "run", "--eager", folder, *RUN, "--expert-memory", "25%", "--cache", "none")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    assert f"layer {layer} expert {expert}: checksum mismatch in {extent.file}" in err
