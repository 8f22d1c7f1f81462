"""Unit tests of the lease book (broker/leases.py): offers, claims, renewals, releases, reclaims,
expiry, idempotency and rebuild, all on an injected clock."""

from __future__ import annotations

import itertools

import pytest

from broker.config import BrokerConfig
from broker.leases import Answer, LeaseBook, PendingGrant, lease_message
from contracts import (
    CapacityUpdate,
    Claim,
    GpuState,
    IdleGrade,
    LeaseKind,
    LeaseLogRecord,
    LeaseState,
    PoolDemand,
    ReasonCode,
    Release,
    Renewal,
)

CFG = BrokerConfig(offer_ttl_s=60, notice_s=30, lease_ttl_s=60, retain_terminal_s=600, reclaim_hold_s=120)


def _book(cfg: BrokerConfig = CFG) -> LeaseBook:
    counter = itertools.count(1)
    return LeaseBook(cfg, new_id=lambda p: f"{p}-{next(counter)}")


def _cap(
    host: str,
    i: int,
    state: GpuState = GpuState.IDLE,
    ts: float = 0.0,
    until: float | None = 10_000.0,
    **kw: object,
) -> CapacityUpdate:
    return CapacityUpdate(
        ts=ts,
        host=host,
        gpu_uuid=f"GPU-{host}-{i}",
        state=state,
        since=ts,
        grade=IdleGrade.FREE if state is GpuState.IDLE else None,
        predicted_idle_until=until if state is GpuState.IDLE else None,
        model_name="NVIDIA H100 80GB HBM3",
        **kw,
    )


def _claim(offer_id: str, cid: str = "c1", site: str = "edge-a", **kw: object) -> Claim:
    return Claim(claim_id=cid, site=site, offer_id=offer_id, ts=0.0, **kw)  # type: ignore[arg-type]


def _idle_node(book: LeaseBook, host: str = "n1", gpus: int = 4, now: float = 0.0) -> str:
    for i in range(gpus):
        book.apply_capacity(_cap(host, i, ts=now), now)
    (offer,) = [o for o in book.offers.values() if o.host == host]
    return offer.offer_id


def test_idle_gpus_of_a_node_make_one_offer_bounded_by_the_prediction() -> None:
    book = _book()
    book.apply_capacity(_cap("n1", 0, until=500.0), 0.0)
    ch = book.apply_capacity(_cap("n1", 1, until=400.0), 1.0)
    assert len(ch.withdrawn) == 1 and len(ch.published) == 1  # the 1-GPU offer is replaced
    (offer,) = book.offers.values()
    assert [g.gpu for g in offer.gpus] == ["n1/GPU-n1-0", "n1/GPU-n1-1"]
    assert offer.available_until == 400.0
    assert offer.expires_at == 1.0 + CFG.offer_ttl_s
    assert offer.notice_seconds == CFG.notice_s
    assert offer.gpus[0].model_name == "NVIDIA H100 80GB HBM3" and offer.gpus[0].grade == "free"
    assert book.violations() == []


def test_offer_promises_no_more_than_the_prediction_and_keeps_a_promise_that_holds() -> None:
    book = _book()
    book.apply_capacity(_cap("n1", 0, until=20.0), 0.0)
    (offer,) = book.offers.values()
    assert offer.available_until == 20.0
    # a refreshed, longer prediction keeps the offer; a shorter one replaces it
    assert not book.apply_capacity(_cap("n1", 0, ts=1.0, until=30.0), 1.0)
    ch = book.apply_capacity(_cap("n1", 0, ts=2.0, until=10.0), 2.0)
    assert [o.available_until for o in ch.published] == [10.0] and ch.withdrawn == [offer]
    # past the prediction the GPU is still idle: still offered, promising nothing beyond it
    assert not book.tick(15.0).published and book.violations() == []


def test_busy_or_unknown_gpu_leaves_its_offer_at_once() -> None:
    book = _book()
    _idle_node(book, gpus=2)
    ch = book.apply_capacity(_cap("n1", 0, state=GpuState.BUSY, ts=1.0), 1.0)
    assert len(ch.withdrawn) == 1
    (offer,) = book.offers.values()
    assert [g.gpu for g in offer.gpus] == ["n1/GPU-n1-1"]
    book.apply_capacity(_cap("n1", 1, state=GpuState.UNKNOWN, ts=2.0), 2.0)
    assert not book.offers
    assert book.violations() == []


def test_gpu_without_a_recent_capacity_update_is_not_offered() -> None:
    book = _book(CFG.model_copy(update={"offer_ttl_s": 1000.0}))
    oid = _idle_node(book, gpus=1)
    answer, _ = book.claim("edge-a", _claim(oid), CFG.capacity_max_age_s + 1)
    assert answer.code is ReasonCode.GPU_UNAVAILABLE and "no recent capacity" in answer.text
    ch = book.tick(CFG.capacity_max_age_s + 1)
    assert [o.offer_id for o in ch.withdrawn] == [oid] and not book.offers
    # a replay of old history (a restarted broker) offers nothing either
    fresh = _book()
    assert not fresh.apply_capacity(_cap("n1", 0, ts=0.0), 1000.0).published


