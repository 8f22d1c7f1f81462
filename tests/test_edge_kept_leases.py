"""broker.kept_leases: leases kept at a target size and handed over on notice, against a fake
broker (the client protocol :class:`broker.kept_leases.LeaseClient`); the real services are in
tests/test_edge_kept_leases_slurm.py."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncGenerator, Callable, Mapping

import pytest

from broker.edge import ClaimRejected, LeaseRequestRejected, WatchEvent
from broker.kept_leases import AVOID_BUDGET_BYTES, Endpoints, KeptLeases, NoEndpoint
from contracts import LeaseMessage, LeaseState, ReasonCode, Reply
from contracts.mqtt import LIMITS, Requirements

pytestmark = pytest.mark.timeout(30)


class Clock:
    """A Unix clock the test moves."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeBroker:
    """The client side of a broker: grants matched claims (idempotent by claim_id), publishes
    lease messages to watchers, answers renewals and releases; scripted refusals and outages."""

    site = "edge-a"

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.leases: dict[str, LeaseMessage] = {}
        self.by_claim: dict[str, str] = {}
        self.claim_ids: list[str] = []
        self.requirements: list[Requirements | None] = []
        """The requirements of each claim sent, in order."""
        self.nodes: list[str] = []
        """The nodes of the next grants, in order (then ``n``)."""
        self.send_hosts = True
        """Lease messages carry ``hosts`` (False: as an old broker, the host only in GPU keys)."""
        self.refuse: list[ReasonCode] = []
        self.timeouts = 0
        """Requests (claims, renewals, releases) still to go unanswered."""
        self.renew_code: ReasonCode = ReasonCode.OK
        self.online: bool | None = True
        self.released: list[tuple[str, float]] = []
        self.renewed: list[str] = []
        self._queues: set[asyncio.Queue[WatchEvent]] = set()
        self._ids = itertools.count(1)

    # what KeptLeases uses ------------------------------------------------------------------------
    @property
    def known_leases(self) -> Mapping[str, LeaseMessage]:
        return dict(self.leases)

    @property
    def broker_online(self) -> bool | None:
        return self.online

    async def request(
        self, count: int, requirements: Requirements | None = None, duration_seconds: float = 300.0,
        min_notice_seconds: float = 0.0, min_duration_seconds: float = 0.0, timeout_s: float = 5.0,
        claim_id: str | None = None, workload: str | None = None,
    ) -> LeaseMessage:  # fmt: skip
        assert claim_id is not None and workload == "infer" and count == 1
        self.claim_ids.append(claim_id)
        self.requirements.append(requirements)
        await asyncio.sleep(0)
        if self.timeouts:
            self.timeouts -= 1
            raise TimeoutError
        if self.refuse:
            code = self.refuse.pop(0)
            raise ClaimRejected(Reply(in_reply_to=claim_id, site=self.site, code=code, ts=self.clock()))
        if claim_id in self.by_claim:
            return self.leases[self.by_claim[claim_id]]
        lease_id = f"L{next(self._ids)}"
        self.by_claim[claim_id] = lease_id
        node = self.nodes.pop(0) if self.nodes else "n"
        msg = LeaseMessage(
            lease_id=lease_id, site=self.site, claim_id=claim_id, offer_id="o",
            gpus=[f"{node}/gpu{lease_id}"], hosts=[node] if self.send_hosts else [], state=LeaseState.GRANTED,
            ts=self.clock(), expires_at=self.clock() + 60, notice_seconds=10, workload=workload,
        )  # fmt: skip
        self.publish(msg)
        return msg

    async def renew(
        self, lease_id: str, extend_seconds: float | None = None, timeout_s: float = 5.0
    ) -> Reply:
        await asyncio.sleep(0)
        if self.timeouts:
            self.timeouts -= 1
            raise TimeoutError
        reply = Reply(in_reply_to=lease_id, site=self.site, code=self.renew_code, ts=self.clock())
        if self.renew_code is not ReasonCode.OK:
            raise LeaseRequestRejected(reply)
        self.renewed.append(lease_id)
        return reply

    async def release(self, lease_id: str, timeout_s: float = 5.0) -> Reply:
        await asyncio.sleep(0)
        if self.timeouts:
            self.timeouts -= 1
            raise TimeoutError
        msg = self.leases[lease_id]
        if not msg.state.live:
            raise LeaseRequestRejected(
                Reply(in_reply_to=lease_id, site=self.site, code=ReasonCode.LEASE_NOT_LIVE, ts=self.clock())
            )
        self.released.append((lease_id, self.clock()))
        self.transition(lease_id, state=LeaseState.RELEASED)
        return Reply(in_reply_to=lease_id, site=self.site, code=ReasonCode.OK, ts=self.clock())

    async def watch(self) -> AsyncGenerator[WatchEvent, None]:
        queue: asyncio.Queue[WatchEvent] = asyncio.Queue()
        self._queues.add(queue)
        try:
            for msg in list(self.leases.values()):
                yield msg
            while True:
                yield await queue.get()
        finally:
            self._queues.discard(queue)

    # what the test does ------------------------------------------------------------------------------
    def publish(self, msg: LeaseMessage) -> None:
        self.leases[msg.lease_id] = msg
        for q in self._queues:
            q.put_nowait(msg)

    def transition(self, lease_id: str, **changes: object) -> None:
        msg = self.leases[lease_id]
        self.publish(msg.model_copy(update={"seq": msg.seq + 1, "ts": self.clock(), **changes}))

    def healthy(self, lease_id: str) -> str:
        endpoint = f"10.0.0.{lease_id[1:]}:8000"
        self.transition(lease_id, endpoint=endpoint)
        return endpoint

    def reclaim(self, lease_id: str, in_s: float = 10.0) -> float:
        deadline = self.clock() + in_s
        self.transition(
            lease_id, state=LeaseState.RECLAIMING, reclaim_deadline=deadline, reason="scheduler_preempted:7"
        )
        return deadline

    def plan_onto(self, lease_id: str, start_in_s: float = 60.0) -> None:
        """The broker's at-risk message: a training job planned onto the lease's GPUs."""
        now = self.clock()
        self.transition(lease_id, reason="at_risk", at_risk_since=now, reclaim_expected_at=now + start_in_s)

    def live(self) -> list[str]:
        return [k for k, m in self.leases.items() if m.state.live]


