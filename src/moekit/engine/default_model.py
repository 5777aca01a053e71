"""The bundled demo model, used when `moekit run` or `moekit bench` is given no checkpoint.

It ships in the repository at models/moekit-demo/ (trained here: docs/DEMO_MODEL.md), beside the
src/ tree this package is installed from (editable install or a clone).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from moekit.errors import CheckpointError

DEMO_NAME = "moekit-demo"


def bundled_model_path() -> Path:
    """models/moekit-demo at the root of the checkout this package lives in."""
    return Path(__file__).resolve().parents[3] / "models" / DEMO_NAME


def default_checkpoint() -> Path:
    path = bundled_model_path()
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"no checkpoint given and the bundled model is missing ({path}); name a checkpoint folder"
        )
    return path


def is_existing(text: str, kind: str) -> bool:
    """Whether TEXT names an existing folder (kind "dir") or file ("file"). Any string may come here
    (a pasted paragraph, a NUL, 100 kB): one the OS cannot take as a path names nothing, so it is False,
    never an error."""
    try:
        path = Path(text)
        return path.is_dir() if kind == "dir" else path.is_file()
    except (OSError, ValueError):  # ENAMETOOLONG, an embedded NUL
        return False


def split_checkpoint_and_prompt(
    first: Optional[str], second: Optional[str], ids_given: bool = False
) -> tuple[Path, Optional[str]]:
    """`run [CHECKPOINT] [PROMPT]`: two arguments are both; one is the checkpoint when it is an
    existing folder or when the prompt comes as ids, otherwise the prompt for the bundled model;
    none means the bundled model."""
    if second is not None:
        return Path(first), second
    if first is not None and (ids_given or is_existing(first, "dir")):
        return Path(first), None
    return default_checkpoint(), first
