"""Analytics joined with the training scheduler (``telemetry.scheduler``): a GPU is offerable only
when the scheduler has it unallocated and its telemetry says idle; a promise never runs past a
pending job's planned start on the node; GPUs allocated but idle are counted per job."""

from __future__ import annotations

import pytest

from analytics.classify import FB_USED, GR_ENGINE_ACTIVE, GpuStatus
from analytics.scheduler import SchedulerJoin
from analytics.service import AnalyticsService
from contracts import GpuSample, GpuState, encode
from contracts.bus import MemoryBus
from contracts.scheduler import PendingJob, SchedulerGpu, SchedulerNode
from tests.analytics_support import IDLE, TOPICS, drain, latest, service
from tests.support import Clock

T0 = 1_700_000_000.0
HOST = "gpu-node-001"


def sample(ts: float, index: int, activity: float = 0.0, host: str = HOST) -> GpuSample:
    return GpuSample(
        ts=ts,
        host=host,
        gpu_uuid=f"GPU-{host}-{index}",
        gpu_index=index,
        model_name="NVIDIA H100 80GB HBM3",
        fields={GR_ENGINE_ACTIVE: activity, FB_USED: 0},
    )


def node(
    ts: float,
    *,
    job_on: dict[int, str] | None = None,
    planned_start: float | None = None,
    need: int = 8,
    state: str = "MIXED",
    flags: tuple[str, ...] = (),
    host: str = HOST,
) -> SchedulerNode:
    job_on = job_on or {}
    pending = []
    if planned_start is not None:
        pending.append(
            PendingJob(
                job_id="43", user="bob", partition="training", gpus_per_node=need, gpus=need,
                reason="Resources", planned_start=planned_start, planned_nodes=[host],
            )
        )  # fmt: skip
    return SchedulerNode(
        ts=ts,
        host=host,
        state=state,
        state_flags=list(flags),
        gpus=[
            SchedulerGpu(
                index=i, gres_type="h100", allocated=i in job_on, job_id=job_on.get(i),
                user="alice" if i in job_on else None, partition="training" if i in job_on else None,
            )
            for i in range(4)
        ],  # fmt: skip
        pending=pending,
    )


async def send(bus: MemoryBus, rec: GpuSample | SchedulerNode) -> None:
    topic = TOPICS.telemetry_gpu if isinstance(rec, GpuSample) else TOPICS.telemetry_scheduler
    await bus.producer().send(topic, encode(rec), key=rec.partition_key)


def gauge(svc: AnalyticsService, **labels: str) -> float | None:
    return svc.registry.get_sample_value("gpupool_analytics_allocated_idle_gpus", labels)


async def _feed(
    bus: MemoryBus, svc: AnalyticsService, clock: Clock, times: range, records: dict[float, SchedulerNode]
) -> None:
    """Every GPU 0..3 idle at each ``T0 + t``; the scheduler record of that time first, if any."""
    for t in times:
        if T0 + t in records:
            await send(bus, records[T0 + t])
        for i in range(4):
            await send(bus, sample(T0 + t, i))
        clock.t = T0 + t
        await drain(svc)