async def until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.005)


async def settle(s: float = 0.25) -> None:
    """Long enough for a few ticks of the helper (0.1 s) to act, if it were going to."""
    await asyncio.sleep(s)


def kept(broker: FakeBroker, clock: Clock, **kw: object) -> KeptLeases:
    args: dict[str, object] = {
        "target": 2, "workload": "infer", "renew_every_s": 60.0, "retry_min_s": 0.01, "retry_max_s": 0.02,
        "clock": clock,
    }  # fmt: skip
    args.update(kw)
    return KeptLeases(broker, **args)  # type: ignore[arg-type]


async def serving_two(broker: FakeBroker, pool: KeptLeases) -> list[str]:
    await until(lambda: len(broker.live()) == 2)
    for lease_id in broker.live():
        broker.healthy(lease_id)
    await pool.ready(2)
    return broker.live()


# endpoints ---------------------------------------------------------------------------------------------
async def test_endpoints_round_robin_count_in_flight_and_drain() -> None:
    ep = Endpoints()
    with pytest.raises(NoEndpoint):
        with ep.use():
            pass
    assert ep._set(["a:1", "b:2"]) and not ep._set(["a:1", "b:2"])
    picked = []
    for _ in range(4):
        with ep.use() as e:
            picked.append(e)
    assert picked == ["a:1", "b:2", "a:1", "b:2"]
    with ep.use() as first, ep.use() as second:
        assert (ep.in_flight(first), ep.in_flight(second)) == (1, 1)
        ep._set(["b:2"])
        assert not await ep.drained(first, 0.05)  # still in flight: gave up after the timeout
        waiter = asyncio.create_task(ep.drained(first, 5))
        await asyncio.sleep(0.01)
        assert not waiter.done()
    assert await waiter  # woken when the request finished
    assert ep.in_flight("a:1") == 0 and await ep.drained("a:1", 0)


