"""Which of moekit's pinned test dependencies are missing: tests/conftest.py refuses to run without them."""

from __future__ import annotations

from importlib import metadata
from typing import Optional

from packaging.requirements import Requirement


def missing_test_dependencies(requirements: Optional[list[str]] = None) -> list[str]:
    """Each requirement of moekit's `test` extra (installed metadata unless given) that is not
    installed, or installed at a version its specifier refuses."""
    if requirements is None:
        requirements = metadata.requires("moekit") or []
    problems = []
    for line in requirements:
        req = Requirement(line)
        if req.marker is None or not req.marker.evaluate({"extra": "test"}) or req.marker.evaluate({"extra": ""}):
            continue  # a run-time or another extra's requirement
        try:
            installed = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{req.name} is not installed")
            continue
        if not req.specifier.contains(installed, prereleases=True):
            problems.append(f"{req.name} {installed} is installed, the tests need {req.name}{req.specifier}")
    return problems
