"""The one backoff of every retry loop: exponential with jitter, reset after a success.

Used by the MQTT reconnect loops (broker and edge SDK), the broker's bus loop, the analytics step
loop, the collectors' delivery spool and the fabric collector's retried diagnostics. Pure: it
computes delays, the caller sleeps (so a loop can cut the sleep short when it is stopping).
"""

from __future__ import annotations

import random


class Backoff:
    """Exponential backoff with jitter: :meth:`next` gives ``min_s``, then doubles up to ``max_s``,
    each delay scaled by a random factor in [0.5, 1] (so many clients that failed together do not
    retry together); :meth:`reset` after a success.

    Args:
        min_s: the first delay before jitter, seconds (> 0).
        max_s: the largest delay before jitter, seconds (>= ``min_s``).
        rng: random source of the jitter (seed it in tests).

    Raises:
        ValueError: ``min_s`` not positive or ``max_s`` below it.
    """

    def __init__(self, min_s: float, max_s: float, rng: random.Random | None = None) -> None:
        if not 0 < min_s <= max_s:
            raise ValueError(f"backoff needs 0 < min_s <= max_s, got {min_s}, {max_s}")
        self.min_s, self.max_s = min_s, max_s
        self._rng = rng or random.Random()
        self._next = min_s

    def next(self) -> float:
        """The delay to sleep now, seconds, in ``[d/2, d]`` for the current step ``d``; the next
        step is ``min(2 d, max_s)``."""
        delay = self._next * (0.5 + 0.5 * self._rng.random())
        self._next = min(self.max_s, self._next * 2)
        return delay

    def reset(self) -> None:
        """Start again from ``min_s``."""
        self._next = self.min_s
