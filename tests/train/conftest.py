"""A tiny corpus (two domains: real stdlib code, generated prose) and a finished tiny run, shared by the tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from moekit.corpus.build import BuildOptions, build
from moekit.corpus.sources import Source, python_stdlib
from train_fixtures import prose, tiny_config


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus")
    stdlib = lambda: (doc for doc, _ in zip(python_stdlib(), range(40)))
    sources = [
        Source("python", "stdlib code", (), stdlib, 200, 20_000),
        Source("prose", "generated prose", (), lambda: prose(200), 50, 2_000),
    ]
    build(out, sources, BuildOptions(seed=1, heldout_fraction=0.1))
    return out


@pytest.fixture(scope="session")
def tiny_run(tiny_corpus, tmp_path_factory):
    """A finished 6-step run: (run folder, config path, result of train())."""
    from moekit.train.session import train

    folder = tmp_path_factory.mktemp("tiny_run")
    config = tiny_config(folder, tiny_corpus)
    result = train(config, folder / "run", say=lambda s: None)
    return folder / "run", config, result
