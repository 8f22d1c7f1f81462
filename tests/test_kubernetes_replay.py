"""The time-compressed replay of generated training jobs on the real Kubernetes control plane
(deploy/local/kubernetes.sh: kwok nodes with ``nvidia.com/gpu``, Kueue's LocalQueue ``training``).

A unit test of the Job a training job becomes, then a short replay over the session's 4-node
cluster: every job that ran its whole compressed run time ends as it was generated, the GPU-hours
from the jobs' watched starts and ends agree with the per-node GPUs of the pods, and the
yardstick measures the scheduler's own start latency.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator.kubernetes_replay import (
    COMPLETE_ANNOTATION,
    FAIL_ANNOTATION,
    GPU_RESOURCE,
    JOB_LABEL,
    QUEUE_LABEL,
    REPLAY_LABEL,
    KubernetesClient,
)
from simulator.replay import account, replay, start_latency
from simulator.training_jobs import (
    TrainingJob,
    TrainingWorkload,
    fit_workload,
    load_cluster_summary,
    load_utilisation_cdf,
)
from tests.services import K8S_BUILD_TIMEOUT_S, kubernetes_built

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
_TIMEOUT_S = 180 if kubernetes_built() else K8S_BUILD_TIMEOUT_S + 180


def test_a_training_job_becomes_a_kueue_job_that_kwok_ends_as_generated(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\nclusters: [{name: c, cluster: {server: 'https://127.0.0.1:1'}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n"
        "current-context: x\n"
    )
    c = KubernetesClient(kubeconfig, tag="t1")
    done = c.job_object(TrainingJob(7, 0.0, 16, 1200.0, "COMPLETED", False), 100.0)
    assert done["metadata"]["name"] == "train-t1-7" and done["metadata"]["namespace"] == "training"
    assert done["metadata"]["labels"] == {QUEUE_LABEL: "training", REPLAY_LABEL: "t1"}
    spec = done["spec"]
    assert spec["suspend"] is True and spec["backoffLimit"] == 0
    assert spec["parallelism"] == spec["completions"] == 2  # 16 GPUs: two whole nodes
    pod = spec["template"]
    assert pod["metadata"]["labels"][JOB_LABEL] == "train-t1-7"
    assert pod["metadata"]["annotations"] == {COMPLETE_ANNOTATION: "12.000s"}  # 1200 s / 100
    assert pod["spec"]["priorityClassName"] == "training"
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {GPU_RESOURCE: "8"}
    failed = c.job_object(TrainingJob(8, 0.0, 2, 5.0, "FAILED", False), 10.0)
    assert failed["spec"]["parallelism"] == 1
    assert failed["spec"]["template"]["metadata"]["annotations"] == {FAIL_ANNOTATION: "0.500s"}
    assert failed["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {GPU_RESOURCE: "2"}
    # a cancelled job carries no end for kwok: the client deletes it on time
    cancelled = c.job_object(TrainingJob(9, 0.0, 1, 5.0, "CANCELLED", False), 10.0)
    assert cancelled["spec"]["template"]["metadata"]["annotations"] == {}
    assert c.job_name(TrainingJob(-3, 0.0, 1, 0.0, "COMPLETED", False)) == "train-t1-y3"


@pytest.mark.timeout(_TIMEOUT_S)
def test_short_replay_on_kubernetes_adds_up(kubeconfig: Path, tmp_path: Path) -> None:
    """40 simulated minutes of Seren-calibrated jobs on 4 nodes (32 GPUs), compressed 120x (20 s)."""
    fit = fit_workload(load_cluster_summary("Seren", DATA))
    w = TrainingWorkload(
        fit, load_utilisation_cdf("seren:GPU_UTIL", DATA), cluster_gpus=32, load=0.8, seed=11
    )
    jobs = w.jobs(2400, 86400)
    assert {j.final_state for j in jobs} == {"COMPLETED", "CANCELLED", "FAILED"}, (
        "pick a seed with every state"
    )
    polls = []
    with KubernetesClient(kubeconfig) as c:
        run = replay(
            c,
            jobs,
            compression=120.0,
            horizon_s=2400,
            cluster_gpus=32,
            out_dir=tmp_path / "out",
            poll_s=0.5,
            observers=[polls.append],
        )
        listed = c.jobs()
    assert len(run.records) == len(jobs) and run.poll_errors == 0 and len(polls) >= 30
    assert all(set(p.gpus_used) >= {"gpu-node-001", "gpu-node-004"} for p in polls)
    assert all(sum(p.gpus_used.values()) <= 32 for p in polls)
    assert max(sum(p.gpus_used.values()) for p in polls) > 0
    for r in run.records.values():
        assert r.end_time is not None, r
        assert listed[r.scheduler_id][0] == r.state
        if r.cancel_sent_wall is None:  # ran its whole compressed run time before the end of the replay
            assert r.state == r.job.final_state, r
            assert r.start_time is not None and r.began_wall == r.start_time
            # kwok ends it (or the client deletes it) its compressed run time after it started
            assert r.end_time - r.start_time == pytest.approx(r.job.duration_s / 120.0, abs=1.5), r
        elif r.state != "CANCELLED":  # cancelled at the end of the replay, as it ended by itself
            assert r.state == r.job.final_state, r
            if r.start_time is not None and r.start_time >= r.cancel_sent_wall:
                # admitted in the race with the deletion: its pod ran its whole run time
                assert r.end_time - r.start_time == pytest.approx(r.job.duration_s / 120.0, abs=1.5), r
            else:
                assert r.end_time <= r.cancel_sent_wall + 1.0, r  # within the last poll
    assert sum(r.cancel_sent_wall is None for r in run.records.values()) >= len(jobs) // 3
    report = account(run, w.idle_fraction, 0.001)
    assert report.jobs_submitted == sum(1 for j in jobs if not j.carried_over)
    assert 0 < report.allocated_gpu_hours <= report.window_gpu_hours
    assert report.idle_unallocated_gpu_hours + report.allocated_gpu_hours == pytest.approx(
        report.window_gpu_hours
    )
    assert 0 <= report.allocated_idle_gpu_hours <= report.allocated_gpu_hours
    # the jobs' watched starts and ends and the pods' GPUs per node tell the same allocation
    assert report.idle_unallocated_sampled_gpu_hours == pytest.approx(
        report.idle_unallocated_gpu_hours, abs=0.1 * report.window_gpu_hours
    )
    p50, p95, p99 = report.queue_delay_s
    assert 0 <= p50 <= p95 <= p99


@pytest.mark.timeout(_TIMEOUT_S)
def test_yardstick_measures_kubernetes_start_latency(kubeconfig: Path, tmp_path: Path) -> None:
    with KubernetesClient(kubeconfig) as c:
        latencies = start_latency(c, tmp_path, rounds=3)
        states = {state for state, *_ in c.jobs().values()}
    assert len(latencies) == 3 and all(0 < t < 5.0 for t in latencies)
    assert states == {"COMPLETED"}
    assert list(tmp_path.iterdir()) == []  # nothing runs, nothing is written
