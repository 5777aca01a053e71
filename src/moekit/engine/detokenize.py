"""Text from a stream of token ids, piece by piece, for printing tokens as they arrive.

A byte-level BPE token can end in the middle of a UTF-8 character, so decoding token by token
would print replacement characters. The stream decodes a short window of recent ids and prints
only the text that has become stable (the approach of transformers' TextStreamer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class TextStream:
    tokenizer: object  # tokenizers.Tokenizer
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0  # window start: decoding from here gives stable context for spacing
    read_offset: int = 0  # ids before this one have been printed

    printed: Optional[str] = field(default=None, repr=False)  # decode of ids[prefix_offset:read_offset], once made

    def push(self, token_id: int) -> str:
        """Add one id; return the newly stable text (possibly empty)."""
        self.ids.append(token_id)
        printed = self._printed()
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) > len(printed) and not full.endswith("\ufffd"):
            new = full[len(printed) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.printed = None
            return new
        return ""

    def flush(self) -> str:
        """Whatever is left once generation ends (an incomplete character prints as is)."""
        printed = self._printed()
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        self.printed = None
        return full[len(printed) :]

    def _printed(self) -> str:
        """The window's printed part, decoded once each time the window moves, not once per id."""
        if self.printed is None:
            self.printed = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        return self.printed
