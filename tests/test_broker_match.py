"""Matchmaking (broker/match.py) and matched claims in the lease book (broker/leases.py): filters
(model, memory, notice, minimum duration, zone, grade), locality tiers (one node, one leaf,
across leaves only when allowed), preference order, deterministic tie-breaks, and leases that span
several offers."""

from __future__ import annotations

import itertools
import logging
import shlex
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from broker.config import BrokerConfig
from broker.leases import Answer, ClaimDecision, LeaseBook, PendingGrant, lease_message
from broker.match import Placement, gpu_rank, match
from contracts import CapacityUpdate, Claim, GpuState, IdleGrade, LeaseState, Offer, OfferedGpu, ReasonCode
from contracts.mqtt import Requirements

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-40GB"


def _offer(
    oid: str,
    host: str,
    n: int,
    *,
    leaf: str | None = "leaf-1",
    model: str = H100,
    fb: int | None = 81559,
    pool: str = "default",
    zone: str | None = None,
    until: float | None = 1000.0,
    notice: float = 30.0,
    grade: str = "free",
) -> Offer:
    return Offer(
        offer_id=oid,
        ts=0.0,
        host=host,
        leaf=leaf,
        gpus=[
            OfferedGpu(gpu=f"{host}/GPU-{i}", model_name=model, fb_total_mib=fb, grade=grade)
            for i in range(n)
        ],
        available_until=until,
        expires_at=60.0,
        notice_seconds=notice,
        pool=pool,
        zone=zone,
    )


def _placed(result: Placement | str) -> Placement:
    assert isinstance(result, Placement), result
    return result


# pure matching -------------------------------------------------------------------------------------
def test_one_node_beats_several_and_the_tightest_node_wins() -> None:
    offers = [_offer("o1", "n1", 8), _offer("o2", "n2", 3), _offer("o3", "n3", 2)]
    p = _placed(match(offers, Requirements(), 3, 0.0))
    assert p.tier == "node" and p.hosts == ["n2"] and p.gpus == ("n2/GPU-0", "n2/GPU-1", "n2/GPU-2")
    p = _placed(match(offers, Requirements(), 5, 0.0))
    assert p.tier == "node" and p.hosts == ["n1"] and len(p.gpus) == 5


def test_several_nodes_under_one_leaf_fewest_nodes_first_never_across_leaves() -> None:
    offers = [
        _offer("o1", "n1", 2, leaf="leaf-a"),
        _offer("o2", "n2", 3, leaf="leaf-a"),
        _offer("o3", "n3", 1, leaf="leaf-a"),
        _offer("o4", "n4", 3, leaf="leaf-b"),
        _offer("o5", "n5", 3, leaf=None),
    ]
    p = _placed(match(offers, Requirements(), 5, 0.0))
    assert p.tier == "leaf" and p.hosts == ["n1", "n2"]
    assert [o.offer_id for o in p.offers] == ["o2", "o1"]  # the bigger node first
    assert len(p.gpus) == 5 and set(p.gpus) == {f"n2/GPU-{i}" for i in range(3)} | {"n1/GPU-0", "n1/GPU-1"}
    # 7 fit only across leaves
    why = match(offers, Requirements(), 7, 0.0)
    assert isinstance(why, str) and "allow_cross_leaf" in why
    p = _placed(match(offers, Requirements(allow_cross_leaf=True), 7, 0.0))
    assert p.tier == "cross_leaf" and len(p.gpus) == 7 and len(p.offers) == 3
    assert isinstance(match(offers, Requirements(allow_cross_leaf=True), 13, 0.0), str)


