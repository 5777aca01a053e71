"""tests/bench measures what tests/engine builds: its tiny checkpoints (hf_tiny, transformers' own
save_pretrained) and its `tiny_checkpoints` fixture; the CLI runs through tests/cli_runner."""

import importlib.util
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS / "engine"))
sys.path.insert(0, str(TESTS))

_spec = importlib.util.spec_from_file_location("engine_conftest", TESTS / "engine" / "conftest.py")
_engine_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_engine_conftest)
tiny_checkpoints = _engine_conftest.tiny_checkpoints
