"""Streaming text: pieces printed token by token add up to the full decode, never a broken character."""

from __future__ import annotations

from tokenizers import Tokenizer

from hf_tiny import train_tokenizer
from moekit.engine.detokenize import TextStream


def test_streamed_pieces_equal_the_whole_text(tmp_path):
    tok = Tokenizer.from_file(str(train_tokenizer(tmp_path / "tokenizer.json")))
    text = "naïve café ✓ 日本語 π ≈ 3.14 and unseen ключ"
    ids = tok.encode(text).ids
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p) > 5  # it really streamed, not one blob at the end
