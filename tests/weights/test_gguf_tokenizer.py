"""The tokenizer rebuilt from a GGUF's tokenizer.ggml.* encodes and decodes exactly as the
checkpoint's own tokenizer.json, for each pre-tokenizer moekit rebuilds."""

from __future__ import annotations

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from gguf_convert import convert, tiny_checkpoint
from hf_tiny import CORPUS
from moekit.engine.loader import load_engine
from moekit.weights.gguf_file import read_gguf
from moekit.weights.gguf_tokenizer import QWEN2, gguf_tokenizer

TEXTS = [
    *CORPUS[:3],
    "",
    "</s> special <s> tokens inside<pad>text",
    "  leading  spaces\n\n\ttabs\r\n 12345 678901 x=3.14159",
    "don't WE'LL they're I'M",
    "混合专家模型 (MoE) — 日本語のテキスト, emoji 🤖✓",
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n",
]


def _split_tokenizer(pattern: str):
    """A byte-level BPE with a Hub-style Split pre-tokenizer (Qwen2's regex)."""

    def train(path):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=["<pad>", "<s>", "</s>"], show_progress=False)
        tok.train_from_iterator(CORPUS, trainer)
        tok.save(str(path))

    return train


@pytest.mark.parametrize("pre", ["default", "qwen2"])
def test_gguf_tokenizer_is_the_checkpoints(tmp_path, pre):
    train = None if pre == "default" else _split_tokenizer(QWEN2)
    folder = tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", tokenizer=train)
    gguf = convert(folder, "f32", tmp_path / "m.gguf", pre=pre)
    meta = read_gguf(gguf).metadata
    assert meta["tokenizer.ggml.pre"] == pre
    rebuilt, why_not = gguf_tokenizer(meta, str(gguf))
    assert why_not is None
    original = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in TEXTS:
        ids = original.encode(text).ids
        assert rebuilt.encode(text).ids == ids, text
        assert rebuilt.decode(ids) == original.decode(ids), text
        assert rebuilt.decode(ids, skip_special_tokens=False) == original.decode(ids, skip_special_tokens=False)


def test_ids_past_the_tokenizer_decode_as_in_the_checkpoint(tmp_path):
    """A model vocabulary larger than its tokenizer's: the converter pads with [PAD{i}] tokens of
    type UNUSED; the original decodes those ids to nothing, and so does the rebuilt one."""
    folder = tiny_checkpoint("qwen3_moe", tmp_path / "ckpt", vocab_size=320)
    gguf = convert(folder, "f32", tmp_path / "m.gguf")
    rebuilt, _ = gguf_tokenizer(read_gguf(gguf).metadata, str(gguf))
    original = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = [17, 305, 42, 319, 2, 300]
    assert rebuilt.decode(ids) == original.decode(ids)
    assert rebuilt.decode(ids, skip_special_tokens=False) == original.decode(ids, skip_special_tokens=False)


def test_engine_from_gguf_encodes_like_the_checkpoint(converted):
    folder, gguf = converted("qwen3_moe", "f32")
    from_gguf, from_folder = load_engine(gguf), load_engine(folder)
    text = "def fibonacci(n):"
    assert from_gguf.encode(text) == from_folder.encode(text)
    out = from_gguf.generate(text, max_new_tokens=8, stop_ids=())
    assert from_gguf.decode(out.token_ids[0]) == from_folder.decode(out.token_ids[0])
