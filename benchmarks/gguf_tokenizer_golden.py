"""Writes the golden file of the GGUF tokenizer tests: what llama.cpp itself makes of 20 texts in a
SentencePiece ("llama") vocabulary (tests/weights/spm_vocabulary.py, golden/mixtral-spm/).

The tests then run on every clone against the committed file; where a python with llama-cpp-python
is found, tests/weights/test_gguf_tokenizer.py also asks llama.cpp again and compares.

How it was made (once; again only when the texts, the vocabulary or the llama.cpp version change):

    benchmarks/build_llama_cpp.sh python        # llama-cpp-python 0.3.36 from its sdist (5-15 min)
    .venv/bin/python benchmarks/gguf_tokenizer_golden.py --retrain

--retrain first trains tokenizer.model again (SentencePiece BPE with Llama's trainer settings on
README.md and hf_tiny's CORPUS); without it the committed tokenizer.model is kept. --llama-python
names another python that imports llama_cpp (default: this one if it does, else the build above).
Each run builds a tiny Mixtral with that tokenizer, converts it with llama.cpp's own
convert_hf_to_gguf.py (`./dev test` fetches it) and writes golden/mixtral-spm/llama_cpp.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The tests' helper folders (as pyproject.toml's pytest `pythonpath` puts them): this script makes
# the tests' vocabulary with the tests' own code.
sys.path[:0] = [str(REPO / "src"), str(REPO / "tests" / "engine"), str(REPO / "tests" / "weights")]

from gguf_convert import convert  # noqa: E402
from hf_tiny import CORPUS  # noqa: E402
from spm_vocabulary import (  # noqa: E402
    LLAMA_CPP_ANSWERS, SPM_TEXTS, TOKENIZER_MODEL, USER_DEFINED, ask_llama_cpp, llama_cpp_python,
    mixtral_with_sentencepiece, sha256,
)


def train_sentencepiece(out: Path) -> Path:
    """tokenizer.model: a SentencePiece BPE as Llama's was trained (byte fallback, digits split,
    identity normalisation, whitespace kept; ids 0, 1, 2: <unk>, <s>, </s>), one user-defined token."""
    import sentencepiece as spm

    with tempfile.TemporaryDirectory() as tmp:
        text = (REPO / "README.md").read_text(encoding="utf-8").splitlines() + CORPUS
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter([line for line in text if line.strip()]), model_prefix=f"{tmp}/tokenizer",
            model_type="bpe", vocab_size=600, hard_vocab_limit=False, byte_fallback=True, split_digits=True,
            normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
            allow_whitespace_only_pieces=True, character_coverage=0.9995, user_defined_symbols=[USER_DEFINED],
            unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2,
        )
        out.write_bytes(Path(f"{tmp}/tokenizer.model").read_bytes())
    return out


def readable_json(golden: dict) -> str:
    """One key a line, and one text or answer a line (a diff then names the text whose answer moved)."""
    def rows(values: list) -> str:
        return "[\n" + ",\n".join("  " + json.dumps(v) for v in values) + "\n ]"

    fields = [f" {json.dumps(k)}: {rows(v) if isinstance(v, list) else json.dumps(v)}" for k, v in golden.items()]
    return "{\n" + ",\n".join(fields) + "\n}\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--retrain", action="store_true", help="train tokenizer.model again first")
    parser.add_argument("--llama-python", help="a python that imports llama_cpp")
    args = parser.parse_args()
    python = args.llama_python or llama_cpp_python(REPO)
    if python is None:
        print("error: no python with llama_cpp: run benchmarks/build_llama_cpp.sh python, or pass --llama-python",
              file=sys.stderr)
        return 2
    if args.retrain:
        train_sentencepiece(TOKENIZER_MODEL)
    with tempfile.TemporaryDirectory() as tmp:
        folder = mixtral_with_sentencepiece(Path(tmp) / "ckpt")
        said = ask_llama_cpp(python, convert(folder, "f32", Path(tmp) / "mixtral-spm.gguf"), SPM_TEXTS)
    golden = {"tokenizer_model_sha256": sha256(TOKENIZER_MODEL), "llama_cpp_python": said["llama_cpp_python"],
              "texts": SPM_TEXTS, "answers": said["answers"]}
    LLAMA_CPP_ANSWERS.write_text(readable_json(golden), encoding="utf-8")
    print(f"{LLAMA_CPP_ANSWERS.relative_to(REPO)}: {len(SPM_TEXTS)} texts, llama-cpp-python {said['llama_cpp_python']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
