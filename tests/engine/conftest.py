from __future__ import annotations

from pathlib import Path

import pytest

from hf_tiny import write_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """family -> folder, written once per session on first use."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = write_checkpoint(family, tmp_path_factory.mktemp(family))
        return made[family]

    return get
