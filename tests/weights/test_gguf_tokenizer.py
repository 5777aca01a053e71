"""The tokenizer rebuilt from a GGUF's tokenizer.ggml.* encodes and decodes exactly as the
checkpoint's own tokenizer.json, for each pre-tokenizer moekit rebuilds (byte-level BPE); and a
SentencePiece GGUF's (tokenizer.ggml.model "llama", as Mixtral and Llama 2 ship) as llama.cpp does.

The SentencePiece GGUF is llama.cpp's converter's, from a tiny Mixtral whose tokenizer.model is a
real SentencePiece BPE trained with Llama's trainer settings (byte fallback, digits split, identity
normalisation, whitespace kept) and whose tokenizer_config.json marks <unk>, <s>, </s> special, as
Mixtral's does, and one token user-defined (spm_vocabulary.py). Three oracles on the same texts:
llama.cpp itself (its answers committed in golden/mixtral-spm/llama_cpp.json, and asked again where
a python with llama-cpp-python is found), llama.cpp's algorithm ported here, and the sentencepiece
library on the tokenizer.model the GGUF was made from.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sentencepiece as spm  # a test dependency: llama.cpp's converter reads tokenizer.model with it
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from gguf_convert import convert, tiny_checkpoint
from hf_tiny import CORPUS
from moekit.engine.loader import load_engine
from moekit.errors import CheckpointError
from moekit.weights.gguf_file import read_gguf
from moekit.weights.gguf_tokenizer import QWEN2, gguf_tokenizer, score_merges
from spm_vocabulary import (
    SPM_TEXTS, SPM_VOCAB, TOKENIZER_MODEL, USER_DEFINED, ask_llama_cpp, golden_answers, llama_cpp_python,
    mixtral_with_sentencepiece, sha256,
)

REPO = Path(__file__).resolve().parents[2]

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
    from_gguf, from_folder = load_engine(gguf, compile=False), load_engine(folder, compile=False)
    text = "def fibonacci(n):"
    assert from_gguf.encode(text) == from_folder.encode(text)
    out = from_gguf.generate(text, max_new_tokens=8, stop_ids=())
    assert from_gguf.decode(out.token_ids[0]) == from_folder.decode(out.token_ids[0])


# ---- SentencePiece ("llama") vocabularies, against llama.cpp ----


# Without an added token's text: llama.cpp puts a space prefix after each added token, which
# neither sentencepiece does nor a round trip gives back.
SPM_PLAIN = [t for t in SPM_TEXTS if "<s>" not in t and USER_DEFINED not in t]


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint folder with tokenizer.model, the f32 GGUF llama.cpp's converter made of it)."""
    root = tmp_path_factory.mktemp("spm")
    folder = mixtral_with_sentencepiece(root / "ckpt")
    return folder, convert(folder, "f32", root / "mixtral-spm.gguf")


@pytest.fixture(scope="module")
def spm_meta(spm_gguf) -> dict:
    return read_gguf(spm_gguf[1]).metadata


@pytest.fixture(scope="module")
def rebuilt(spm_gguf, spm_meta):
    tok, why_not = gguf_tokenizer(spm_meta, str(spm_gguf[1]))
    assert why_not is None
    return tok


def llama_cpp_spm(meta: dict, text: str) -> list[int]:
    """llama.cpp's SPM tokenize (llama-vocab.cpp, parse_special, add_bos), ported line for line and
    slow: split out added tokens, longest first; a space before each stretch of text after one (or
    at the start); then merge the best-scoring adjacent pair, leftmost on a tie, until none is."""
    tokens, types, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"], meta["tokenizer.ggml.scores"]
    ids = {t: i for i, t in enumerate(tokens)}
    pieces: list = [text] if text else []
    for special in sorted((i for i, kind in enumerate(types) if kind in (2, 3, 4)), key=lambda i: -len(tokens[i])):
        split = []
        for piece in pieces:
            if isinstance(piece, int):
                split.append(piece)
                continue
            for j, part in enumerate(piece.split(tokens[special])):
                split += ([special] if j else []) + ([part] if part else [])
        pieces = split
    out, after_special = [meta["tokenizer.ggml.bos_token_id"]], True
    for piece in pieces:
        if isinstance(piece, int):
            out.append(piece)
        else:
            out += _spm_merge(((" " if after_special else "") + piece).replace(" ", "▁"), ids, scores)
        after_special = isinstance(piece, int)
    return out


