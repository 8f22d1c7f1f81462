"""Per-site quotas and fair share (broker/quota.py) and their use by the lease book: hard quotas,
weighted max-min shares, refusal of a site above its share while GPUs are scarce and a site below
it waits, and reclaims that take GPUs first from the sites most over their share."""

from __future__ import annotations

import itertools
import logging

import pytest

from broker.config import BrokerConfig
from broker.leases import ClaimDecision, LeaseBook
from broker.quota import WaitingSites, fair_share, holdings, quota_refusal, reclaim_order, weighted_max_min
from contracts import (
    CapacityUpdate,
    Claim,
    GpuState,
    IdleGrade,
    LeaseLogRecord,
    LeaseState,
    PoolDemand,
    ReasonCode,
)


# pure policy ----------------------------------------------------------------------------------------
def test_weighted_max_min_fills_progressively_and_caps_at_demand() -> None:
    assert weighted_max_min(12, {"a": 10, "b": 10, "c": 10}, {}) == pytest.approx({"a": 4, "b": 4, "c": 4})
    # a small demand is met in full and the rest is split by weight
    got = weighted_max_min(12, {"a": 2, "b": 20, "c": 20}, {"b": 2.0})
    assert got == pytest.approx({"a": 2, "b": 20 / 3, "c": 10 / 3})
    assert weighted_max_min(100, {"a": 3, "b": 0}, {}) == {"a": 3.0, "b": 0.0}
    assert weighted_max_min(0, {"a": 3}, {}) == {"a": 0.0}
    with pytest.raises(ValueError):
        weighted_max_min(-1, {"a": 1}, {})
    with pytest.raises(ValueError):
        weighted_max_min(1, {"a": 1}, {"a": 0.0})


def test_fair_share_refuses_only_when_scarce_and_someone_below_share_waits() -> None:
    def w(site: str) -> float:
        return 1.0

    # nobody waits: anything goes
    assert fair_share("a", 2, {"a": 6}, 2, {}, w).ok
    # b waits for 4, holds 0: a (holding 6 of 8) may not take the last 2
    v = fair_share("a", 2, {"a": 6}, 2, {"b": 4}, w)
    assert not v.ok and v.share == pytest.approx(4) and v.owed == pytest.approx(4)
    assert "fair share" in v.text and "(b)" in v.text
    # plenty free: a may exceed its share with GPUs nobody is owed
    assert fair_share("a", 2, {"a": 6}, 10, {"b": 4}, w).ok
    # b itself, below its share, is admitted
    assert fair_share("b", 2, {"a": 6}, 2, {"b": 4}, w).ok
    # weight 2 for a: share 2/3 of 8 = 5.3, a at 6 + 2 = 8 is over and refused; of 9 GPUs with
    # weight 3, a's share is 6.75 < 7 and b is owed its 2 whole GPUs of 2.25: a takes the
    # fraction (admitted, 2 free left for b); of 9 with 3 free and a wanting 2, b's 2 are not left
    assert not fair_share("a", 2, {"a": 6}, 2, {"b": 4}, lambda s: 2.0 if s == "a" else 1.0).ok
    v = fair_share("a", 1, {"a": 6}, 3, {"b": 4}, lambda s: 3.0 if s == "a" else 1.0)
    assert v.ok and v.share == pytest.approx(6.75) and v.owed == 2
    assert not fair_share("a", 2, {"a": 6}, 3, {"b": 4}, lambda s: 3.0 if s == "a" else 1.0).ok
    v = fair_share("a", 1, {"a": 6}, 3, {"b": 4}, lambda s: 4.0 if s == "a" else 1.0)
    assert v.ok and v.share == pytest.approx(7)


