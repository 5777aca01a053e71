"""Byte-level BPE trained with the `tokenizers` library, saved as a standard tokenizer.json.

Special tokens come first (ids 0, 1, 2: pad, bos, eos); documents are joined with eos when training,
so the model learns where a document ends. The file loads in transformers' PreTrainedTokenizerFast
and in moekit's engine loader (tokenizers.Tokenizer.from_file).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|endoftext|>"
SPECIALS = (PAD, BOS, EOS)
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok, folder: Path) -> None:
    """tokenizer.json plus the small tokenizer_config.json transformers' AutoTokenizer reads."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))
