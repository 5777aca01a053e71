"""The import graph between moekit's packages, read from the sources (every import, function-local
ones included), and its cycles: none, or the script exits 1 and names them.

    .venv/bin/python benchmarks/import_graph.py            # edges, one package a line, then "cycles: none"
    .venv/bin/python benchmarks/import_graph.py --mermaid  # the same as a Mermaid graph (docs/ARCHITECTURE.md)

A package is a folder under src/moekit/; each module at the top (cli, errors, __main__) is a node of
its own, and "moekit" is the package's __init__.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "moekit"


def package_of(module: str) -> str:
    """moekit.ops.build → ops; a module at the top is its own node (moekit.errors → errors); moekit
    itself (its __init__) → moekit."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "moekit"


def imports_of(path: Path) -> set[str]:
    """The moekit modules a source file imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("moekit"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("moekit"):
            folder = SRC.joinpath(*node.module.split(".")[1:])
            for a in node.names:  # `from moekit import ops`: the module ops, not moekit's __init__
                sub = folder / a.name
                found.add(f"{node.module}.{a.name}" if sub.is_dir() or sub.with_suffix(".py").exists() else node.module)
    return found


def package_graph() -> dict[str, set[str]]:
    """package → the other packages its files import."""
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        here = rel.parts[0] if len(rel.parts) > 1 else ("moekit" if rel.stem == "__init__" else rel.stem)
        graph.setdefault(here, set())
        for module in imports_of(path):
            there = package_of(module)
            if there != here:
                graph[here].add(there)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mermaid", action="store_true", help="print a Mermaid graph")
    args = parser.parse_args()
    graph = package_graph()
    if args.mermaid:
        print("graph TD")
        for here in sorted(graph):
            for there in sorted(graph[here] - {"moekit"}):
                print(f"  {here} --> {there}")
    else:
        for here in sorted(graph):
            print(f"{here:10} → {', '.join(sorted(graph[here])) or '(nothing)'}")
    found = cycles(graph)
    print("cycles: " + ("; ".join(" ↔ ".join(c) for c in found) if found else "none"), file=sys.stderr if args.mermaid else sys.stdout)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