def test_with_a_scheduler_fence_only_gpus_it_holds_for_lending_are_offered_or_claimable() -> None:
    book = _book()
    book.set_lendable((), 0.0)  # the scheduler holds nothing yet
    for i in range(3):
        assert not book.apply_capacity(_cap("n1", i), 0.0).published
    assert not book.offers
    # what its placeholders should hold: the idle, fresh, unleased GPUs
    assert book.to_hold_for_lending(0.0) == [f"n1/GPU-n1-{i}" for i in range(3)]
    ch = book.set_lendable({"n1/GPU-n1-0", "n1/GPU-n1-2"}, 1.0)
    (offer,) = ch.published
    assert [g.gpu for g in offer.gpus] == ["n1/GPU-n1-0", "n1/GPU-n1-2"]
    # a GPU outside the fence cannot be claimed, named or matched
    answer, _ = book.claim("edge-a", _claim(offer.offer_id, gpus=["n1/GPU-n1-1"]), 1.0)
    assert answer.code is ReasonCode.GPU_UNAVAILABLE
    answer, _ = book.claim("edge-a", Claim(claim_id="m1", site="edge-a", count=3, ts=1.0), 1.0)
    assert answer.code is ReasonCode.NO_MATCH
    assert [g.gpu for g in book.offers[offer.offer_id].gpus] == ["n1/GPU-n1-0", "n1/GPU-n1-2"]
    # training took GPU 0 from its placeholder: the offer follows at once
    ch = book.set_lendable({"n1/GPU-n1-2"}, 2.0)
    assert [o.offer_id for o in ch.withdrawn] == [offer.offer_id]
    (offer2,) = ch.published
    assert [g.gpu for g in offer2.gpus] == ["n1/GPU-n1-2"]
    assert book.set_lendable({"n1/GPU-n1-2"}, 3.0).published == []  # nothing changed
    # a leased GPU is not one to hold for lending (its lease's jobs hold it)
    answer, _ = book.claim("edge-a", _claim(offer2.offer_id, cid="c2"), 3.0)
    assert answer.ok
    assert book.to_hold_for_lending(3.0) == ["n1/GPU-n1-0", "n1/GPU-n1-1"]
    # lifting the fence offers every idle GPU again
    (offer3,) = book.set_lendable(None, 4.0).published
    assert [g.gpu for g in offer3.gpus] == ["n1/GPU-n1-0", "n1/GPU-n1-1"]
    assert book.violations() == []


def test_an_older_capacity_update_is_ignored() -> None:
    book = _book()
    book.apply_capacity(_cap("n1", 0, state=GpuState.BUSY, ts=10.0), 10.0)
    ch = book.apply_capacity(_cap("n1", 0, ts=5.0), 11.0)
    assert not ch and not book.offers


def test_claim_grants_a_lease_and_withdraws_the_offer() -> None:
    book = _book()
    oid = _idle_node(book, gpus=4)
    answer, ch = book.claim("edge-a", _claim(oid, count=2, duration_seconds=1000), 5.0)
    assert answer.ok and answer.lease_id
    (rec,) = ch.records
    assert rec.state is LeaseState.GRANTED and rec.seq == 1 and rec.site == "edge-a"
    assert rec.gpus == ["n1/GPU-n1-0", "n1/GPU-n1-1"]
    assert rec.expires_at == 5.0 + CFG.lease_ttl_s and rec.ends_at == 1005.0
    assert [o.offer_id for o in ch.withdrawn] == [oid]
    (rest,) = ch.published
    assert [g.gpu for g in rest.gpus] == ["n1/GPU-n1-2", "n1/GPU-n1-3"]
    assert book.lease_of("n1/GPU-n1-0") == rec.lease_id
    assert book.violations() == []


def test_lease_ends_at_the_claimed_duration() -> None:
    book = _book()
    book.apply_capacity(_cap("n1", 0, until=100.0), 0.0)
    (offer,) = book.offers.values()
    answer, ch = book.claim("edge-a", _claim(offer.offer_id, duration_seconds=30), 1.0)
    assert answer.ok
    assert ch.records[0].ends_at == 31.0 and ch.records[0].expires_at == 31.0


@pytest.mark.parametrize(
    ("claim_kw", "code"),
    [
        ({"offer_id": "offer-999"}, ReasonCode.UNKNOWN_OFFER),
        ({"gpus": ["n9/GPU-x"]}, ReasonCode.GPU_UNAVAILABLE),
        ({"count": 9}, ReasonCode.GPU_UNAVAILABLE),
        ({"min_notice_seconds": 31.0}, ReasonCode.NOTICE_TOO_SHORT),
        ({"site": "edge-b"}, ReasonCode.SITE_MISMATCH),
    ],
)
def test_claim_rejections(claim_kw: dict[str, object], code: ReasonCode) -> None:
    book = _book()
    oid = _idle_node(book, gpus=2)
    claim = Claim(**{"claim_id": "c1", "site": "edge-a", "offer_id": oid, "ts": 0.0, **claim_kw})  # type: ignore[arg-type]
    answer, ch = book.claim("edge-a", claim, 1.0)
    assert answer.code is code, answer
    assert not ch.records and oid in book.offers


def test_expired_offer_is_rejected_even_before_the_tick() -> None:
    book = _book()
    oid = _idle_node(book)
    answer, _ = book.claim("edge-a", _claim(oid), CFG.offer_ttl_s + 0.1)
    assert answer.code is ReasonCode.OFFER_EXPIRED
    book.tick(CFG.offer_ttl_s + 0.2)
    assert oid not in book.offers and len(book.offers) == 1  # re-offered under a new id
    answer, _ = book.claim("edge-a", _claim(oid, cid="c2"), CFG.offer_ttl_s + 0.3)
    assert answer.code is ReasonCode.OFFER_EXPIRED


