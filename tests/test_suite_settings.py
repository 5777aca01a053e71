"""The suite's own settings (tests/conftest.py): a missing or wrongly pinned test dependency stops
the suite instead of skipping what needs it, no Hypothesis test carries a timing deadline, tests
marked slow run only when asked for, tests that start processes never overlap under xdist and
their modules come first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from hypothesis import settings

from pinned_dependencies import missing_test_dependencies

# The pytest runs below check this suite's conftest, not the plugins installed beside it:
# schemathesis's pytest plugin (unused: tests/serve/test_openapi.py runs its `st` command) costs
# each start ~1 s of imports.
QUIET = ("-p", "no:cacheprovider", "-p", "no:schemathesis")


def test_this_environment_has_every_pinned_test_dependency():
    assert missing_test_dependencies() == []


def test_a_missing_package_and_a_wrong_pin_are_named_and_other_extras_ignored():
    installed = metadata.version("pytest")
    problems = missing_test_dependencies([
        'surely-not-installed-moekit-dep==1.0; extra == "test"',
        f'pytest!={installed}; extra == "test"',
        'hypothesis>=6; extra == "test"',
        'not-installed-docs-only>=1; extra == "docs"',
        "not-installed-runtime-dep>=1",
    ])
    assert problems == [
        "surely-not-installed-moekit-dep is not installed",
        f"pytest {installed} is installed, the tests need pytest!={installed}",
    ]


def test_the_suite_refuses_to_start_under_another_transformers(tmp_path):
    """A transformers 0.0.1 distribution ahead on the path (as a stray install would be): pytest
    stops before running anything and names the package and its pin."""
    dist = tmp_path / "transformers-0.0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 0.0.1\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-k", "this_environment", *QUIET],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 4, done.stdout  # pytest's usage error: nothing ran
    assert "transformers 0.0.1 is installed, the tests need transformers==5.24.0" in done.stderr


def test_hypothesis_runs_without_a_deadline():
    assert settings().deadline is None  # the profile every @given in the suite inherits


TESTS = Path(__file__).resolve().parent

# A module of the shapes the suite's tests take: a sweep marked slow, one test marked processes,
# one that starts servers through the serve_process fixture, and two plain ones. Each non-slow test
# writes when it ran (wall clock: the workers are processes) into the folder OUT names, after
# holding its worker for HOLD seconds (0 unless a test asks: only overlaps need the time).
EXAMPLE = """
import json, os, time
import pytest

@pytest.fixture
def serve_process():
    return None

def spell(name):
    start = time.time()
    time.sleep(float(os.environ.get("HOLD", "0")))
    with open(os.path.join(os.environ["OUT"], name), "w") as f:
        json.dump([start, time.time()], f)

@pytest.mark.slow
def test_sweep():
    pass

def test_plain():
    spell("plain")

def test_plain_too():
    spell("plain_too")

@pytest.mark.processes
def test_ranks():
    spell("ranks")

def test_server(serve_process):
    spell("server")
"""


@pytest.fixture
def suite_like(pytester, monkeypatch, tmp_path):
    """A pytester folder with this suite's conftest.py and EXAMPLE (tests/ on the path for its imports)."""
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    slow: slow\n    processes: processes\n")
    pytester.makepyfile(test_example=EXAMPLE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OUT", str(tmp_path))
    return pytester


def test_slow_tests_run_only_with_all_or_a_mark_expression_that_names_them(suite_like):
    default = suite_like.runpytest_subprocess(*QUIET, "-p", "no:xdist")
    default.assert_outcomes(passed=4, deselected=1)
    everything = suite_like.runpytest_subprocess(*QUIET, "-p", "no:xdist", "--all")
    everything.assert_outcomes(passed=5)
    only_slow = suite_like.runpytest_subprocess(*QUIET, "-p", "no:xdist", "-m", "slow")
    only_slow.assert_outcomes(passed=1, deselected=4)
    other_marks = suite_like.runpytest_subprocess(*QUIET, "-p", "no:xdist", "-m", "not processes")
    other_marks.assert_outcomes(passed=3, deselected=2)  # still without the slow one


def test_tests_that_start_processes_never_overlap_on_two_workers(suite_like, monkeypatch, tmp_path):
    """The two 1-second tests that start processes (one by its mark, one by its fixture), alone on
    two workers, so that each worker takes one: they run one after the other all the same."""
    monkeypatch.setenv("HOLD", "1.0")  # long enough that two unlocked tests would overlap
    result = suite_like.runpytest_subprocess(*QUIET, "-n", "2", "-k", "ranks or server", "-v")
    result.assert_outcomes(passed=2)
    assert len({line.split()[0] for line in result.stdout.lines if " PASSED " in line}) == 2  # [gw0], [gw1]
    first, second = sorted(json.loads((tmp_path / name).read_text()) for name in ("ranks", "server"))
    assert first[1] <= second[0], (first, second)


def test_modules_that_start_processes_are_run_first_each_in_one_piece(suite_like):
    """A module with a test that starts processes goes ahead of a plain module collected before it,
    all its tests together (the plain ones too: its module-scoped servers start once); each part
    keeps its collection order."""
    suite_like.makepyfile(test_aaa_plain="def test_first():\n    pass\n\ndef test_second():\n    pass\n")
    result = suite_like.runpytest_subprocess(*QUIET, "-p", "no:xdist", "--collect-only", "-q")
    ids = [line for line in result.stdout.lines if "::" in line]
    assert ids == ["test_example.py::test_plain", "test_example.py::test_plain_too", "test_example.py::test_ranks",
                   "test_example.py::test_server", "test_aaa_plain.py::test_first", "test_aaa_plain.py::test_second"]


SHARED = """
import os
import pytest
from once_per_run import made_once

@pytest.fixture(scope="session")
def thing(request, tmp_path_factory):
    def make(folder):
        with open(os.path.join(os.environ["OUT"], "made"), "a") as f:
            f.write(os.environ.get("PYTEST_XDIST_WORKER", "-") + "\\n")
        (folder / "weights").write_text("w")
        return folder / "weights"
    return made_once(request.config, tmp_path_factory, "thing", make)

def test_one(thing):
    assert thing.read_text() == "w"

def test_two(thing):
    assert thing.read_text() == "w"
"""


def test_a_fixture_made_once_is_made_by_one_worker_for_both(pytester, monkeypatch, tmp_path):
    pytester.makepyfile(test_shared=SHARED)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OUT", str(tmp_path))
    result = pytester.runpytest_subprocess(*QUIET, "-n", "2", "-v")
    result.assert_outcomes(passed=2)
    assert len({line.split()[0] for line in result.stdout.lines if " PASSED " in line}) == 2  # [gw0], [gw1]
    assert len((tmp_path / "made").read_text().split()) == 1
