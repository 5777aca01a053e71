"""The manifest's dense checksums: every tensor the routed experts' extents do not cover, whole; an
older manifest without them still reads; the JSON keeps them."""

from __future__ import annotations

import json
import zlib

import pytest

from moekit.weights.manifest import MANIFEST_NAME, build_manifest, read_manifest, tensor_checks, write_manifest
from moekit.spec import load_spec
from moekit.weights.checkpoint import open_checkpoint, placements
from offload_files import write_tiny


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {f: write_tiny(f, tmp_path_factory.mktemp(f)) for f in ("mixtral", "granitemoe", "gpt_oss")}


# Which Hub tensors hold routed-expert weights (the store's extents), per layout.
ROUTED = {
    "mixtral": lambda n: ".experts." in n,  # experts.{j}.w1/w2/w3.weight, one tensor each
    "granitemoe": lambda n: n.endswith(("input_linear.weight", "output_linear.weight")),  # [E, ...] stacks
    "gpt_oss": lambda n: n.endswith(("experts.gate_up_proj", "experts.down_proj")),  # not their biases
}


@pytest.mark.parametrize("family", sorted(ROUTED))
def test_tensors_are_exactly_the_ones_no_expert_extent_covers(folders, family):
    folder = folders[family]
    manifest = build_manifest(folder, load_spec(str(folder)))
    names = set(open_checkpoint(folder).tensor_names)
    dense = {t.name for t in manifest.tensors}
    assert dense == {n for n in names if not ROUTED[family](n)} and dense != names
    data = (folder / "model.safetensors").read_bytes()
    for t in manifest.tensors:
        assert zlib.crc32(data[t.offset : t.offset + t.length]) == t.crc32, t.name
    # every tensor gets a check: its own, or its experts' (all E of a stacked one)
    checks = tensor_checks(folder, manifest, placements(open_checkpoint(folder)))
    assert set(checks) == names
    assert sum(c.length for cs in checks.values() for c in cs) == sum(p[2] for p in placements(open_checkpoint(folder)).values())


def test_the_json_keeps_the_tensors_and_an_older_manifest_reads_without_them(folders, tmp_path):
    folder = folders["mixtral"]
    manifest = build_manifest(folder, load_spec(str(folder)))
    write_manifest(tmp_path, manifest)
    assert read_manifest(tmp_path).tensors == manifest.tensors
    raw = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert raw["version"] == 1 and raw["tensors"][0] == [manifest.tensors[0].name, "model.safetensors",
                                                         manifest.tensors[0].offset, manifest.tensors[0].length,
                                                         manifest.tensors[0].crc32]
    del raw["tensors"]  # what moekit wrote before the key existed
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(raw))
    older = read_manifest(tmp_path)
    assert older.tensors is None and older.experts == manifest.experts