def test_claim_on_a_leased_gpu_is_gpu_unavailable() -> None:
    book = _book()
    oid = _idle_node(book, gpus=2)
    assert book.claim("edge-a", _claim(oid), 1.0)[0].ok
    answer, ch = book.claim("edge-b", _claim(oid, cid="c1", site="edge-b"), 2.0)
    assert answer.code is ReasonCode.GPU_UNAVAILABLE and "leased" in answer.text
    assert not ch


def test_repeated_claim_id_gets_the_same_answer() -> None:
    book = _book()
    oid = _idle_node(book, gpus=2)
    first, _ = book.claim("edge-a", _claim(oid, count=1), 1.0)
    again, ch = book.claim("edge-a", _claim(oid, count=1), 2.0)
    assert again.replayed and again.code is first.code and again.lease_id == first.lease_id
    assert not ch and len(book.live_leases()) == 1
    bad, _ = book.claim("edge-a", _claim("offer-999", cid="c9"), 3.0)
    bad_again, _ = book.claim("edge-a", _claim(oid, cid="c9"), 4.0)  # same id, now valid offer: same answer
    assert bad_again.code is bad.code is ReasonCode.UNKNOWN_OFFER


def test_reserved_gpus_are_neither_offered_nor_claimable_until_grant_or_abort() -> None:
    book = _book()
    oid = _idle_node(book, gpus=2)
    step, ch = book.begin_claim("edge-a", _claim(oid, count=1), 1.0)
    assert isinstance(step, PendingGrant)
    (rest,) = book.offers.values()
    assert [g.gpu for g in rest.gpus] == ["n1/GPU-n1-1"]
    other, _ = book.begin_claim("edge-b", _claim(oid, site="edge-b", gpus=["n1/GPU-n1-0"]), 1.5)
    assert isinstance(other, Answer) and other.code is ReasonCode.GPU_UNAVAILABLE
    assert book.violations() == []
    answer, ch = book.abort(step, ReasonCode.ISOLATION_FAILED, "pkey not verified", 2.0)
    assert answer.code is ReasonCode.ISOLATION_FAILED and not ch.records
    (offer,) = book.offers.values()
    assert len(offer.gpus) == 2  # the GPU is back on offer
    with pytest.raises(KeyError):
        book.grant(step, 3.0)
    again, _ = book.begin_claim("edge-a", _claim(oid, count=1), 4.0)
    assert isinstance(again, Answer) and again.code is ReasonCode.ISOLATION_FAILED


def test_renewal_activates_and_moves_expiry_never_past_the_end() -> None:
    book = _book()
    oid = _idle_node(book, gpus=1)
    answer, _ = book.claim("edge-a", _claim(oid, duration_seconds=100), 0.0)
    lid = answer.lease_id
    assert lid is not None
    ok, ch = book.renew("edge-a", Renewal(lease_id=lid, site="edge-a", ts=50.0), 50.0)
    assert ok.ok and ch.records[0].state is LeaseState.ACTIVE and ch.records[0].expires_at == 100.0
    assert ch.records[0].seq == 2
    expired, _ = book.renew("edge-a", Renewal(lease_id=lid, site="edge-a", ts=0), 100.0)
    assert expired.code is ReasonCode.LEASE_NOT_LIVE
    ch = book.tick(100.0)
    assert ch.records[0].state is LeaseState.EXPIRED and ch.records[0].reason == "ended"


@pytest.mark.parametrize(
    ("site", "payload_site", "lease_id", "code"),
    [
        ("edge-b", "edge-b", None, ReasonCode.UNKNOWN_LEASE),  # another site's lease
        ("edge-a", "edge-b", None, ReasonCode.SITE_MISMATCH),
        ("edge-a", "edge-a", "lease-999", ReasonCode.UNKNOWN_LEASE),
    ],
)
def test_renew_and_release_rejections(
    site: str, payload_site: str, lease_id: str | None, code: ReasonCode
) -> None:
    book = _book()
    oid = _idle_node(book, gpus=1)
    lid = book.claim("edge-a", _claim(oid), 0.0)[0].lease_id
    target = lease_id or lid
    assert target is not None
    a, ch = book.renew(site, Renewal(lease_id=target, site=payload_site, ts=0), 1.0)
    assert a.code is code and not ch
    a, ch = book.release(site, Release(lease_id=target, site=payload_site, ts=0), 1.0)
    assert a.code is code and not ch
    assert len(book.live_leases()) == 1


def test_ttl_expiry_returns_the_gpus_to_the_offers() -> None:
    book = _book()
    oid = _idle_node(book, gpus=1)
    book.claim("edge-a", _claim(oid), 0.0)
    assert not book.offers
    ch = book.tick(CFG.lease_ttl_s)
    assert [r.state for r in ch.records] == [LeaseState.EXPIRED] and ch.records[0].reason == "ttl"
    assert len(ch.published) == 1 and book.violations() == []