async def test_acquire_waits_for_an_endpoint_at_most_its_wait_then_fails() -> None:
    """A request sent while no endpoint serves waits for one (the gap between a lease's deadline
    and its replacement serving) up to ``wait_s``, then takes the first that joins; past the wait,
    or with none, it fails ``NoEndpoint``; an endpoint that leaves again keeps it waiting."""
    ep = Endpoints()
    with pytest.raises(NoEndpoint):
        async with ep.acquire(0):
            pass
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(NoEndpoint):
        async with ep.acquire(0.05):
            pass
    assert asyncio.get_running_loop().time() - t0 >= 0.05

    async def take() -> tuple[str, int]:
        async with ep.acquire(1.0) as endpoint:
            return endpoint, ep.in_flight(endpoint)

    waiting = asyncio.create_task(take())
    await asyncio.sleep(0.02)
    ep._set(["a:1"])
    ep._set([])  # gone before the waiter ran: it waits on
    await asyncio.sleep(0.02)
    assert not waiting.done()
    ep._set(["b:2"])
    assert await asyncio.wait_for(waiting, 1.0) == ("b:2", 1)
    assert ep.in_flight("b:2") == 0
    async with ep.acquire(0) as endpoint:  # one serves: at once, as use()
        assert endpoint == "b:2"


# keeping the target ------------------------------------------------------------------------------------
async def test_claims_up_to_the_target_and_serves_each_endpoint_once_healthy() -> None:
    clock = Clock()
    broker = FakeBroker(clock)
    changes: list[tuple[str, ...]] = []
    async with kept(broker, clock, on_change=changes.append) as pool:
        await until(lambda: len(broker.live()) == 2)
        await settle()
        assert len(broker.claim_ids) == 2  # no more claims than the target
        assert pool.endpoints.serving == ()
        first = broker.healthy(broker.live()[0])
        await until(lambda: pool.endpoints.serving == (first,))
        second = broker.healthy(broker.live()[1])
        assert set(await pool.ready(2)) == {first, second}
        assert changes[-1] == pool.endpoints.serving and len(changes) == 2
        # a later message without endpoint (a restarted broker checking health again) keeps it
        broker.transition(broker.live()[0], endpoint=None, state=LeaseState.ACTIVE)
        await settle()
        assert set(pool.endpoints.serving) == {first, second}
    assert sorted(r for r, _ in broker.released) == sorted(broker.leases)  # released on exit
    assert pool.endpoints.serving == ()


async def test_reclaim_claims_first_switches_when_the_replacement_serves_drains_then_releases_early() -> None:
    clock = Clock()
    broker = FakeBroker(clock)
    async with kept(broker, clock) as pool:
        old, other = await serving_two(broker, pool)
        old_ep = broker.leases[old].endpoint
        with pool.endpoints.use() as in_flight:  # one request on the old endpoint, not finished
            assert in_flight == old_ep
            deadline = broker.reclaim(old)
            await until(lambda: len(broker.live()) == 3)  # the replacement, claimed at once
            (new,) = set(broker.live()) - {old, other}
            await settle()
            # the replacement does not serve yet: the old endpoint keeps serving (2 still >= target)
            assert old_ep in pool.endpoints.serving and not broker.released
            new_ep = broker.healthy(new)
            await until(lambda: old_ep not in pool.endpoints.serving)
            assert set(pool.endpoints.serving) == {broker.leases[other].endpoint, new_ep}
            await settle()
            assert not broker.released  # a request is still in flight there
        await until(lambda: bool(broker.released))
        assert broker.released == [(old, clock.now)]
        (h,) = pool.handovers
        assert (h.lease_id, h.endpoint, h.deadline, h.drained) == (old, old_ep, deadline, True)
        assert h.switched_at is not None and h.drained_at is not None and h.early
        await until(lambda: h.ended is LeaseState.RELEASED)
        assert pool.counts["reclaims"] == 1 and pool.counts["released_early"] == 1
        assert pool.counts["lost"] == 0 and pool.counts["released"] == 0  # its own release
        assert set(pool.leases) == {other, new}
        assert len(broker.claim_ids) == 3