async def test_allocated_gpu_is_not_offered_and_the_window_stops_at_the_planned_start() -> None:
    bus, clock = MemoryBus(), Clock(T0)
    svc = service(bus, clock, refresh_s=3600.0, scheduler=True)
    await svc.start()
    try:
        # GPU 0 held by training job 42 (idle by DCGM); job 43 planned onto the node at T0 + 45
        # needs 2 GPUs there: the free GPUs 1 and 2 (lowest index first) are not lent, GPU 3 is
        records = {T0 + t: node(T0 + t, job_on={0: "42"}, planned_start=T0 + 45, need=2) for t in (0, 10, 20, 30)}
        await _feed(bus, svc, clock, range(0, 31, 10), records)
        # (an update goes out when the state changes: GPU 0 stays unknown, from idle_pending to
        # scheduler_allocated, so its current update is read from the service)
        held = svc.current_states()[f"{HOST}/GPU-{HOST}-0"]
        assert held.state is GpuState.UNKNOWN and held.reason == "scheduler_allocated"
        for i in (1, 2):
            planned = svc.current_states()[f"{HOST}/GPU-{HOST}-{i}"]
            assert planned.state is GpuState.UNKNOWN and planned.reason == "scheduler_planned"
            assert planned.planned_start == T0 + 45
        free = latest(bus)[f"{HOST}/GPU-{HOST}-3"]
        assert free.state is GpuState.IDLE and free.ts == T0 + 30 and free.planned_start is None
        # without the plan the promise would be T0 + 30 + min_idle_s (no history): cut at T0 + 45
        assert free.predicted_idle_until == pytest.approx(T0 + 45)
        assert gauge(svc, partition="training", user="alice", job="42") == 1
        # the idle GPU-hours of job 42: reads at 0, 10, 20, 30 s; GPU 0 decided idle from 30 s only
        # (min_idle_s), so the read at 30 s is the first idle one and, being the latest, counts 0
        _, rows = svc.store.sql(
            "SELECT job_id, job_user, job_partition, gpus, allocated_gpu_hours, idle_gpu_hours"
            " FROM allocated_idle_gpu_hours"
        )
        assert rows == [("42", "alice", "training", 1, pytest.approx(30 / 3600), 0.0)]
        at40 = node(T0 + 40, job_on={0: "42"}, planned_start=T0 + 45, need=2)
        await _feed(bus, svc, clock, range(40, 41), {T0 + 40: at40})
        _, [(idle_h, alloc_h)] = svc.store.sql(
            "SELECT idle_gpu_hours, allocated_gpu_hours FROM allocated_idle_gpu_hours"
        )
        assert idle_h == pytest.approx(10 / 3600) and alloc_h == pytest.approx(40 / 3600)
        # the planned start comes within the promise: at T0 + 45 it is now, so nothing is offered
        at45 = node(T0 + 45, job_on={0: "42"}, planned_start=T0 + 45, need=2)
        await _feed(bus, svc, clock, range(45, 46), {T0 + 45: at45})
        free = latest(bus)[f"{HOST}/GPU-{HOST}-3"]
        assert free.state is GpuState.UNKNOWN and free.reason == "scheduler_planned_start"
        # the job starts: GPUs 0-3 allocated, no pending job; then it ends and GPU 1 is free again
        at50 = node(T0 + 50, job_on={i: "43" for i in range(4)})
        await _feed(bus, svc, clock, range(50, 51), {T0 + 50: at50})
        assert svc.current_states()[f"{HOST}/GPU-{HOST}-1"].reason == "scheduler_allocated"
        assert gauge(svc, partition="training", user="alice", job="43") == 4
        assert gauge(svc, partition="training", user="alice", job="42") is None  # gone, not a stale 1
        await _feed(bus, svc, clock, range(60, 61), {T0 + 60: node(T0 + 60)})
        free = latest(bus)[f"{HOST}/GPU-{HOST}-1"]
        assert free.state is GpuState.IDLE and free.predicted_idle_until is not None
        assert free.predicted_idle_until > T0 + 60
    finally:
        await svc.stop()
    assert gauge(svc, partition="training", user="alice", job="43") is None  # withdrawn at stop


async def test_stale_unknown_and_drained_nodes_are_not_offered() -> None:
    bus, clock = MemoryBus(), Clock(T0)
    svc = service(bus, clock, refresh_s=3600.0, scheduler=True, scheduler_stale_s=20.0)
    await svc.start()
    try:
        for t in range(0, 31, 10):
            await send(bus, node(T0 + t))
            await send(bus, node(T0 + t, host="gpu-node-002", state="IDLE", flags=("DRAIN",)))
            for host in (HOST, "gpu-node-002", "gpu-node-003"):
                for i in range(4):
                    await send(bus, sample(T0 + t, i, host=host))
            clock.t = T0 + t
            await drain(svc)
        now = svc.current_states()
        assert now[f"{HOST}/GPU-{HOST}-2"].state is GpuState.IDLE
        assert now["gpu-node-002/GPU-gpu-node-002-2"].reason == "scheduler_node_drain"
        assert now["gpu-node-003/GPU-gpu-node-003-2"].reason == "scheduler_unknown"  # no scheduler state
        # the Slurm source stops: 20 s after its last read the node's GPUs are not offered
        clock.t = T0 + 50
        for i in range(4):
            await send(bus, sample(T0 + 50, i))
        await drain(svc)
        assert latest(bus)[f"{HOST}/GPU-{HOST}-2"].state is GpuState.IDLE  # 20 s old: not yet stale
        clock.t = T0 + 51
        for i in range(4):
            await send(bus, sample(T0 + 51, i))
        await drain(svc)
        assert svc.current_states()[f"{HOST}/GPU-{HOST}-2"].reason == "scheduler_stale"
        assert latest(bus)[f"{HOST}/GPU-{HOST}-2"].state is GpuState.UNKNOWN  # published: idle -> unknown
    finally:
        await svc.stop()


