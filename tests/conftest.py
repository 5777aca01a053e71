"""Suite-wide settings: one torch thread, no Hypothesis deadline, and the pinned test dependencies
present (a missing transformers would otherwise turn every exactness test into a quiet skip)."""

from __future__ import annotations

import pytest
from hypothesis import settings

from pinned_dependencies import missing_test_dependencies

# A deadline is a timing assertion: on a busy 2-core machine an example that takes 300 ms is not a bug.
settings.register_profile("moekit", deadline=None)
settings.load_profile("moekit")


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
