from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_tiny import write_checkpoint


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a busy 2-core machine an OpenMP barrier that
    waits for a descheduled thread turns a microsecond GEMM into a scheduler time slice (ms)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """family -> folder, written once per session on first use."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = write_checkpoint(family, tmp_path_factory.mktemp(family))
        return made[family]

    return get