async def test_without_the_scheduler_the_join_plays_no_part() -> None:
    bus, clock = MemoryBus(), Clock(T0)
    svc = service(bus, clock, refresh_s=3600.0)
    await svc.start()
    try:
        records = {T0 + t: node(T0 + t, job_on={0: "42"}, planned_start=T0 + 45) for t in (0, 10, 20, 30)}
        await _feed(bus, svc, clock, range(0, 31, 10), records)
        now = latest(bus)
        assert now[f"{HOST}/GPU-{HOST}-0"].state is GpuState.IDLE
        assert now[f"{HOST}/GPU-{HOST}-1"].predicted_idle_until == pytest.approx(T0 + 30 + IDLE.min_idle_s)
        _, [(n,)] = svc.store.sql("SELECT count(*) FROM scheduler_gpu_samples")
        assert n == 0  # not even read
    finally:
        await svc.stop()


async def test_a_bad_scheduler_record_is_counted_and_skipped() -> None:
    bus, clock = MemoryBus(), Clock(T0)
    svc = service(bus, clock, scheduler=True)
    await svc.start()
    rejected = "gpupool_analytics_rejected_records_total"
    before = svc.registry.get_sample_value(rejected, {"reason": "invalid_record"}) or 0
    try:
        await bus.producer().send(TOPICS.telemetry_scheduler, b'{"ts": 1, "host": "x"}', key="x")
        await send(bus, node(T0))
        await drain(svc)
        after = svc.registry.get_sample_value(rejected, {"reason": "invalid_record"})
        assert after == before + 1
        _, [(n,)] = svc.store.sql("SELECT count(*) FROM scheduler_gpu_samples")
        assert n == 4
    finally:
        await svc.stop()


def _status(index_key: str, *, gi: int | None = None, ts: float = T0) -> GpuStatus:
    return GpuStatus(
        key=index_key, host=HOST, gpu_uuid="GPU-x", gpu_instance_id=gi, model_name=None,
        state=GpuState.IDLE, since=ts - 60, ts=ts, reason="",
    )  # fmt: skip


def test_join_keeps_the_newest_state_and_mig_instances_follow_their_gpu() -> None:
    join = SchedulerJoin(stale_after_s=60.0)
    join.note_gpu("k0", 0)
    join.note_gpu("k0/1", 0)  # a MIG instance of GPU 0 (DCGM gives it its GPU's index)
    join.note_gpu("k1", 1)
    join.observe(node(T0 + 10, job_on={0: "42"}))
    join.observe(node(T0, job_on={1: "41"}))  # older, arrived late: ignored
    assert join.block_reason(_status("k0"), T0 + 10) == "scheduler_allocated"
    assert join.block_reason(_status("k0/1", gi=1), T0 + 10) == "scheduler_allocated"
    assert join.block_reason(_status("k1"), T0 + 10) is None
    assert join.allocated_idle([_status("k0"), _status("k0/1", gi=1), _status("k1")]) == {
        ("training", "alice", "42"): 1  # whole GPUs only: the MIG instance is not counted twice
    }
    join.note_gpu("k1", None)  # index unknown: cannot be matched to Slurm, not offered
    assert join.block_reason(_status("k1"), T0 + 10) == "scheduler_unknown"
    join.forget_hosts([HOST])
    assert join.block_reason(_status("k0"), T0 + 10) == "scheduler_unknown" and join.node(HOST) is None
    with pytest.raises(ValueError):
        SchedulerJoin(stale_after_s=0)


