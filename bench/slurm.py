"""Benchmark: lending through Slurm — the training job that needs lent GPUs, and a lease's end.

Starts a private Slurm cluster with ``deploy/local/slurm.sh`` (its own state directory under a
temporary folder, ``GPUPOOL_SLURM_GRACE`` = the notice), then measures, in the same run, on every
node in parallel, for ``--rounds`` rounds:

* yardstick: a training job (``--gpus`` GPUs, partition ``training``) submitted to a node whose
  GPUs are free: submit -> RUNNING;
* lent: the same job submitted while a lease hold (:class:`broker.scheduler_slurm.SlurmScheduler`)
  holds all 8 GPUs of the node, with a workload that ignores SIGTERM (the worst case: the hold
  leaves only at the end of its notice): submit -> RUNNING, and the time from submit to gpupool
  seeing the hold preempted (``PreemptTime`` set);
* a lease's end: :meth:`SlurmScheduler.release` of a running hold -> Slurm lists it no more;
* a hold's start: :meth:`SlurmScheduler.hold` -> running on its GPUs (what a claim would wait for
  without placeholder holds).

Then, with ``--claims N`` (default 200; 0: skip), the broker end to end on the same cluster: an
MQTT server of its own (a private Mosquitto when installed, :mod:`gpupool.demo_mosquitto`, else
amqtt in this process) and the in-process bus, every GPU of the 4 nodes idle, one site claiming one
GPU at a time and releasing it, ``N`` claims against a broker without the scheduler
(:class:`broker.lending.NoLending`: the yardstick) and ``N`` against one lending through Slurm
(:class:`broker.lending.SlurmLending`, placeholder holds), alternating in blocks of 10: claim →
lease at the site, p50/p99 of each and their ratio; a claim whose GPU had no placeholder yet
(refused, claimed again) is counted. For the Slurm broker also: release → Slurm runs no job of
the lease (hold gone, read every 20 ms), and, after each block, one lease of 8 GPUs per node and
a training job on each node: Slurm's SIGTERM to the lease's hold (recorded by its script,
microseconds) → the site holding the reclaim notice with Slurm's deadline, the same from Slurm's
``PreemptTime`` (whole seconds: up to 1 s too long), and training submit → notice.

It prints p50/p99 of each, the added time (lent - yardstick, per round and node) against the
target (<= notice + 5 s, p99 over at least 50 preemptions), the release p99 against 1 s, the
claim p99 with Slurm against 100 ms and the notice p99 against 1 s.
The cluster is stopped at the end, also on an error or Ctrl-C.

Run: ``.venv/bin/python bench/slurm.py [--rounds 13] [--notice-s 3] [--gpus 4] [--claims 200]``
(4 nodes x 13 rounds = 52 preemptions; ``--rounds 0`` for the broker part only). Needs Debian's slurmctld, slurmd, slurm-client and munge
(``deploy/local/install-system.sh``). Exit 0 when both targets are met, 1 otherwise, 2 when the
cluster could not start.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from broker.config import BrokerConfig  # noqa: E402
from bench.support.lending import claim_one_gpu, idle_capacity  # noqa: E402
from broker.edge import EdgeClient  # noqa: E402
from broker.lending import Lending, NoLending, SlurmLending  # noqa: E402
from broker.placeholders import read_term  # noqa: E402
from broker.scheduler import HoldRequest, HoldState  # noqa: E402
from broker.scheduler_slurm import JOB_NAME, SlurmScheduler  # noqa: E402
from broker.service import BrokerService  # noqa: E402
from contracts import KafkaTopics, LeaseState  # noqa: E402
from contracts.bus import MemoryBus  # noqa: E402
from gpupool.embedded_mqtt import EmbeddedMqttBroker  # noqa: E402
from gpupool.demo_mosquitto import PrivateMosquitto, mosquitto_binary  # noqa: E402
from bench.support.services import NODES, Cluster  # noqa: E402

IGNORES_TERM = ("bash", "-c", "trap '' TERM; while true; do sleep 0.1; done")


def _pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of ``values``, nearest rank."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))]


async def _round(cluster: Cluster, sched: SlurmScheduler, host: str, n: int, gpus: int, notice_s: int,
                 out: dict[str, list[float]]) -> None:
    # Yardstick: the node's GPUs are free.
    t0 = time.monotonic()
    job = await cluster.submit_training(host, gpus)
    out["free"].append(await cluster.until_running(job, t0))
    await cluster.cancel(job)
    await cluster.until_gone(job)
    # A hold of every GPU of the node, then the same training job.
    lease = f"bench-{host}-{n}"
    t0 = time.monotonic()
    await sched.hold(HoldRequest(lease, host, 8, time.time() + 3600, notice_s, IGNORES_TERM), timeout_s=60)
    out["hold"].append(time.monotonic() - t0)
    t0 = time.monotonic()
    job = await cluster.submit_training(host, gpus)
    seen = False
    while True:
        if not seen:
            h = (await sched.holds()).get(lease)
            if h is not None and h.state is HoldState.PREEMPTED:
                out["observed"].append(time.monotonic() - t0)
                seen = True
                await sched.confirm_notice(h)  # what the broker does when it sees a preemption
            elif h is None:  # gone before it was ever seen preempted: a notice gpupool missed
                out["missed"].append(time.monotonic() - t0)
                seen = True
        if await cluster.state(job) == "RUNNING":
            out["lent"].append(time.monotonic() - t0)
            break
        if time.monotonic() - t0 > 120:
            raise RuntimeError(f"training job {job} on {host} never ran")
        await asyncio.sleep(0.02)
    await cluster.cancel(job)
    await cluster.until_gone(job)
    # A lease's end: hold, release, gone.
    lease = f"bench-rel-{host}-{n}"
    await sched.hold(HoldRequest(lease, host, gpus, time.time() + 3600, notice_s), timeout_s=60)
    t0 = time.monotonic()
    await sched.release(lease)
    out["release"].append(time.monotonic() - t0)


async def _lent_jobs(cluster: Cluster, job_ids: set[str] | None = None) -> set[str]:
    """Ids of the running gpupool jobs (of ``job_ids`` when given)."""
    proc = await asyncio.create_subprocess_exec(
        "squeue", "-h", "-n", JOB_NAME, "-t", "RUNNING", "-o", "%i", stdout=asyncio.subprocess.PIPE,
        env={**cluster.env, "SLURM_CONF": str(cluster.conf)},
    )
    out, _ = await proc.communicate()
    ids = set(out.decode().split())
    return ids if job_ids is None else ids & job_ids


async def _loop_lag(out: list[float], period_s: float = 0.005) -> None:
    """How late the event loop (broker and site together) wakes a ``period_s`` sleep, into ``out``."""
    while True:
        t0 = time.perf_counter()
        await asyncio.sleep(period_s)
        out.append(time.perf_counter() - t0 - period_s)


async def _broker_phase(
    cluster: Cluster, lending: Lending, claims: int, notice_s: int, out: dict[str, list[float]], tag: str
) -> None:
    """``claims`` claims of one GPU each (claim → lease into ``out[tag]``), released at once; with
    a :class:`SlurmLending`, release → hold gone into ``out["hold_gone"]``."""
    mqtt: EmbeddedMqttBroker | PrivateMosquitto
    if mosquitto_binary() is not None:  # a server of its own process, as in production
        mqtt = PrivateMosquitto(Path(tempfile.mkdtemp(prefix="gpupool-bench-mqtt-")), "gpupool/v1", ["bench"])
        await mqtt.start()
        users, protocol = mqtt.users, mqtt.protocol
    else:
        mqtt = EmbeddedMqttBroker()
        await mqtt.start()
        users, protocol = {}, 4
    bus, topics = MemoryBus(), KafkaTopics()
    cfg = BrokerConfig(offer_ttl_s=600, lease_ttl_s=300, notice_s=notice_s, tick_s=0.1)
    svc = BrokerService(bus=bus, topics=topics, mqtt_host=mqtt.host, mqtt_port=mqtt.port, protocol=protocol,
                        mqtt_username="gpupool-broker" if users else None, mqtt_password=users.get("gpupool-broker"),
                        config=cfg, lending=lending)  # fmt: skip
    await idle_capacity(bus, topics, NODES)
    await svc.start()
    stop = asyncio.Event()
    serve = asyncio.create_task(svc.run(stop))
    lag = asyncio.create_task(_loop_lag(out[f"{tag}_lag"]))
    slurm = lending if isinstance(lending, SlurmLending) else None
    try:
        await svc.wait_connected(10)
        async with EdgeClient(site="bench", host=mqtt.host, port=mqtt.port, protocol=protocol,
                              username="bench" if users else None, password=users.get("bench")) as site:
            if slurm is not None:  # placeholders on every offered GPU before the first claim
                while sum(len(v) for v in slurm._idle.values()) < 8 * len(NODES):
                    await asyncio.sleep(0.05)
            n = 0
            while n < claims:
                if slurm is not None:  # steady state: the released GPU held again, no release running
                    t_refill = time.perf_counter()
                    while sum(len(v) for v in slurm._idle.values()) < 8 * len(NODES) or any(
                        t.get_name().startswith("hold-") for t in slurm._tasks
                    ):
                        await asyncio.sleep(0.02)
                    if n:
                        out["refill"].append(time.perf_counter() - t_refill)
                lease = await claim_one_gpu(site, out, tag)
                if lease is None:
                    continue
                n += 1
                jobs = {h.job_id for h in slurm._leases.get(lease.lease_id, [])} if slurm else set()
                t1 = time.perf_counter()
                await site.release(lease.lease_id)
                if slurm is not None:
                    while await _lent_jobs(cluster, jobs):
                        await asyncio.sleep(0.02)
                    out["hold_gone"].append(time.perf_counter() - t1)
            if slurm is not None:
                await _notices(cluster, site, slurm, out)
    finally:
        lag.cancel()
        stop.set()
        await serve
        await svc.stop()
        await mqtt.stop()
        await cluster.cancel_all()


async def _notices(cluster: Cluster, site: EdgeClient, slurm: SlurmLending, out: dict[str, list[float]]) -> None:
    """One lease of all 8 GPUs per node, then a training job on each node: Slurm choosing the
    lease's hold → the site holding the reclaim notice (state ``reclaiming`` with Slurm's
    deadline), with Slurm's choice timed two ways: when the hold's script got Slurm's SIGTERM
    (its term file, microseconds; Slurm signals the job as it preempts it, so this is at most
    the signal's delivery later than the choice) and Slurm's ``PreemptTime`` (whole seconds,
    truncated: up to 1 s early, so that figure is up to 1 s too long); and submit → notice."""
    for host in NODES:
        while len(slurm._idle.get(host, {})) < 8:
            await asyncio.sleep(0.05)

    async def one(host: str) -> None:
        offer = None
        while offer is None:
            offer = next((o for o in site.known_offers.values() if o.host == host and len(o.gpus) == 8), None)
            await asyncio.sleep(0.01)
        lease = await site.claim(offer.offer_id, count=8, timeout_s=10)
        jobs = [h.job_id for h in slurm._leases[lease.lease_id]]
        t0 = time.time()
        job = await cluster.submit_training(host, 1)
        msg = await site.wait_lease(
            lease.lease_id, lambda m: m.state not in (LeaseState.GRANTED, LeaseState.ACTIVE), 30
        )
        seen = time.time()
        if msg.state is LeaseState.RECLAIMING:
            out["submit_notice"].append(seen - t0)
            for _ in range(100):  # the script writes it on SIGTERM; the notice may come first
                terms = [t for j in jobs if (t := read_term(slurm.control_dir / f"{j}.term")) is not None]
                if terms:
                    out["notice"].append(seen - min(terms))
                    break
                await asyncio.sleep(0.02)
            else:
                print(f"lease {lease.lease_id}: no term file of {jobs}", file=sys.stderr)
            preempted = [h.preempted_at for h in await slurm.scheduler.jobs() if h.job_id in jobs and h.preempted_at]
            if preempted:
                out["notice_preempt_time"].append(seen - min(preempted))
        else:  # e.g. revoked at once because a hold was gone (hold_lost) before the site saw reclaiming
            print(f"lease {lease.lease_id}: {msg.state} ({msg.reason}) instead of a notice", file=sys.stderr)
        await cluster.cancel(job)

    await asyncio.gather(*(one(h) for h in NODES))


async def _main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="gpupool-bench-slurm-") as tmp:
        cluster = Cluster(Path(tmp) / "slurm", args.notice_s)
        started = cluster.script("start")
        if started.returncode != 0:
            print(started.stderr, file=sys.stderr)
            return 2
        try:
            sched = SlurmScheduler(cluster.conf)
            out: dict[str, list[float]] = {k: [] for k in ("free", "lent", "observed", "missed", "release", "hold")}
            for n in range(args.rounds):
                await asyncio.gather(*(_round(cluster, sched, h, n, args.gpus, args.notice_s, out) for h in NODES))
                print(f"round {n + 1}/{args.rounds}: {len(out['lent'])} preemptions", file=sys.stderr, flush=True)
            for k in ("none", "slurm", "none_refused", "slurm_refused", "hold_gone", "notice", "submit_notice",
                      "notice_preempt_time", "refill", "none_lag", "slurm_lag"):
                out[k] = []
            for block in range(0, args.claims, 10):
                size = min(10, args.claims - block)
                await _broker_phase(cluster, NoLending(), size, args.notice_s, out, "none")
                lending = SlurmLending(SlurmScheduler(cluster.conf), notice_s=args.notice_s,
                                       control_dir=Path(tmp) / "lending", poll_s=0.25)  # fmt: skip
                await _broker_phase(cluster, lending, size, args.notice_s, out, "slurm")
                print(f"claims: {len(out['slurm'])}/{args.claims}", file=sys.stderr, flush=True)
        finally:
            cluster.script("stop")
    if args.claims:
        print(f"\nclaim -> lease at the site, {args.claims} claims each, same run")
        print(f"{'':45} {'p50 ms':>8} {'p99 ms':>8} {'n':>6}")
        for name, key in (("broker without the scheduler (yardstick)", "none"), ("broker lending through Slurm", "slurm"),
                          ("event loop lag, broker without the scheduler", "none_lag"),
                          ("event loop lag, broker lending through Slurm", "slurm_lag"),
                          ("release -> hold gone (Slurm)", "hold_gone"),
                          ("Slurm's SIGTERM to the hold -> notice at site", "notice"),
                          ("PreemptTime (whole s) -> notice at the site", "notice_preempt_time"),
                          ("training submit -> notice at the site", "submit_notice"),
                          ("release -> GPU held by a placeholder again", "refill")):
            print(f"{name:45} {statistics.median(out[key]) * 1e3:8.1f} {_pct(out[key], 0.99) * 1e3:8.1f} "
                  f"{len(out[key]):6d}")
        print(f"claims refused for want of a placeholder: {len(out['slurm_refused'])}; ratio p99 slurm/none "
              f"{_pct(out['slurm'], 0.99) / _pct(out['none'], 0.99):.2f}x; claim p99 target 100 ms: "
              f"{'met' if _pct(out['slurm'], 0.99) <= 0.1 else 'MISSED'}; notice p99 target 1 s: "
              f"{'met' if _pct(out['notice'], 0.99) <= 1.0 else 'MISSED'} ({len(out['notice'])} preemptions)")
    if not args.rounds:
        return 0
    added = [lent - free for lent, free in zip(out["lent"], out["free"], strict=True)]
    rows = [
        ("training job, GPUs free (yardstick)", out["free"]),
        ("training job, GPUs lent (ignores TERM)", out["lent"]),
        ("added by lending", added),
        ("submit -> hold seen preempted", out["observed"]),
        ("hold -> running on its GPUs", out["hold"]),
        ("release -> hold gone", out["release"]),
    ]
    print(f"\nSlurm lending, {len(added)} preemptions, notice {args.notice_s} s, {args.gpus} GPUs per training job")
    print(f"{'':42} {'p50 s':>8} {'p99 s':>8}")
    for name, values in rows:
        print(f"{name:42} {statistics.median(values):8.3f} {_pct(values, 0.99):8.3f}")
    added_ok = _pct(added, 0.99) <= args.notice_s + 5.0 and len(added) >= 50
    release_ok = _pct(out["release"], 0.99) <= 1.0
    print(f"added p99 {_pct(added, 0.99):.3f} s vs target notice + 5 = {args.notice_s + 5:.1f} s: "
          f"{'met' if added_ok else 'MISSED'}")
    print(f"release p99 {_pct(out['release'], 0.99):.3f} s vs target 1 s: {'met' if release_ok else 'MISSED'}")
    print(f"preemptions gpupool did not see before the hold was gone: {len(out['missed'])}")
    print(f"ratio lent/free p50: {statistics.median(out['lent']) / statistics.median(out['free']):.2f}x")
    return 0 if added_ok and release_ok and not out["missed"] else 1


def main() -> int:
    """Run the benchmark (module docstring); exit 0 when the targets are met, 1 otherwise, 2 when the cluster could not start."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=13)
    p.add_argument("--notice-s", type=int, default=3)
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--claims", type=int, default=200)
    return asyncio.run(_main(p.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
