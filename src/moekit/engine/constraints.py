"""Grammar-constrained decoding: a per-row token mask from llguidance, applied before sampling.

A constrained row carries a TokenConstraint: before each of its tokens is sampled, the grammar's
matcher says which ids may come next and every other logit of that row becomes -inf; the chosen
id is then fed back to the matcher. Rows without a constraint are not touched, so a free request
decoding beside constrained ones gets exactly the tokens it gets alone. The grammar knows when it
is complete (a JSON value closed, a tool call's end tag written): the row then ends as a stop.

Shapes: B rows, V the model's vocabulary (the mask is V bits packed into ceil(V / 32) int32 words).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import Tensor

from moekit.errors import MoekitError

# Bit i of a packed mask word is token 32 * word + i (llguidance's layout, as vLLM and SGLang use it).
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


class ConstraintError(MoekitError):
    """A grammar refused (a schema feature the library does not support, or a token it rejects)."""


def grammar_tokenizer(tokenizer, vocab_size: int, eos_ids: Sequence[int]):
    """A tokenizers.Tokenizer → llguidance's view of it over the model's `vocab_size` ids (a model's
    embedding is often padded past the tokenizer's last id; those ids are never allowed)."""
    import llguidance

    to_str = getattr(tokenizer, "to_str", None)
    if to_str is None:
        raise ConstraintError("this model's tokenizer cannot drive a grammar (it is not a tokenizer.json tokenizer)")
    eos = list(eos_ids) or None
    try:
        return llguidance.LLTokenizer(to_str(), n_vocab=vocab_size, eos_token=eos)
    except Exception as err:  # the library's refusal of a tokenizer it cannot map to bytes
        raise ConstraintError(f"llguidance cannot use this model's tokenizer: {_first_line(str(err))}") from None


def json_schema_grammar(schema: dict) -> str:
    """A JSON Schema → an llguidance grammar. Compact JSON (no free whitespace): a model may not pad
    its answer with spaces forever, and a client's json.loads reads it the same."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def lark_grammar(source: str) -> str:
    """A Lark grammar (llguidance's dialect: `%json {...}` embeds a JSON Schema) → a grammar."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(source)


def check_grammar(grammar: str, tokenizer) -> None:
    """Raise ConstraintError with the library's own first line if it refuses the grammar."""
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise ConstraintError(_first_line(messages[0] if messages else "the grammar is refused"))


def allowed_from_words(words: Tensor, vocab: int) -> Tensor:
    """[ceil(V/32)] int32 packed mask → [V] bool, True where the token may come next."""
    bits = (words.unsqueeze(-1) >> _BIT_SHIFTS) & 1  # [W, 32]
    return bits.reshape(-1)[:vocab].bool()


@dataclass(eq=False)
class TokenConstraint:
    """One request's grammar state: what it allows next, and whether it is complete."""

    matcher: object  # llguidance.LLMatcher
    vocab: int
    words: Tensor = field(init=False, repr=False)  # [ceil(V/32)] int32, refilled every step

    def __post_init__(self):
        self.words = torch.zeros((self.vocab + 31) // 32, dtype=torch.int32)
        if self.matcher.is_error():
            raise ConstraintError(_first_line(self.matcher.get_error()))

    def allowed(self) -> Tensor:
        """[V] bool: the tokens the grammar allows next."""
        self.matcher.unsafe_compute_mask_ptr(self.words.data_ptr(), self.words.numel() * 4)
        return allowed_from_words(self.words, self.vocab)

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ConstraintError(f"the grammar refused token {token}: {_first_line(self.matcher.get_error())}")

    def copy(self) -> "TokenConstraint":
        """An independent constraint in the same state: one per row when one request decodes
        several rows (several prompts, or n > 1)."""
        return TokenConstraint(self.matcher.deep_copy(), self.vocab)

    @property
    def complete(self) -> bool:
        """Nothing more may follow (the grammar allows only the end of the text now)."""
        return self.matcher.is_stopped()


def new_constraint(grammar: str, tokenizer, vocab: int) -> TokenConstraint:
    """A fresh matcher for one request (grammar from json_schema_grammar / lark_grammar)."""
    import llguidance

    return TokenConstraint(llguidance.LLMatcher(tokenizer, grammar, log_level=0), vocab)


def mask_logits(logits: Tensor, constraints: Sequence[Optional[TokenConstraint]]) -> Tensor:
    """[B, V] logits → the same with each constrained row's disallowed tokens at -inf.

    Returns `logits` itself when no row is constrained; otherwise a copy whose free rows are
    bit-for-bit the input's."""
    if all(c is None for c in constraints):
        return logits
    out = logits.clone()
    for i, constraint in enumerate(constraints):
        if constraint is not None:
            allowed = constraint.allowed()  # [V]
            out[i, : allowed.shape[0]].masked_fill_(~allowed, float("-inf"))
            out[i, allowed.shape[0] :] = float("-inf")
    return out


def _first_line(text: str) -> str:
    """The library's message on one line (its regex errors span several, with a caret drawing)."""
    words = " ".join(line.strip() for line in str(text).splitlines() if line.strip().strip("^"))
    return words[:300] or "the grammar is refused"