def test_two_sites_owed_half_of_the_last_free_gpu_each_do_not_refuse_it_to_each_other() -> None:
    def w(site: str) -> float:
        return 1.0

    # b and c hold 5 each and both wait for one more; 1 GPU is free: shares 5.5 each. Whoever
    # claims it first gets it (owing half a GPU to the other refused both, and it stayed unclaimed)
    for claimant, other in (("b", "c"), ("c", "b")):
        v = fair_share(claimant, 1, {"b": 5, "c": 5}, 1, {"b": 1, "c": 1}, w)
        assert v.ok and v.share == pytest.approx(5.5) and v.owed == 0, (claimant, other)
    # a whole GPU owed is still kept: c holds 4, b 6, 1 free: c's share 5.5 owes it 1
    assert not fair_share("b", 1, {"b": 6, "c": 4}, 1, {"c": 1}, w).ok


def test_quota_refusal_and_holdings() -> None:
    assert quota_refusal("a", 3, 1, 4) == ""
    assert "quota is 4" in quota_refusal("a", 3, 2, 4)
    assert quota_refusal("a", 300, 200, None) == ""
    recs = [
        _rec("l1", "a", 2, LeaseState.ACTIVE),
        _rec("l2", "a", 1, LeaseState.RELEASED),
        _rec("l3", "b", 3),
    ]
    assert holdings(recs, [("a", 1), ("c", 2)]) == {"a": 3, "b": 3, "c": 2}


def test_waiting_sites_expire_and_are_served() -> None:
    ws = WaitingSites(10.0)
    ws.refused("a", 2, 0.0)
    ws.refused("a", 1, 5.0)
    ws.refused("b", 3, 0.0)
    assert ws.waiting(9.0) == {"a": 2, "b": 3}
    assert ws.waiting(12.0) == {"a": 2}
    ws.served("a")
    assert ws.waiting(12.0) == {}


def _rec(
    lid: str, site: str, n: int, state: LeaseState = LeaseState.GRANTED, at: float = 0.0
) -> LeaseLogRecord:
    return LeaseLogRecord(
        lease_id=lid,
        site=site,
        claim_id=lid,
        offer_id="o",
        gpus=[f"{lid}/GPU-{i}" for i in range(n)],
        state=state,
        ts=at,
        granted_at=at,
        expires_at=at + 60,
        notice_seconds=30,
    )


def test_reclaim_order_takes_from_the_most_over_share_site_newest_first() -> None:
    leases = [
        _rec("a1", "a", 2, at=1),
        _rec("a2", "a", 2, at=2),
        _rec("a3", "a", 2, at=3),
        _rec("b1", "b", 2, at=4),
    ]
    order = reclaim_order(leases, {"a": 6, "b": 2}, lambda s: 1.0)
    assert [r.lease_id for r in order] == ["a3", "a2", "a1", "b1"]  # a: 6 → 4 → 2 ties b at 2: by name
    # weight 3 for a: 6/3 = 2 = b's 2/1 → a first by name, then b (2) before a (4/3)
    order = reclaim_order(leases, {"a": 6, "b": 2}, lambda s: 3.0 if s == "a" else 1.0)
    assert [r.lease_id for r in order] == ["a3", "b1", "a2", "a1"]


# in the lease book -------------------------------------------------------------------------------------
CFG = BrokerConfig(
    offer_ttl_s=600,
    notice_s=30,
    lease_ttl_s=600,
    site_quotas={"edge-a": 3},
    site_weights={"edge-c": 2.0},
    fair_share_window_s=60,
)


def _book(cfg: BrokerConfig = CFG) -> LeaseBook:
    counter = itertools.count(1)
    return LeaseBook(cfg, new_id=lambda p: f"{p}-{next(counter)}")


def _idle(book: LeaseBook, host: str, n: int, now: float = 0.0) -> None:
    for i in range(n):
        book.apply_capacity(
            CapacityUpdate(
                ts=now,
                host=host,
                gpu_uuid=f"GPU-{host}-{i}",
                state=GpuState.IDLE,
                since=now,
                grade=IdleGrade.FREE,
                predicted_idle_until=10_000.0,
                leaf="leaf-1",
            ),
            now,
        )