async def test_with_an_overlap_the_leaving_endpoint_shares_the_traffic_that_long_after_the_replacement_joined() -> (
    None
):
    clock = Clock()
    broker = FakeBroker(clock)
    async with kept(broker, clock, overlap_s=2.0, handover_margin_s=1.0) as pool:
        old, other = await serving_two(broker, pool)
        old_ep = broker.leases[old].endpoint
        broker.reclaim(old, in_s=10.0)
        await until(lambda: len(broker.live()) == 3)
        (new,) = set(broker.live()) - {old, other}
        joined = clock.now
        new_ep = broker.healthy(new)
        await until(lambda: new_ep in pool.endpoints.serving)
        clock.now = joined + 1.99
        await settle()
        assert set(pool.endpoints.serving) == {old_ep, broker.leases[other].endpoint, new_ep}
        assert not broker.released
        clock.now = joined + 2.0
        await until(lambda: old_ep not in pool.endpoints.serving)
        await until(lambda: bool(broker.released))
        assert pool.handovers[0].switched_at == joined + 2.0 and pool.handovers[0].early


async def test_an_overlap_never_keeps_the_leaving_endpoint_past_the_margin_before_its_deadline() -> None:
    clock = Clock()
    broker = FakeBroker(clock)
    async with kept(broker, clock, overlap_s=30.0, handover_margin_s=1.0) as pool:
        old, other = await serving_two(broker, pool)
        old_ep = broker.leases[old].endpoint
        deadline = broker.reclaim(old, in_s=10.0)
        await until(lambda: len(broker.live()) == 3)
        (new,) = set(broker.live()) - {old, other}
        new_ep = broker.healthy(new)
        await until(lambda: new_ep in pool.endpoints.serving)
        clock.now = deadline - 1.01
        await settle()
        assert old_ep in pool.endpoints.serving
        clock.now = deadline - 1.0
        await until(lambda: old_ep not in pool.endpoints.serving)
    with pytest.raises(ValueError, match="overlap_s"):
        kept(broker, clock, overlap_s=-0.1)


async def test_without_a_replacement_the_leaving_endpoint_serves_until_the_margin_before_the_deadline() -> (
    None
):
    clock = Clock()
    broker = FakeBroker(clock)
    async with kept(broker, clock, handover_margin_s=1.0) as pool:
        old, other = await serving_two(broker, pool)
        old_ep = broker.leases[old].endpoint
        deadline = broker.reclaim(old, in_s=10.0)
        clock.now = deadline - 1.01
        await settle()
        assert old_ep in pool.endpoints.serving
        clock.now = deadline - 1.0  # the margin reached, another endpoint serves: switched
        await until(lambda: old_ep not in pool.endpoints.serving)
        await until(lambda: bool(broker.released))
        assert pool.endpoints.serving == (broker.leases[other].endpoint,)


async def test_the_last_serving_endpoint_is_not_switched_off_for_a_deadline() -> None:
    clock = Clock()
    broker = FakeBroker(clock)
    broker.refuse = [ReasonCode.NO_MATCH] * 10_000  # no second lease, no replacement
    async with kept(broker, clock, target=1) as pool:
        broker.refuse = []
        await until(lambda: len(broker.live()) == 1)
        broker.refuse = [ReasonCode.NO_MATCH] * 10_000
        (only,) = broker.live()
        ep = broker.healthy(only)
        await pool.ready(2)
        deadline = broker.reclaim(only, in_s=10.0)
        clock.now = deadline - 0.5
        await settle()
        assert pool.endpoints.serving == (ep,) and not broker.released
        assert pool.counts["refused:no_match"] > 1


async def test_refused_claims_are_sent_again_with_a_new_claim_id_one_unanswered_with_the_same() -> None:
    clock = Clock()
    broker = FakeBroker(clock)
    broker.refuse = [ReasonCode.GPU_UNAVAILABLE, ReasonCode.ISOLATION_FAILED]
    async with kept(broker, clock, target=1) as pool:
        await until(lambda: len(broker.live()) == 1)
        assert len(set(broker.claim_ids)) == 3
        assert pool.counts["refused:gpu_unavailable"] == pool.counts["refused:isolation_failed"] == 1
    clock2 = Clock()
    broker = FakeBroker(clock2)
    broker.timeouts = 2
    async with kept(broker, clock2, target=1) as pool:
        await until(lambda: len(broker.live()) == 1)
        await settle()
        assert len(broker.claim_ids) == 3 and len(set(broker.claim_ids)) == 1  # never two leases
        assert pool.counts["claim_timeouts"] == 2 and pool.counts["granted"] == 1


