"""moekit-experts.json: built once with a crc32 per extent, written beside the checkpoint and nowhere
else, reused while it matches, and a clear error when it belongs to another model or stale files."""

from __future__ import annotations

import json
import shutil
import sys
import zlib

import pytest

from hf_tiny import write_checkpoint
from offload_files import readonly_copy, run_unprivileged
from moekit.errors import MoekitError
from moekit.weights.manifest import MANIFEST_NAME, load_or_build_manifest, read_manifest
from moekit.spec import load_spec


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """Checkpoints nobody writes a manifest into: tests work on copies."""
    return {f: write_checkpoint(f, tmp_path_factory.mktemp(f)) for f in ("mixtral", "qwen3_moe")}


@pytest.fixture
def mixtral(pristine, tmp_path):
    return shutil.copytree(pristine["mixtral"], tmp_path / "mixtral")


def _listing(folder):
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


def test_first_build_checksums_every_expert_and_writes_only_the_manifest(mixtral):
    spec = load_spec(str(mixtral))
    before = _listing(mixtral)
    calls = []
    manifest = load_or_build_manifest(mixtral, spec, progress=lambda done, total: calls.append((done, total)))
    after = _listing(mixtral)
    assert set(after) - set(before) == {MANIFEST_NAME}
    assert {k: v for k, v in after.items() if k != MANIFEST_NAME} == before  # nothing else touched
    assert manifest.built and manifest.on_disk and manifest.source == "checkpoint"
    total = len(spec.moe_layers) * spec.layers[spec.moe_layers[0]].ffn.num_experts
    assert len(manifest.experts) == total
    assert calls[-1] == (total, total) and [d for d, _ in calls] == list(range(1, total + 1))
    for ex in manifest.experts.values():
        for x in ex.extents:
            with open(mixtral / x.file, "rb") as fh:
                fh.seek(x.offset)
                assert x.crc32 == zlib.crc32(fh.read(x.length))


def test_second_load_reads_the_same_manifest_without_rebuilding(mixtral):
    spec = load_spec(str(mixtral))
    first = load_or_build_manifest(mixtral, spec)
    calls = []
    second = load_or_build_manifest(mixtral, spec, progress=lambda *a: calls.append(a))
    assert not second.built and second.on_disk and calls == []
    assert second.experts == first.experts and second.fingerprint == first.fingerprint
    assert not list(mixtral.glob(".*tmp*"))  # the atomic write left no temporary behind


def test_manifest_of_another_model_is_a_clear_error(pristine, mixtral, tmp_path):
    qwen = shutil.copytree(pristine["qwen3_moe"], tmp_path / "qwen")
    load_or_build_manifest(mixtral, load_spec(str(mixtral)))
    shutil.copy(mixtral / MANIFEST_NAME, qwen / MANIFEST_NAME)
    with pytest.raises(MoekitError, match="was written for another model .mixtral, 2 layers, 6 experts"):
        load_or_build_manifest(qwen, load_spec(str(qwen)))


def test_same_family_with_a_different_config_is_another_model(mixtral):
    load_or_build_manifest(mixtral, load_spec(str(mixtral)))
    config = json.loads((mixtral / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (mixtral / "config.json").write_text(json.dumps(config))
    with pytest.raises(MoekitError, match="another model .*a different config.json"):
        load_or_build_manifest(mixtral, load_spec(str(mixtral)))


def test_a_weight_file_that_changed_size_is_a_clear_error(mixtral):
    load_or_build_manifest(mixtral, load_spec(str(mixtral)))
    path = mixtral / "model.safetensors"
    size = path.stat().st_size
    with path.open("ab") as fh:
        fh.write(b"\0" * 16)
    changed = f"changed size since {MANIFEST_NAME} was written .{size} → {size + 16} bytes"
    with pytest.raises(MoekitError, match=changed):
        load_or_build_manifest(mixtral, load_spec(str(mixtral)))


def test_a_malformed_manifest_is_a_clear_error(mixtral):
    (mixtral / MANIFEST_NAME).write_text('{"format": "moekit-experts", "version": 1, "experts": [')
    with pytest.raises(MoekitError, match="not a valid manifest .*delete it"):
        read_manifest(mixtral)


def test_dense_model_has_nothing_to_manifest(tmp_path):
    folder = write_checkpoint("llama", tmp_path / "llama")
    with pytest.raises(MoekitError, match="no MoE layers"):
        load_or_build_manifest(folder, load_spec(str(folder)))


def test_read_only_folder_keeps_the_manifest_in_memory(pristine):
    code = (
        "import sys; from moekit.weights.manifest import load_or_build_manifest; from moekit.spec import load_spec; "
        "m = load_or_build_manifest(sys.argv[1], load_spec(sys.argv[1])); "
        "print(m.on_disk, m.built, len(m.experts))"
    )
    with readonly_copy(pristine["mixtral"]) as folder:
        done = run_unprivileged([sys.executable, "-c", code, str(folder)])
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ["False", "True", "12"]
        assert not (folder / MANIFEST_NAME).exists() and not list(folder.glob(".*"))