def test_gpus_held_by_gpupools_own_lent_jobs_stay_lendable() -> None:
    from contracts.scheduler import LENT_JOB_NAME

    join = SchedulerJoin(stale_after_s=60.0)
    for i in range(3):
        join.note_gpu(f"k{i}", i)
    rec = node(T0, job_on={0: "50", 1: "51"})
    gpus = [
        g.model_copy(update={"job_name": LENT_JOB_NAME, "partition": "lent"}) if g.index == 0 else g
        for g in rec.gpus
    ]
    join.observe(rec.model_copy(update={"gpus": gpus}))
    assert join.block_reason(_status("k0"), T0) is None  # a placeholder or lease hold: lendable
    assert join.block_reason(_status("k1"), T0) == "scheduler_allocated"  # a training job
    assert join.allocated_idle([_status(f"k{i}") for i in range(3)]) == {("training", "alice", "51"): 1}


def _planned_node(*, need: int | None, gpus: int | None = None, nodes: tuple[str, ...] = (HOST,),
                  lent: tuple[int, ...] = (), training: tuple[int, ...] = (), start: float | None = T0 + 100,
                  more: tuple[PendingJob, ...] = ()) -> SchedulerNode:
    from contracts.scheduler import LENT_JOB_NAME

    gpus_ = [
        SchedulerGpu(index=i, allocated=i in lent or i in training,
                     job_id="90" if i in lent else ("42" if i in training else None),
                     job_name=LENT_JOB_NAME if i in lent else None)
        for i in range(8)
    ]  # fmt: skip
    pending = [PendingJob(job_id="43", gpus_per_node=need, gpus=gpus, planned_start=start, planned_nodes=list(nodes))]
    return SchedulerNode(ts=T0, host=HOST, state="MIXED", gpus=gpus_, pending=[*pending, *more])


def test_planned_gpus_are_the_free_ones_lowest_index_first_then_gpupools_holds() -> None:
    from analytics.scheduler import planned_gpus

    # 3 GPUs per node: free 1, 2 (0 held by training), then the lent hold 3 (free ones first)
    got = planned_gpus(_planned_node(need=3, lent=(3, 4), training=(0, 2)))
    assert got == {1: T0 + 100, 5: T0 + 100, 6: T0 + 100}
    got = planned_gpus(_planned_node(need=3, lent=(3, 4), training=(0, 1, 2, 5, 6, 7)))
    assert got == {3: T0 + 100, 4: T0 + 100}  # only 2 not held by training: both
    # exactly the count asked: 2 of 8 free GPUs, not 3, not 1
    assert sorted(planned_gpus(_planned_node(need=2))) == [0, 1]
    # asked per job: ceil(5 / 2 nodes) = 3 on this node
    assert sorted(planned_gpus(_planned_node(need=None, gpus=5, nodes=(HOST, "gpu-node-002")))) == [0, 1, 2]
    assert sorted(planned_gpus(_planned_node(need=None, gpus=4, nodes=(HOST, "gpu-node-002")))) == [0, 1]
    # no GPUs asked, no estimate, or planned onto another node: nothing
    assert planned_gpus(_planned_node(need=None)) == {}
    assert planned_gpus(_planned_node(need=2, start=None)) == {}
    assert planned_gpus(_planned_node(need=2, nodes=("gpu-node-002",))) == {}
    # two jobs: the earlier one takes the lower indices, the later one the next ones
    later = PendingJob(job_id="41", gpus_per_node=1, planned_start=T0 + 50, planned_nodes=[HOST])
    assert planned_gpus(_planned_node(need=2, more=(later,))) == {0: T0 + 50, 1: T0 + 100, 2: T0 + 100}


