"""Slurm parsers (collectors.slurm_parse) and node records (collectors.slurm_records) on outputs
captured from the local Slurm 22.05 cluster (tests/fixtures/slurm) and on edge cases written in
the documented format: DOWN/DRAIN nodes, jobs spanning nodes, IDX lists like 0,2-3, type-less
GRES, bad input."""

from __future__ import annotations

from datetime import UTC, datetime
from functools import partial
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectors.slurm_parse import (
    pending_gpus,
    GresEntry,
    SlurmParseError,
    expand_hostlist,
    parse_gres,
    parse_index_list,
    parse_job,
    parse_node,
    parse_records,
    parse_slurm_time,
    parse_tres_gpus,
    split_fields,
)
from collectors.slurm_records import build_node_records

FIXTURES = Path(__file__).parent / "fixtures" / "slurm"
job_utc = partial(parse_job, tz=UTC)


def _utc(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def test_index_lists() -> None:
    assert parse_index_list("0-3") == [0, 1, 2, 3]
    assert parse_index_list("0,2-3") == [0, 2, 3]
    assert parse_index_list("7") == [7]
    assert parse_index_list("3,1,1-2") == [1, 2, 3]
    assert parse_index_list("N/A") == [] and parse_index_list("") == []
    for bad in ("3-1", "a", "1-", "-1", "0,,1", "1-b"):
        with pytest.raises(SlurmParseError) as e:
            parse_index_list(bad)
        assert e.value.reason == "bad_index"


def test_gres_strings() -> None:
    assert parse_gres("gpu:h100:6(IDX:0-5)") == [GresEntry("gpu", "h100", 6, (0, 1, 2, 3, 4, 5))]
    assert parse_gres("gpu:h100:0(IDX:N/A)") == [GresEntry("gpu", "h100", 0, ())]
    assert parse_gres("gpu:4") == [GresEntry("gpu", None, 4, None)]  # type-less
    assert parse_gres("gpu:2(IDX:0,2)") == [GresEntry("gpu", None, 2, (0, 2))]
    assert parse_gres("gpu:h100:8(S:0-1)") == [GresEntry("gpu", "h100", 8, None)]  # socket list ignored
    assert parse_gres("gpu:a100:2(IDX:0,2-3),nic:1(IDX:0)") == [
        GresEntry("gpu", "a100", 2, (0, 2, 3)),
        GresEntry("nic", None, 1, (0,)),
    ]
    assert parse_gres("gres/gpu:h100=2") == [GresEntry("gpu", "h100", 2, None)]
    assert parse_gres("(null)") == [] and parse_gres("") == []
    for bad in ("gpu:a:b:c:1", ":4", "gpu::4", "gres/gpu=x"):
        with pytest.raises(SlurmParseError):
            parse_gres(bad)


def test_tres_gpus() -> None:
    assert parse_tres_gpus("gres:gpu:h100:8") == 8
    assert parse_tres_gpus("gres:gpu:8") == 8
    assert parse_tres_gpus("gres/gpu=2") == 2
    assert parse_tres_gpus("cpu=2,gres:gpu:4") == 4
    assert parse_tres_gpus("gres:gpu") == 1
    assert parse_tres_gpus("cpu=2") is None and parse_tres_gpus(None) is None


def test_hostlists_and_times() -> None:
    assert expand_hostlist("gpu-node-[001,003-004]") == ["gpu-node-001", "gpu-node-003", "gpu-node-004"]
    assert expand_hostlist("(null)") == [] and expand_hostlist("") == []
    with pytest.raises(SlurmParseError) as e:
        expand_hostlist("gpu-node-[003-001")
    assert e.value.reason == "bad_hostlist"
    assert parse_slurm_time("2026-12-01T15:03:26", UTC) == _utc("2026-12-01T15:03:26")
    assert parse_slurm_time("Unknown") is None and parse_slurm_time("N/A") is None
    with pytest.raises(SlurmParseError):
        parse_slurm_time("tomorrow")


def test_fields_with_spaces_and_repeated_keys() -> None:
    line = "NodeName=n1 OS=Linux 6.1 #1 SMP State=IDLE+DRAIN Reason=maint window [root@2026-12-01T14:03:46]"
    assert split_fields(line) == [
        ("NodeName", "n1"),
        ("OS", "Linux 6.1 #1 SMP"),
        ("State", "IDLE+DRAIN"),
        ("Reason", "maint window [root@2026-12-01T14:03:46]"),
    ]
    with pytest.raises(SlurmParseError):
        split_fields("no fields here")


def test_real_nodes_and_jobs_of_the_local_cluster() -> None:
    """Captured with: job 1 (training, 4 GPUs of gpu-node-001), job 2 (training, 3 GPUs on each of
    gpu-node-002 and -003), job 3 (lent, 2 GPUs of gpu-node-001), job 4 pending for 8 GPUs of
    gpu-node-001, job 5 pending for 8 GPUs on each of 4 nodes (type-less --gres=gpu:8), job 6
    held; times printed in UTC."""
    nodes, problems = parse_records((FIXTURES / "nodes_mixed.txt").read_text(), parse_node)
    assert problems == []
    assert [n.name for n in nodes] == ["gpu-node-001", "gpu-node-002", "gpu-node-003", "gpu-node-004"]
    n1 = nodes[0]
    assert n1.state == "MIXED" and n1.flags == () and n1.partitions == ("training", "lent")
    assert n1.gpus == tuple((i, "h100") for i in range(8)) and n1.gpus_used == frozenset(range(6))
    assert nodes[3].state == "IDLE" and nodes[3].flags == ("PLANNED",) and nodes[3].gpus_used == frozenset()
    jobs, problems = parse_records((FIXTURES / "jobs_mixed.txt").read_text(), job_utc)
    assert problems == []
    by_id = {j.job_id: j for j in jobs}
    assert by_id["1"].gpus_by_node == {"gpu-node-001": (0, 1, 2, 3)}
    assert (by_id["1"].user, by_id["1"].partition, by_id["1"].state) == ("root", "training", "RUNNING")
    assert by_id["2"].gpus_by_node == {"gpu-node-002": (0, 1, 2), "gpu-node-003": (0, 1, 2)}
    assert by_id["2"].gpus_requested == 6
    assert by_id["3"].gpus_by_node == {"gpu-node-001": (4, 5)} and by_id["3"].partition == "lent"
    j4 = by_id["4"]
    assert (j4.state, j4.reason, j4.gpus_per_node, j4.gpus_requested) == ("PENDING", "Resources", 8, 8)
    assert j4.start == _utc("2026-12-01T15:03:26") and j4.sched_nodes == ("gpu-node-001",)
    j5 = by_id["5"]
    assert j5.gpus_per_node == 8 and j5.num_nodes == 4 and j5.gpus_requested == 32
    assert j5.sched_nodes == tuple(f"gpu-node-00{i}" for i in range(1, 5))
    assert by_id["6"].start is None and by_id["6"].reason == "JobHeldUser" and by_id["6"].sched_nodes == ()
    # squeue --start, captured at the same moment, gives the same estimates and nodes
    for line in (FIXTURES / "squeue_start_mixed.txt").read_text().splitlines():
        job_id, start, sched = line.split("|")
        assert by_id[job_id].start == parse_slurm_time(start, UTC)
        assert by_id[job_id].sched_nodes == tuple(expand_hostlist(sched))

    recs = build_node_records(nodes, jobs, ts=1.0, seq_start=10)
    assert [r.seq for r in recs] == [10, 11, 12, 13] and all(r.ts == 1.0 for r in recs)
    r1 = recs[0]
    assert [(g.index, g.allocated, g.job_id, g.partition) for g in r1.gpus] == [
        (0, True, "1", "training"), (1, True, "1", "training"), (2, True, "1", "training"),
        (3, True, "1", "training"), (4, True, "3", "lent"), (5, True, "3", "lent"),
        (6, False, None, None), (7, False, None, None),
    ]  # fmt: skip
    assert all(g.gres_type == "h100" and g.user in (None, "root") for g in r1.gpus)
    assert [p.job_id for p in r1.pending] == ["4", "5"]
    assert r1.next_planned_start() == _utc("2026-12-01T15:03:26")
    r3 = recs[2]
    assert [g.job_id for g in r3.gpus] == ["2", "2", "2", None, None, None, None, None]
    assert [p.job_id for p in r3.pending] == ["5"] and r3.next_planned_start() == _utc("2026-12-01T15:23:00")
    assert all(r.schedulable for r in recs)
    assert not any(p.job_id == "6" for r in recs for p in r.pending)  # no plan, no node asked


def test_real_drained_and_down_nodes() -> None:
    nodes, problems = parse_records((FIXTURES / "nodes_drain_down.txt").read_text(), parse_node)
    assert problems == []
    n3, n4 = nodes[2], nodes[3]
    assert (n3.state, n3.flags, n3.reason) == ("MIXED", ("DRAIN",), "maint window [root@2026-12-01T14:03:46]")
    assert (n4.state, n4.flags, n4.reason) == ("DOWN", ("DRAIN",), "node dead [root@2026-12-01T14:03:50]")
    jobs, _ = parse_records((FIXTURES / "jobs_drain_down.txt").read_text(), job_utc)
    recs = build_node_records(nodes, jobs, ts=0.0)
    assert [r.schedulable for r in recs] == [True, True, False, False]
    assert recs[2].gpus[0].job_id == "2"  # a draining node keeps its running job


def test_edge_cases_in_the_documented_format() -> None:
    node = parse_node(
        "NodeName=dgx-07 CoresPerSocket=1 Gres=gpu:4 GresUsed=gpu:3(IDX:0,2-3) State=ALLOCATED* "
        "Partitions=batch"
    )
    assert node.gpus == ((0, None), (1, None), (2, None), (3, None))  # type-less GRES
    assert node.gpus_used == frozenset({0, 2, 3})
    assert node.state == "ALLOCATED" and node.flags == ("NOT_RESPONDING",)
    mixed = parse_node(
        "NodeName=n2 Gres=gpu:a100:2,gpu:v100:2,nic:1 "
        "GresUsed=gpu:a100:1(IDX:1),gpu:v100:0(IDX:N/A) State=MIXED"
    )
    assert mixed.gpus == ((0, "a100"), (1, "a100"), (2, "v100"), (3, "v100")) and mixed.gpus_used == {1}
    assert parse_node("NodeName=cpu-1 Gres=(null) GresUsed= State=IDLE").gpus == ()
    # a job spanning nodes with different indices: one -d group per allocation
    job = parse_job(
        "JobId=77 JobName=big run UserId=alice(1001) Partition=training JobState=RUNNING Reason=None "
        "NumNodes=3 NumTasks=3 TresPerNode=gres:gpu:2 Nodes=dgx-[07-08] CPU_IDs=0 Mem=0 GRES=gpu:2(IDX:0,2) "
        "Nodes=dgx-09 CPU_IDs=1 Mem=0 GRES=gpu:2(IDX:2-3)"
    )
    assert job.name == "big run" and job.user == "alice"
    assert job.gpus_by_node == {"dgx-07": (0, 2), "dgx-08": (0, 2), "dgx-09": (2, 3)}
    assert job.gpus_requested == 6
    held = parse_node("NodeName=dgx-09 Gres=gpu:4 GresUsed=gpu:4(IDX:0-3) State=ALLOCATED")
    [rec] = build_node_records([held], [job], ts=0.0)
    # 0 and 1 are in GresUsed but no job read claims them: allocated, owner unknown
    assert [(g.allocated, g.job_id) for g in rec.gpus] == [
        (True, None), (True, None), (True, "77"), (True, "77")
    ]  # fmt: skip
    done = parse_job("JobId=76 JobState=COMPLETED Nodes=dgx-09 CPU_IDs=1 Mem=0 GRES=gpu:2(IDX:0-1)")
    [rec] = build_node_records([held], [done, job], ts=0.0)
    assert [g.job_id for g in rec.gpus] == [None, None, "77", "77"]  # a finished job holds nothing
    completing = parse_job("JobId=75 JobState=COMPLETING Nodes=dgx-09 CPU_IDs=1 Mem=0 GRES=gpu:2(IDX:0-1)")
    [rec] = build_node_records([held], [completing, job], ts=0.0)
    assert [g.job_id for g in rec.gpus] == ["75", "75", "77", "77"]
    per_task = parse_job("JobId=8 JobState=PENDING NumTasks=4 TresPerTask=gres:gpu:1 ReqNodeList=dgx-09")
    assert per_task.gpus_requested == 4
    [rec] = build_node_records([held], [per_task], ts=0.0)
    assert [(p.job_id, p.planned_start, p.gpus) for p in rec.pending] == [("8", None, 4)]
    assert rec.next_planned_start() is None


def test_bad_lines_are_reported_and_the_rest_is_kept() -> None:
    text = (
        "NodeName=ok-1 Gres=gpu:2 State=IDLE\n"
        "garbage without fields\n"
        "NodeName=bad-1 Gres=gpu:2 GresUsed=gpu:2(IDX:3-1) State=MIXED\n"
        "Gres=gpu:2 State=IDLE\n"
        "\n"
    )
    nodes, problems = parse_records(text, parse_node)
    assert [n.name for n in nodes] == ["ok-1"]
    assert [(p.lineno, p.reason) for p in problems] == [
        (2, "no_fields"), (3, "bad_index"), (4, "missing_key")
    ]  # fmt: skip
    # one line cannot make a node of a billion GPUs; 1024 is the most
    assert len(parse_node("NodeName=big Gres=gpu:1024 State=IDLE").gpus) == 1024
    with pytest.raises(SlurmParseError) as e:
        parse_node("NodeName=big Gres=gpu:1000,gpu:h100:25 State=IDLE")
    assert e.value.reason == "bad_gres"
    jobs, problems = parse_records("No jobs in the system\n", job_utc)
    assert jobs == [] and problems == []


_token = st.text(alphabet=st.sampled_from("abcdefgh0123456789-_:,()[]=+*/ .N/A"), max_size=30)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(
    ["NodeName", "JobId", "JobState", "State", "Gres", "GresUsed", "GRES", "Nodes", "SchedNodeList",
     "ReqNodeList", "StartTime", "TresPerNode", "TresPerJob", "NumNodes", "UserId", "Reason"]
), _token), max_size=12), st.text(max_size=40))  # fmt: skip
def test_fuzz_parsers_raise_only_their_own_error(pairs: list[tuple[str, str]], noise: str) -> None:
    """Any line: a record or a SlurmParseError (counted by reason), never another exception; and
    build_node_records accepts whatever parsed."""
    line = " ".join(f"{k}={v}" for k, v in pairs) + " " + noise
    nodes, _ = parse_records(line, parse_node)
    jobs, _ = parse_records(line, job_utc)
    for rec in build_node_records(nodes, jobs, ts=0.0):
        assert all(g.index >= 0 for g in rec.gpus)


def test_pending_gpus_add_up_per_partition_over_pending_jobs_only() -> None:
    """jobs_mixed: pending jobs 4 (8 GPUs), 5 (8 x 4 nodes) and 6 (held, 2) of ``training``; the
    running jobs (``training`` and ``lent``) add nothing, so ``lent`` is absent, not 0."""
    jobs, _ = parse_records((FIXTURES / "jobs_mixed.txt").read_text(), job_utc)
    assert pending_gpus(jobs) == {"training": 42}
    assert pending_gpus([j for j in jobs if j.state != "PENDING"]) == {}
    assert pending_gpus([]) == {}