def test_demand_reclaims_with_notice_then_release_in_notice_holds_gpus_back() -> None:
    book = _book()
    oid = _idle_node(book, gpus=2)
    lid = book.claim("edge-a", _claim(oid), 0.0)[0].lease_id
    assert lid is not None
    demand = PoolDemand(demand_id="d1", ts=10.0, gpus=["n1/GPU-n1-1"], reason="job-7")
    result, ch = book.apply_demand(demand, 10.0)
    assert result == "reclaimed"
    (rec,) = ch.records
    assert rec.state is LeaseState.RECLAIMING and rec.reclaim_deadline == 10.0 + CFG.notice_s
    assert rec.reason == "demand:d1"
    assert book.apply_demand(demand, 11.0)[0] == "duplicate"
    # renewals keep working while reclaiming; the state stays reclaiming
    ok, ch = book.renew("edge-a", Renewal(lease_id=lid, site="edge-a", ts=0), 12.0)
    assert ok.ok and ch.records[0].state is LeaseState.RECLAIMING
    ok, ch = book.release("edge-a", Release(lease_id=lid, site="edge-a", ts=0), 20.0)
    assert ch.records[0].state is LeaseState.RELEASED and ch.records[0].reclaim_deadline == 40.0
    assert not book.offers, "reclaimed GPUs are held for training, not offered again"
    book.apply_capacity(_cap("n1", 0, state=GpuState.BUSY, ts=21.0), 21.0)
    book.apply_capacity(_cap("n1", 0, ts=22.0), 22.0)  # training used it and let it go: offer again
    assert [g.gpu for o in book.offers.values() for g in o.gpus] == ["n1/GPU-n1-0"]
    book.apply_capacity(_cap("n1", 1, ts=130.0), 130.0)  # analytics' refresh: still idle, still held
    assert [g.gpu for o in book.offers.values() for g in o.gpus] == ["n1/GPU-n1-0"]
    book.tick(20.0 + CFG.reclaim_hold_s)
    assert sorted(g.gpu for o in book.offers.values() for g in o.gpus) == ["n1/GPU-n1-0", "n1/GPU-n1-1"]


def test_reclaim_deadline_revokes() -> None:
    book = _book()
    oid = _idle_node(book, gpus=1)
    lid = book.claim("edge-a", _claim(oid), 0.0)[0].lease_id
    book.reclaim(5.0, count=1, reason="test")
    book.renew("edge-a", Renewal(lease_id=lid or "", site="edge-a", ts=0), 30.0)
    assert not book.tick(34.9).records
    ch = book.tick(35.0)
    assert [(r.state, r.reason) for r in ch.records] == [(LeaseState.REVOKED, "reclaim_deadline")]
    assert book.lease_of("n1/GPU-n1-0") is None


def test_count_demand_takes_the_newest_leases_and_stale_demands_are_ignored() -> None:
    book = _book()
    for h in ("n1", "n2", "n3"):
        _idle_node(book, host=h, gpus=1)
    for i, oid in enumerate(sorted(book.offers)):
        book.claim("edge-a", _claim(oid, cid=f"c{i}"), float(i))
    result, ch = book.apply_demand(PoolDemand(demand_id="d", ts=10.0, count=2), 10.0)
    assert result == "reclaimed"
    assert sorted(r.granted_at for r in ch.records) == [1.0, 2.0]
    assert book.apply_demand(PoolDemand(demand_id="old", ts=0.0), CFG.demand_max_age_s + 1)[0] == "stale"
    assert book.apply_demand(PoolDemand(demand_id="x", ts=11.0, gpus=["n1/GPU-n1-0"]), 11.0)[0] == "reclaimed"
    assert book.apply_demand(PoolDemand(demand_id="y", ts=12.0), 12.0)[0] == "nothing_to_reclaim"


def test_terminal_leases_are_forgotten_after_retention() -> None:
    book = _book()
    oid = _idle_node(book, gpus=1)
    lid = book.claim("edge-a", _claim(oid), 0.0)[0].lease_id or ""
    book.release("edge-a", Release(lease_id=lid, site="edge-a", ts=0), 1.0)
    assert not book.tick(1.0 + CFG.retain_terminal_s - 1).forgotten
    ch = book.tick(1.0 + CFG.retain_terminal_s)
    assert [r.lease_id for r in ch.forgotten] == [lid] and lid not in book.leases


def test_rebuild_restores_leases_answers_and_holds() -> None:
    book = _book()
    oid = _idle_node(book, gpus=3)
    log: list[LeaseLogRecord] = []
    a, ch = book.claim("edge-a", _claim(oid, count=1), 0.0)
    log += ch.records
    oid2 = next(iter(book.offers))
    b, ch = book.claim("edge-b", _claim(oid2, site="edge-b", count=1), 1.0)
    log += ch.records
    log += book.reclaim(2.0, gpus=["n1/GPU-n1-1"], reason="r").records
    _, ch = book.renew("edge-a", Renewal(lease_id=a.lease_id or "", site="edge-a", ts=0), 3.0)
    log += ch.records

    fresh = _book()
    for i in range(3):
        fresh.apply_capacity(_cap("n1", i), 0.0)
    fresh.rebuild(reversed(log), 4.0)  # order across and within leases does not matter
    assert {r.lease_id: (r.state, r.seq) for r in fresh.live_leases()} == {
        r.lease_id: (r.state, r.seq) for r in book.live_leases()
    }
    assert fresh.violations() == []
    assert sorted(g.gpu for o in fresh.offers.values() for g in o.gpus) == ["n1/GPU-n1-2"]
    again, _ = fresh.claim("edge-a", _claim(oid, count=1), 5.0)
    assert again.replayed and again.lease_id == a.lease_id
    # the reclaim still completes by its deadline after the restart
    ch = fresh.tick(2.0 + CFG.notice_s)
    assert [(r.lease_id, r.state) for r in ch.records] == [(b.lease_id, LeaseState.REVOKED)]


