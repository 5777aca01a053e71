"""Prompt batching and request checks, before any model runs."""

from __future__ import annotations

import pytest

from moekit.engine.generate import check_request, left_pad
from moekit.errors import MoekitError


def test_left_pad_puts_real_tokens_last_and_counts_positions_per_row():
    ids, mask, positions = left_pad([[5, 6, 7], [9]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[True, True, True], [False, False, True]]
    assert positions[0].tolist() == [0, 1, 2]
    assert positions[1, -1].item() == 0  # the lone real token is at position 0 of its row


@pytest.mark.parametrize(
    "prompts, new, message",
    [
        ([[1, 2]], 0, "max-new-tokens"),
        ([[1, 2]], -3, "max-new-tokens"),
        ([[1, 500]], 4, "outside the vocabulary"),
        ([[1, -1]], 4, "outside the vocabulary"),
        ([[]], 4, "empty"),
        ([], 4, "no prompt"),
        ([list(range(90))], 20, "context"),
    ],
)
def test_impossible_requests_are_refused_in_one_line(prompts, new, message):
    with pytest.raises(MoekitError, match=message) as err:
        check_request(prompts, new, vocab_size=100, max_positions=100)
    assert "\n" not in str(err.value)


def test_a_request_that_exactly_fills_the_context_is_accepted_and_one_more_token_is_not():
    assert check_request([list(range(80))], 20, vocab_size=100, max_positions=100) is None
    assert check_request([[99]], 99, vocab_size=100, max_positions=100) is None  # the last id, the last slot
    with pytest.raises(MoekitError, match="context"):
        check_request([list(range(80))], 21, vocab_size=100, max_positions=100)
    with pytest.raises(MoekitError, match="context"):
        check_request([[99]], 100, vocab_size=100, max_positions=100)