def _want(site: str, count: int, cid: str, **kw: object) -> Claim:
    return Claim(claim_id=cid, site=site, count=count, ts=0.0, **kw)  # type: ignore[arg-type]


def test_site_quota_counts_live_leases_and_claims_in_progress(caplog: pytest.LogCaptureFixture) -> None:
    book = _book()
    _idle(book, "n1", 8)
    caplog.set_level(logging.INFO, logger="broker.leases")
    book.begin_claim("edge-a", _want("edge-a", 2, "c1"), 1.0)  # 2 reserved
    answer, refused_ch = book.claim("edge-a", _want("edge-a", 2, "c2"), 1.0)  # 2 reserved + 2 > 3
    assert refused_ch.decisions == [ClaimDecision("edge-a", "match", "quota_exceeded")]
    assert answer.code is ReasonCode.QUOTA_EXCEEDED and "quota is 3" in answer.text
    (offer,) = book.offers.values()
    named = Claim(claim_id="c3", site="edge-a", offer_id=offer.offer_id, count=2, ts=0.0)
    assert book.claim("edge-a", named, 1.0)[0].code is ReasonCode.QUOTA_EXCEEDED
    assert book.claim("edge-a", _want("edge-a", 1, "c4"), 1.0)[0].ok
    assert book.held() == {"edge-a": 3}
    assert book.claim("edge-b", _want("edge-b", 5, "c5"), 1.0)[0].ok  # no quota for edge-b
    assert book.violations() == []
    refused = [
        r
        for r in caplog.records
        if r.getMessage() == "claim_decided" and r.__dict__["result"] == "quota_exceeded"
    ]
    assert len(refused) == 2 and {r.__dict__["kind"] for r in refused} == {"match", "offer"}


def test_site_above_its_share_is_refused_while_a_site_below_it_waits() -> None:
    book = _book()
    _idle(book, "n1", 4)
    _idle(book, "n2", 4)
    assert book.claim("edge-b", _want("edge-b", 6, "b1"), 1.0)[0].ok
    # edge-d asks for 4 and gets nothing: only 2 free
    assert book.claim("edge-d", _want("edge-d", 4, "d1"), 2.0)[0].code is ReasonCode.NO_MATCH
    # edge-b (6 of 8, share 4) may not take the last 2 while edge-d waits
    refused, _ = book.claim("edge-b", _want("edge-b", 2, "b2"), 3.0)
    assert (
        refused.code is ReasonCode.QUOTA_EXCEEDED
        and "fair share" in refused.text
        and "edge-d" in refused.text
    )
    # edge-d takes what there is; then nobody below its share waits for those GPUs
    assert book.claim("edge-d", _want("edge-d", 2, "d2"), 4.0)[0].ok
    # after the window edge-b is not held back by edge-d's old refusal
    _idle(book, "n3", 4, now=70.0)
    assert book.claim("edge-b", _want("edge-b", 2, "b3"), 70.0)[0].ok
    assert book.violations() == []


def test_count_demand_reclaims_from_the_most_over_share_site_first() -> None:
    book = _book()
    _idle(book, "n1", 8)
    for cid, site, n in [("b1", "edge-b", 2), ("b2", "edge-b", 2), ("c1", "edge-c", 2), ("c2", "edge-c", 2)]:
        assert book.claim(site, _want(site, n, cid), 1.0)[0].ok
    # b holds 4 (weight 1), c holds 4 (weight 2): b is the most over its share
    result, ch = book.apply_demand(PoolDemand(demand_id="d1", ts=2.0, count=4), 2.0)
    assert result == "reclaimed"
    assert [r.site for r in ch.records] == ["edge-b", "edge-b"]
    result, ch = book.apply_demand(PoolDemand(demand_id="d2", ts=3.0, count=2), 3.0)
    assert [r.site for r in ch.records] == ["edge-c"]