def test_rebuild_revokes_the_later_of_two_live_leases_on_one_gpu() -> None:
    base = {
        "site": "edge-a",
        "offer_id": "o",
        "gpus": ["n1/GPU-n1-0"],
        "state": LeaseState.ACTIVE,
        "expires_at": 100.0,
        "notice_seconds": 30.0,
    }
    recs = [
        LeaseLogRecord(lease_id="l1", claim_id="c1", ts=1.0, granted_at=1.0, **base),  # type: ignore[arg-type]
        LeaseLogRecord(lease_id="l2", claim_id="c2", ts=2.0, granted_at=2.0, **base),
    ]  # type: ignore[arg-type]
    book = _book()
    ch = book.rebuild(recs, 3.0)
    assert [(r.lease_id, r.state, r.reason) for r in ch.records] == [
        ("l2", LeaseState.REVOKED, "rebuild_conflict")
    ]
    assert book.lease_of("n1/GPU-n1-0") == "l1" and book.violations() == []


# minimum guaranteed duration --------------------------------------------------------------------------
def _guaranteed(
    book: LeaseBook, offer_id: str, cid: str, count: int, min_s: float, now: float
) -> LeaseLogRecord:
    answer, ch = book.claim(
        "edge-a", _claim(offer_id, cid, count=count, min_duration_seconds=min_s, duration_seconds=3600), now
    )
    assert answer.ok, answer
    return ch.records[0]


def test_unforced_demand_inside_a_guarantee_waits_for_its_end() -> None:
    book = _book()
    offer_id = _idle_node(book, gpus=2)
    rec = _guaranteed(book, offer_id, "c1", 1, 600.0, 10.0)
    assert rec.min_until == 610.0
    result, ch = book.apply_demand(PoolDemand(demand_id="d1", ts=20.0, gpus=list(rec.gpus)), 20.0)
    assert result == "reclaimed"
    (r,) = ch.records
    assert r.state is LeaseState.RECLAIMING and r.reclaim_deadline == 610.0
    assert r.reason == "demand:d1;deferred_to_guarantee_end"
    assert ch.reclaims_deferred == 1 and ch.guarantees_broken == 0
    # renewals keep it alive; the notice passing does not revoke it, the guarantee's end does
    book.renew("edge-a", Renewal(lease_id=r.lease_id, site="edge-a", ts=40.0), 40.0)
    assert not [x for x in book.tick(20.0 + CFG.notice_s + 1).records if not x.state.live]
    for t in range(70, 610, 40):
        book.renew("edge-a", Renewal(lease_id=r.lease_id, site="edge-a", ts=t), float(t))
        assert book.tick(float(t)).records == [] and book.violations() == []
    (end,) = [x for x in book.tick(610.0).records if x.lease_id == r.lease_id]
    assert end.state is LeaseState.REVOKED and end.reason == "reclaim_deadline"


def test_forced_demand_breaks_the_guarantee_and_says_so() -> None:
    book = _book()
    offer_id = _idle_node(book, gpus=2)
    rec = _guaranteed(book, offer_id, "c1", 2, 600.0, 10.0)
    _, ch = book.apply_demand(PoolDemand(demand_id="d1", ts=20.0, count=1, force=True), 20.0)
    (r,) = ch.records
    assert r.lease_id == rec.lease_id and r.reclaim_deadline == 20.0 + CFG.notice_s
    assert r.reason == "demand:d1;guarantee_broken"
    assert ch.guarantees_broken == 1 and ch.reclaims_deferred == 0
    assert book.violations() == []
    # a rebuilt broker knows the guarantee was broken by force (not a violation)
    fresh = _book()
    fresh.rebuild([rec, r], 21.0)
    assert fresh.violations() == []
    assert fresh.tick(20.0 + CFG.notice_s).records[0].state is LeaseState.REVOKED


def test_count_demand_takes_unguarded_leases_first_and_a_passed_guarantee_no_longer_counts() -> None:
    book = _book()
    offer_id = _idle_node(book, gpus=4)
    guarded = _guaranteed(book, offer_id, "c1", 2, 100.0, 10.0)
    (offer,) = book.offers.values()
    plain = book.claim("edge-a", _claim(offer.offer_id, "c2", count=2), 11.0)[1].records[0]
    _, ch = book.apply_demand(PoolDemand(demand_id="d1", ts=12.0, count=2), 12.0)
    assert [r.lease_id for r in ch.records] == [plain.lease_id]
    assert ch.records[0].reclaim_deadline == 12.0 + CFG.notice_s
    # once now + notice reaches min_until, the guarantee no longer delays anything
    _, ch = book.apply_demand(PoolDemand(demand_id="d2", ts=80.0, count=2), 80.0)
    assert [r.lease_id for r in ch.records] == [guarded.lease_id]
    assert ch.records[0].reclaim_deadline == 80.0 + CFG.notice_s and ch.records[0].reason == "demand:d2"


