"""One home for measurement: the product's packages never import moekit.bench; the CLI does."""

from __future__ import annotations

import ast
from pathlib import Path

import moekit

SRC = Path(moekit.__file__).resolve().parent
CLI = {"commands", "bench"}  # the bench commands and the harnesses themselves


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_product_module_imports_the_benchmarks():
    offenders = [
        str(path.relative_to(SRC))
        for path in SRC.rglob("*.py")
        if path.relative_to(SRC).parts[0] not in CLI
        and any(name == "moekit.bench" or name.startswith("moekit.bench.") for name in _imports(path))
    ]
    assert offenders == []