def test_filters_model_memory_grade_zone_notice_duration() -> None:
    offers = [
        _offer("o1", "n1", 4, model=A100, fb=40960),
        _offer("o2", "n2", 4, zone="metro-east", until=100.0),
        _offer("o3", "n3", 4, zone="metro-west", notice=10.0),
        _offer("o4", "n4", 4, fb=None, grade="memory_held"),
    ]
    assert _placed(match(offers, Requirements(model_names=[A100]), 2, 0.0)).hosts == ["n1"]
    assert _placed(match(offers, Requirements(min_fb_total_mib=80000, zone="metro-east"), 2, 0.0)).hosts == [
        "n2"
    ]
    # n1 (40 GiB) fails memory, n2 the minimum duration, n3 the notice, n4 unknown memory
    why = match(offers, Requirements(min_fb_total_mib=80000), 4, 0.0, min_duration=200.0, min_notice=20.0)
    assert isinstance(why, str)
    assert "not promised for the minimum duration" in why and "notice too short" in why
    assert "no GPU meeting model/memory/grade free" in why
    assert _placed(match(offers, Requirements(zone="metro-west"), 1, 0.0)).hosts == ["n3"]
    assert isinstance(match(offers, Requirements(zone="metro-west"), 1, 0.0, min_notice=20.0), str)
    assert isinstance(match(offers, Requirements(zone="nowhere"), 1, 0.0), str)
    # memory_held GPUs only when allowed
    only_held = [offers[3]]
    assert _placed(match(only_held, Requirements(), 1, 0.0)).hosts == ["n4"]
    assert isinstance(match(only_held, Requirements(allow_memory_held=False), 1, 0.0), str)
    # usable() removes GPUs (leased, reserved, held)
    p = _placed(match([offers[0]], Requirements(), 2, 0.0, usable=lambda g: g != "n1/GPU-0"))
    assert p.gpus == ("n1/GPU-1", "n1/GPU-2")


def test_preference_order_after_locality_with_rank_of_the_worst_gpu() -> None:
    offers = [
        _offer("o1", "n1", 4, model=A100, leaf="leaf-a"),
        _offer("o2", "n2", 4, model=H100, leaf="leaf-a"),
        _offer("o3", "n3", 2, model=H100, leaf="leaf-b", pool="edge-pool"),
        _offer("o4", "n4", 2, model=H100, leaf="leaf-b", pool="edge-pool"),
    ]
    assert _placed(match(offers, Requirements(prefer=[A100]), 4, 0.0)).hosts == ["n1"]
    assert _placed(match(offers, Requirements(prefer=[H100]), 4, 0.0)).hosts == ["n2"]
    # pool names rank too; locality beats preference: one node of leaf-a over two of edge-pool
    assert _placed(match(offers, Requirements(prefer=["edge-pool"]), 4, 0.0)).hosts in (["n1"], ["n2"])
    p = _placed(match(offers, Requirements(prefer=["edge-pool", H100]), 4, 0.0))
    assert p.tier == "node" and p.hosts == ["n2"] and p.rank == 1
    # with 6 wanted no node suffices: leaf-a (4 A100 + 4 H100) vs leaf-b (4 H100 of edge-pool)
    p = _placed(match(offers, Requirements(prefer=[H100, A100]), 6, 0.0))
    assert p.tier == "leaf" and p.hosts == ["n1", "n2"] and p.rank == 1
    assert p.gpus[:4] == tuple(f"n2/GPU-{i}" for i in range(4))  # the preferred node first
    assert gpu_rank(offers[2].gpus[0], offers[2], ["x", "edge-pool"]) == 1
    assert gpu_rank(offers[2].gpus[0], offers[2], ["x"]) == 1


def test_ties_are_broken_deterministically_whatever_the_input_order() -> None:
    offers = [_offer(f"o{i}", f"n{i}", 2, leaf="leaf-a") for i in range(5)]
    first = _placed(match(offers, Requirements(), 2, 0.0))
    assert first.hosts == ["n0"]
    for perm in itertools.permutations(offers[:4]):
        assert _placed(match(perm, Requirements(), 3, 0.0)) == _placed(
            match(offers[:4], Requirements(), 3, 0.0)
        )


