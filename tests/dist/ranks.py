"""Start real ranks for a test: the test process hosts the TCPStore on a port the OS picks, each
rank is `python tests/dist/rank_main.py` reading its orders on stdin. Every wait is bounded and
every child is killed if the test gives up on it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_ranks(world: int, runs: list[dict], out: Path, timeout_s: float = 20.0, fault: dict | None = None,
              wall_s: float = 240.0, checkpoint_of_rank: dict | None = None) -> list[tuple[int, str, dict]]:
    """Start `world` ranks that each do `runs` in one process group; → per rank (exit code, stderr,
    its results JSON or {})."""
    from moekit.dist.group import host_store

    store = host_store(world, timeout_s)
    procs = []
    try:
        for rank in range(world):
            orders = {"rank": rank, "world": world, "port": store.port, "timeout_s": timeout_s, "runs": runs,
                      "out": str(out / f"rank{rank}.json"), "fault": fault,
                      "checkpoint": (checkpoint_of_rank or {}).get(rank)}
            with open(out / f"rank{rank}.err", "w") as err:  # a file: a full pipe could stall the rank
                proc = subprocess.Popen([sys.executable, str(HERE / "rank_main.py")], stdin=subprocess.PIPE,
                                        stdout=subprocess.DEVNULL, stderr=err, text=True)
            proc.stdin.write(json.dumps(orders))
            proc.stdin.close()
            procs.append(proc)
        results = []
        for rank, proc in enumerate(procs):
            try:
                proc.wait(timeout=wall_s)
                err = (out / f"rank{rank}.err").read_text()
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                err = "(killed by the test: no exit within its wall time)"
            path = out / f"rank{rank}.json"
            results.append((proc.returncode, err, json.loads(path.read_text()) if path.is_file() else {}))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