def test_forced_demand_brings_a_deferred_reclaim_forward() -> None:
    book = _book()
    offer_id = _idle_node(book, gpus=2)
    rec = _guaranteed(book, offer_id, "c1", 2, 600.0, 10.0)
    _, ch = book.apply_demand(PoolDemand(demand_id="d1", ts=20.0, count=2), 20.0)
    assert ch.records[0].reclaim_deadline == 610.0
    # an unforced demand leaves the deferred deadline alone
    assert book.apply_demand(PoolDemand(demand_id="d2", ts=30.0, gpus=list(rec.gpus)), 30.0)[1].records == []
    _, ch = book.apply_demand(PoolDemand(demand_id="d3", ts=40.0, gpus=list(rec.gpus), force=True), 40.0)
    (r,) = ch.records
    assert r.state is LeaseState.RECLAIMING and r.reclaim_deadline == 40.0 + CFG.notice_s
    assert r.reason == "demand:d3;guarantee_broken" and r.seq == 3
    assert book.violations() == []
    assert book.tick(40.0 + CFG.notice_s).records[0].state is LeaseState.REVOKED


# tick: only what falls due ----------------------------------------------------------------------------
def test_tick_reoffers_at_hold_end_and_withdraws_stale_gpus_without_new_capacity() -> None:
    book = _book(CFG.model_copy(update={"capacity_max_age_s": 300.0, "offer_ttl_s": 1000.0}))
    oid = _idle_node(book, gpus=2)
    lid = book.claim("edge-a", _claim(oid, count=1), 0.0)[0].lease_id or ""
    book.reclaim(1.0, count=1, reason="r")
    book.release("edge-a", Release(lease_id=lid, site="edge-a", ts=0), 2.0)

    def offered() -> list[str]:
        return sorted(g.gpu for o in book.offers.values() for g in o.gpus)

    assert offered() == ["n1/GPU-n1-1"]
    assert book.tick(2.0 + CFG.reclaim_hold_s - 0.001).published == []
    book.tick(2.0 + CFG.reclaim_hold_s)
    assert offered() == ["n1/GPU-n1-0", "n1/GPU-n1-1"]
    # no update for 300 s: stale, withdrawn at the first tick past the age (not at the boundary)
    assert book.tick(300.0).withdrawn == []
    assert [o.host for o in book.tick(300.01).withdrawn] == ["n1"] and not book.offers


def test_idle_tick_looks_at_no_node(monkeypatch: pytest.MonkeyPatch) -> None:
    book = _book()
    for host in ("n1", "n2", "n3"):
        _idle_node(book, host=host, gpus=2)
    looked: list[object] = []
    real = book._eligible
    monkeypatch.setattr(book, "_eligible", lambda node, now: looked.append(node) or real(node, now))
    assert not book.tick(5.0) and looked == []
    book.tick(CFG.offer_ttl_s)  # every offer expires: each node is looked at once, and re-offered
    assert sorted(looked) == [("default", "n1"), ("default", "n2"), ("default", "n3")]
    assert len(book.offers) == 3 and book.violations() == []


def test_a_claim_names_only_a_workload_profile_its_site_may_use() -> None:
    from broker.workloads import WorkloadProfile

    profiles = (
        WorkloadProfile(name="infer", argv=("srv", "--port", "{port}"), port_min=20000, port_max=20001),
        WorkloadProfile(name="private", argv=("srv",), port_min=20000, port_max=20000, sites=("edge-b",)),
    )
    book = _book(CFG.model_copy(update={"workloads": profiles}))
    offer = _idle_node(book)
    for name, why in (("nope", "unknown workload profile"), ("private", "not allowed to site")):
        answer, ch = book.begin_claim("edge-a", _claim(offer, cid=f"c-{name}", count=1, workload=name), 1.0)
        assert (
            isinstance(answer, Answer) and answer.code is ReasonCode.UNKNOWN_WORKLOAD and why in answer.text
        )
        assert not ch.records and offer in book.offers  # nothing changed
    step, _ = book.begin_claim("edge-a", _claim(offer, cid="c-ok", count=1, workload="infer"), 1.0)
    assert isinstance(step, PendingGrant) and step.record.workload == "infer"
    _, ch = book.grant(step, 1.0)
    assert ch.records[0].workload == "infer"
    step, _ = book.begin_claim(
        "edge-b", _claim(_idle_node(book, "n2"), cid="c-b", site="edge-b", workload="private"), 1.0
    )
    assert isinstance(step, PendingGrant)


def test_a_scheduler_deadline_is_the_reclaim_deadline_even_inside_a_guarantee() -> None:
    book = _book()
    offer = _idle_node(book)
    step, _ = book.begin_claim(
        "edge-a", _claim(offer, count=2, duration_seconds=600, min_duration_seconds=300), 1.0
    )
    assert isinstance(step, PendingGrant)
    book.grant(step, 1.0)
    lease = step.record.lease_id
    ch = book.reclaim(10.0, step.record.gpus, reason="scheduler_preempted:7", force=True, deadline=14.5)
    (rec,) = ch.records
    assert rec.lease_id == lease and rec.state is LeaseState.RECLAIMING
    assert rec.reclaim_deadline == 14.5 and rec.reason.startswith("scheduler_preempted:7")
    assert book.tick(14.4).records == []
    (revoked,) = book.tick(14.5).records
    assert revoked.state is LeaseState.REVOKED


