"""transformers is never imported by the engine or the calculator at run time: in a fresh interpreter
where importing transformers (or accelerate) fails, moekit still loads, generates, pages experts and
counts, and gives the tokens it gives here."""

from __future__ import annotations

import json
import subprocess
import sys

from moekit.engine.loader import load_engine

_CHILD = r"""
import json, sys

class NoReferenceLibraries:
    '''An import of transformers or accelerate fails, as it would where they are not installed.'''
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("transformers", "accelerate"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None

sys.meta_path.insert(0, NoReferenceLibraries())
import moekit
from moekit.calc.params import count_params
from moekit.spec import load_spec

folder, prompt = sys.argv[1], [int(t) for t in sys.argv[2].split(",")]
resident = moekit.load(folder, compile=False)
paged = moekit.load(folder, expert_memory="25%", policy="lfu", prefetch=True, compile=False)
out = {
    "resident": resident.generate(prompt, max_new_tokens=12, stop_ids=()).token_ids[0],
    "paged": paged.generate(prompt, max_new_tokens=12, stop_ids=()).token_ids[0],
    "total_params": count_params(load_spec("mixtral-8x7b")).total_params,
}
paged.close()
from moekit import cli
sys.argv = ["moekit", "run", "--eager", folder, "--prompt-ids", sys.argv[2], "--max-new-tokens", "4", "--json"]
try:
    cli.main()
except SystemExit as exit_:
    assert not exit_.code, exit_.code
out["imported"] = sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "accelerate"))
print(json.dumps(out))
"""


def test_generation_paging_and_counting_need_no_transformers(tiny_checkpoints):
    folder = tiny_checkpoints("qwen3_moe")
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(folder), "1,17,42"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    want = load_engine(folder, compile=False).generate([1, 17, 42], max_new_tokens=12, stop_ids=()).token_ids[0]
    assert got["resident"] == got["paged"] == want
    assert got["total_params"] == 46_702_792_704  # Mixtral 8x7B, as transformers counts it
    assert got["imported"] == []