async def test_a_lease_revoked_without_notice_leaves_the_view_at_once_and_is_replaced() -> None:
    clock = Clock()
    broker = FakeBroker(clock)
    async with kept(broker, clock) as pool:
        gone, other = await serving_two(broker, pool)
        broker.transition(gone, state=LeaseState.REVOKED, reason="hold_lost:9")
        await until(lambda: pool.endpoints.serving == (broker.leases[other].endpoint,))
        await until(lambda: len(broker.live()) == 2)
        assert pool.counts["lost"] == 1 and pool.counts["revoked"] == 1
        assert gone not in pool.leases and not broker.released


async def test_a_renewal_answered_unknown_lease_loses_the_lease_and_a_timeout_does_not() -> None:
    clock = Clock()
    broker = FakeBroker(clock)
    async with kept(broker, clock, renew_every_s=0.05) as pool:
        first, second = await serving_two(broker, pool)
        broker.timeouts = 4  # the broker is away: renewals unanswered, nothing lost
        await until(lambda: pool.counts["renewal_timeouts"] >= 4)
        await settle(0.1)
        assert set(pool.leases) == {first, second} and len(pool.endpoints.serving) == 2
        broker.renew_code = ReasonCode.UNKNOWN_LEASE
        await until(lambda: pool.counts["lost"] == 2)
        assert pool.endpoints.serving == ()
        broker.renew_code = ReasonCode.OK
        await until(lambda: len(set(pool.leases) - {first, second}) == 2)


async def test_a_broker_back_online_gets_every_lease_renewed_at_once() -> None:
    clock = Clock()
    broker = FakeBroker(clock)
    async with kept(broker, clock, renew_every_s=3600) as pool:
        leases = await serving_two(broker, pool)
        broker.online = False
        await settle()
        assert not broker.renewed
        broker.online = True
        await until(lambda: sorted(broker.renewed) == sorted(leases))
        assert pool.counts["broker_restarts"] == 1 and len(pool.endpoints.serving) == 2


async def test_a_lease_not_serving_within_the_ready_timeout_is_released_and_replaced() -> None:
    clock = Clock()
    broker = FakeBroker(clock)
    async with kept(broker, clock, target=1, ready_timeout_s=30) as pool:
        await until(lambda: len(broker.live()) == 1)
        (slow,) = broker.live()
        clock.now += 29.9
        await settle()
        assert slow in pool.leases
        clock.now += 0.1
        await until(lambda: broker.released == [(slow, clock.now)])
        await until(lambda: len(broker.live()) == 1 and broker.live() != [slow])
        assert pool.counts["start_failed"] == 1


async def test_at_risk_hands_over_like_a_notice_and_takes_the_deadline_of_a_later_reclaim() -> None:
    clock = Clock()
    broker = FakeBroker(clock)
    async with kept(broker, clock) as pool:
        risky, other = await serving_two(broker, pool)
        assert not pool.at_risk("L999")
        assert pool.at_risk(risky, reason="site_health")
        assert not pool.at_risk(risky)  # once
        await until(lambda: len(broker.live()) == 3)
        (h,) = pool.handovers
        assert h.deadline is None and h.reason == "site_health"
        deadline = broker.reclaim(risky)
        await until(lambda: h.deadline == deadline)
        assert pool.counts["reclaims"] == 0 and pool.counts["at_risk"] == 1
        (new,) = set(broker.live()) - {risky, other}
        broker.healthy(new)
        await until(lambda: bool(broker.released))
        assert broker.released[0][0] == risky and h.early


async def test_the_brokers_at_risk_message_starts_the_hand_over_before_any_notice() -> None:
    clock = Clock()
    broker = FakeBroker(clock)
    async with kept(broker, clock) as pool:
        risky, other = await serving_two(broker, pool)
        broker.plan_onto(risky)
        await until(lambda: len(broker.live()) == 3)  # a replacement claimed, no notice yet
        (h,) = pool.handovers
        assert h.lease_id == risky and h.reason == "at_risk" and h.deadline is None
        assert pool.counts["at_risk"] == 1 and pool.counts["reclaims"] == 0
        broker.plan_onto(risky, 30.0)  # an earlier plan: still one hand-over
        await settle()
        assert len(pool.handovers) == 1 and pool.counts["at_risk"] == 1
        (new,) = set(broker.live()) - {risky, other}
        broker.healthy(new)
        await until(lambda: bool(broker.released))
        assert broker.released[0][0] == risky and h.early  # the pool got its GPUs back early


