"""The drift check's sampling: every short history, a share N/messages of long ones, never with N = 0."""

import random

from gateway.service import _sample_drift


def test_short_histories_are_always_checked_and_zero_turns_the_check_off() -> None:
    assert all(_sample_drift(n, 8) for n in range(1, 9))
    assert not any(_sample_drift(n, 0) for n in (1, 5, 100))


def test_long_histories_are_checked_in_proportion_to_n_over_their_length() -> None:
    random.seed(1234)
    draws = 20_000
    for messages in (16, 40, 160):
        share = sum(_sample_drift(messages, 8) for _ in range(draws)) / draws
        expected = 8 / messages
        assert abs(share - expected) < 4 * (expected * (1 - expected) / draws) ** 0.5 + 1e-9, (messages, share)
