"""tests/offload builds its checkpoints with tests/engine's hf_tiny (transformers' own save_pretrained)
and runs the CLI with tests/cli_runner."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "engine"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