async def test_entering_adopts_the_sites_live_leases_of_the_workload() -> None:
    clock = Clock()
    broker = FakeBroker(clock)
    lease = await broker.request(1, claim_id="earlier", workload="infer")
    ep = broker.healthy(lease.lease_id)
    async with kept(broker, clock) as pool:
        assert pool.endpoints.serving == (ep,)
        await until(lambda: len(broker.live()) == 2)
        assert len(broker.claim_ids) == 2  # one adopted, one claimed


def test_bad_targets_are_refused() -> None:
    with pytest.raises(ValueError, match="target"):
        KeptLeases(FakeBroker(Clock()), target=0, workload="infer")
    with pytest.raises(ValueError, match="backoff"):
        KeptLeases(FakeBroker(Clock()), target=1, workload="infer", retry_min_s=0)


async def test_a_lease_reclaimed_before_it_serves_is_released_at_once() -> None:
    clock = Clock()
    broker = FakeBroker(clock)
    async with kept(broker, clock) as pool:
        await until(lambda: len(broker.live()) == 2)
        starting, other = broker.live()
        ep = broker.healthy(other)
        broker.reclaim(starting)
        await until(lambda: broker.released == [(starting, clock.now)])
        assert pool.endpoints.serving == (ep,)
        (h,) = pool.handovers
        assert h.endpoint is None and h.drained_at is None and h.early
        await until(lambda: len(broker.live()) == 2)  # and replaced


async def test_an_endpoint_serves_only_once_the_sites_probe_passes_for_its_lease() -> None:
    clock = Clock()
    broker = FakeBroker(clock)
    ready: set[str] = set()
    asked: list[tuple[str, str]] = []

    async def probe(endpoint: str, lease_id: str) -> bool:
        asked.append((endpoint, lease_id))
        return lease_id in ready

    async with kept(broker, clock, target=1, probe=probe) as pool:
        await until(lambda: len(broker.live()) == 1)
        (lease,) = broker.live()
        ep = broker.healthy(lease)
        await until(lambda: len(asked) >= 3)
        assert pool.endpoints.serving == () and set(asked) == {(ep, lease)}
        ready.add(lease)
        await until(lambda: pool.endpoints.serving == (ep,))


async def test_a_serving_endpoint_failing_its_recheck_in_a_row_leaves_at_once_and_is_replaced() -> None:
    clock = Clock()
    broker = FakeBroker(clock)
    answers: dict[str, list[bool]] = {}

    async def recheck(endpoint: str, lease_id: str) -> bool:
        script = answers.get(lease_id)
        return script.pop(0) if script else True

    async with kept(broker, clock, recheck=recheck, recheck_every_s=0.02, recheck_failures=2) as pool:
        flaky, dead = await serving_two(broker, pool)
        answers[flaky] = [False, True, False, True]  # never twice in a row: stays
        answers[dead] = [False, False]
        await until(lambda: bool(broker.released))
        assert broker.released[0][0] == dead and pool.counts["unhealthy"] == 1
        assert broker.leases[flaky].endpoint in pool.endpoints.serving
        assert broker.leases[dead].endpoint not in pool.endpoints.serving
        (h,) = pool.handovers
        assert h.reason == "unhealthy" and h.endpoint is None  # nothing drained from a dead endpoint
        await until(lambda: len(broker.live()) == 2)
    with pytest.raises(ValueError, match="recheck_failures"):
        KeptLeases(broker, target=1, workload="infer", recheck_failures=0)


# spreading over nodes ---------------------------------------------------------------------------------
def _avoided(req: Requirements | None) -> list[str]:
    return [] if req is None else req.avoid_hosts


