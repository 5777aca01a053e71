"""The calculator's half of moekit must work where torch is not installed."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import sys
from moekit.calc.params import count_params
from moekit.spec import list_presets, load_spec
for name in list_presets():
    count_params(load_spec(name))
print(sorted(m for m in ("torch", "transformers", "safetensors") if m in sys.modules))
"""


def test_specs_and_counts_never_import_torch() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
