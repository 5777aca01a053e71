"""Suite-wide settings: one torch thread, no Hypothesis deadline, and the pinned test dependencies
present (a missing transformers would otherwise turn every exactness test into a quiet skip); and
the fixtures more than one folder shares.

The helper modules (hf_tiny, cli_runner, gguf_convert, ...) are imported by their names from any
folder: pyproject.toml's pytest `pythonpath` lists the folders that hold them."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

from once_per_run import made_once, run_lock
from pinned_dependencies import missing_test_dependencies

# pytester: tests/test_suite_settings.py runs this conftest on example modules.
pytest_plugins = ["pytester"]

# A deadline is a timing assertion: on a busy 2-core machine an example that takes 300 ms is not a bug.
settings.register_profile("moekit", deadline=None)
settings.load_profile("moekit")


# Fixtures that start servers: a test that uses one counts as marked `processes`.
PROCESS_FIXTURES = frozenset({"serve_process"})


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true", dest="run_slow",
                     help="also run the tests marked slow (end-to-end sweeps a faster test already covers)")


def pytest_collection_modifyitems(config, items):
    """Tests marked slow leave the run unless --all, or an -m expression that names them, asks; the
    modules that start processes come first (process_modules_first)."""
    if not (config.getoption("run_slow") or "slow" in config.getoption("markexpr")):
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker("slow")]
    items[:] = process_modules_first(items)


def process_modules_first(items: list) -> list:
    """The modules that hold a test starting processes, ahead of the rest; each part in collection
    order, a module's tests together (its module-scoped servers start once). Under `--dist worksteal`
    (pyproject's addopts) the first worker's share begins with them, so the lock-serialised tests
    run one after another on it while the other worker runs in-process tests, instead of the two
    workers meeting at the lock (xdist's `load` deals tests out in turns: one worker waits idle)."""
    serial = {item.path for item in items if starts_processes(item)}
    return sorted(items, key=lambda item: item.path not in serial)  # stable


def starts_processes(item) -> bool:
    return item.get_closest_marker("processes") is not None or bool(PROCESS_FIXTURES & set(item.fixturenames))


@pytest.fixture(autouse=True)
def one_process_test_at_a_time(request, tmp_path_factory):
    """Under xdist, a test that starts servers or rank processes holds a lock that its run's other
    workers share, so that such tests never overlap: two of them on a 2-core machine (ranks, a
    server and its client) would oversubscribe it and stretch their own timeouts. Their workers'
    in-process tests keep running meanwhile. (xdist's `xdist_group` + `--dist loadgroup` would do
    this by scheduling, but with pytest 9.2 it silently groups nothing: pytest-xdist issue 1386.)"""
    if not hasattr(request.config, "workerinput") or not starts_processes(request.node):
        yield
        return
    with run_lock(request.config, tmp_path_factory, "processes"):
        yield


def pytest_configure(config):
    problems = missing_test_dependencies()
    if problems:
        raise pytest.UsageError(
            f"the pinned test dependencies are not all there: {'; '.join(problems)} "
            "(install them with: pip install -e '.[test]')"
        )


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a busy 2-core machine an OpenMP barrier that
    waits for a descheduled thread turns a microsecond GEMM into a scheduler time slice (ms).
    torch is imported here, not at the top, so the calculator's tests stay torch-free."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_checkpoints(request, tmp_path_factory):
    """family -> folder of hf_tiny's checkpoint (transformers' save_pretrained), written once per
    run on first use (`made_once`: one worker writes, the others read). Imported here, not at the
    top: torch-free tests."""
    from hf_tiny import write_checkpoint

    def get(family: str) -> Path:
        return made_once(request.config, tmp_path_factory, f"tiny-{family}", lambda folder: write_checkpoint(family, folder))

    return get
