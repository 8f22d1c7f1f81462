"""Per-site quotas and fair share across sites (pure logic, used by :class:`broker.leases.LeaseBook`).

The policy (weighted max-min fairness over one resource, GPUs):

1. **Quota** (hard): a site never holds more than ``BrokerConfig.quota_of(site)`` GPUs at once,
   counting its live leases and its claims being granted. A claim that would go past it is refused
   with ``quota_exceeded``. Default: unlimited.
2. **Fair share** (soft, only when GPUs are scarce). The lendable capacity ``C`` is every GPU that
   is leased, being granted, or free on an offer. The contenders are the sites holding GPUs, the
   sites *waiting* (a claim of theirs was refused for want of GPUs — ``gpu_unavailable``,
   ``no_match`` — or by this rule, within ``fair_share_window_s``) and the claimant. Each
   contender's demand is what it holds plus what it wants (claimant: the claim's GPUs; waiting
   site: its refused count; others: nothing more). Shares are the weighted max-min allocation
   of ``C`` over those demands (:func:`weighted_max_min`, weights ``site_weights``, default 1).
   A claim that would take the claimant above its share is refused with ``quota_exceeded`` when
   granting it would leave fewer free GPUs than the waiting sites below their share are owed
   (each is owed ``min(refused count, ⌊share − held⌋)``: GPUs are whole, a fraction of one left
   over goes to whoever claims it first). So a site may always use GPUs nobody
   else is waiting for, and never those a site under its share asked for recently.
3. **Reclaim order**: a demand for ``count`` GPUs takes leases first from the site most over its
   share — the highest ``held / weight``, re-evaluated after each lease taken — and within a site
   the newest lease first (:func:`reclaim_order`).

Waiting sites are remembered in memory only (:class:`WaitingSites`); a restarted broker forgets
them and they count again at their next refusal.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from contracts import LeaseLogRecord

_EPS = 1e-9


def weighted_max_min(
    capacity: float, demands: Mapping[str, float], weights: Mapping[str, float]
) -> dict[str, float]:
    """Weighted max-min fair shares (progressive filling) of ``capacity`` units.

    Every site with demand rises at the rate of its weight until it reaches its demand or the
    capacity is used up. Args: ``capacity`` (>= 0), ``demands`` site → units wanted (>= 0),
    ``weights`` site → weight (> 0; a site missing from it weighs 1). Returns site → share, with
    ``0 <= share <= demand`` and ``sum(shares) <= capacity``. Raises ``ValueError`` for a
    negative capacity or demand, or a weight <= 0.
    """
    if capacity < 0:
        raise ValueError(f"negative capacity {capacity}")
    share = {s: 0.0 for s in demands}
    active: set[str] = set()
    for s, d in demands.items():
        if d < 0:
            raise ValueError(f"negative demand {d} of {s}")
        if weights.get(s, 1.0) <= 0:
            raise ValueError(f"weight of {s} must be > 0")
        if d > 0:
            active.add(s)
    remaining = float(capacity)
    while active and remaining > _EPS:
        total_w = sum(weights.get(s, 1.0) for s in active)
        level = remaining / total_w
        saturated = sorted(s for s in active if demands[s] - share[s] <= level * weights.get(s, 1.0) + _EPS)
        if not saturated:
            for s in active:
                share[s] += level * weights.get(s, 1.0)
            break
        for s in saturated:
            remaining -= demands[s] - share[s]
            share[s] = float(demands[s])
            active.discard(s)
    return share


@dataclass(frozen=True, slots=True)
class Verdict:
    """The fair-share decision on one claim.

    Attributes:
        ok: True if the claim may go ahead.
        text: why it was refused (empty when ``ok``).
        held: GPUs the claimant holds now.
        share: the claimant's weighted max-min share, GPUs (``inf`` with no scarcity test).
        owed: free GPUs owed to waiting sites below their share.
    """

    ok: bool
    text: str = ""
    held: int = 0
    share: float = math.inf
    owed: float = 0.0


class WaitingSites:
    """Sites whose claims were refused for want of GPUs recently: site → (GPUs wanted, until).

    Args:
        window_s: how long a refusal keeps a site waiting, seconds.
    """

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._waiting: dict[str, tuple[int, float]] = {}

    def refused(self, site: str, count: int, now: float) -> None:
        """``site`` was refused ``count`` GPUs at ``now`` (the larger recent count is kept)."""
        cur = self._waiting.get(site)
        keep = count if cur is None or cur[1] <= now else max(count, cur[0])
        self._waiting[site] = (keep, now + self.window_s)

    def served(self, site: str) -> None:
        """``site`` got GPUs: it no longer waits."""
        self._waiting.pop(site, None)

    def waiting(self, now: float) -> dict[str, int]:
        """Site → GPUs wanted, for sites still waiting at ``now`` (expired entries dropped)."""
        for s in [s for s, (_, until) in self._waiting.items() if until <= now]:
            del self._waiting[s]
        return {s: n for s, (n, _) in sorted(self._waiting.items())}

    def clear(self) -> None:
        """Forget every waiting site (broker restart)."""
        self._waiting.clear()


def quota_refusal(site: str, held: int, wanted: int, quota: int | None) -> str:
    """Why ``site`` holding ``held`` GPUs may not take ``wanted`` more under ``quota``
    (``None``: unlimited); ``""`` if it may."""
    if quota is not None and held + wanted > quota:
        return f"site {site} holds {held} GPUs, wants {wanted} more; quota is {quota}"
    return ""


def fair_share(
    site: str,
    wanted: int,
    held: Mapping[str, int],
    free: int,
    waiting: Mapping[str, int],
    weight: Callable[[str], float],
) -> Verdict:
    """Decide whether ``site`` may take ``wanted`` GPUs under the fair-share rule (module doc).

    Args:
        site: the claimant.
        wanted: GPUs the claim takes (>= 1).
        held: site → GPUs held (live leases and claims being granted); missing sites hold 0.
        free: GPUs free on offers now (including those the claim takes).
        waiting: site → GPUs refused recently (:meth:`WaitingSites.waiting`).
        weight: site → fair-share weight (> 0).

    Returns a :class:`Verdict`.
    """
    mine = held.get(site, 0)
    others = {t: n for t, n in waiting.items() if t != site and n > 0}
    if not others:
        return Verdict(True, held=mine)
    capacity = sum(held.values()) + free
    demands: dict[str, float] = {t: float(n) for t, n in held.items() if n > 0}
    for t, n in others.items():
        demands[t] = demands.get(t, 0.0) + n
    demands[site] = mine + wanted
    weights = {t: weight(t) for t in demands}
    shares = weighted_max_min(capacity, demands, weights)
    # GPUs are whole: a waiting site is owed the whole GPUs below its share; the fraction left over
    # goes to whoever claims first (owing it to every site refused each of them: two sites each
    # owed half of the last free GPU were refused it in turn, and it stayed unclaimed)
    owed = sum(min(n, math.floor(max(0.0, shares[t] - held.get(t, 0)) + _EPS)) for t, n in others.items())
    share = shares[site]
    if mine + wanted <= share + _EPS or free - wanted >= owed - _EPS:
        return Verdict(True, held=mine, share=share, owed=owed)
    starved = ", ".join(sorted(t for t, n in others.items() if shares[t] - held.get(t, 0) > _EPS))
    return Verdict(
        False,
        f"fair share: site {site} would hold {mine + wanted} GPUs, its share is {share:.1f} of "
        f"{capacity}; {free} free GPUs and {owed:.1f} are owed to waiting sites ({starved})",
        held=mine,
        share=share,
        owed=owed,
    )


def reclaim_order(
    leases: Iterable[LeaseLogRecord], held: Mapping[str, int], weight: Callable[[str], float]
) -> list[LeaseLogRecord]:
    """``leases`` in the order a demand for ``count`` GPUs should take them: repeatedly the
    newest lease (by ``granted_at``, then ``lease_id``) of the site with the highest
    ``held / weight`` (ties: site name), where ``held`` (site → GPUs held) drops by each lease
    taken. Every lease appears once."""
    by_site: dict[str, list[LeaseLogRecord]] = {}
    for r in leases:
        by_site.setdefault(r.site, []).append(r)
    for recs in by_site.values():
        recs.sort(key=lambda r: (r.granted_at, r.lease_id))  # newest last: popped first
    left = {s: float(held.get(s, sum(len(r.gpus) for r in recs))) for s, recs in by_site.items()}
    out: list[LeaseLogRecord] = []
    while by_site:
        site = min(by_site, key=lambda s: (-left[s] / weight(s), s))
        rec = by_site[site].pop()
        out.append(rec)
        left[site] -= len(rec.gpus)
        if not by_site[site]:
            del by_site[site]
    return out


def holdings(leases: Iterable[LeaseLogRecord], reserved: Sequence[tuple[str, int]] = ()) -> dict[str, int]:
    """Site → GPUs held: the GPUs of the live ``leases`` plus ``reserved`` (site, GPUs) pairs of
    claims being granted."""
    out: dict[str, int] = {}
    for r in leases:
        if r.state.live:
            out[r.site] = out.get(r.site, 0) + len(r.gpus)
    for site, n in reserved:
        out[site] = out.get(site, 0) + n
    return out
