"""Building the operators: the cache key follows what a build depends on, and a build that fails says
so in one line naming the compiler's log, while the plain reference keeps working."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch

from moekit.ops import build as builds
from moekit.ops.runtime import load

REFUSED = ("-mno-such-isa-flag",)  # a flag every compiler refuses: the build fails as a missing ISA would


def test_the_cache_key_names_torch_the_cpu_and_the_sources():
    key = builds.build_key(builds.NATIVE)
    assert key.startswith(f"torch{torch.__version__.replace('+', '_')}-{torch.backends.cpu.get_cpu_capability().lower()}-")
    assert key != builds.build_key(builds.SCALAR)  # other flags: another folder
    assert builds.sources_digest() == builds.sources_digest()  # a hash of the files, nothing else
    assert {p.name for p in builds.CSRC.iterdir()} >= {*builds.SOURCES, "vec.h", "rows.h", "ops.h", ".clang-format"}


def test_isa_variants_differ_by_compiler_defines_only():
    for v in (builds.NATIVE, builds.NARROW, builds.SCALAR):
        assert f"-DMOEKIT_NAMESPACE={v.namespace}" in v.flags() and f"-DMOEKIT_SUFFIX={v.suffix}" in v.flags()


def test_a_build_that_fails_is_one_line_naming_its_log(tmp_path):
    result = builds.build(builds.NATIVE, tmp_path, REFUSED)
    assert not result.ok and result.log is not None and result.log.exists()
    text = result.log.read_text()
    assert "mno-such-isa-flag" in text and len(text.splitlines()) > 3  # the compiler's whole output, kept
    line = result.line()
    assert "\n" not in line and str(result.log) in line and "reference" in line
    loaded = load(tmp_path, REFUSED)
    assert not loaded.ok and len(loaded.failures()) == 1  # the AVX2 build is not tried after the native one failed


def test_after_a_failed_build_a_process_runs_the_reference(tmp_path):
    """In a fresh process (nothing registered before): the failed load is one line, no operator is
    registered, and the eager helpers give torch's results."""
    script = textwrap.dedent(f"""
        from pathlib import Path
        import torch
        from moekit import ops
        loaded = ops.load(Path({str(tmp_path)!r}), {REFUSED!r})
        print("\\n".join(loaded.failures()))
        assert not ops.available() and ops.namespaces() == () and ops.chosen() == {{}}
        x = torch.randn(3, 50)
        assert torch.equal(ops.rows_argmax(x), x.argmax(-1))
        print("reference ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "reference ok" and len(lines) == 2 and "could not be built" in lines[0] and "build.log" in lines[0]


def test_a_killed_builds_leftover_lock_does_not_stall_the_next_build(tmp_path):
    """torch's build lock is a file that a killed build leaves behind; the next build of that key
    clears it (moekit holds its own lock, which dies with its holder) instead of waiting for ever."""
    key = builds.build_key(builds.NATIVE) + "-" + builds._flags_hash(REFUSED)
    folder = tmp_path / key / builds.NATIVE.namespace
    folder.mkdir(parents=True)
    (folder / "lock").write_text("")  # what a build killed mid-way leaves
    script = textwrap.dedent(f"""
        from pathlib import Path
        from moekit.ops import build as builds
        print(builds.build(builds.NATIVE, Path({str(tmp_path)!r}), {REFUSED!r}).line())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "could not be built" in done.stdout and not (folder / "lock").exists()