# lease kinds, prices and the at-risk warning --------------------------------------------------------


def test_offers_state_both_prices_and_a_window_lease_is_promised_until_the_offer_s_promise() -> None:
    book = _book(CFG.model_copy(update={"window_price": 2.5, "preemptible_price": 0.8}))
    oid = _idle_node(book)  # predicted idle until 10 000
    offer = book.offers[oid]
    assert (offer.window_price, offer.preemptible_price) == (2.5, 0.8)
    answer, ch = book.claim("edge-a", _claim(oid, count=1, lease_kind=LeaseKind.WINDOW, duration_seconds=20_000), 5.0)
    assert answer.ok
    (rec,) = ch.records
    assert rec.kind is LeaseKind.WINDOW and rec.window_until == 10_000.0 and rec.min_until == 10_000.0
    msg = lease_message(rec)
    assert msg.kind is LeaseKind.WINDOW and msg.window_until == 10_000.0 and msg.at_risk_since is None
    # capped at the lease's end
    _, ch = book.claim("edge-a", _claim(book_offer(book), "c2", count=1, lease_kind=LeaseKind.WINDOW,
                                        duration_seconds=100), 5.0)  # fmt: skip
    assert ch.records[-1].window_until == 105.0
    # a preemptible lease promises nothing but the notice
    _, ch = book.claim("edge-a", _claim(book_offer(book), "c3", count=1, lease_kind=LeaseKind.PREEMPTIBLE), 5.0)
    rec = ch.records[-1]
    assert rec.kind is LeaseKind.PREEMPTIBLE and rec.window_until is None and rec.min_until is None
    assert book.violations() == []


def book_offer(book: LeaseBook) -> str:
    (offer,) = book.offers.values()
    return offer.offer_id


def test_a_window_needs_a_promise_past_now_and_a_preemptible_lease_no_minimum() -> None:
    book = _book()
    for i in range(2):
        book.apply_capacity(_cap("n1", i, until=None), 0.0)  # no prediction: nothing promised
    oid = book_offer(book)
    answer, _ = book.claim("edge-a", _claim(oid, count=1, lease_kind=LeaseKind.WINDOW), 1.0)
    assert answer.code is ReasonCode.DURATION_UNAVAILABLE
    answer, _ = book.claim("edge-a", _claim(oid, "c2", count=1, lease_kind=LeaseKind.PREEMPTIBLE), 1.0)
    assert answer.ok
    # a promise that ends exactly now is no window; one a hair later is
    book = _book()
    book.apply_capacity(_cap("n1", 0, ts=0.0, until=50.0), 0.0)
    oid = book_offer(book)
    assert book.claim("edge-a", _claim(oid, count=1, lease_kind=LeaseKind.WINDOW), 50.0)[0].code is (
        ReasonCode.DURATION_UNAVAILABLE)
    answer, ch = book.claim("edge-a", _claim(oid, "c2", count=1, lease_kind=LeaseKind.WINDOW), 49.5)
    assert answer.ok and ch.records[-1].window_until == 50.0
    # matched: the same rule
    book = _book()
    book.apply_capacity(_cap("n1", 0, ts=0.0, until=None), 0.0)
    matched = Claim(claim_id="m", site="edge-a", count=1, ts=0.0, lease_kind=LeaseKind.WINDOW)
    assert book.claim("edge-a", matched, 1.0)[0].code is ReasonCode.NO_MATCH
    with pytest.raises(ValueError, match="preemptible"):
        _claim("o", lease_kind=LeaseKind.PREEMPTIBLE, min_duration_seconds=1.0)
    # a claim of an earlier release: a minimum guarantee makes it a window of that length
    assert _claim("o", min_duration_seconds=1.0).kind is LeaseKind.WINDOW
    assert _claim("o").kind is LeaseKind.PREEMPTIBLE


def _planned(host: str, i: int, start: float, ts: float, state: GpuState = GpuState.UNKNOWN) -> CapacityUpdate:
    return _cap(host, i, state=state, ts=ts, planned_start=start, reason="scheduler_planned")


def test_a_plan_onto_a_leased_gpu_marks_the_lease_at_risk_before_any_notice() -> None:
    book = _book()
    oid = _idle_node(book)
    _, ch = book.claim("edge-a", _claim(oid, count=2, lease_kind=LeaseKind.WINDOW, duration_seconds=20_000), 1.0)
    (lease,) = ch.records
    # a plan onto a GPU the lease does not hold: nothing
    ch = book.apply_capacity(_planned("n1", 2, 500.0, 2.0), 2.0)
    assert ch.records == [] and ch.at_risk == 0
    # onto GPU 1 of the lease: at risk, same state, the window cut is counted
    ch = book.apply_capacity(_planned("n1", 1, 500.0, 3.0), 3.0)
    (rec,) = ch.records
    assert rec.state is LeaseState.GRANTED and rec.reason == "at_risk" and rec.seq == 2
    assert (rec.at_risk_since, rec.reclaim_expected_at, rec.window_until) == (3.0, 500.0, 10_000.0)
    assert (ch.at_risk, ch.windows_cut) == (1, 1)
    # the same plan again, or a later one: nothing new; an earlier one: moved earlier, not cut again
    assert book.apply_capacity(_planned("n1", 0, 500.0, 4.0), 4.0).records == []
    assert book.apply_capacity(_planned("n1", 0, 600.0, 5.0), 5.0).records == []
    ch = book.apply_capacity(_planned("n1", 0, 499.0, 6.0), 6.0)
    (rec,) = ch.records
    assert (rec.at_risk_since, rec.reclaim_expected_at) == (3.0, 499.0) and (ch.at_risk, ch.windows_cut) == (1, 0)
    # a reclaiming lease has its notice already: no at-risk on top
    book.reclaim(7.0, gpus=[lease.gpus[0]])
    assert book.apply_capacity(_planned("n1", 0, 100.0, 8.0), 8.0).records == []
    assert book.violations() == []