def test_avoided_hosts_are_a_preference_never_a_refusal() -> None:
    # n1 is the tightest fit, so it wins without avoid_hosts
    offers = [_offer("o1", "n1", 2), _offer("o2", "n2", 8), _offer("o3", "n10", 8)]
    assert _placed(match(offers, Requirements(), 1, 0.0)).hosts == ["n1"]
    # avoided: the best of the other nodes (n10 and n2 tie on fit: the name breaks it); a name is
    # avoided as a whole ("n1" does not avoid "n10")
    assert _placed(match(offers, Requirements(avoid_hosts=["n1"]), 1, 0.0)).hosts == ["n10"]
    assert _placed(match(offers, Requirements(avoid_hosts=["n1", "n10"]), 1, 0.0)).hosts == ["n2"]
    # the other nodes hold exactly the count: still spread; one more and it falls back
    assert _placed(match(offers, Requirements(avoid_hosts=["n1", "n10"]), 8, 0.0)).hosts == ["n2"]
    assert _placed(match(offers, Requirements(avoid_hosts=["n1", "n2"]), 8, 0.0)).hosts == ["n10"]
    # only avoided nodes have GPUs: granted there all the same, off the first names (the list is
    # in priority order: the last names are given up first)
    assert _placed(match(offers, Requirements(avoid_hosts=["n1", "n2", "n10"]), 1, 0.0)).hosts == ["n10"]
    assert _placed(match(offers, Requirements(avoid_hosts=["n10", "n2", "n1"]), 1, 0.0)).hosts == ["n1"]
    assert _placed(match(offers, Requirements(avoid_hosts=["n2", "n1", "n10"]), 1, 0.0)).hosts == ["n10"]
    alone = _placed(match(offers[:1], Requirements(avoid_hosts=["n1"]), 2, 0.0))
    assert alone.gpus == ("n1/GPU-0", "n1/GPU-1")
    # the other nodes are used up (usable() removes their GPUs): the avoided node it is
    busy = {"n2/GPU-0", "n10/GPU-0"}
    taken = _placed(
        match(offers[1:], Requirements(avoid_hosts=["n2"]), 8, 0.0, usable=lambda g: g not in busy)
    )
    assert taken.tier == "leaf" and taken.hosts == ["n10", "n2"] and len(taken.gpus) == 8
    # and too few GPUs anywhere is answered as without it
    why = match(offers, Requirements(avoid_hosts=["n1"]), 19, 0.0)
    assert isinstance(why, str) and "18 matching GPUs on 3 offers for 19 wanted" in why


def test_avoided_hosts_come_before_locality_and_preference() -> None:
    offers = [
        _offer("o1", "n1", 4, model=A100, leaf="leaf-a"),
        _offer("o2", "n2", 2, leaf="leaf-a"),
        _offer("o3", "n3", 2, leaf="leaf-a"),
        _offer("o4", "n4", 3, leaf="leaf-b"),
    ]
    # one node (n1) beats two; avoiding it, two nodes of leaf-a (n2, n3) beat it
    assert _placed(match(offers, Requirements(), 4, 0.0)).hosts == ["n1"]
    p = _placed(match(offers, Requirements(avoid_hosts=["n1"]), 4, 0.0))
    assert p.tier == "leaf" and p.hosts == ["n2", "n3"]
    # preferred A100 on the avoided node loses to H100 elsewhere
    p = _placed(match(offers, Requirements(prefer=[A100], avoid_hosts=["n1"]), 2, 0.0))
    assert p.hosts == ["n2"] and p.rank == 1
    # no placement off n1 and n2 (leaf-a: n3's 2, leaf-b: 3, not across leaves): the last name
    # is given up (n2 + n3), or, named first, n2 is kept and n1 given up; across leaves, n3 + n4
    p = _placed(match(offers, Requirements(avoid_hosts=["n1", "n2"]), 4, 0.0))
    assert p.tier == "leaf" and p.hosts == ["n2", "n3"]
    p = _placed(match(offers, Requirements(avoid_hosts=["n2", "n1"]), 4, 0.0))
    assert p.tier == "node" and p.hosts == ["n1"]
    p = _placed(match(offers, Requirements(avoid_hosts=["n1", "n2"], allow_cross_leaf=True), 4, 0.0))
    assert p.tier == "cross_leaf" and p.hosts == ["n3", "n4"]
    # none off even the first name: as if nothing were avoided
    p = _placed(match(offers, Requirements(avoid_hosts=["n1", "n2"]), 5, 0.0))
    assert p == _placed(match(offers, Requirements(), 5, 0.0)) and p.hosts == ["n1", "n2"]


@settings(max_examples=400, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 4), min_size=1, max_size=6),
    leaves=st.lists(st.sampled_from(["leaf-a", "leaf-b", None]), min_size=6, max_size=6),
    avoid=st.lists(st.integers(0, 6), unique=True),
    count=st.integers(1, 9),
    cross_leaf=st.booleans(),
)
def test_avoiding_hosts_never_turns_a_match_into_a_refusal_and_keeps_off_the_longest_prefix(
    sizes: list[int], leaves: list[str | None], avoid: list[int], count: int, cross_leaf: bool
) -> None:
    offers = [_offer(f"o{i}", f"n{i}", n, leaf=leaves[i]) for i, n in enumerate(sizes) if n]
    avoided = [f"n{i}" for i in avoid]
    plain = match(offers, Requirements(allow_cross_leaf=cross_leaf), count, 0.0)
    got = match(offers, Requirements(allow_cross_leaf=cross_leaf, avoid_hosts=avoided), count, 0.0)
    assert isinstance(got, Placement) == isinstance(plain, Placement)
    # every prefix, longest first: the first that leaves a placement gives the answer
    for k in range(len(avoided), -1, -1):
        kept_off = [o for o in offers if o.host not in avoided[:k]]
        there = match(kept_off, Requirements(allow_cross_leaf=cross_leaf), count, 0.0)
        if isinstance(there, Placement):
            assert got == there, k
            break


