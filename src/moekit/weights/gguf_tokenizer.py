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

SentencePiece vocabularies (`tokenizer.ggml.model == "llama"`: Mixtral, Llama 2, Phi-3.5-MoE) are
rebuilt to encode and decode as llama.cpp's SPM tokenizer does (llama-vocab.cpp):

  encode   " " → "▁", and a "▁" before each stretch of text between special tokens when
           tokenizer.ggml.add_space_prefix (default true); then over the whole stretch, no
           pre-tokenizer, merge the adjacent pair whose concatenation is the highest-scoring
           vocabulary token (tokenizer.ggml.scores), until none is; a character that no token
           covers becomes its UTF-8 bytes' <0xNN> tokens. BOS first when tokenizer.ggml.add_bos_token
           (default true, as llama.cpp has it), EOS last when add_eos_token.
  decode   "▁" → " ", <0xNN> tokens → their bytes, special tokens skipped, then one leading
           space dropped (the prefix encoding added) when add_space_prefix: llama-cpp-python's
           Llama.detokenize of ids that start with BOS, and llama.cpp's llama_detokenize of ids
           that do not (a continuation), except one that starts with another control token,
           whose empty text llama_detokenize takes the space off instead.

The highest-score-first merges become a BPE merge list ranked by the merged token's score (the
rank transformers' GGUF converter derives too). llama.cpp breaks a tie of equal scores by position
and a ranked list cannot: the two can differ only where two overlapping pairs make the same token
(a vocabulary of runs such as "aaa" from "a" + "aa" and "aa" + "a").

In both, tokens of type CONTROL (and SentencePiece's UNKNOWN) become special added tokens: found
whole in the text, as llama.cpp tokenizes with parse_special, and skipped by decode, as llama.cpp
detokenizes without `special`; USER_DEFINED ones plain added tokens, found whole and decoded as
written. Other vocabularies (`bert`, `t5`, ...) are not rebuilt: the engine then works on token
ids, and loading says so.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from moekit.errors import CheckpointError

# tokenizer.json's Split patterns, copied from the Hub tokenizers these pre-types were hashed from.
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s+(?!\S)|\s+")
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
SPLITS = {"qwen2": QWEN2, "llama-bpe": LLAMA3}
GPT2_LIKE = ("gpt-2", "default", "olmo")
SUPPORTED_PRE = tuple(sorted((*SPLITS, *GPT2_LIKE)))
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED = 1, 2, 3, 4, 5  # gguf.TokenType


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
    if kind == "gpt2":
        return _byte_level_bpe(meta, where), None
    if kind == "llama":
        return _sentencepiece_bpe(meta, where), None
    return None, (f"the GGUF's {kind!r} tokenizer is not rebuilt (only byte-level BPE, 'gpt2', and SentencePiece, "
                  "'llama'): prompts are token ids")


def _vocabulary(meta: Mapping[str, Any], where: str) -> tuple[list[str], list[int]]:
    """(tokens, their gguf.TokenType), refused in one line when the two lists disagree."""
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if not tokens or len(types) != len(tokens):
        raise CheckpointError(f"{where}: tokenizer.ggml.tokens ({len(tokens)}) and tokenizer.ggml.token_type "
                              f"({len(types)}) do not describe one vocabulary")
    return tokens, types


def _byte_level_bpe(meta: Mapping[str, Any], where: str):
    from tokenizers import Tokenizer, decoders, models

    tokens, types = _vocabulary(meta, where)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre = str(meta.get("tokenizer.ggml.pre", "default"))
    # UNUSED ids are the converter's [PAD{i}] fillers up to the model's vocab_size: the original
    # tokenizer has no such ids and decodes them to nothing, so they stay out of the vocabulary.
    vocab = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind != UNUSED}
    bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre == "llama-bpe")
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = _pre_tokenizer(pre, where)
    tok.decoder = decoders.ByteLevel()
    _add_tokens(tok, tokens, types, special=(CONTROL,))
    _post_processor(tok, meta, tokens, add_bos=False, where=where)
    return tok


