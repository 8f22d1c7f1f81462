"""InfiniBand fabric collector: topology from ``ibnetdiscover -p``, port counters from ``perfquery``.

One :meth:`FabricCollector.sweep` reads every switch's ports, then every CA's, with one
``perfquery -x LID p1,p2,...`` process per device (bounded concurrency, a timeout per run),
and produces :class:`contracts.telemetry.IbPortSample` records to ``telemetry.ib_port``.
:meth:`FabricCollector.discover` produces a :class:`contracts.fabric.FabricTopology` snapshot to
the compacted ``fabric.topology`` topic under the key ``topology``.

Which ports are read: those with a peer at the last discovery, plus those seen with a peer at any
earlier discovery of this collector — so a port whose link went down is still read (its switch
answers) and reported ``DOWN``; a CA that is no longer discovered (its only link is down) is not
queried. Switches go first: they hold the fabric-wide picture (every CA port is also seen from
its leaf's port), and a leaf port read before the CAs is not disturbed by the MADs that reading
the CA behind it sends through that port.

Legacy counters: when ``perfquery -x`` shows no ``PortXmitWait`` (the PMA lacks the additional
extended counters, e.g. ibsim), ``legacy_counters="auto"`` also runs legacy ``perfquery`` for the
same ports and adds the counters the extended read lacked (error counters, ``PortXmitWait``) with
their legacy widths; 64-bit values always win. That second process per device doubles a sweep's
cost, so ``legacy_every=N`` runs it on every Nth sweep only (the first sweep, then sweeps N, 2N...):
the 64-bit data counters are read every sweep, and the samples of a sweep without the legacy read
carry only what was read (the legacy-only counters are absent, never 0 and never a stale copy).

Failures never escape a sweep: each is logged (``fabric_device_error``) and counted in
``gpupool_collector_fabric_errors_total{reason}`` (:class:`collectors.metrics.FabricCollectorMetrics`), and
the other devices are still read.

Running against ibsim: pass ``env`` with ``IBSIM_SOCKNAME`` and ``LD_PRELOAD`` (the ``env`` of the
fabric's ``fabric.json``) and keep ``concurrency`` below ibsim's 10 client slots minus OpenSM's.
libumad2sim builds a fake sysfs tree ``sys-<pid>/`` in each client's working directory and removes it
at exit; on a disk file system that costs more CPU than the rest of the run, so the private work
directory goes to ``/dev/shm`` (tmpfs) when it is writable (measured on a 100-switch fabric with
``bench/fabric_sweep.py``, extended + legacy reads: 2.2-7.3 s of perfquery CPU per sweep on ext4,
0.85 s on tmpfs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Self

from collectors.metrics import FabricCollectorMetrics
from collectors.fabric_parse import (
    PerfqueryBlock,
    PerfqueryResult,
    Topology,
    TopologyNode,
    parse_ibnetdiscover,
    parse_perfquery,
)
from collectors.fabric_records import port_sample, topology_record
from contracts.base import encode
from contracts.bus.api import Bus, Producer
from contracts.fabric import FabricTopology
from contracts.telemetry import IbPortSample
from contracts.topics import KafkaTopics
from runtime.backoff import Backoff

__all__ = ["DiagResult", "FabricCollector"]

log = logging.getLogger(__name__)

# Local transport failures, retried (``retries``): no UMAD device, no ibsim client slot, or an ibsim
# client slot taken away while the run used it ("sim_attach: can't connect to sim socket ...",
# "_do_madrpc: send failed": seen on a 100-switch ibsim fabric when the slot reaper's ``X <n>``
# meets a slot just reused by a new client).
_TRANSPORT_MARKERS = (
    "mad_rpc_open_port",
    "sim_init",
    "sim_attach",
    "connect failed",
    "can't open UMAD",
    "umad_open_port",
    "_do_madrpc: send failed",
)
_UNREACHABLE_MARKERS = (
    "_do_madrpc failed",
    "failed: classportinfo",
    "failed: perfquery",
    "failed: perfextquery",
)


@dataclass(frozen=True, slots=True)
class DiagResult:
    """One run of a diag command.

    Attributes:
        stdout / stderr: decoded output (UTF-8, undecodable bytes replaced).
        returncode: exit status; ``None`` when it never ran or was killed at the timeout.
        duration_s: wall time, seconds.
        reason: ``None`` on success, else ``exec_error``, ``timeout``, ``transport`` (cannot open the
            MAD transport: no umad device / no ibsim client slot), ``unreachable`` (MAD RPC to the
            target failed) or ``exit_status``.
    """

    stdout: str
    stderr: str
    returncode: int | None
    duration_s: float
    reason: str | None


_Target = tuple[TopologyNode, list[int]]


def _tmpfs_dir() -> str | None:
    """``/dev/shm`` when it is a writable directory (a tmpfs on Linux), else ``None`` (default temp dir)."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK) else None


