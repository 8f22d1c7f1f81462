"""Replay generated training jobs on a real Kubernetes control plane: the Kubernetes client of
:func:`simulator.replay.replay`.

:class:`KubernetesClient` submits each :class:`simulator.training_jobs.TrainingJob` as a
``batch/v1`` Job in namespace ``training`` with label ``kueue.x-k8s.io/queue-name: training``
(Kueue's LocalQueue: Kueue admits the Job against the ClusterQueue's quota and unsuspends it);
``parallelism`` = ``completions`` = the job's nodes, each pod asking ``nvidia.com/gpu`` = its GPUs
per node (and one CPU), PriorityClass ``training`` (kube-scheduler preempts gpupool's lent pods,
PriorityClass ``gpupool-lent``, for it), ``backoffLimit: 0``. No container runs on kwok's nodes:
the pod's annotation tells kwok how the job ends (``deploy/local/kubernetes/kwok.yaml``):

* COMPLETED: ``pod-complete.stage.kwok.x-k8s.io/delay`` = the compressed run time (a Go
  duration): the pod succeeds that long after it is Running;
* FAILED: ``pod-fail.stage.kwok.x-k8s.io/delay``: the pod fails (exit code 1) then, and with
  ``backoffLimit: 0`` so does the Job;
* CANCELLED: no annotation; its owner's cancel is the client deleting the Job (and its pods,
  grace 0) the compressed run time after it started, from a thread of its own (on time however
  short the job).

A cancel (:meth:`KubernetesClient.cancel`, the end of a replay) is the same deletion.

Everything measured comes from one watch of every pod of the cluster (a thread; after an
expired version or a failure it lists again and reconciles), each event stamped with the wall
time it arrived (ms resolution):

* a job starts when the watch shows the last of its pods Running (queueing delay = that - the
  driver's submit: creation → pod Running); it ends when its pods have all Succeeded, when one
  Failed, or, deleted, when its last pod is gone (its GPUs are free for kube-scheduler then);
* GPUs allocated per node: the ``nvidia.com/gpu`` limits of every pod bound to the node and
  neither Succeeded nor Failed, in any namespace (what kube-scheduler counts; gpupool's lent pods
  count, as Slurm's ``GresUsed`` counts placeholder jobs).

Job states are reported with Slurm's names (:mod:`simulator.replay`): PENDING (created, not every
pod Running), RUNNING, COMPLETED, FAILED, CANCELLED.
"""

from __future__ import annotations

import heapq
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from simulator.replay import Listing, ReplayError
from simulator.training_jobs import TrainingJob

log = logging.getLogger(__name__)

GPU_RESOURCE = "nvidia.com/gpu"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
REPLAY_LABEL = "gpupool.io/replay"
"""Label of every Job (and pod) of one client: its run tag."""
JOB_LABEL = "gpupool.io/replay-job"
"""Label of a replayed job's pods: the Job's name."""
COMPLETE_ANNOTATION = "pod-complete.stage.kwok.x-k8s.io/delay"
FAIL_ANNOTATION = "pod-fail.stage.kwok.x-k8s.io/delay"
IMAGE = "registry.k8s.io/pause:3.10"
_TERMINAL = frozenset({"Succeeded", "Failed"})
_WATCH_TIMEOUT_S = 5


@dataclass
class _Tracked:
    """One submitted Job as the watch sees it (guarded by the client's lock)."""

    name: str
    pods_wanted: int
    submitted: float
    cancel_after_s: float | None
    state: str = "PENDING"
    started: float | None = None
    ended: float | None = None
    deleting: bool = False
    phases: dict[str, str] = field(default_factory=dict)
    """Pod name → last phase seen, pods that exist."""
    running: set[str] = field(default_factory=set)
    """Pods ever seen Running."""


@dataclass(frozen=True)
class _Pod:
    node: str | None
    gpus: int
    phase: str
    job: str | None


def _go_duration(seconds: float) -> str:
    """``seconds`` as a Go duration (``time.ParseDuration``), ms precision: ``"12.345s"``."""
    return f"{max(0.0, seconds):.3f}s"


def _pod_gpus(pod: dict[str, Any]) -> int:
    total = 0
    for c in pod.get("spec", {}).get("containers", []):
        res = c.get("resources") or {}
        want = (res.get("limits") or {}).get(GPU_RESOURCE) or (res.get("requests") or {}).get(GPU_RESOURCE)
        if want is not None:
            total += int(want)
    return total