def score_merges(vocab: Mapping[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every pair (left, right) of vocabulary tokens whose concatenation is a vocabulary token, best
    first: ranked by that token's score, the order llama.cpp's SPM merges in. Equal scores keep
    the token's id order, then the shorter left part first (llama.cpp would take the leftmost pair)."""
    ranked = []
    for token, index in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], index, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _sentencepiece_bpe(meta: Mapping[str, Any], where: str):
    from tokenizers import Tokenizer, decoders, models, normalizers

    tokens, types = _vocabulary(meta, where)
    scores = list(meta.get("tokenizer.ggml.scores") or [])
    if len(scores) != len(tokens):
        raise CheckpointError(f"{where}: a SentencePiece vocabulary needs a score per token (tokenizer.ggml.scores: "
                              f"{len(scores)} for {len(tokens)} tokens)")
    # As in the byte-level case, UNUSED ids decode to nothing (llama.cpp gives them no text).
    vocab = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind != UNUSED}
    unknown = _unknown_token(meta, tokens, types)
    # byte_fallback: a character no token covers becomes its <0xNN> byte tokens, as llama.cpp's resegment does.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=score_merges(vocab, scores), unk_token=unknown, fuse_unk=True,
                               byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    # Normalizers run once per stretch of text between added tokens: llama.cpp's space prefix "if
    # previous is special" (the first stretch counts as after one).
    escape = [normalizers.Replace(" ", "▁")]
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend("▁")] if prefix else []) + escape)
    tok.pre_tokenizer = None  # llama.cpp merges over the whole stretch: spaces are no boundary
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    _add_tokens(tok, tokens, types, special=(CONTROL, UNKNOWN))
    _post_processor(tok, meta, tokens, add_bos=True, where=where)
    return tok


def _unknown_token(meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> Optional[str]:
    """What a character no token or byte token covers becomes: tokenizer.ggml.unknown_token_id, else
    the token of type UNKNOWN (converters mark <unk> CONTROL when tokenizer_config.json says special)."""
    index = meta.get("tokenizer.ggml.unknown_token_id")
    if index is not None and 0 <= int(index) < len(tokens):
        return tokens[int(index)]
    return next((t for t, kind in zip(tokens, types) if kind == UNKNOWN), None)


def _add_tokens(tok, tokens: list[str], types: list[int], special: tuple[int, ...]) -> None:
    """Tokens of the `special` types as special added tokens, USER_DEFINED ones as plain added
    tokens: both are matched whole in the raw text before the model sees it."""
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types)
                            if kind in special])
    tok.add_tokens([AddedToken(t, normalized=False) for t, kind in zip(tokens, types) if kind == USER_DEFINED])


def _post_processor(tok, meta: Mapping[str, Any], tokens: list[str], add_bos: bool, where: str) -> None:
    """BOS first and EOS last as tokenizer.ggml.add_bos_token / add_eos_token say (add_bos: the
    default where the GGUF says nothing; llama.cpp's is true for SentencePiece, false for gpt2)."""
    from tokenizers import processors

    bos, eos = (_end_token(meta, key, default, tokens, where) for key, default in (("bos", add_bos), ("eos", False)))
    if bos is None and eos is None:
        return
    first, last = f"{bos[0]} " if bos else "", f" {eos[0]}" if eos else ""
    tok.post_processor = processors.TemplateProcessing(
        single=f"{first}$A{last}", pair=f"{first}$A{last} {first}$B{last}",
        special_tokens=list(dict(e for e in (bos, eos) if e).items()))


def _end_token(meta: Mapping[str, Any], key: str, default: bool, tokens: list[str],
               where: str) -> Optional[tuple[str, int]]:
    """(text, id) of the BOS or EOS ("bos" / "eos") the tokenizer adds, or None."""
    index = meta.get(f"tokenizer.ggml.{key}_token_id")
    if not meta.get(f"tokenizer.ggml.add_{key}_token", default) or index is None:
        return None
    if not 0 <= int(index) < len(tokens):
        raise CheckpointError(f"{where}: tokenizer.ggml.{key}_token_id {index} is outside the vocabulary "
                              f"of {len(tokens)} tokens")
    return tokens[int(index)], int(index)