def test_count_must_be_positive() -> None:
    with pytest.raises(ValueError):
        match([], Requirements(), 0, 0.0)


# claims in the book ------------------------------------------------------------------------------------
CFG = BrokerConfig(offer_ttl_s=60, notice_s=30, lease_ttl_s=60, pool_zones={"default": "metro-east"})


def _book(cfg: BrokerConfig = CFG) -> LeaseBook:
    counter = itertools.count(1)
    return LeaseBook(cfg, new_id=lambda p: f"{p}-{next(counter)}")


def _idle(book: LeaseBook, host: str, n: int, leaf: str | None = "leaf-1", until: float = 10_000.0) -> None:
    for i in range(n):
        book.apply_capacity(
            CapacityUpdate(
                ts=0.0,
                host=host,
                gpu_uuid=f"GPU-{host}-{i}",
                state=GpuState.IDLE,
                since=0.0,
                grade=IdleGrade.FREE,
                predicted_idle_until=until,
                model_name=H100,
                fb_total_mib=81559,
                leaf=leaf,
            ),
            0.0,
        )


def _want(count: int, cid: str = "m1", site: str = "edge-a", **kw: object) -> Claim:
    return Claim(claim_id=cid, site=site, count=count, ts=0.0, **kw)  # type: ignore[arg-type]


def test_matched_claim_spans_two_nodes_of_one_leaf_and_grants_every_host() -> None:
    book = _book()
    _idle(book, "n1", 3)
    _idle(book, "n2", 3)
    _idle(book, "n3", 8, leaf="leaf-2", until=50.0)
    assert {o.zone for o in book.offers.values()} == {"metro-east"}
    step, ch = book.begin_claim(
        "edge-a", _want(5, min_duration_seconds=100, requirements=Requirements(zone="metro-east")), 1.0
    )
    assert isinstance(step, PendingGrant), step
    assert step.matched and step.record.hosts == ["n1", "n2"] and len(step.record.gpus) == 5
    assert step.record.offer_ids == [o.offer_id for o in step.offers] and len(step.offers) == 2
    assert step.record.reason == "match:leaf"
    assert ch.placements == ["leaf"] and ch.decisions == []  # reserved, not yet decided
    assert {o.offer_id for o in ch.withdrawn} == set(step.record.offer_ids)
    left = [o for o in book.offers.values() if o.host in ("n1", "n2")]
    assert len(left) == 1 and len(left[0].gpus) == 1  # the rest of the second node is offered anew
    assert book.violations() == []
    answer, ch = book.grant(step, 2.0)
    assert answer.ok
    (rec,) = ch.records
    # the guarantee counts from the reservation (t=1, checked against the promise), not the grant
    assert rec.min_until == 101.0 and rec.granted_at == 2.0
    msg = lease_message(rec)
    assert msg.hosts == ["n1", "n2"] and msg.offer_ids == rec.offer_ids and msg.min_until == 101.0
    assert ch.decisions == [ClaimDecision("edge-a", "match", "ok")]
    assert book.violations() == []


def test_a_matched_claim_avoiding_a_node_is_granted_on_another_and_there_when_nothing_else_fits(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="broker.leases")
    book = _book()
    _idle(book, "n1", 1)
    _idle(book, "n2", 4)
    # without it the tightest node (n1) would be taken
    answer, ch = book.claim("edge-a", _want(1, requirements=Requirements(avoid_hosts=["n1"])), 1.0)
    assert answer.ok and ch.records[0].hosts == ["n2"] and ch.records[0].reason == "match:node"
    answer, ch = book.claim("edge-a", _want(1, "m2", requirements=Requirements(avoid_hosts=["n2"])), 1.0)
    assert answer.ok and ch.records[0].hosts == ["n1"]
    # only the avoided node has GPUs left: granted there, not refused
    answer, ch = book.claim("edge-a", _want(3, "m3", requirements=Requirements(avoid_hosts=["n2"])), 1.0)
    assert answer.ok and ch.records[0].hosts == ["n2"] and len(ch.records[0].gpus) == 3
    assert book.violations() == []
    # only that last placement is logged as on an avoided node
    (on_avoided,) = [r for r in caplog.records if r.getMessage() == "match_on_avoided_hosts"]
    assert on_avoided.__dict__["claim_id"] == "m3" and on_avoided.__dict__["avoided"] == ["n2"]


