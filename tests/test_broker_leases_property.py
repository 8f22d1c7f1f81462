"""Property test of the lease book: random interleavings of capacity updates, claims (of named
offers and matched by requirements; one- and two-step, with aborts; with minimum guaranteed
durations; preemptible and window leases), renewals, releases, reclaims and demands (forced or
not), scheduler plans onto GPUs, ticks and broker restarts (rebuild from the lease log) never put
a GPU in two live leases, never offer a GPU that is leased or not idle, never let a site hold more
than its quota, never take a lease back inside its guarantee without force, never promise a window
past the offers' promise or the lease's end, mark a lease at risk only after a plan onto one of
its GPUs (its expected reclaim never moving later), and a rebuilt book carries on with exactly the
leases the log says are live.

The checks are computed here from the lease log and the capacity updates the test sent, not from
the book's own bookkeeping (``violations()`` is checked as well).
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from broker.config import BrokerConfig
from broker.leases import LeaseBook, PendingGrant
from contracts import (
    CapacityUpdate,
    Claim,
    GpuState,
    LeaseKind,
    LeaseLogRecord,
    LeaseState,
    PoolDemand,
    ReasonCode,
    Release,
    Renewal,
)
from contracts.mqtt import Requirements

HOSTS = ["n1", "n2", "n3"]
GPUS = [f"{h}/GPU-{h}-{i}" for h in HOSTS for i in range(3)]
LEAF = {"n1": "leaf-1", "n2": "leaf-1", "n3": "leaf-2"}
MODEL = {"n1": "H100", "n2": "H100", "n3": "A100"}
SITES = ["edge-a", "edge-b", "edge-c"]
CFG = BrokerConfig(
    offer_ttl_s=20,
    notice_s=5,
    lease_ttl_s=15,
    retain_terminal_s=60,
    reclaim_hold_s=25,
    demand_max_age_s=30,
    capacity_max_age_s=45,
    site_quotas={"edge-a": 4, "edge-b": 6},
    site_weights={"edge-c": 2.0},
    fair_share_window_s=20,
)
REQUIREMENTS = st.builds(
    Requirements,
    model_names=st.sampled_from([[], ["H100"], ["A100"]]),
    prefer=st.sampled_from([[], ["A100", "H100"], ["H100"]]),
    allow_cross_leaf=st.booleans(),
    avoid_hosts=st.lists(st.sampled_from(HOSTS), max_size=3, unique=True),
)

_ids = itertools.count(1)


def _new_id(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}"


class LeaseBookMachine(RuleBasedStateMachine):
    """Drives a :class:`LeaseBook` with an explicit clock."""

    def __init__(self) -> None:
        super().__init__()
        self.book = LeaseBook(CFG, new_id=_new_id)
        self.now = 1000.0
        self.last_tick = self.now
        self.log: list[LeaseLogRecord] = []
        self.caps: dict[str, CapacityUpdate] = {}
        self.seen_offers: list[str] = []
        self.claims = 0
        self.forced: set[str] = set()
        """Leases a forced reclaim or demand moved to reclaiming."""
        self.plans: dict[str, float] = {}
        """Lease id → the earliest planned start sent for one of its GPUs while it held it."""

    # helpers ---------------------------------------------------------------------------------------
    def _take(self, ch: object) -> None:
        self.log.extend(ch.records)  # type: ignore[attr-defined]
        if self.book.violations():
            raise AssertionError(self.book.violations())
        self.seen_offers.extend(o.offer_id for o in ch.published)  # type: ignore[attr-defined]

    def _latest(self) -> dict[str, LeaseLogRecord]:
        out: dict[str, LeaseLogRecord] = {}
        for r in self.log:
            if r.lease_id not in out or r.seq > out[r.lease_id].seq:
                out[r.lease_id] = r
        return out

    def _pick_offer(self, data: st.DataObject) -> str:
        choices = sorted(self.book.offers) + self.seen_offers[-5:] + ["offer-nope"]
        return data.draw(st.sampled_from(choices), label="offer")

    def _pick_lease(self, data: st.DataObject) -> str:
        ids = sorted(self._latest()) or ["lease-nope"]
        return data.draw(st.sampled_from([*ids, "lease-nope"]), label="lease")

    def _claim(self, data: st.DataObject) -> tuple[str, Claim]:
        site = data.draw(st.sampled_from(SITES), label="site")
        offer_id = self._pick_offer(data)
        self.claims += 1
        cid = data.draw(st.sampled_from([f"c{self.claims}", "c-repeat"]), label="claim_id")
        payload_site = site if data.draw(st.integers(0, 9), label="mismatch") else "edge-z"
        duration = data.draw(st.floats(1, 100), label="duration")
        min_duration = min(duration, data.draw(st.sampled_from([0.0, 0.0, 10.0, 40.0]), label="min_duration"))
        notice = data.draw(st.sampled_from([0.0, 5.0, 6.0]), label="notice")
        kinds = [None, LeaseKind.WINDOW] + ([LeaseKind.PREEMPTIBLE] if min_duration == 0 else [])
        kind = data.draw(st.sampled_from(kinds), label="lease_kind")
        if data.draw(st.booleans(), label="matched"):
            claim = Claim(
                claim_id=cid,
                site=payload_site,
                count=data.draw(st.integers(1, 5), label="count"),
                requirements=data.draw(REQUIREMENTS, label="requirements"),
                duration_seconds=duration,
                min_duration_seconds=min_duration,
                min_notice_seconds=notice,
                ts=self.now,
                lease_kind=kind,
            )
            return site, claim
        offer_id = self._pick_offer(data)
        gpus = data.draw(st.lists(st.sampled_from(GPUS), max_size=2, unique=True), label="gpus")
        count = data.draw(st.integers(0, 3), label="count")
        claim = Claim(
            claim_id=cid,
            site=payload_site,
            offer_id=offer_id,
            gpus=gpus,
            count=count,
            duration_seconds=duration,
            min_duration_seconds=min_duration,
            min_notice_seconds=notice,
            ts=self.now,
            lease_kind=kind,
        )
        return site, claim

    def _check_grant(self, claim: Claim, ch: object) -> None:
        """A granted window lease is promised past now, no further than its offers' promise."""
        for rec in ch.records:  # type: ignore[attr-defined]
            if rec.seq != 1 or rec.state is not LeaseState.GRANTED:
                continue
            assert rec.kind is claim.kind
            if claim.kind is LeaseKind.WINDOW:
                assert rec.window_until is not None and rec.ends_at is not None
                assert rec.window_until <= rec.ends_at
                if claim.lease_kind == LeaseKind.WINDOW.value:  # promised past the reservation (claim.ts)
                    assert rec.window_until > claim.ts or rec.window_until == rec.ends_at
            else:
                assert rec.window_until is None and rec.min_until is None

    # rules -----------------------------------------------------------------------------------------
    @rule(dt=st.floats(0, 30))
    def tick(self, dt: float) -> None:
        self.now += dt
        self._take(self.book.tick(self.now))
        self.last_tick = self.now
        # the tick touches only nodes whose timers fired: it must still miss none — every GPU
        # that may be leased now is on an offer
        offered = {g.gpu for o in self.book.offers.values() for g in o.gpus}
        for gpu in self.book.capacity:
            if not self.book._unavailable(gpu, self.now):
                assert gpu in offered, f"{gpu} is leasable but on no offer after the tick"

    @rule(
        gpu=st.sampled_from(GPUS),
        state=st.sampled_from(list(GpuState)),
        idle_for=st.one_of(st.none(), st.floats(0, 120)),
        age=st.floats(0, 5),
        plan_in=st.one_of(st.none(), st.none(), st.floats(0, 60)),
    )
    def capacity(self, gpu: str, state: GpuState, idle_for: float | None, age: float, plan_in: float | None) -> None:
        host, uuid = gpu.split("/")
        until = None if state is not GpuState.IDLE or idle_for is None else self.now + idle_for
        u = CapacityUpdate(
            ts=self.now - age,
            host=host,
            gpu_uuid=uuid,
            state=state,
            since=self.now - age,
            predicted_idle_until=until,
            model_name=MODEL[host],
            leaf=LEAF[host],
            planned_start=None if plan_in is None else self.now + plan_in,
        )
        old = self.caps.get(gpu)
        lease = self.book.lease_of(gpu)
        live = lease is not None and self.book.leases[lease].state in (LeaseState.GRANTED, LeaseState.ACTIVE)
        if u.planned_start is not None and lease is not None and live and (old is None or u.ts >= old.ts):
            self.plans[lease] = min(self.plans.get(lease, u.planned_start), u.planned_start)
        if old is None or u.ts >= old.ts:
            self.caps[gpu] = u
        self._take(self.book.apply_capacity(u, self.now))

    @rule(host=st.sampled_from(HOSTS), idle_for=st.floats(10, 120))
    def idle_node(self, host: str, idle_for: float) -> None:
        """Every GPU of ``host`` reported idle now (so that claims have something to take)."""
        for gpu in [g for g in GPUS if g.startswith(f"{host}/")]:
            u = CapacityUpdate(
                ts=self.now,
                host=host,
                gpu_uuid=gpu.split("/")[1],
                state=GpuState.IDLE,
                since=self.now,
                predicted_idle_until=self.now + idle_for,
                model_name=MODEL[host],
                leaf=LEAF[host],
            )
            self.caps[gpu] = u
            self._take(self.book.apply_capacity(u, self.now))

    @rule(fence=st.one_of(st.none(), st.sets(st.sampled_from(GPUS))))
    def scheduler_fence(self, fence: set[str] | None) -> None:
        """The training scheduler now holds ``fence`` for lending (``None``: no fence)."""
        self._take(self.book.set_lendable(fence, self.now))
        offered = {g.gpu for o in self.book.offers.values() for g in o.gpus}
        if fence is not None:
            assert offered <= fence, f"offered {sorted(offered - fence)} outside the fence"
        wanted = set(self.book.to_hold_for_lending(self.now))
        # a GPU whose update went stale (or whose hold ended) since the last tick keeps or gets its
        # offer until the next tick fires its node's timer: wanted then, or wanted now
        kept_until_tick = set(self.book.to_hold_for_lending(self.last_tick))
        assert offered <= wanted | kept_until_tick, "an offered GPU is not one the scheduler should hold"
        for gpu in wanted:  # every GPU the scheduler holds and the book wants is offered
            if fence is None or gpu in fence:
                assert gpu in offered, f"{gpu} is held for lending and wanted but on no offer"

    @rule(data=st.data())
    def claim(self, data: st.DataObject) -> None:
        site, claim = self._claim(data)
        answer, ch = self.book.claim(site, claim, self.now)
        self._take(ch)
        self._check_grant(claim, ch)
        if answer.ok and not answer.replayed:
            assert len(ch.records) == 1 and ch.records[0].state is LeaseState.GRANTED

    @rule(data=st.data(), grant=st.booleans(), delay=st.floats(0, 3))
    def claim_two_step(self, data: st.DataObject, grant: bool, delay: float) -> None:
        site, claim = self._claim(data)
        step, ch = self.book.begin_claim(site, claim, self.now)
        self._take(ch)
        if not isinstance(step, PendingGrant):
            return
        # while the fabric works, no offer may hold the reserved GPUs
        offered = {g.gpu for o in self.book.offers.values() for g in o.gpus}
        assert not offered & set(step.record.gpus)
        self.now += delay
        if grant:
            _, ch = self.book.grant(step, self.now)
            self._check_grant(claim, ch)
        else:
            _, ch = self.book.abort(step, ReasonCode.ISOLATION_FAILED, "test", self.now)
        self._take(ch)

    @rule(data=st.data(), ext=st.one_of(st.none(), st.floats(1, 100)))
    def renew(self, data: st.DataObject, ext: float | None) -> None:
        lid = self._pick_lease(data)
        site = self._latest()[lid].site if lid in self._latest() else "edge-a"
        _, ch = self.book.renew(
            site, Renewal(lease_id=lid, site=site, ts=self.now, extend_seconds=ext), self.now
        )
        self._take(ch)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lid = self._pick_lease(data)
        site = data.draw(st.sampled_from(SITES), label="releasing site")
        _, ch = self.book.release(site, Release(lease_id=lid, site=site, ts=self.now), self.now)
        self._take(ch)

    @rule(
        gpus=st.lists(st.sampled_from(GPUS), max_size=3, unique=True),
        count=st.integers(0, 4),
        force=st.booleans(),
    )
    def reclaim(self, gpus: list[str], count: int, force: bool) -> None:
        ch = self.book.reclaim(self.now, gpus, count, "test", force=force)
        if force:
            self.forced.update(r.lease_id for r in ch.records)
        self._take(ch)

    @rule(
        did=st.sampled_from(["d1", "d2", "d3", "d4"]),
        gpus=st.lists(st.sampled_from(GPUS), max_size=2, unique=True),
        count=st.integers(0, 3),
        age=st.floats(0, 40),
        force=st.booleans(),
    )
    def demand(self, did: str, gpus: list[str], count: int, age: float, force: bool) -> None:
        _, ch = self.book.apply_demand(
            PoolDemand(demand_id=did, ts=self.now - age, gpus=gpus, count=count, force=force), self.now
        )
        if force:
            self.forced.update(r.lease_id for r in ch.records)
        self._take(ch)

    @rule()
    def restart(self) -> None:
        """A new broker: rebuild from the lease log, then capacity is read again from the start."""
        before = {r.lease_id: r for r in self.book.live_leases()}
        fresh = LeaseBook(CFG, new_id=_new_id)
        ch = fresh.rebuild(self.log, self.now)
        assert not [r for r in ch.records if r.reason == "rebuild_conflict"]
        self._take(ch)
        for u in self.caps.values():
            lease = fresh.lease_of(u.key)
            if u.planned_start is not None and lease is not None and fresh.leases[lease].state in (
                LeaseState.GRANTED, LeaseState.ACTIVE
            ):  # the new broker learns the plans again
                self.plans[lease] = min(self.plans.get(lease, u.planned_start), u.planned_start)
            self._take(fresh.apply_capacity(u, self.now))
        after = {r.lease_id: r for r in fresh.live_leases()}
        # same live leases, with the same terms (the tick at rebuild may only end leases that were due)
        for lid, rec in after.items():
            assert before[lid] == rec
        for lid in set(before) - set(after):
            assert self._latest()[lid].state in (LeaseState.EXPIRED, LeaseState.REVOKED)
        self.book = fresh

    # invariants ------------------------------------------------------------------------------------
    @invariant()
    def no_gpu_in_two_live_leases(self) -> None:
        holder: dict[str, str] = {}
        for rec in self._latest().values():
            if rec.state.live:
                for g in rec.gpus:
                    assert g not in holder, f"{g} in {holder[g]} and {rec.lease_id}"
                    holder[g] = rec.lease_id

    @invariant()
    def offers_only_idle_unleased_gpus_within_prediction(self) -> None:
        live = {g for r in self._latest().values() if r.state.live for g in r.gpus}
        for offer in self.book.offers.values():
            for og in offer.gpus:
                cap = self.caps[og.gpu]
                assert og.gpu not in live, f"offer {offer.offer_id} holds leased {og.gpu}"
                assert cap.state is GpuState.IDLE, f"offer {offer.offer_id} holds {cap.state} {og.gpu}"
                assert cap.planned_start is None, f"offer {offer.offer_id} holds {og.gpu}, planned for training"
                # fresh when offered, and withdrawn by the next tick once stale
                assert offer.ts - cap.ts <= CFG.capacity_max_age_s, (
                    f"offer {offer.offer_id} made on stale {og.gpu}"
                )
                assert self.last_tick - cap.ts <= CFG.capacity_max_age_s, (
                    f"offer {offer.offer_id} kept stale {og.gpu}"
                )
                if cap.predicted_idle_until is not None:
                    # the promise is the prediction, or (a prediction already passed) nothing past ts
                    assert (
                        offer.available_until is not None
                        and offer.available_until <= max(cap.predicted_idle_until, offer.ts)
                    )
                if offer.available_until is not None:
                    assert offer.available_until >= offer.ts, f"offer {offer.offer_id} promises before its ts"

    @invariant()
    def log_is_a_valid_history(self) -> None:
        by_lease: dict[str, list[LeaseLogRecord]] = {}
        for r in self.log:
            by_lease.setdefault(r.lease_id, []).append(r)
        for recs in by_lease.values():
            assert [r.seq for r in recs] == list(range(1, len(recs) + 1))
            assert recs[0].state is LeaseState.GRANTED
            assert all(r.state.live for r in recs[:-1]), "a terminal lease changed again"

    @invariant()
    def no_site_above_its_quota(self) -> None:
        held: dict[str, int] = {}
        for rec in self._latest().values():
            if rec.state.live:
                held[rec.site] = held.get(rec.site, 0) + len(rec.gpus)
        for site, n in held.items():
            quota = CFG.quota_of(site)
            assert quota is None or n <= quota, f"{site} holds {n} GPUs, quota {quota}"

    @invariant()
    def no_unforced_reclaim_inside_a_guarantee(self) -> None:
        for r in self.log:
            if r.min_until is None or r.lease_id in self.forced:
                continue
            if r.state is LeaseState.RECLAIMING:
                assert r.reclaim_deadline is not None and r.reclaim_deadline >= r.min_until, (
                    f"lease {r.lease_id} reclaimed for {r.reclaim_deadline} inside its guarantee to {r.min_until}"
                )
            if r.state is LeaseState.REVOKED:
                assert r.ts >= r.min_until, f"lease {r.lease_id} revoked at {r.ts} inside its guarantee"

    @invariant()
    def matched_leases_stay_local(self) -> None:
        for r in self.log:
            if r.seq == 1:
                assert r.hosts == sorted({g.split("/")[0] for g in r.gpus})
                assert len(r.offer_ids) >= 1 and r.offer_ids[0] == r.offer_id
                if r.reason == "match:leaf":
                    assert len({LEAF[h] for h in r.hosts}) == 1

    @invariant()
    def at_risk_only_after_a_plan_and_never_later(self) -> None:
        by_lease: dict[str, list[LeaseLogRecord]] = {}
        for r in self.log:
            by_lease.setdefault(r.lease_id, []).append(r)
        for lid, recs in by_lease.items():
            recs = sorted(recs, key=lambda r: r.seq)
            assert len({r.window_until for r in recs if r.reason != "log_write_failed"}) <= 1, (
                f"lease {lid}'s promised window moved")
            expected = [r.reclaim_expected_at for r in recs if r.reclaim_expected_at is not None]
            assert expected == sorted(expected, reverse=True), f"lease {lid}'s expected reclaim moved later"
            if expected:
                assert lid in self.plans and expected[-1] == self.plans[lid], (
                    f"lease {lid} at risk at {expected[-1]}, plans sent {self.plans.get(lid)}")
            for r in recs:
                if r.reason == "at_risk":
                    assert r.at_risk_since is not None and r.state in (LeaseState.GRANTED, LeaseState.ACTIVE)

    @invariant()
    def book_agrees(self) -> None:
        assert self.book.violations() == []


TestLeaseBook = LeaseBookMachine.TestCase
TestLeaseBook.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
