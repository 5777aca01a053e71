"""Suite-wide settings."""

from __future__ import annotations

import pytest


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
