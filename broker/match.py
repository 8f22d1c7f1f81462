"""Matchmaking: a claim's requirements (``contracts.mqtt.Requirements``) → the offers and GPUs
that best meet them (pure logic, used by :class:`broker.leases.LeaseBook`).

An offer is a candidate when it is live, its notice is at least the claim's ``min_notice_seconds``,
it is promised (``available_until``) for at least ``min_duration_seconds`` from now, and it is in
the wanted zone. Its GPUs are filtered by model, framebuffer size, grade and availability.

Placement, best first (locality, then preference, then tie-breaks, all deterministic):

1. **one node**: a single offer with enough GPUs;
2. **one leaf**: several offers whose nodes hang off the same leaf switch (offers of unknown
   leaf never group);
3. **across leaves**: any offers, only if the claim allows it (``allow_cross_leaf``).

Within a tier the placement whose worst GPU ranks best in the claim's ``prefer`` list wins; then
the fewest nodes; then the tightest fit (fewest GPUs left over on the nodes used, so whole nodes
stay free for bigger claims); then the names (pool, leaf, host, offer id). Several nodes are
filled biggest first (fewest nodes), better-ranked first among equals; a node's GPUs are taken
best rank first, then by GPU key.

Anti-affinity (``avoid_hosts``, in priority order) comes before all of that, as a preference:
the best placement over the offers of the nodes not named is taken when there is one; otherwise
the last names are given up first: the best placement off the longest prefix of the list that
leaves one (a claim is never refused for it). So a spread placement of a worse tier or rank beats
a better one on an avoided node.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from contracts.mqtt import Offer, OfferedGpu, Requirements

TIERS = ("node", "leaf", "cross_leaf")
"""Locality tiers of a placement, best first."""

_Fill = tuple[int, int, int, list[tuple[Offer, list[str]]]]
"""(worst rank, nodes used, GPUs left over on them, [(offer, GPU keys taken)])."""


@dataclass(frozen=True, slots=True)
class Placement:
    """The offers and GPUs picked for a claim.

    Attributes:
        offers: the offers drawn from, in the order their GPUs were taken.
        gpus: GPU keys taken (``count`` of them), grouped by offer.
        tier: ``node``, ``leaf`` or ``cross_leaf`` (:data:`TIERS`).
        rank: preference rank of the worst GPU taken (0 = first ``prefer`` entry;
            ``len(prefer)`` = not named).
    """

    offers: tuple[Offer, ...]
    gpus: tuple[str, ...]
    tier: str
    rank: int

    @property
    def hosts(self) -> list[str]:
        """The nodes used, sorted."""
        return sorted({o.host for o in self.offers})


@dataclass(frozen=True, slots=True)
class Candidate:
    """An offer that can contribute GPUs to a claim.

    Attributes:
        offer: the offer.
        gpus: its GPUs that meet the requirements, as (preference rank, GPU key), best first.
    """

    offer: Offer
    gpus: tuple[tuple[int, str], ...]


def gpu_rank(gpu: OfferedGpu, offer: Offer, prefer: Sequence[str]) -> int:
    """Preference rank of ``gpu`` on ``offer``: the index of the first ``prefer`` entry equal to
    its model name or its offer's pool; ``len(prefer)`` when none names it."""
    for i, name in enumerate(prefer):
        if name == gpu.model_name or name == offer.pool:
            return i
    return len(prefer)


def _gpu_fits(gpu: OfferedGpu, req: Requirements) -> bool:
    if req.model_names and gpu.model_name not in req.model_names:
        return False
    if req.min_fb_total_mib is not None and (
        gpu.fb_total_mib is None or gpu.fb_total_mib < req.min_fb_total_mib
    ):
        return False
    return req.allow_memory_held or gpu.grade == "free"


def _offer_refusal(
    offer: Offer, req: Requirements, now: float, min_notice: float, min_duration: float
) -> str:
    if now >= offer.expires_at:
        return "expired"
    if offer.notice_seconds < min_notice:
        return "notice"
    if min_duration > 0 and (offer.available_until is None or offer.available_until < now + min_duration):
        return "duration"
    if req.zone is not None and offer.zone != req.zone:
        return "zone"
    return ""