class KubernetesClient:
    """Kueue-admitted training Jobs on one cluster, measured through a pod watch: a
    :class:`simulator.replay.SchedulerClient` (module docstring). Use it as a context manager
    (or call :meth:`start` and :meth:`close`): the watch and the canceller run in threads.

    Args:
        kubeconfig: the cluster's kubeconfig (its current context; it must be allowed to create
            and delete Jobs and pods in ``namespace`` and to list and watch pods and nodes).
        namespace: where the Jobs go (the LocalQueue's namespace).
        queue: the LocalQueue.
        priority_class: the training pods' PriorityClass.
        tag: the run tag in every name and in label :data:`REPLAY_LABEL` (random when None), so
            two replays on one cluster never share a name.
        timeout_s: per API call.
    """

    def __init__(
        self,
        kubeconfig: Path,
        *,
        namespace: str = "training",
        queue: str = "training",
        priority_class: str = "training",
        tag: str | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self.namespace = namespace
        self.queue = queue
        self.priority_class = priority_class
        self.tag = tag or secrets.token_hex(3)
        self.timeout_s = timeout_s
        self._api = config.new_client_from_config(config_file=str(kubeconfig))
        self._watch_api = config.new_client_from_config(config_file=str(kubeconfig))
        self.batch = client.BatchV1Api(self._api)
        self.core = client.CoreV1Api(self._api)
        self._lock = threading.Lock()
        self._jobs: dict[str, _Tracked] = {}
        self._pods: dict[str, _Pod] = {}
        self._nodes: list[str] = []
        self._due: list[tuple[float, str]] = []
        self._wake = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.watch_errors = 0
        """Watch streams that broke (other than an expired version); each was followed by a list."""

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> KubernetesClient:
        """List the nodes and pods, start the watch and the canceller; ``self``.

        Raises:
            ReplayError: the API server refused or did not answer.
        """
        try:
            nodes = self.core.list_node(_request_timeout=self.timeout_s)
        except (ApiException, HTTPError, OSError) as e:
            raise ReplayError(f"list nodes: {e}") from e
        self._nodes = sorted(
            str(n.metadata.name)
            for n in nodes.items
            if n.metadata is not None and n.status is not None and GPU_RESOURCE in (n.status.allocatable or {})
        )
        version = self._list()
        self._threads = [
            threading.Thread(target=self._watch_loop, args=(version,), name="replay-pod-watch", daemon=True),
            threading.Thread(target=self._cancel_loop, name="replay-canceller", daemon=True),
        ]
        for t in self._threads:
            t.start()
        return self

    def close(self) -> None:
        """Stop the threads and delete every Job of this client's tag (pods with grace 0)."""
        self._stop.set()
        with self._wake:
            self._wake.notify_all()
        for t in self._threads:
            t.join(_WATCH_TIMEOUT_S + 10)
        selector = f"{REPLAY_LABEL}={self.tag}"
        try:
            self.batch.delete_collection_namespaced_job(
                self.namespace,
                label_selector=selector,
                propagation_policy="Background",
                _request_timeout=self.timeout_s,
            )
            self.core.delete_collection_namespaced_pod(
                self.namespace,
                label_selector=selector,
                grace_period_seconds=0,
                _request_timeout=self.timeout_s,
            )
        except (ApiException, HTTPError, OSError) as e:
            log.warning("replay cleanup failed", extra={"error": str(e)[:300]})

    def __enter__(self) -> KubernetesClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- SchedulerClient

    def job_name(self, job: TrainingJob) -> str:
        """The Job's name: ``train-<tag>-<job id>`` (``y<n>`` for the yardstick's negative ids)."""
        ident = str(job.job_id) if job.job_id >= 0 else f"y{-job.job_id}"
        return f"train-{self.tag}-{ident}"

    def job_object(self, job: TrainingJob, compression: float) -> dict[str, Any]:
        """The ``batch/v1`` Job of ``job`` at ``compression`` (module docstring)."""
        name = self.job_name(job)
        run_s = job.duration_s / compression
        annotations = {}
        if job.final_state == "COMPLETED":
            annotations[COMPLETE_ANNOTATION] = _go_duration(run_s)
        elif job.final_state == "FAILED":
            annotations[FAIL_ANNOTATION] = _go_duration(run_s)
        labels = {REPLAY_LABEL: self.tag, JOB_LABEL: name}
        return {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name, "namespace": self.namespace,
                         "labels": {QUEUE_LABEL: self.queue, REPLAY_LABEL: self.tag}},
            "spec": {
                "suspend": True,
                "parallelism": job.nodes,
                "completions": job.nodes,
                "backoffLimit": 0,
                "ttlSecondsAfterFinished": 60,
                "template": {
                    "metadata": {"labels": labels, "annotations": annotations},
                    "spec": {
                        "restartPolicy": "Never",
                        "priorityClassName": self.priority_class,
                        "terminationGracePeriodSeconds": 0,
                        "containers": [{
                            "name": "train",
                            "image": IMAGE,
                            "resources": {
                                "requests": {"cpu": "1", GPU_RESOURCE: str(job.gpus_per_node)},
                                "limits": {GPU_RESOURCE: str(job.gpus_per_node)},
                            },
                        }],
                    },
                },
            },
        }  # fmt: skip

    def submit(self, job: TrainingJob, compression: float, out_dir: Path) -> str:
        """Create ``job``'s Job (``out_dir`` is unused: nothing runs); its name.

        Raises:
            ReplayError: the API server refused it (or did not answer).
        """
        body = self.job_object(job, compression)
        name = body["metadata"]["name"]
        cancel_after = job.duration_s / compression if job.final_state == "CANCELLED" else None
        with self._lock:
            self._jobs[name] = _Tracked(name, job.nodes, time.time(), cancel_after)
        try:
            # the client takes a plain dict body as it takes a V1Job (it serialises either)
            self.batch.create_namespaced_job(self.namespace, cast(Any, body), _request_timeout=self.timeout_s)
        except (ApiException, HTTPError, OSError) as e:
            with self._lock:
                self._jobs.pop(name, None)
            raise ReplayError(f"create Job {name}: {e}") from e
        return name

    def jobs(self) -> Listing:
        """Every Job this client submitted: name -> (state, submit, start, end), wall Unix s."""
        with self._lock:
            return {n: (t.state, t.submitted, t.started, t.ended) for n, t in self._jobs.items()}

    def gpus_used(self) -> dict[str, int]:
        """GPUs allocated per GPU node now (module docstring), from the watch."""
        used = dict.fromkeys(self._nodes, 0)
        with self._lock:
            for p in self._pods.values():
                if p.node is not None and p.phase not in _TERMINAL:
                    used[p.node] = used.get(p.node, 0) + p.gpus
        return used

    def cancel(self, *job_ids: str) -> None:
        """Delete these Jobs and their pods (grace 0); a Job already gone is no error."""
        for name in job_ids:
            self._delete(name)

    def began(self, job_id: str, out_dir: Path) -> float | None:
        """When the watch showed the job's last pod Running (None: it never ran)."""
        with self._lock:
            t = self._jobs.get(job_id)
            return t.started if t is not None else None

    # ---------------------------------------------------------------- internals

    def _delete(self, name: str) -> None:
        with self._lock:
            tracked = self._jobs.get(name)
            if tracked is None or tracked.ended is not None:
                return
            tracked.deleting = True
        try:
            self.batch.delete_namespaced_job(
                name,
                self.namespace,
                propagation_policy="Background",
                grace_period_seconds=0,
                _request_timeout=self.timeout_s,
            )
        except ApiException as e:
            if e.status != 404:
                log.warning("replay cancel failed", extra={"job": name, "error": str(e)[:300]})
        except (HTTPError, OSError) as e:
            log.warning("replay cancel failed", extra={"job": name, "error": str(e)[:300]})
        try:
            self.core.delete_collection_namespaced_pod(
                self.namespace,
                label_selector=f"{JOB_LABEL}={name}",
                grace_period_seconds=0,
                _request_timeout=self.timeout_s,
            )
        except (ApiException, HTTPError, OSError) as e:
            log.warning("replay cancel failed", extra={"job": name, "error": str(e)[:300]})
        now = time.time()
        with self._lock:
            if tracked.ended is None and not self._live(name):  # no pod (still queued in Kueue): over now
                tracked.ended, tracked.state = now, "CANCELLED"

    def _cancel_loop(self) -> None:
        """Delete each CANCELLED job when its run time since its start is over."""
        with self._wake:
            while not self._stop.is_set():
                if not self._due:
                    self._wake.wait(1.0)
                    continue
                due, name = self._due[0]
                left = due - time.time()
                if left > 0:
                    self._wake.wait(min(left, 1.0))
                    continue
                heapq.heappop(self._due)
                self._wake.release()
                try:
                    self._delete(name)
                finally:
                    self._wake.acquire()

    def _list(self) -> str:
        """List every pod, reconcile with what the watch knew (pods gone in between are deleted
        now); the list's resourceVersion."""
        try:
            # _preload_content=False: the raw HTTP response (JSON), not a V1PodList
            resp = cast(Any, self.core.list_pod_for_all_namespaces)(
                _request_timeout=self.timeout_s, _preload_content=False
            )
            listed = json.loads(resp.data)
        except (ApiException, HTTPError, OSError, ValueError) as e:
            raise ReplayError(f"list pods: {e}") from e
        now = time.time()
        seen = set()
        for pod in listed.get("items", []):
            seen.add(pod["metadata"]["uid"])
            self._event("MODIFIED", pod, now)
        with self._lock:
            gone = [uid for uid in self._pods if uid not in seen]
        for uid in gone:
            self._gone(uid, now)
        return str(listed["metadata"]["resourceVersion"])

    def _watch_loop(self, version: str) -> None:
        backoff = 0.1
        core = client.CoreV1Api(self._watch_api)
        while not self._stop.is_set():
            w = watch.Watch()
            try:
                for event in w.stream(
                    core.list_pod_for_all_namespaces,
                    resource_version=version,
                    timeout_seconds=_WATCH_TIMEOUT_S,
                    _request_timeout=_WATCH_TIMEOUT_S + 5,
                    allow_watch_bookmarks=True,
                    deserialize=False,
                ):
                    if self._stop.is_set():
                        return
                    obj = event["object"]
                    if event["type"] == "ERROR":
                        if obj.get("code") == 410:
                            raise ApiException(status=410, reason="Expired")
                        continue
                    version = obj["metadata"].get("resourceVersion") or version
                    if event["type"] != "BOOKMARK":
                        self._event(event["type"], obj, time.time())
                backoff = 0.1
            except Exception as e:  # noqa: BLE001 — whatever broke the stream, the watch must go on
                if self._stop.is_set():
                    return
                if not (isinstance(e, ApiException) and e.status == 410):
                    self.watch_errors += 1
                    log.warning("replay watch failed", extra={"error": str(e)[:300]})
                    time.sleep(backoff)
                    backoff = min(5.0, backoff * 2)
                while not self._stop.is_set():
                    try:
                        version = self._list()
                        break
                    except ReplayError as err:
                        log.warning("replay list failed", extra={"error": str(err)[:300]})
                        time.sleep(backoff)

    def _gone(self, uid: str, t: float) -> None:
        with self._lock:
            pod = self._pods.pop(uid, None)
            if pod is None or pod.job is None:
                return
            tracked = self._jobs.get(pod.job)
        if tracked is not None:
            self._fold(tracked, None, "", t)

    def _event(self, kind: str, pod: dict[str, Any], t: float) -> None:
        meta = pod.get("metadata", {})
        uid = meta.get("uid")
        if uid is None:
            return
        if kind == "DELETED":
            self._gone(uid, t)
            return
        job = (meta.get("labels") or {}).get(JOB_LABEL)
        phase = (pod.get("status") or {}).get("phase", "Pending")
        with self._lock:
            self._pods[uid] = _Pod(pod.get("spec", {}).get("nodeName"), _pod_gpus(pod), phase, job)
            tracked = self._jobs.get(job) if job is not None else None
        if tracked is not None and self._fold(tracked, meta.get("name", uid), phase, t):
            if not meta.get("deletionTimestamp"):
                self._delete_pod(meta.get("name", uid))

    def _delete_pod(self, name: str) -> None:
        try:
            self.core.delete_namespaced_pod(
                name, self.namespace, grace_period_seconds=0, _request_timeout=self.timeout_s
            )
        except ApiException as e:
            if e.status != 404:
                log.warning("replay pod delete failed", extra={"pod": name, "error": str(e)[:300]})
        except (HTTPError, OSError) as e:
            log.warning("replay pod delete failed", extra={"pod": name, "error": str(e)[:300]})

    def _fold(self, tr: _Tracked, pod: str | None, phase: str, t: float) -> bool:
        """One pod change of a tracked job at ``t`` (``pod`` None: one of its pods is gone); True
        when ``pod`` belongs to a Job being deleted and holds its GPUs still (created in a race
        with the deletion: the caller deletes it)."""
        with self._wake:
            if pod is None or (tr.deleting and phase in _TERMINAL):
                if tr.deleting and tr.ended is None and not self._live(tr.name):
                    tr.ended, tr.state = t, "CANCELLED"
                return False
            tr.phases[pod] = phase
            if tr.deleting:
                return True
            if tr.ended is not None:
                return False
            if phase == "Running":
                tr.running.add(pod)
            if tr.started is None and (len(tr.running) >= tr.pods_wanted or phase in _TERMINAL):
                tr.started, tr.state = t, "RUNNING"
                if tr.cancel_after_s is not None and not tr.deleting:
                    heapq.heappush(self._due, (t + tr.cancel_after_s, tr.name))
                    self._wake.notify()
            if phase == "Failed":
                tr.ended, tr.state = t, "FAILED"
            elif phase == "Succeeded" and sum(p == "Succeeded" for p in tr.phases.values()) >= tr.pods_wanted:
                tr.ended, tr.state = t, "COMPLETED"
            return False

    def _live(self, name: str) -> bool:
        """Whether a pod of Job ``name`` exists and is neither Succeeded nor Failed (lock held)."""
        return any(p.job == name and p.phase not in _TERMINAL for p in self._pods.values())