@pytest.mark.parametrize("send_hosts", [True, False])
async def test_each_claim_avoids_the_nodes_of_the_kept_leases_and_a_replacement_the_reclaimed_one_first(
    send_hosts: bool,
) -> None:
    clock = Clock()
    broker = FakeBroker(clock)
    broker.send_hosts = send_hosts  # an old broker: the nodes are read from the GPU keys
    broker.nodes = ["node-b", "node-a", "node-c", "node-d"]
    async with kept(broker, clock, avoid_taken_back_s=30.0) as pool:
        first, second = await serving_two(broker, pool)
        # claims go one at a time: the second knows where the first landed
        assert [_avoided(r) for r in broker.requirements] == [[], ["node-b"]]
        assert broker.requirements[0] is None  # nothing to avoid: the site's requirements as given
        assert pool.avoid_hosts() == ["node-b", "node-a"]  # oldest lease first
        broker.reclaim(second)
        await until(lambda: len(broker.live()) == 3)
        # the replacement keeps off the node taken back first, then the other lease's node
        assert _avoided(broker.requirements[-1]) == ["node-a", "node-b"]
        (new,) = set(broker.live()) - {first, second}
        broker.healthy(new)
        await until(lambda: second not in pool.leases)
        # released: its node stays last for avoid_taken_back_s (30 s)
        assert pool.avoid_hosts() == ["node-b", "node-c", "node-a"]
        clock.now += 29.9
        assert pool.avoid_hosts() == ["node-b", "node-c", "node-a"]
        clock.now += 0.1
        assert pool.avoid_hosts() == ["node-b", "node-c"]
        # an at-risk lease (here the oldest) comes first while it is handed over
        assert pool.at_risk(first)
        await until(lambda: len(broker.requirements) == 4)
        assert _avoided(broker.requirements[-1]) == ["node-b", "node-c"]
        assert len(broker.live()) == 3
        assert pool.avoid_hosts() == ["node-b", "node-c", "node-d"]


async def test_nodes_taken_back_are_not_remembered_with_avoid_taken_back_s_0() -> None:
    clock = Clock()
    broker = FakeBroker(clock)
    broker.nodes = ["node-b", "node-a", "node-c"]
    async with kept(broker, clock, avoid_taken_back_s=0.0) as pool:
        first, second = await serving_two(broker, pool)
        broker.reclaim(second)
        await until(lambda: len(broker.live()) == 3)
        (new,) = set(broker.live()) - {first, second}
        broker.healthy(new)
        await until(lambda: second not in pool.leases)
        assert pool.avoid_hosts() == ["node-b", "node-c"]
    with pytest.raises(ValueError, match="avoid_taken_back_s"):
        kept(broker, clock, avoid_taken_back_s=-1.0)


async def test_the_sites_own_requirements_are_kept_and_its_avoided_nodes_come_first() -> None:
    clock = Clock()
    broker = FakeBroker(clock)
    broker.nodes = ["node-z", "node-a"]
    own = Requirements(model_names=["H100"], avoid_hosts=["node-x"])
    async with kept(broker, clock, requirements=own) as pool:
        await serving_two(broker, pool)
        assert broker.requirements[0] == own
        second = broker.requirements[1]
        assert second is not None and second.model_names == ["H100"]
        assert second.avoid_hosts == ["node-x", "node-z"]
        assert pool.avoid_hosts() == ["node-x", "node-z", "node-a"]


async def test_a_long_avoid_list_is_cut_from_its_end_so_the_claim_stays_inside_the_limits() -> None:
    clock = Clock()
    broker = FakeBroker(clock)
    broker.nodes = ["node-a"]
    names = [f"site-node-{i:018d}" for i in range(2000)]  # 32 bytes each in the JSON, with ", "
    own = Requirements(avoid_hosts=names[: LIMITS.max_list_items])
    async with kept(broker, clock, target=1, requirements=own) as pool:
        await until(lambda: len(broker.live()) == 1)
        avoid = pool.avoid_hosts()
        assert avoid == names[: AVOID_BUDGET_BYTES // 32]  # the most important first, to the byte
        assert len(json.dumps(avoid)) <= AVOID_BUDGET_BYTES
    short = [f"n{i}" for i in range(1100)]  # 1,024 of them fit in the bytes: the count cuts
    many = kept(broker, clock, requirements=Requirements.model_construct(avoid_hosts=short))
    assert many.avoid_hosts() == short[: LIMITS.max_list_items]
    longest = "n" * LIMITS.max_name_chars
    too_long = Requirements.model_construct(avoid_hosts=["x" * (LIMITS.max_name_chars + 1), longest])
    pool = kept(broker, clock, requirements=too_long)
    assert pool.avoid_hosts() == [longest]