def candidates(
    offers: Iterable[Offer],
    req: Requirements,
    now: float,
    min_notice: float,
    min_duration: float,
    usable: Callable[[str], bool],
) -> tuple[list[Candidate], dict[str, int]]:
    """The offers that can contribute GPUs, each with its fitting GPUs ranked, and a tally of why
    the others could not (``expired``, ``notice``, ``duration``, ``zone``, ``gpus``: no fitting
    GPU). ``usable(gpu_key)`` says whether a GPU may be leased now."""
    out: list[Candidate] = []
    why: dict[str, int] = {}
    for offer in sorted(offers, key=lambda o: o.offer_id):
        refusal = _offer_refusal(offer, req, now, min_notice, min_duration)
        if not refusal:
            fit = sorted(
                (gpu_rank(g, offer, req.prefer), g.gpu)
                for g in offer.gpus
                if _gpu_fits(g, req) and usable(g.gpu)
            )
            if fit:
                out.append(Candidate(offer, tuple(fit)))
                continue
            refusal = "gpus"
        why[refusal] = why.get(refusal, 0) + 1
    return out, why


def _fill(cands: Sequence[Candidate], count: int) -> _Fill | None:
    """The best way to take ``count`` GPUs from ``cands``: (worst rank, nodes, leftover, picks)
    or ``None`` if they hold too few."""
    if sum(len(c.gpus) for c in cands) < count:
        return None
    for limit in sorted({r for c in cands for r, _ in c.gpus}):
        usable = [(c, [g for r, g in c.gpus if r <= limit]) for c in cands]
        usable = [(c, gs) for c, gs in usable if gs]
        if sum(len(gs) for _, gs in usable) < count:
            continue
        # fewest nodes: the biggest first; among equals the better-ranked, then by name
        usable.sort(
            key=lambda cg: (
                -len(cg[1]),
                sum(r for r, _ in cg[0].gpus[: len(cg[1])]),
                cg[0].offer.pool,
                cg[0].offer.host,
                cg[0].offer.offer_id,
            )
        )
        picks: list[tuple[Offer, list[str]]] = []
        left, leftover = count, 0
        for c, gs in usable:
            take = gs[:left]
            picks.append((c.offer, take))
            leftover += len(c.offer.gpus) - len(take)
            left -= len(take)
            if left == 0:
                break
        rank_of = {g: r for c in cands for r, g in c.gpus}
        worst = max(rank_of[g] for _, gs in picks for g in gs)
        return worst, len(picks), leftover, picks
    return None


def _placement(found: _Fill, tier: str) -> Placement:
    worst, _, _, picks = found
    return Placement(
        offers=tuple(o for o, _ in picks), gpus=tuple(g for _, gs in picks for g in gs), tier=tier, rank=worst
    )


def best_placement(cands: Sequence[Candidate], count: int, allow_cross_leaf: bool) -> Placement | None:
    """The best :class:`Placement` of ``count`` GPUs over ``cands`` (module docstring), or ``None``."""
    best_node: tuple[tuple[int, int, str, str, str], Candidate] | None = None
    for c in cands:
        if len(c.gpus) >= count:
            worst = c.gpus[count - 1][0]
            node_key = (worst, len(c.offer.gpus) - count, c.offer.pool, c.offer.host, c.offer.offer_id)
            if best_node is None or node_key < best_node[0]:
                best_node = (node_key, c)
    if best_node is not None:
        c = best_node[1]
        return Placement((c.offer,), tuple(g for _, g in c.gpus[:count]), "node", best_node[0][0])
    leaves: dict[str, list[Candidate]] = {}
    for c in cands:
        if c.offer.leaf is not None:
            leaves.setdefault(c.offer.leaf, []).append(c)
    best_leaf: tuple[tuple[int, int, int, str], _Fill] | None = None
    for leaf in sorted(leaves):
        found = _fill(leaves[leaf], count)
        if found is not None:
            leaf_key = (found[0], found[1], found[2], leaf)
            if best_leaf is None or leaf_key < best_leaf[0]:
                best_leaf = (leaf_key, found)
    if best_leaf is not None:
        return _placement(best_leaf[1], "leaf")
    if allow_cross_leaf:
        found = _fill(cands, count)
        if found is not None:
            return _placement(found, "cross_leaf")
    return None


