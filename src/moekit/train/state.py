"""The run folder and its checkpoints: everything needed to continue a run exactly, written atomically.

  run.json              which run this folder holds (the config's identity) — refuse another run
  config.toml           the config as given
  tokenizer/            tokenizer.json, tokenizer_config.json (trained once)
  tokens.safetensors    the tokenized train split (made once)
  state.safetensors     parameters + AdamW moments, our names (fp32)
  state.json            step, and the AdamW step counts
  metrics.jsonl         one line per logged step
  model/                the latest Hub-format export

A checkpoint is written to temporary files and renamed: a crash leaves the previous one whole.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from moekit.errors import MoekitError

RUN_FILE = "run.json"
OWNED = ("run.json", "config.toml", "tokenizer", "tokens.safetensors", "state.safetensors", "state.json",
         "metrics.jsonl", "model")


class RunFolderError(MoekitError):
    """A run folder that holds another run, or nothing to resume."""


@dataclass(frozen=True)
class RunFolder:
    path: Path

    def file(self, name: str) -> Path:
        return self.path / name

    @property
    def has_run(self) -> bool:
        return self.file(RUN_FILE).is_file()

    @property
    def has_checkpoint(self) -> bool:
        return self.file("state.json").is_file() and self.file("state.safetensors").is_file()

    def identity(self) -> str | None:
        if not self.has_run:
            return None
        try:
            return json.loads(self.file(RUN_FILE).read_text()).get("identity")
        except json.JSONDecodeError:
            raise RunFolderError(f"{self.file(RUN_FILE)}: not valid JSON") from None


def prepare_folder(run: RunFolder, identity: str, config_text: str, resume: bool, force: bool) -> bool:
    """Claim the folder for this run; returns True when a checkpoint should be resumed."""
    if resume and force:
        raise RunFolderError("--resume and --force contradict each other: pick one")
    held = run.identity()
    if run.path.exists() and not run.path.is_dir():
        raise RunFolderError(f"{run.path}: exists and is not a folder")
    if resume:
        if held is None or not run.has_checkpoint:
            raise RunFolderError(f"{run.path}: no checkpoint to resume (start the run without --resume)")
        if held != identity:
            raise RunFolderError(f"{run.path}: holds a different run (config differs); use another --out or --force")
        return True
    if held is not None or (run.path.is_dir() and any(run.path.iterdir())):
        if not force:
            what = "a run" if held is not None else "files"
            raise RunFolderError(f"{run.path}: already holds {what}; pass --resume to continue or --force to replace it")
        for name in OWNED:
            target = run.file(name)
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    run.path.mkdir(parents=True, exist_ok=True)
    atomic_text(run.file("config.toml"), config_text)
    atomic_text(run.file(RUN_FILE), json.dumps({"identity": identity}, indent=2) + "\n")
    return False


def atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(run: RunFolder, decoder, optimizer, step: int) -> None:
    from safetensors.torch import save_file

    names = {id(p): n for n, p in decoder.named_parameters()}
    tensors = {f"param/{n}": p.detach().cpu().contiguous() for n, p in decoder.named_parameters()}
    adam_steps = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p)
            if not st:
                continue
            n = names[id(p)]
            tensors[f"exp_avg/{n}"] = st["exp_avg"].detach().cpu().contiguous()
            tensors[f"exp_avg_sq/{n}"] = st["exp_avg_sq"].detach().cpu().contiguous()
            adam_steps[n] = float(st["step"])
    tmp = run.file("state.safetensors.tmp")
    save_file(tensors, str(tmp))
    # The tensors first, then the step that names them: state.json never points at a half-written file.
    os.replace(tmp, run.file("state.safetensors"))
    atomic_text(run.file("state.json"), json.dumps({"step": step, "adam_steps": adam_steps}) + "\n")


def load_checkpoint(run: RunFolder, decoder, optimizer) -> int:
    """Restore parameters and AdamW state; returns the step the checkpoint was taken after."""
    from safetensors.torch import load_file

    meta = json.loads(run.file("state.json").read_text())
    tensors = load_file(str(run.file("state.safetensors")))
    params = dict(decoder.named_parameters())
    with torch.no_grad():
        for n, p in params.items():
            key = f"param/{n}"
            if key not in tensors:
                raise RunFolderError(f"{run.file('state.safetensors')}: no {key}; the checkpoint does not match the config")
            p.copy_(tensors[key])
    for n, p in params.items():
        if n in meta["adam_steps"]:
            optimizer.state[p] = {
                "step": torch.tensor(meta["adam_steps"][n]),
                "exp_avg": tensors[f"exp_avg/{n}"].to(p.device),
                "exp_avg_sq": tensors[f"exp_avg_sq/{n}"].to(p.device),
            }
    return int(meta["step"])


def truncate_metrics(run: RunFolder, step: int) -> None:
    """Drop logged lines past `step`: a resumed run logs them again."""
    path = run.file("metrics.jsonl")
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
    atomic_text(path, "".join(line + "\n" for line in kept))
