"""Token streams per domain and the batches drawn from them.

Each domain's documents are tokenized, each followed by eos, and concatenated into one stream.
A batch is a pure function of (seed, step): which domain each row comes from and where its window
starts are drawn from a generator seeded with both, so a resumed run sees exactly the batches an
uninterrupted run would.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from moekit.errors import MoekitError
from moekit.train.tokenizer import EOS_ID


def tokenize_domains(tok, texts: dict[str, list[str]]) -> dict[str, Tensor]:
    """domain → int32 stream [N] of its documents, each followed by eos."""
    streams = {}
    for domain, docs in texts.items():
        ids: list[int] = []
        for enc in tok.encode_batch(docs):
            ids.extend(enc.ids)
            ids.append(EOS_ID)
        streams[domain] = torch.tensor(ids, dtype=torch.int32)
    return streams


def save_streams(streams: dict[str, Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_suffix(".tmp")
    save_file(streams, str(tmp))
    tmp.replace(path)


def load_streams(path: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def domain_weights(streams: dict[str, Tensor], mix: str) -> Tensor:
    """[n_domains] sampling probabilities: equal, by size, or by the square root of size."""
    sizes = torch.tensor([float(len(s)) for s in streams.values()])
    raw = {"uniform": torch.ones_like(sizes), "size": sizes, "sqrt": sizes.sqrt()}[mix]
    return raw / raw.sum()


def check_streams(streams: dict[str, Tensor], seq_len: int) -> None:
    for domain, s in streams.items():
        if len(s) < seq_len + 1:
            raise MoekitError(
                f"domain {domain!r} has {len(s)} training tokens, fewer than one window of seq_len+1 = {seq_len + 1}"
            )


def batch_at(streams: dict[str, Tensor], weights: Tensor, seed: int, step: int, batch: int, seq_len: int):
    """(inputs [B, S] int64, targets [B, S] int64, domain index per row [B]) for training step `step`."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    names = list(streams)
    rows = torch.multinomial(weights, batch, replacement=True, generator=gen)  # [B]
    windows = []
    for r in rows.tolist():
        stream = streams[names[r]]
        start = int(torch.randint(len(stream) - seq_len, (1,), generator=gen))
        windows.append(stream[start : start + seq_len + 1])
    window = torch.stack(windows).long()  # [B, S+1]
    return window[:, :-1], window[:, 1:], rows
