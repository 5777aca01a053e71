"""Generated ids → the text a client sees: stable UTF-8 pieces, cut at the first stop string.

A stop string can span tokens, so the last `longest stop - 1` characters are held back until the
next token shows whether they begin a stop string. Without a tokenizer every piece is empty and
clients read the token ids instead (as vLLM's `return_token_ids`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from moekit.engine.detokenize import TextStream


@dataclass
class StopText:
    tokenizer: Optional[object]
    stops: list[str]
    pending: str = ""  # decoded, not yet sent
    stopped: bool = False
    _stream: Optional[TextStream] = field(default=None, repr=False)
    hold: int = field(init=False, default=0)  # characters held back: the longest stop string's, less one

    def __post_init__(self):
        if self.tokenizer is not None:
            self._stream = TextStream(self.tokenizer)
        self.hold = max((len(s) for s in self.stops), default=1) - 1

    def push(self, token_id: int) -> str:
        """One generated id → the text that may be sent now ("" while held back or stopped)."""
        if self.stopped or self._stream is None:
            return ""
        self.pending += self._stream.push(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        """Generation ended: whatever is left (up to a stop string)."""
        if self.stopped or self._stream is None:
            return ""
        self.pending += self._stream.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if not self.stops:  # nothing to hold back or look for
            out, self.pending = self.pending, ""
            return out
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.pending, self.stopped = self.pending[:cut], "", True
            return out
        keep = 0 if final else min(self.hold, len(self.pending))
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep :]
        return out
