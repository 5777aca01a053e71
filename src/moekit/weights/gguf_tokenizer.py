"""The tokenizer a GGUF carries (tokenizer.ggml.*), rebuilt as a `tokenizers.Tokenizer`.

GPT-2-style byte-level BPE (`tokenizer.ggml.model == "gpt2"`, what Qwen, OLMoE and Llama 3 ship)
is rebuilt exactly: the vocabulary and merges are the tokenizer.json's own, and the pre-tokenizer is
the one `tokenizer.ggml.pre` names (the converter chose that name by hashing the original
tokenizer's output, so the name stands for the original's regex):

  pre                  split before byte-level BPE
  qwen2                Qwen2's regex (single digits, CJK runs, ...)
  llama-bpe            Llama 3's regex (digits in threes), merges ignored for whole-vocab words
  gpt-2, default,      GPT-2's own regex (ByteLevel with use_regex); "default" is what moekit's
  olmo                 benchmarks label their home-trained GPT-2-style tokenizers with

Tokens of type CONTROL become special added tokens (skipped by decode, as transformers does),
USER_DEFINED ones plain added tokens. SentencePiece vocabularies (`llama`, Mixtral's) are not
rebuilt: the engine then works on token ids, and loading says so.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from moekit.errors import CheckpointError

# tokenizer.json's Split patterns, copied from the Hub tokenizers these pre-types were hashed from.
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
SPLITS = {"qwen2": QWEN2, "llama-bpe": LLAMA3}
GPT2_LIKE = ("gpt-2", "default", "olmo")
SUPPORTED_PRE = tuple(sorted((*SPLITS, *GPT2_LIKE)))
CONTROL, USER_DEFINED, UNUSED = 3, 4, 5  # gguf.TokenType


def _pre_tokenizer(pre: str, where: str):
    from tokenizers import Regex, pre_tokenizers

    if pre in GPT2_LIKE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise CheckpointError(f"{where}: GGUF tokenizer pre-type {pre!r} is not supported "
                          f"(supported: {', '.join(SUPPORTED_PRE)}); give token ids with --prompt-ids")


def gguf_tokenizer(meta: Mapping[str, Any], where: str) -> tuple[Optional[object], Optional[str]]:
    """(tokenizer, None), or (None, why not) for a vocabulary moekit does not rebuild."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        return None, "the GGUF carries no tokenizer: prompts are token ids"
    if kind != "gpt2":
        return None, f"the GGUF's {kind!r} tokenizer is not rebuilt (only byte-level BPE, 'gpt2'): prompts are token ids"
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    # UNUSED ids are the converter's [PAD{i}] fillers up to the model's vocab_size: the original
    # tokenizer has no such ids and decodes them to nothing, so they stay out of the vocabulary.
    vocab = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind != UNUSED}
    bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre == "llama-bpe")
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(pre, where)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in range(len(tokens)) if types[i] == CONTROL])
    tok.add_tokens([AddedToken(tokens[i], normalized=False) for i in range(len(tokens)) if types[i] == USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        name = tokens[int(bos)]
        tok.post_processor = processors.TemplateProcessing(single=f"{name} $A", pair=f"{name} $A {name} $B",
                                                           special_tokens=[(name, int(bos))])
    return tok, None