def test_a_gpu_the_plan_needs_is_not_lent_and_carries_its_planned_start() -> None:
    join = SchedulerJoin(stale_after_s=600.0)
    for i in range(8):
        join.note_gpu(f"k{i}", i)
    join.observe(_planned_node(need=2, lent=(0,)))
    # the free GPUs 1, 2 are planned; the lent hold 0 too only past the free ones: not here
    assert [join.block_reason(_status(f"k{i}"), T0) for i in range(4)] == [
        None, "scheduler_planned", "scheduler_planned", None]
    assert [join.planned_start(_status(f"k{i}"), T0) for i in range(4)] == [None, T0 + 100, T0 + 100, None]
    assert join.planned_start(_status("unknown-key"), T0) is None
    # once the planned start is now, the whole node is held back (as before)
    assert join.block_reason(_status("k3"), T0 + 100) == "scheduler_planned_start"
    join.forget_hosts([HOST])
    assert join.planned_start(_status("k1"), T0) is None


def test_a_gpu_planned_later_than_the_lead_is_lent_until_the_lead_before_its_start() -> None:
    """The plan needs GPUs 0, 1 at T0 + 100: with a lead of 30 s they are lendable (no reason, no
    planned start: no lease at risk) until T0 + 70, then withheld and their planned start
    published; the node's window still ends at the planned start (no promise past it)."""
    join = SchedulerJoin(stale_after_s=600.0, plan_lead_s=30.0)
    for i in range(8):
        join.note_gpu(f"k{i}", i)
    join.observe(_planned_node(need=2))
    for now, reason, start in (
        (T0, None, None),
        (T0 + 69.999, None, None),
        (T0 + 70.0, "scheduler_planned", T0 + 100),  # exactly the lead before: withheld
        (T0 + 99.0, "scheduler_planned", T0 + 100),
    ):
        assert join.block_reason(_status("k1", ts=T0), now) == reason, now
        assert join.planned_start(_status("k1", ts=T0), now) == start, now
        assert join.block_reason(_status("k2", ts=T0), now) is None  # not one the plan needs
    # a sample newer than the clock counts as now
    assert join.planned_start(_status("k1", ts=T0 + 70.0), T0) == T0 + 100
    assert join.window_end(HOST) == T0 + 100
    # lead 0: lendable until the planned start itself; an infinite lead: never (the strict rule)
    zero, strict = SchedulerJoin(600.0, plan_lead_s=0.0), SchedulerJoin(600.0, plan_lead_s=float("inf"))
    for join_ in (zero, strict):
        join_.note_gpu("k1", 1)
        join_.observe(_planned_node(need=2))
    assert zero.block_reason(_status("k1"), T0 + 99.999) is None
    assert strict.block_reason(_status("k1"), T0 - 1e6) == "scheduler_planned"
    with pytest.raises(ValueError):
        SchedulerJoin(600.0, plan_lead_s=-1.0)


def test_gpupools_own_pending_placeholders_are_no_demand() -> None:
    """Slurm plans a pending placeholder (``SchedNodeList``, ``StartTime``) like any job; it waits
    to hold a GPU for lending, so it withholds nothing, starts no window's end and puts no lease
    at risk; a training job planned alongside it still does."""
    from analytics.scheduler import planned_gpus
    from contracts.scheduler import LENT_JOB_NAME

    own = PendingJob(
        job_id="44", job_name=LENT_JOB_NAME, gpus_per_node=1, planned_start=T0, planned_nodes=[HOST]
    )
    rec = _planned_node(need=2, start=None, more=(own,))
    assert planned_gpus(rec) == {}
    assert rec.next_planned_start() is None
    join = SchedulerJoin(stale_after_s=600.0)
    for i in range(8):
        join.note_gpu(f"k{i}", i)
    join.observe(rec)
    assert [join.block_reason(_status(f"k{i}"), T0) for i in range(8)] == [None] * 8
    assert join.window_end(HOST) is None
    # the same job under a training name is demand: one GPU withheld, the node's window ends at T0
    theirs = own.model_copy(update={"job_name": "train-7"})
    rec = _planned_node(need=2, start=None, more=(theirs,))
    assert planned_gpus(rec) == {0: T0}
    assert rec.next_planned_start() == T0
