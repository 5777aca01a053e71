"""`moekit run ... --expert-parallel N|auto [--placement FILE]`: the run command's sharded path.

commands/run.py parses and checks the request as always, then hands it here with its own report
function, which rank 0 calls; the other ranks generate quietly. The exchange's figures (experts
held, bytes sent per decoded token, peak RSS per rank) follow on stderr.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer

from moekit.errors import MoekitError

AUTO = "auto"


def bare_flag(argv: list[str]) -> Optional[str]:
    """The line for `--expert-parallel` given no value (click would only say it "requires an
    argument"; under torchrun the value a user means is `auto`), or None."""
    for i, arg in enumerate(argv):
        if arg == "--expert-parallel" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            return ("--expert-parallel needs a value: a rank count (--expert-parallel 2, ranks started here) or auto "
                    "(torchrun's ranks: torchrun --nproc-per-node N -m moekit ... --expert-parallel auto)")
    return None


def parse_ranks(text: str) -> Optional[int]:
    """'4' → 4; 'auto' → None (torchrun's world size)."""
    if text.strip().lower() == AUTO:
        return None
    try:
        ranks = int(text)
    except ValueError:
        raise MoekitError(f"--expert-parallel takes a rank count or auto (torchrun's ranks), got {text!r}") from None
    if ranks < 1:
        raise MoekitError(f"--expert-parallel needs at least 1 rank, got {ranks}")
    return ranks


def offload_fields(offload) -> Optional[dict]:
    """OffloadOptions as a Job carries them (JSON: paths as text)."""
    if offload is None:
        return None
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(offload).items()}


def run_sharded(expert_parallel: Optional[str], placement: Optional[Path], timeout_s: float, checkpoint, prompt,
                prompt_ids, dtype: str, device: str, offload, max_new_tokens: int, sampling, stop_ids, report) -> None:
    from moekit.dist.session import Job, run_expert_parallel, summary

    if expert_parallel is None:
        raise MoekitError("--placement needs --expert-parallel N (or auto under torchrun)")
    if timeout_s <= 0:
        raise MoekitError(f"--ep-timeout must be positive, got {timeout_s:g}")
    ranks = parse_ranks(expert_parallel)
    job = Job(
        checkpoint=str(checkpoint),
        dtype=dtype,
        device=device,
        prompt=prompt,
        prompt_ids=None if prompt_ids is None else list(prompt_ids),
        max_new_tokens=max_new_tokens,
        sampling=asdict(sampling),
        stop_ids=None if stop_ids is None else list(stop_ids),
        offload=offload_fields(offload),
        placement=None if placement is None else str(placement),
        timeout_s=timeout_s,
    )
    result = run_expert_parallel(job, ranks, report)
    if result:
        typer.echo(summary(result), err=True)
