"""A SentencePiece ("llama") GGUF vocabulary and what llama.cpp itself makes of 20 texts in it.

The vocabulary is tests/weights/golden/mixtral-spm/tokenizer.model, a SentencePiece BPE trained
once with Llama's trainer settings (benchmarks/gguf_tokenizer_golden.py --retrain says how), put
into a tiny Mixtral checkpoint whose tokenizer_config.json marks <unk>, <s>, </s> special (as
Mixtral's does) and one token user-defined, and converted by llama.cpp's own convert_hf_to_gguf.py.

llama.cpp's answers (tokenize with and without special tokens, detokenize, a continuation's
detokenize) are committed in golden/mixtral-spm/llama_cpp.json, made by
benchmarks/gguf_tokenizer_golden.py under a python that has llama-cpp-python; the tests read the
file everywhere, and where such a python is found (`llama_cpp_python`) one test asks llama.cpp
again and compares.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from hf_tiny import write_checkpoint

GOLDEN = Path(__file__).resolve().parent / "golden" / "mixtral-spm"
TOKENIZER_MODEL = GOLDEN / "tokenizer.model"
LLAMA_CPP_ANSWERS = GOLDEN / "llama_cpp.json"

SPM_VOCAB = 640  # the model's; the tokenizer has fewer, the converter pads with [PAD{i}] (UNUSED)
USER_DEFINED = "<tool>"
SPM_TEXTS = [
    "Hello world",
    "hello  world, two spaces",
    " leading space",
    "   three leading spaces",
    "trailing spaces  ",
    " ",
    "",
    "a",
    "line one\nline two\n\nline four\n",
    "\n starts with a newline",
    "\ttab\tseparated\tvalues",
    "digits 1234567890 and 3.14159, 2026-12-01",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)",
    "don't WE'LL they're I'M",
    "naïve café, déjà vu, Grüße",
    "日本語のテキスト and 混合专家模型 (MoE)",
    "emoji 🤖✓ and π ≈ 3.14159",
    "bytes no token covers: ℵ ǅ ẞ \u0001\u007f",
    f"call {USER_DEFINED} now,{USER_DEFINED}twice{USER_DEFINED}",
    "<s> control tokens </s> inside<unk>text",
]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def mixtral_with_sentencepiece(folder: Path, model: Path = TOKENIZER_MODEL) -> Path:
    """A tiny Mixtral checkpoint whose tokenizer is the SentencePiece `model` (ids 0, 1, 2: <unk>,
    <s>, </s>, special; USER_DEFINED not), as Mixtral ships it: tokenizer.model + tokenizer_config.json."""
    import sentencepiece as spm

    write_checkpoint("mixtral", folder, vocab_size=SPM_VOCAB)
    shutil.copyfile(model, folder / "tokenizer.model")
    sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
    special = {i: sp.id_to_piece(i) for i in (0, 1, 2)}
    decoder = {str(i): {"content": t, "special": True, "normalized": False, "lstrip": False, "rstrip": False,
                        "single_word": False} for i, t in special.items()}
    decoder[str(sp.piece_to_id(USER_DEFINED))] = dict(decoder["0"], content=USER_DEFINED, special=False)
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
              "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": True,
              "clean_up_tokenization_spaces": False, "added_tokens_decoder": decoder}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


# llama.cpp's side, run under a python that has llama_cpp: tokenize as its server does (special
# tokens parsed) and as plain text, detokenize as llama-cpp-python's Llama does, and as llama.cpp's
# own llama_detokenize does a continuation (the ids after BOS).
ORACLE = r"""
import ctypes, json, sys
import llama_cpp

job = json.load(sys.stdin)
llm = llama_cpp.Llama(job["gguf"], vocab_only=True, verbose=False)
vocab = llama_cpp.llama_model_get_vocab(llm.model)

def c_detokenize(ids):
    array = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
    buf = ctypes.create_string_buffer(64 * len(ids) + 64)
    n = llama_cpp.llama_detokenize(vocab, array, len(ids), buf, len(buf), False, False)
    return buf.raw[:n].decode("utf-8", errors="replace")

out = []
for text in job["texts"]:
    ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
    out.append({"ids": ids, "plain": llm.tokenize(text.encode("utf-8"), add_bos=True, special=False),
                "detokenize": llm.detokenize(ids).decode("utf-8", errors="replace"),
                "continuation": c_detokenize(ids[1:])})
json.dump({"llama_cpp_python": llama_cpp.__version__, "answers": out}, sys.stdout)
"""


def llama_cpp_python(repo: Path) -> Optional[str]:
    """A python that imports llama_cpp: this one, else benchmarks/build_llama_cpp.sh's build
    (bench-out/llama.cpp/venv under `repo`); None where neither has it."""
    if importlib.util.find_spec("llama_cpp") is not None:
        return sys.executable
    built = repo / "bench-out" / "llama.cpp" / "venv" / "bin" / "python"
    return str(built) if built.is_file() else None


def ask_llama_cpp(python: str, gguf: Path, texts: list[str]) -> dict:
    """llama.cpp's answers for `texts` in `gguf`'s vocabulary, in a child process of `python`:
    {"llama_cpp_python": version, "answers": [{"ids", "plain", "detokenize", "continuation"}, ...]}."""
    done = subprocess.run([python, "-c", ORACLE], input=json.dumps({"gguf": str(gguf), "texts": texts}),
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp's tokenizer under {python} failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout)


def golden_answers() -> dict:
    """The committed golden file: {"tokenizer_model_sha256", "llama_cpp_python", "texts", "answers"}."""
    return json.loads(LLAMA_CPP_ANSWERS.read_text(encoding="utf-8"))
