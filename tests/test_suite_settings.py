"""The suite's own settings (tests/conftest.py): a missing or wrongly pinned test dependency stops
the suite instead of skipping what needs it, and no Hypothesis test carries a timing deadline."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

from hypothesis import settings

from pinned_dependencies import missing_test_dependencies


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
        [sys.executable, "-m", "pytest", __file__, "-q", "-k", "this_environment", "-p", "no:cacheprovider"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert done.returncode == 4, done.stdout  # pytest's usage error: nothing ran
    assert "transformers 0.0.1 is installed, the tests need transformers==5.24.0" in done.stderr


def test_hypothesis_runs_without_a_deadline():
    assert settings().deadline is None  # the profile every @given in the suite inherits