def _classify(returncode: int, stderr: str) -> str | None:
    if returncode == 0:
        return None
    if any(s in stderr for s in _TRANSPORT_MARKERS):
        return "transport"
    if any(s in stderr for s in _UNREACHABLE_MARKERS):
        return "unreachable"
    return "exit_status"


class FabricCollector:
    """Collects an InfiniBand fabric's topology and port counters through infiniband-diags.

    Args:
        bus: where records go (a producer is created by :meth:`start`).
        topics: topic names.
        run_prefix: argv prefix for every command (e.g. ``["sudo", "-n"]`` or ``["ibsim-run"]``;
            Debian's ``ibsim-run`` breaks when ``LD_PRELOAD`` is already set: prefer ``env``).
        env: variables added to this process's environment for the commands (e.g.
            ``IBSIM_SOCKNAME`` and ``LD_PRELOAD`` for ibsim).
        workdir: working directory of the commands (libumad2sim writes ``sys-<pid>/`` there);
            default: a private temporary directory, under ``/dev/shm`` when writable, removed by
            :meth:`stop`.
        concurrency: perfquery processes at once (>= 1).
        timeout_s: per perfquery run, seconds; the process group is killed after it.
        discover_timeout_s: per ibnetdiscover run, seconds.
        include_cas: also read CA (HCA) ports, after the switches.
        legacy_counters: run legacy ``perfquery`` after ``-x`` when the extended output lacks
            ``PortXmitWait`` (``auto``), every time (``always``) or never (``never``).
        legacy_every: do that legacy run on every Nth sweep only (>= 1; sweeps counted from 0 by
            this collector, legacy on sweep 0, N, 2N...); the extended run happens every sweep.
        retries: extra attempts of a run that failed with ``transport`` (a busy ibsim slot).
        perfquery / ibnetdiscover: the commands' names or paths.
        clock: wall clock for sample timestamps (Unix seconds).
        metrics: where it counts (``gpupool_collector_fabric_*``); give it the collector
            service's registry (``FabricCollectorMetrics(service_registry)``) so its ``/metrics``
            shows them; ``None``: new ones on a registry of their own (:attr:`metrics`).
    """

    def __init__(
        self,
        bus: Bus,
        topics: KafkaTopics,
        *,
        run_prefix: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        workdir: Path | str | None = None,
        concurrency: int = 8,
        timeout_s: float = 5.0,
        discover_timeout_s: float = 60.0,
        include_cas: bool = True,
        legacy_counters: Literal["auto", "always", "never"] = "auto",
        legacy_every: int = 1,
        retries: int = 1,
        perfquery: str = "perfquery",
        ibnetdiscover: str = "ibnetdiscover",
        client_id: str = "gpupool-fabric",
        clock: Callable[[], float] = time.time,
        metrics: FabricCollectorMetrics | None = None,
    ) -> None:
        self.metrics = metrics if metrics is not None else FabricCollectorMetrics()
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if timeout_s <= 0 or discover_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")
        if legacy_every < 1:
            raise ValueError("legacy_every must be >= 1")
        self._bus = bus
        self._topics = topics
        self._run_prefix = list(run_prefix)
        self._env = {**os.environ, **(env or {})}
        self._workdir = Path(workdir) if workdir is not None else None
        self._own_workdir = workdir is None
        self._concurrency = concurrency
        self._timeout_s = timeout_s
        self._discover_timeout_s = discover_timeout_s
        self._include_cas = include_cas
        self._legacy = legacy_counters
        self._legacy_every = legacy_every
        self._sweeps = 0
        self._retries = max(0, retries)
        self._perfquery = perfquery
        self._ibnetdiscover = ibnetdiscover
        self._client_id = client_id
        self._clock = clock
        self._producer: Producer | None = None
        self._topology: Topology | None = None
        self._known_ports: dict[str, set[int]] = {}
        self._seq = 0

    # lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Create the work directory (if private) and start the producer."""
        if self._workdir is None:
            self._workdir = Path(tempfile.mkdtemp(prefix="gpupool-fabric-", dir=_tmpfs_dir()))
        self._workdir.mkdir(parents=True, exist_ok=True)
        if self._producer is None:
            producer = self._bus.producer(self._client_id)
            await producer.start()
            self._producer = producer

    async def stop(self) -> None:
        """Flush and stop the producer; remove a private work directory."""
        if self._producer is not None:
            try:
                await self._producer.flush()
            finally:
                await self._producer.stop()
                self._producer = None
        if self._own_workdir and self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def topology(self) -> Topology | None:
        """The last discovery's parse, or ``None`` before the first."""
        return self._topology

    # running commands ---------------------------------------------------------------------------
    async def _exec(self, args: Sequence[str], timeout_s: float) -> DiagResult:
        """Run ``run_prefix + args``; kill its process group at ``timeout_s``. Never raises."""
        argv = [*self._run_prefix, *args]
        t0 = time.perf_counter()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=self._workdir,
                env=self._env,
                start_new_session=True,
            )
        except OSError as exc:
            return DiagResult("", str(exc), None, time.perf_counter() - t0, "exec_error")
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        except TimeoutError:
            self.metrics.timeouts.inc()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            if self._workdir is not None:  # libumad2sim's fake sysfs, left behind by a killed client
                shutil.rmtree(self._workdir / f"sys-{proc.pid}", ignore_errors=True)
            return DiagResult("", "", None, time.perf_counter() - t0, "timeout")
        stderr = err.decode(errors="replace")
        rc = proc.returncode if proc.returncode is not None else -1
        return DiagResult(
            out.decode(errors="replace"), stderr, rc, time.perf_counter() - t0, _classify(rc, stderr)
        )

    async def _exec_retrying(self, args: Sequence[str], timeout_s: float) -> DiagResult:
        """:meth:`_exec`, run again up to ``retries`` times after a transport failure (MAD
        timeouts and the like), with :class:`runtime.backoff.Backoff` (50 ms doubling) between."""
        res = await self._exec(args, timeout_s)
        backoff = Backoff(0.05, 1.0)
        for _ in range(self._retries):
            if res.reason != "transport":
                break
            await asyncio.sleep(backoff.next())
            res = await self._exec(args, timeout_s)
        return res

    def _error(self, reason: str, **fields: object) -> None:
        self.metrics.errors.labels(reason=reason).inc()
        log.warning("fabric_device_error", extra={"reason": reason, **fields})

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    async def _publish(self, topic: str, key: str, value: bytes) -> None:
        if self._producer is None:
            raise RuntimeError("FabricCollector is not started")
        await self._producer.send(topic, value, key=key)

    # discovery ----------------------------------------------------------------------------------
    async def discover(self) -> Topology:
        """Run ``ibnetdiscover -p``, parse it, publish a :class:`FabricTopology`, and return the parse.

        A failed run or an empty output returns a :class:`Topology` with ``error`` set (and
        nothing published); the previous topology stays in use for sweeps.

        Raises:
            RuntimeError: the collector is not started.
        """
        if self._producer is None:
            raise RuntimeError("FabricCollector is not started")
        res = await self._exec_retrying([self._ibnetdiscover, "-p"], self._discover_timeout_s)
        self.metrics.discovery_duration.observe(res.duration_s)
        if res.reason is not None:
            self._error(res.reason, command="ibnetdiscover", stderr=res.stderr[-500:])
            return Topology(error=res.reason)
        topo = parse_ibnetdiscover(res.stdout)
        for p in topo.problems:
            self._error(p.reason, command="ibnetdiscover", line_no=p.lineno, line=p.line[:200])
        if topo.error is not None:
            self._error(topo.error, command="ibnetdiscover")
            return topo
        ts = self._clock()
        record = topology_record(topo, ts=ts, seq=self._next_seq())
        await self._publish(self._topics.fabric_topology, record.key, encode(record))
        down = 0
        for guid, node in topo.nodes().items():
            known = self._known_ports.setdefault(guid, set())
            known.update(p for p, tp in node.ports.items() if tp.connected)
            down += sum(1 for p in known if not (p in node.ports and node.ports[p].connected))
        self.metrics.ports_down.set(down)
        self._topology = topo
        log.info(
            "fabric_discovered",
            extra={
                "nodes": len(record.nodes),
                "links": len(record.links),
                "ports_down": down,
                "duration_s": round(res.duration_s, 4),
            },
        )
        return topo

    def topology_record(self) -> FabricTopology | None:
        """The last discovery as a record (without publishing), or ``None`` before the first."""
        if self._topology is None:
            return None
        return topology_record(self._topology, ts=self._clock(), seq=self._seq)

    # counters -----------------------------------------------------------------------------------
    def _targets(self, topo: Topology) -> tuple[list[_Target], list[_Target]]:
        """(switches, other nodes) with the ports to read of each."""
        switches: list[_Target] = []
        cas: list[_Target] = []
        for guid, node in sorted(topo.nodes().items()):
            ports = {p for p, tp in node.ports.items() if tp.connected} | self._known_ports.get(guid, set())
            if not ports:
                continue
            (switches if node.node_type == "SW" else cas).append((node, sorted(ports)))
        return switches, cas

    async def _read_device(self, node: TopologyNode, ports: list[int], legacy: bool) -> list[IbPortSample]:
        """perfquery one device (extended, then legacy if ``legacy`` and needed); samples for the ports it
        answered."""
        if node.lid <= 0:
            self._error("no_lid", guid=node.guid, node_name=node.name)
            return []
        t0 = time.perf_counter()
        port_arg = ",".join(str(p) for p in ports)
        runs: list[tuple[str, list[str]]] = [("extended", [self._perfquery, "-x", str(node.lid), port_arg])]
        blocks: dict[int, list[PerfqueryBlock]] = {}
        failed = False
        i = 0
        while i < len(runs):
            kind, args = runs[i]
            i += 1
            res = await self._exec_retrying(args, self._timeout_s)
            if res.reason is not None:
                self._error(
                    res.reason,
                    guid=node.guid,
                    lid=node.lid,
                    node_name=node.name,
                    kind=kind,
                    returncode=res.returncode,
                    stderr=res.stderr[-300:],
                )
                failed = True
                break
            parsed: PerfqueryResult = parse_perfquery(res.stdout)
            for p in parsed.problems:
                self._error(p.reason, guid=node.guid, lid=node.lid, line_no=p.lineno, line=p.line[:200])
            if parsed.error is not None:
                self._error(parsed.error, guid=node.guid, lid=node.lid, node_name=node.name, kind=kind)
                failed = True
                break
            for b in parsed.blocks:
                if b.port is not None:
                    blocks.setdefault(b.port, []).append(b)
            lacks_wait = any("PortXmitWait" not in b.counters for b in parsed.blocks)
            if (
                kind == "extended"
                and legacy
                and (self._legacy == "always" or (self._legacy == "auto" and lacks_wait))
            ):
                runs.append(("legacy", [self._perfquery, str(node.lid), port_arg]))
        self.metrics.device_duration.labels(node_type=node.node_type).observe(time.perf_counter() - t0)
        ts = self._clock()
        samples = []
        for port in ports:
            got = blocks.get(port)
            if not got:
                if not failed:
                    self._error("missing_port", guid=node.guid, lid=node.lid, port=port)
                continue
            samples.append(port_sample(node, port, got, ts=ts, seq=self._next_seq()))
        return samples

    @property
    def legacy_due(self) -> bool:
        """Whether the next :meth:`sweep` includes the legacy ``perfquery`` run (see ``legacy_every``)."""
        return self._legacy != "never" and self._sweeps % self._legacy_every == 0

    async def sweep(self) -> list[IbPortSample]:
        """Read every target port's counters (switches, then CAs) and publish the samples.

        Discovers first if nothing was discovered yet. Returns the samples produced (a device that
        failed contributes none; its failure is counted). The legacy counters are read only when
        :attr:`legacy_due`; a sweep that found no topology does not count towards ``legacy_every``.

        Raises:
            RuntimeError: the collector is not started.
        """
        if self._producer is None:
            raise RuntimeError("FabricCollector is not started")
        topo = self._topology
        if topo is None:
            topo = await self.discover()
            if topo.error is not None:
                return []
        t0 = time.perf_counter()
        legacy = self.legacy_due
        self._sweeps += 1
        switches, cas = self._targets(topo)
        sem = asyncio.Semaphore(self._concurrency)

        async def one(node: TopologyNode, ports: list[int]) -> list[IbPortSample]:
            async with sem:
                return await self._read_device(node, ports, legacy)

        samples: list[IbPortSample] = []
        for group in (switches, cas if self._include_cas else []):
            for part in await asyncio.gather(*(one(n, p) for n, p in group)):
                samples.extend(part)
        for s in samples:
            await self._publish(self._topics.telemetry_ib_port, s.partition_key, encode(s))
        self.metrics.samples.inc(len(samples))
        self.metrics.sweep_duration.observe(time.perf_counter() - t0)
        return samples

    async def collect(self) -> list[IbPortSample]:
        """:meth:`discover` then :meth:`sweep` (the sweep uses the previous topology if discovery failed)."""
        await self.discover()
        return await self.sweep()

    async def run(
        self, interval_s: float, *, discover_every: int = 1, stop: asyncio.Event | None = None
    ) -> None:
        """Sweep every ``interval_s`` seconds (discovering every ``discover_every`` sweeps) until
        ``stop`` is set. An exception in one round is logged and counted (``publish``), never raised."""
        stop = stop or asyncio.Event()
        n = 0
        while not stop.is_set():
            started = time.monotonic()
            try:
                if n % max(1, discover_every) == 0:
                    await self.discover()
                await self.sweep()
            except Exception:  # the loop must survive a bus outage
                self.metrics.errors.labels(reason="publish").inc()
                log.exception("fabric_round_failed")
            n += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, interval_s - (time.monotonic() - started)))