def test_no_match_is_answered_with_the_reason_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    book = _book()
    _idle(book, "n1", 2, until=50.0)
    caplog.set_level(logging.INFO, logger="broker.leases")
    answer, ch = book.claim("edge-a", _want(2, min_duration_seconds=100), 1.0)
    assert isinstance(answer, Answer) and answer.code is ReasonCode.NO_MATCH and not ch
    assert "minimum duration" in answer.text
    answer, _ = book.claim("edge-a", _want(2, "m2", requirements=Requirements(zone="metro-west")), 1.0)
    assert answer.code is ReasonCode.NO_MATCH and "other zone" in answer.text
    answer, _ = book.claim("edge-a", _want(3, "m3"), 1.0)
    assert answer.code is ReasonCode.NO_MATCH and "2 matching GPUs on 1 offers for 3 wanted" in answer.text
    decided = [r for r in caplog.records if r.getMessage() == "claim_decided"]
    assert [r.__dict__["result"] for r in decided] == ["no_match"] * 3
    assert decided[0].__dict__["kind"] == "match" and decided[0].__dict__["site"] == "edge-a"
    # repeated claim ids get the same answer, not a second decision
    again, _ = book.claim("edge-a", _want(3, "m3"), 2.0)
    assert again.replayed and again.code is ReasonCode.NO_MATCH
    assert len([r for r in caplog.records if r.getMessage() == "claim_decided"]) == 3


def test_named_offer_claim_checks_the_minimum_duration() -> None:
    book = _book()
    _idle(book, "n1", 2, until=50.0)
    (offer,) = book.offers.values()
    claim = Claim(claim_id="c1", site="edge-a", offer_id=offer.offer_id, min_duration_seconds=100, ts=0.0)
    answer, _ = book.claim("edge-a", claim, 1.0)
    assert answer.code is ReasonCode.DURATION_UNAVAILABLE
    ok, ch = book.claim(
        "edge-a", claim.model_copy(update={"claim_id": "c2", "min_duration_seconds": 40}), 1.0
    )
    assert ok.ok and ch.records[0].min_until == 41.0 and ch.records[0].offer_ids == [offer.offer_id]
    assert ch.records[0].hosts == ["n1"]


def test_aborted_matched_claim_offers_every_node_again() -> None:
    book = _book()
    _idle(book, "n1", 2)
    _idle(book, "n2", 2)
    step, _ = book.begin_claim("edge-a", _want(4), 1.0)
    assert isinstance(step, PendingGrant) and step.record.hosts == ["n1", "n2"]
    assert not book.offers
    answer, ch = book.abort(step, ReasonCode.ISOLATION_FAILED, "fabric down", 2.0)
    assert answer.code is ReasonCode.ISOLATION_FAILED
    assert sorted(o.host for o in ch.published) == ["n1", "n2"]
    assert book.violations() == []


def test_lease_spanning_two_nodes_is_reclaimed_and_offered_again_as_a_whole() -> None:
    book = _book(CFG.model_copy(update={"reclaim_hold_s": 0.0}))
    _idle(book, "n1", 2)
    _idle(book, "n2", 2)
    answer, ch = book.claim("edge-a", _want(4), 1.0)
    lease_id = answer.lease_id
    assert answer.ok and lease_id is not None
    ch = book.reclaim(2.0, gpus=["n2/GPU-n2-0"])
    assert [r.lease_id for r in ch.records] == [lease_id] and ch.records[0].state is LeaseState.RECLAIMING
    ch = book.tick(2.0 + CFG.notice_s)
    assert ch.records[-1].state is LeaseState.REVOKED
    assert sorted(o.host for o in book.offers.values()) == ["n1", "n2"]


