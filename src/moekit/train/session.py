"""One `moekit train` invocation: claim the run folder, prepare tokenizer and tokens, build, train, save."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from moekit.train.config import TrainConfig, load_config
from moekit.train.state import RunFolder, load_checkpoint, prepare_folder, save_checkpoint, truncate_metrics


def prepare_tokens(cfg: TrainConfig, run: RunFolder, say: Callable[[str], None]) -> dict:
    """The tokenizer (trained on the train split once) and the tokenized train split, cached in the run."""
    from moekit.corpus.reader import domains, read_split
    from moekit.train.data import check_streams, load_streams, save_streams, tokenize_domains
    from moekit.train.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

    tok_folder = run.file("tokenizer")
    tokens_path = run.file("tokens.safetensors")
    if (tok_folder / "tokenizer.json").is_file() and tokens_path.is_file():
        streams = load_streams(tokens_path)
    else:
        corpus = Path(cfg.train.corpus)
        # Every domain, strictly: a model trained without one of its corpus's domains is not the model asked for
        # (eval and report skip an empty domain and name it; training refuses it).
        texts = read_split(corpus, "train", only=domains(corpus))
        say(f"training a byte-level BPE tokenizer (vocab {cfg.model['vocab_size']}) on {sum(map(len, texts.values()))} documents")
        tok = train_tokenizer((t for docs in texts.values() for t in docs), cfg.model["vocab_size"])
        save_tokenizer(tok, tok_folder)
        tok = load_tokenizer(tok_folder / "tokenizer.json")
        streams = tokenize_domains(tok, texts)
        save_streams(streams, tokens_path)
    check_streams(streams, cfg.train.seq_len)
    # safetensors hands names back sorted: sort the fresh ones too, so a resumed run draws the same rows
    return dict(sorted(streams.items()))


def train(
    config_path: Path,
    out: Path,
    resume: bool = False,
    force: bool = False,
    device: str | None = None,
    threads: int | None = None,
    say: Callable[[str], None] = print,
    on_step: Callable[[int, dict | None], None] = lambda step, line: None,
    stop_after: int | None = None,
) -> dict:
    """Train (or continue) the run in `out`; returns {'steps', 'model'}. `stop_after` ends early (tests)."""
    from moekit.engine.loader import resolve_device
    from moekit.train.hub_save import export
    from moekit.train.init import build_decoder, parameter_groups
    from moekit.train.loop import run_training

    cfg = load_config(config_path)
    overrides = {k: v for k, v in (("device", device), ("threads", threads)) if v is not None}
    cfg = replace(cfg, train=replace(cfg.train, **overrides))
    dev = resolve_device(cfg.train.device)
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    run = RunFolder(Path(out))
    resuming = prepare_folder(run, cfg.identity(), Path(config_path).read_text(), resume, force)
    streams = prepare_tokens(cfg, run, say)

    decoder = build_decoder(cfg.model, cfg.train.seed, str(dev))
    t = cfg.train
    # foreach=False: the same per-parameter update order every run, on every torch build
    optimizer = torch.optim.AdamW(parameter_groups(decoder, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                                  foreach=False)
    first = 0
    if resuming:
        first = load_checkpoint(run, decoder, optimizer)
        truncate_metrics(run, first)
        say(f"resuming {out} after step {first}")

    def save(step: int) -> None:
        save_checkpoint(run, decoder, optimizer, step)
        export(decoder, cfg.model, run.file("model"), t.save_dtype, run.file("tokenizer"))

    done = run_training(cfg, run, decoder, optimizer, streams, first, on_step, save, stop_after)
    return {"steps": done, "model": str(run.file("model")), "decoder": decoder}