def spread_placement(cands: Sequence[Candidate], count: int, req: Requirements) -> Placement | None:
    """The best :class:`Placement` of ``count`` GPUs over ``cands`` off the longest prefix of
    ``req.avoid_hosts`` that leaves one (module docstring); ``None`` when there is none even with
    nothing avoided. A placement off a prefix is one off every shorter prefix, so the longest is
    found by bisection: at most about log2(len(avoid_hosts)) + 2 placements are computed."""
    avoid = req.avoid_hosts

    def off(k: int) -> Placement | None:
        skip = set(avoid[:k])
        return best_placement([c for c in cands if c.offer.host not in skip], count, req.allow_cross_leaf)

    found = off(len(avoid))
    if found is not None or not avoid:
        return found
    found = off(0)
    if found is None:
        return None
    lo, hi = 0, len(avoid)  # off(lo) is ``found``; off(hi) is None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        placed = off(mid)
        if placed is None:
            hi = mid
        else:
            lo, found = mid, placed
    return found


def match(
    offers: Iterable[Offer],
    req: Requirements,
    count: int,
    now: float,
    *,
    min_notice: float = 0.0,
    min_duration: float = 0.0,
    usable: Callable[[str], bool] = lambda _: True,
) -> Placement | str:
    """Pick ``count`` (>= 1) GPUs meeting ``req`` from ``offers`` at ``now`` (Unix s).

    ``min_notice`` / ``min_duration`` are the claim's ``min_notice_seconds`` and
    ``min_duration_seconds``; ``usable(gpu_key)`` is False for GPUs that may not be leased now
    (leased, reserved, held for training). ``req.avoid_hosts`` is a preference (module
    docstring): it never turns a match into a refusal. Returns the best :class:`Placement`, or a sentence
    saying why nothing matched (for a ``no_match`` reply): the offers refused by reason; when
    ``req.zone`` is set and no offer carries a zone, that the operator sets
    ``[broker.pool_zones]``; when a minimum framebuffer is asked, how many offered GPUs have an
    unknown one ("memory of n offered GPUs is unknown"). Raises ``ValueError`` if ``count`` < 1.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    offers = list(offers)
    cands, why = candidates(offers, req, now, min_notice, min_duration, usable)
    found = spread_placement(cands, count, req)
    if found is not None:
        return found
    total = sum(len(c.gpus) for c in cands)
    parts = [f"{total} matching GPUs on {len(cands)} offers for {count} wanted"]
    if cands and total >= count:
        parts.append("none on one node or under one leaf switch (allow_cross_leaf not set)")
    labels = {
        "expired": "expired",
        "notice": "notice too short",
        "duration": "not promised for the minimum duration",
        "zone": "other zone",
        "gpus": "no GPU meeting model/memory/grade free",
    }
    if req.zone is not None and all(o.zone is None for o in offers):
        labels["zone"] = "no offer has a latency zone; the operator sets [broker.pool_zones]"
    parts.extend(f"{n} offers: {labels[k]}" for k, n in sorted(why.items()))
    unknown = unknown_memory_gpus(offers, req, now, min_notice, min_duration)
    if unknown:
        parts.append(
            f"memory of {unknown} offered GPUs is unknown (no DCGM_FI_DEV_FB_TOTAL or FB_USED/FB_FREE "
            "from their exporter), so min_fb_total_mib cannot match them"
        )
    return "; ".join(parts)


def unknown_memory_gpus(
    offers: Iterable[Offer], req: Requirements, now: float, min_notice: float, min_duration: float
) -> int:
    """How many GPUs of the live, fitting offers (notice, duration, zone as in :func:`candidates`)
    have an unknown framebuffer size (``fb_total_mib`` ``None``) while ``req`` asks for a
    minimum one (``min_fb_total_mib``): they can never match it. 0 when no minimum is asked."""
    if req.min_fb_total_mib is None:
        return 0
    return sum(
        1
        for offer in offers
        if not _offer_refusal(offer, req, now, min_notice, min_duration)
        for g in offer.gpus
        if g.fb_total_mib is None
    )