def test_claim_shapes_are_validated() -> None:
    with pytest.raises(ValidationError):
        Claim(claim_id="x", site="a", ts=0.0)  # neither an offer nor a count
    with pytest.raises(ValidationError):
        Claim(claim_id="x", site="a", offer_id="o", requirements=Requirements(), ts=0.0)
    with pytest.raises(ValidationError):
        Claim(claim_id="x", site="a", count=1, gpus=["n1/GPU-0"], ts=0.0)
    with pytest.raises(ValidationError):
        Claim(claim_id="x", site="a", count=1, duration_seconds=10, min_duration_seconds=20, ts=0.0)
    old = Claim.model_validate_json('{"claim_id":"x","site":"a","offer_id":"o","ts":0}')
    assert not old.matched and old.requirements is None and old.min_duration_seconds == 0


def test_a_guarantee_never_outlasts_the_promise_however_long_isolation_takes() -> None:
    """The minimum duration is checked against the offer's ``available_until`` when the claim is
    accepted; a slow fabric verify before the grant must not push ``min_until`` past it."""
    book = _book()
    _idle(book, "n1", 2, until=101.0)
    step, _ = book.begin_claim("edge-a", _want(2, min_duration_seconds=100), 1.0)
    assert isinstance(step, PendingGrant), step
    (offer,) = step.offers
    answer, ch = book.grant(step, 19.0)  # 18 s of isolation
    assert answer.ok
    (rec,) = ch.records
    assert rec.min_until == 101.0 <= (offer.available_until or 0.0)
    assert book.violations() == []


def test_no_match_says_when_memory_is_unknown_or_no_offer_has_a_zone() -> None:
    # an exporter that sent no FB_TOTAL / FB_FREE: fb_total_mib unknown on every GPU
    blind = [_offer("o1", "n1", 4, fb=None), _offer("o2", "n2", 2, fb=None)]
    why = match(blind, Requirements(min_fb_total_mib=81000), 1, 0.0)
    assert isinstance(why, str)
    assert "memory of 6 offered GPUs is unknown" in why and "2 offers: no GPU meeting" in why
    # known memory too small: no word about unknown memory
    small = match([_offer("o3", "n3", 2, fb=40960)], Requirements(min_fb_total_mib=81000), 1, 0.0)
    assert isinstance(small, str) and "unknown" not in small
    # no minimum asked: unknown memory matches nothing less, and is not mentioned
    assert _placed(match(blind, Requirements(), 4, 0.0)).hosts == ["n1"]
    # a zone asked where no offer carries one: say who sets zones
    zoneless = match([_offer("o4", "n4", 2)], Requirements(zone="metro-east"), 1, 0.0)
    assert isinstance(zoneless, str)
    assert "1 offers: no offer has a latency zone; the operator sets [broker.pool_zones]" in zoneless
    # some offers have zones, just not this one: the plain reason
    other = match([_offer("o5", "n5", 2, zone="metro-west")], Requirements(zone="metro-east"), 1, 0.0)
    assert isinstance(other, str) and "1 offers: other zone" in other and "pool_zones" not in other


def test_the_readme_claim_by_requirements_matches_demo_like_offers() -> None:
    # what `make demo` offers: H100 80GB HBM3 nodes (FB_TOTAL 81559 MiB from FB_USED + FB_FREE +
    # FB_RESERVED), no latency zone, promises of a few minutes (README "Adding an edge site")
    now = 0.0
    demo = [_offer(f"o{i}", f"gpu-node-00{i}", n, leaf=None, until=now + 150.0) for i, n in ((1, 3), (2, 2))]
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    start = text.index("gpupool edge claim --mqtt")
    args = shlex.split(text[start : text.index("\n", text.index("\\\n", start) + 2)].replace("\\\n", " "))
    opts = {args[i]: args[i + 1] for i in range(3, len(args) - 1) if args[i].startswith("--")}
    assert set(opts) == {"--mqtt", "--site", "--count", "--model", "--min-memory-mib", "--duration"}, opts
    readme = Requirements(model_names=[opts["--model"]], min_fb_total_mib=int(opts["--min-memory-mib"]))
    placed = _placed(match(demo, readme, int(opts["--count"]), now))
    assert placed.tier == "node" and placed.hosts == ["gpu-node-002"]
    # the README's extra options say what they need: a zone needs [broker.pool_zones], a
    # minimum duration offers promised that long
    with_zone = Requirements(model_names=[H100], min_fb_total_mib=81000, zone="metro-east")
    assert "[broker.pool_zones]" in str(match(demo, with_zone, 2, now))
    assert "not promised for the minimum duration" in str(match(demo, readme, 2, now, min_duration=600.0))