def test_a_plan_after_a_window_ends_cuts_nothing_and_a_preemptible_lease_is_warned_too() -> None:
    book = _book()
    oid = _idle_node(book)
    _, ch = book.claim("edge-a", _claim(oid, count=1, lease_kind=LeaseKind.WINDOW, duration_seconds=20_000), 1.0)
    ch = book.apply_capacity(_planned("n1", 0, 10_000.0, 2.0), 2.0)  # exactly at the window's end
    assert (ch.at_risk, ch.windows_cut) == (1, 0)
    _, ch = book.claim("edge-b", _claim(book_offer(book), "c2", site="edge-b", count=1), 3.0)
    gpu = ch.records[-1].gpus[0]
    ch = book.apply_capacity(_planned("n1", int(gpu[-1]), 40.0, 4.0), 4.0)
    (rec,) = ch.records
    assert rec.kind is LeaseKind.PREEMPTIBLE and rec.reclaim_expected_at == 40.0 and ch.windows_cut == 0
    assert book.violations() == []


def test_an_idle_gpu_the_scheduler_planned_for_a_pending_job_is_not_offered() -> None:
    book = _book()
    book.apply_capacity(_cap("n1", 0, ts=0.0), 0.0)
    book.apply_capacity(_cap("n1", 1, ts=0.0, planned_start=90.0), 0.0)
    (offer,) = book.offers.values()
    assert [g.gpu for g in offer.gpus] == ["n1/GPU-n1-0"]
    book.apply_capacity(_cap("n1", 1, ts=1.0), 1.0)  # the plan went away: offered again
    (offer,) = book.offers.values()
    assert len(offer.gpus) == 2 and book.violations() == []


def test_a_claim_on_an_offer_another_claim_withdrew_is_served_from_the_nodes_current_offer() -> None:
    book = _book()
    oid = _idle_node(book, gpus=2)
    first, second = (g.gpu for g in book.offers[oid].gpus)
    assert book.claim("edge-a", _claim(oid, gpus=[first]), 1.0)[0].ok
    (current,) = book.offers.values()  # the rest of the node, offered anew under a new id
    assert current.offer_id != oid and [g.gpu for g in current.gpus] == [second]
    # edge-b claimed from the offer it saw before edge-a's claim withdrew it: same terms, served
    answer, _ = book.claim("edge-b", _claim(oid, cid="c2", site="edge-b", gpus=[second]), 2.0)
    assert answer.ok
    (lease,) = [r for r in book.live_leases() if r.site == "edge-b"]
    assert lease.gpus == [second] and lease.offer_id == current.offer_id
    # the GPU edge-a took is not in the current offer: refused, saying why
    taken, _ = book.claim("edge-c", _claim(oid, cid="c3", site="edge-c", gpus=[first]), 3.0)
    assert taken.code is ReasonCode.GPU_UNAVAILABLE and "leased" in taken.text
    # more GPUs than the current offer holds: refused the same way
    more, _ = book.claim("edge-c", _claim(oid, cid="c4", site="edge-c", count=2), 3.0)
    assert more.code is ReasonCode.GPU_UNAVAILABLE


def test_a_withdrawn_offer_is_served_from_its_successor_only_before_its_own_expiry() -> None:
    for at, ok in ((CFG.offer_ttl_s - 0.01, True), (CFG.offer_ttl_s, False)):
        book = _book()
        oid = _idle_node(book, gpus=2)
        second = book.offers[oid].gpus[1].gpu
        assert book.claim("edge-a", _claim(oid, count=1), 1.0)[0].ok
        answer, _ = book.claim("edge-b", _claim(oid, cid="c2", site="edge-b", gpus=[second]), at)
        assert answer.ok is ok and (ok or answer.code is ReasonCode.OFFER_EXPIRED), (at, answer)


def test_a_withdrawn_offer_is_not_served_from_a_successor_promising_a_shorter_window() -> None:
    book = _book()
    oid = _idle_node(book, gpus=2)
    second = book.offers[oid].gpus[1].gpu
    assert book.claim("edge-a", _claim(oid, count=1), 1.0)[0].ok
    book.apply_capacity(_cap("n1", 1, ts=2.0, until=5_000.0), 2.0)  # the prediction shrinks
    (current,) = book.offers.values()
    assert current.available_until == 5_000.0 < 10_000.0
    answer, _ = book.claim("edge-b", _claim(oid, cid="c2", site="edge-b", gpus=[second]), 3.0)
    assert answer.code is ReasonCode.UNKNOWN_OFFER and "withdrawn" in answer.text
    assert book.claim("edge-b", _claim(current.offer_id, cid="c3", site="edge-b", gpus=[second]), 4.0)[0].ok
