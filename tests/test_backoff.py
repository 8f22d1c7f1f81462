"""The one backoff of every retry loop (:class:`runtime.backoff.Backoff`)."""

from __future__ import annotations

import random

import pytest

from runtime.backoff import Backoff


class _Fixed(random.Random):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def random(self) -> float:
        return self.value


@pytest.mark.parametrize(("jitter", "scale"), [(0.0, 0.5), (1.0, 1.0)])
def test_doubles_to_the_cap_with_jitter_and_resets(jitter: float, scale: float) -> None:
    b = Backoff(0.5, 3.0, rng=_Fixed(jitter))
    assert [b.next() for _ in range(5)] == [scale * d for d in (0.5, 1.0, 2.0, 3.0, 3.0)]
    b.reset()
    assert b.next() == scale * 0.5


def test_jitter_stays_within_half_and_whole_step() -> None:
    b = Backoff(1.0, 1.0, rng=random.Random(7))
    delays = [b.next() for _ in range(1000)]
    assert 0.5 <= min(delays) < 0.51 and 0.99 < max(delays) <= 1.0


@pytest.mark.parametrize(("lo", "hi"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_refuses_bounds_that_make_no_backoff(lo: float, hi: float) -> None:
    with pytest.raises(ValueError, match="min_s"):
        Backoff(lo, hi)
