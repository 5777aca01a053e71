import pytest

from moekit.train.tokenizer import BOS, BOS_ID, EOS, EOS_ID, PAD_ID, load_tokenizer, save_tokenizer, train_tokenizer

TEXTS = ["def parse_args(argv):\n    return argv[1:]\n", "grep searches for patterns.", "数据库 连接 选项", "échec ✓"]


def test_byte_level_bpe_round_trips_any_text_and_has_the_special_ids(tmp_path):
    tok = train_tokenizer(TEXTS * 20, vocab_size=300)
    save_tokenizer(tok, tmp_path)
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert (tok.token_to_id("<|pad|>"), tok.token_to_id(BOS), tok.token_to_id(EOS)) == (PAD_ID, BOS_ID, EOS_ID)
    for text in TEXTS + ["never seen: ∮ ζ 🚀 \t\n  x"]:
        assert tok.decode(tok.encode(text).ids) == text
    assert len(tok.encode(TEXTS[0]).ids) < len(TEXTS[0].encode())  # merges were learned


def test_transformers_loads_the_same_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = train_tokenizer(TEXTS * 20, vocab_size=300)
    save_tokenizer(tok, tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf.eos_token_id == EOS_ID and hf.bos_token_id == BOS_ID
    text = "def parse_args(argv): 数据库"
    assert hf(text)["input_ids"] == load_tokenizer(tmp_path / "tokenizer.json").encode(text).ids
