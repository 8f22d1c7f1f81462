"""Per-site request rate limit: one token bucket per site (claims, renewals and releases share
it). A site may send ``burst`` requests at once and ``rate`` per second on average; a request
finding the bucket empty is answered ``rate_limited`` and changes nothing."""

from __future__ import annotations


class SiteRateLimiter:
    """Token buckets by site.

    Args:
        rate: tokens added per second (> 0).
        burst: bucket size (>= 1).
        max_sites: buckets kept at most; the fullest (idle longest) are dropped beyond it, which
            only ever gives a site a full bucket back.

    Raises ``ValueError`` for a rate <= 0 or a burst < 1.
    """

    def __init__(self, rate: float, burst: float, max_sites: int = 100_000) -> None:
        if not rate > 0 or not burst >= 1:
            raise ValueError(f"rate must be > 0 and burst >= 1, got {rate}, {burst}")
        self.rate, self.burst, self._max_sites = rate, burst, max_sites
        self._buckets: dict[str, tuple[float, float]] = {}

    def allow(self, site: str, now: float) -> bool:
        """Take one token of ``site``'s bucket at ``now`` (monotonic seconds); False if empty."""
        tokens, at = self._buckets.get(site, (self.burst, now))
        tokens = min(self.burst, tokens + max(0.0, now - at) * self.rate)
        if tokens < 1.0:
            self._buckets[site] = (tokens, now)
            return False
        self._buckets[site] = (tokens - 1.0, now)
        if len(self._buckets) > self._max_sites:
            self._buckets.pop(next(iter(self._buckets)))
        return True