def _spm_merge(text: str, ids: dict, scores: list) -> list[int]:
    symbols = list(text)
    while True:
        pairs = [(scores[ids[a + b]], -i) for i, (a, b) in enumerate(zip(symbols, symbols[1:])) if a + b in ids]
        if not pairs:
            break
        i = -max(pairs)[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    return [t for s in symbols for t in ([ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()])]


@pytest.fixture(scope="module")
def llama_cpp_says() -> list[dict]:
    """llama.cpp's answers for SPM_TEXTS, from the committed golden file."""
    return golden_answers()["answers"]


def test_the_golden_file_answers_these_texts_in_this_vocabulary():
    golden = golden_answers()
    assert golden["texts"] == SPM_TEXTS
    assert golden["tokenizer_model_sha256"] == sha256(TOKENIZER_MODEL), (
        "tokenizer.model changed since llama_cpp.json was made: run benchmarks/gguf_tokenizer_golden.py")
    assert len(golden["answers"]) == len(SPM_TEXTS)


@pytest.mark.llama_cpp
def test_llama_cpp_today_says_what_the_golden_file_says(spm_gguf):
    """llama.cpp asked again (a python with llama-cpp-python: deselected where there is none)."""
    python = llama_cpp_python(REPO)
    assert python is not None, "the llama_cpp mark is deselected where no python has llama_cpp"
    golden = golden_answers()
    said = ask_llama_cpp(python, spm_gguf[1], SPM_TEXTS)
    for text, now, then in zip(SPM_TEXTS, said["answers"], golden["answers"]):
        assert now == then, (text, f"llama-cpp-python {said['llama_cpp_python']} now, {golden['llama_cpp_python']} then")


def test_the_gguf_is_a_sentencepiece_vocabulary_with_every_token_type(spm_meta):
    meta = spm_meta
    assert meta["tokenizer.ggml.model"] == "llama"
    assert set(meta["tokenizer.ggml.token_type"]) == {1, 3, 4, 5, 6}  # NORMAL, CONTROL, USER_DEFINED, UNUSED, BYTE
    assert len(meta["tokenizer.ggml.tokens"]) == SPM_VOCAB


@pytest.mark.parametrize("text", SPM_TEXTS)
def test_ids_are_those_of_llama_cpps_algorithm_ported(spm_meta, rebuilt, text):
    assert rebuilt.encode(text).ids == llama_cpp_spm(spm_meta, text)


@pytest.mark.parametrize("index", range(len(SPM_TEXTS)))
def test_ids_are_llama_cpps(rebuilt, llama_cpp_says, index):
    text, want = SPM_TEXTS[index], llama_cpp_says[index]
    assert rebuilt.encode(text).ids == want["ids"], text


def test_without_special_tokens_ids_are_llama_cpps_plain_tokenize(spm_gguf, spm_meta, llama_cpp_says):
    """tokenizers' encode_special_tokens is llama.cpp's special=False: control tokens' text is text."""
    plain, _ = gguf_tokenizer(spm_meta, str(spm_gguf[1]))
    plain.encode_special_tokens = True
    for text, want in zip(SPM_TEXTS, llama_cpp_says):
        assert plain.encode(text).ids == want["plain"], text


@pytest.mark.parametrize("index", range(len(SPM_TEXTS)))
def test_decode_is_llama_cpps_detokenize(rebuilt, llama_cpp_says, index):
    text, want = SPM_TEXTS[index], llama_cpp_says[index]
    ids = want["ids"]
    assert rebuilt.decode(ids) == want["detokenize"], text
    # Generated ids have no BOS before them. llama_detokenize takes the leading space off the first
    # token's text, and the text of a control token is empty: that one case is not reproduced.
    if ids[1:2] != [rebuilt.token_to_id("<s>")]:
        assert rebuilt.decode(ids[1:]) == want["continuation"], text
    if text in SPM_PLAIN:
        assert rebuilt.decode(ids) == text  # round trip (decode skips the special tokens)


@pytest.mark.parametrize("text", SPM_PLAIN)
def test_ids_and_text_are_sentencepieces_own(spm_gguf, rebuilt, text):
    """The library llama.cpp's SPM tokenizer was ported from, on the tokenizer.model itself."""
    folder, _ = spm_gguf
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    ids = [sp.bos_id(), *sp.encode(text)]
    assert rebuilt.encode(text).ids == ids
    assert rebuilt.decode(ids) == sp.decode(ids) == text


def test_the_engine_from_the_gguf_encodes_text(spm_gguf, rebuilt):
    engine = load_engine(spm_gguf[1], compile=False)
    assert not any("not rebuilt" in note for note in engine.notes)
    assert engine.encode(SPM_TEXTS[0]) == rebuilt.encode(SPM_TEXTS[0]).ids
    out = engine.generate(SPM_TEXTS[0], max_new_tokens=4, stop_ids=())
    assert isinstance(engine.decode(out.token_ids[0]), str)


def test_merges_are_ranked_by_the_merged_tokens_score():
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5}
    scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0]  # "bc" before "ab"; "abc" from either, last
    assert score_merges(vocab, scores) == [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]


def test_a_vocabulary_without_scores_is_one_error():
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "a"], "tokenizer.ggml.token_type": [2, 1]}
    with pytest.raises(CheckpointError, match="tokenizer.ggml.scores: 0 for 2 tokens"):
        gguf_tokenizer(meta, "x.gguf")
