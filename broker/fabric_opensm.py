"""Per-lease fabric isolation on OpenSM: a partition (PKey) per lease, applied by rewriting
``partitions.conf`` / ``qos-policy.conf`` and sending OpenSM a SIGHUP, then read back from the
fabric before the lease is granted (:class:`OpenSmFabric`, a :class:`broker.fabric.FabricManager`).

What "verified" means here, all read with infiniband-diags over the fabric (never from OpenSM's
files or logs):

* ``smpquery pkeys <lid>`` of each leased host's HCA port shows the PKey as a **limited** member
  (bit 15 clear), and of the edge gateway's port as a **full** member (bit 15 set);
* with ``verify_switch_ports`` and a ``topology.json`` next to ``fabric.json``: the switch port
  facing each of those HCAs shows the same entry — OpenSM's partition enforcement
  (``part_enforce both``) on the switch, which is what stops a host that rewrote its own table;
* with ``verify_sl``: ``saquery PR --slid <gateway> --dlid <host> --pkey <pkey>`` answers with the
  lease's SL (the QoS rule and the partition's ``sl=`` reached the SA; see
  :mod:`broker.fabric_plan` for what OpenSM honours).

* with a QoS plan (``qos_share_percent``): on every port of every shortest path between each
  leased host and the gateway (from ``ibnetdiscover -p``, :mod:`broker.fabric_paths`), the SL2VL
  rows of the input ports on those paths and the VL arbitration tables show the plan
  (:mod:`broker.fabric_qos`), read with SMPs in one child process per round
  (:mod:`broker.fabric_smp`; ``smpquery`` would take two processes per port). The plan is
  written as a gpupool-managed block at the end of ``opensm.conf`` with the first partition
  change after it differs, and made effective by the same SIGHUP. :meth:`OpenSmFabric.audit`
  reads every switch port back against it the same way (every input port's row;
  :meth:`OpenSmFabric.audit_forever` every ``audit_interval_s``) and sets
  ``gpupool_broker_fabric_qos_drift_ports``.

``saquery PKeyTableRecord`` is refused to an untrusted requester (DESIGN.md), so PKey tables are
read with SMPs (``smpquery``), addressed by the LIDs in ``fabric.json``.

State: ``fabric.json`` as written by ``deploy/local/fabric.sh`` (``env`` for the diag commands —
``IBSIM_SOCKNAME`` and ``LD_PRELOAD`` on the simulated fabric, nothing on a real one —
``workdir``, ``opensm_pid_file``, ``partitions_conf``, ``qos_policy_conf``, ``nodes`` → kind, role,
``port_guid``, ``lid``). It is re-read when it changes. The partitions file must exist: OpenSM
treats a missing file as "every port a full member of the default partition" but an existing one
without a Default rule as "every port a limited member", so creating it would change the fabric.

Concurrency: one lock around "read files → change → write → SIGHUP". Changes asked for while a
write is in progress are applied together in the next write with a single SIGHUP (batching);
verification runs outside the lock, each change against its own ports.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from broker.fabric import FabricError
from broker.fabric_paths import LinkGraph, PathPort, union
from broker.metrics import FabricMetrics
from broker.fabric_plan import (
    FilePlan,
    LeasePartition,
    ManagedState,
    Membership,
    PlanError,
    membership,
    operator_pkeys,
    parse_partitions,
    parse_path_record,
    parse_pkey_table,
    plan,
)
from broker.fabric_qos import (
    QosPlan,
    high_limit_for,
    managed_block,
    plan_qos,
    render_opensm_conf,
    sl2vl_problem,
    vlarb_problem,
)
from contracts import LeaseLogRecord
from contracts.leases import LaneQos, Partition
from contracts.topics import lease_hosts

__all__ = ["FabricNode", "FabricState", "OpenSmFabric", "default_host_ports"]

log = logging.getLogger(__name__)

_GUID = re.compile(r"^0x[0-9a-fA-F]{1,16}$")
_TRAILING_NUMBER = re.compile(r"(\d+)$")
_AUDIT_CHUNK = 64
"""Switch ports an audit reads per child process."""
_FABRIC_SMP = Path(__file__).with_name("fabric_smp.py")
"""The SMP reader (:mod:`broker.fabric_smp`), run as a script in a child process."""
HostPorts = Mapping[str, Sequence[str]] | Callable[[str], Sequence[str]]
"""Host name → HCA node ids of ``fabric.json`` or port GUIDs (``0x`` + hex)."""


class _Failure(FabricError):
    """A :class:`FabricError` with the ``reason`` label it is counted under."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class FabricNode:
    """One node of ``fabric.json``.

    Attributes:
        nodeid: ibsim node id / host name of the HCA (``node007``, ``leaf-2``, ``edge-gw``).
        kind: ``hca`` or ``switch``.
        role: ``compute``, ``edge-gateway``, ``leaf`` or ``spine``.
        port_guid: the port GUID (``0x`` + 16 lowercase hex digits) OpenSM's partitions name.
        lid: its LID (switches: port 0's).
        peer: for HCAs, ``(switch nodeid, switch port)`` of the link of port 1, from
            ``topology.json``; ``None`` when unknown.
    """

    nodeid: str
    kind: str
    role: str
    port_guid: str
    lid: int
    peer: tuple[str, int] | None = None


@dataclass(frozen=True)
class FabricState:
    """What :class:`OpenSmFabric` needs from ``fabric.json`` (format: module docstring).

    Attributes:
        path: the ``fabric.json`` read.
        mtime_ns: its modification time when read.
        env: extra environment of the diag commands.
        workdir: their working directory (libumad2sim writes ``sys-<pid>/`` there).
        opensm_pid_file: file holding OpenSM's PID.
        partitions_conf: OpenSM's partition configuration file.
        qos_policy_conf: OpenSM's QoS policy file (``None``: not managed).
        opensm_conf: OpenSM's configuration file, where the QoS plan goes (``None``: unknown).
        nodes: node id → node, in ``fabric.json`` order.
    """

    path: Path
    mtime_ns: int
    env: dict[str, str]
    workdir: Path
    opensm_pid_file: Path
    partitions_conf: Path
    qos_policy_conf: Path | None
    opensm_conf: Path | None = None
    nodes: dict[str, FabricNode] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> FabricState:
        """Read ``path`` (and ``topology.json`` beside it, when present, for switch peers).

        Raises ``OSError`` if it cannot be read, ``ValueError`` if it is not such a file.
        """
        mtime = path.stat().st_mtime_ns
        try:
            data = json.loads(path.read_text())
            peers = _peers(path.parent / "topology.json")
            nodes = {
                nid: FabricNode(
                    nodeid=nid,
                    kind=str(n["kind"]),
                    role=str(n.get("role", "")),
                    port_guid=f"0x{int(str(n['port_guid']), 16):016x}",
                    lid=int(n["lid"]),
                    peer=peers.get(nid),
                )
                for nid, n in data["nodes"].items()
            }
            qos = data.get("qos_policy_conf")
            conf = data.get("opensm_conf")
            return cls(
                path=path,
                mtime_ns=mtime,
                env={str(k): str(v) for k, v in data.get("env", {}).items()},
                workdir=Path(data.get("workdir") or path.parent),
                opensm_pid_file=Path(data["opensm_pid_file"]),
                partitions_conf=Path(data["partitions_conf"]),
                qos_policy_conf=Path(qos) if qos else None,
                opensm_conf=Path(conf) if conf else None,
                nodes=nodes,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{path}: not a fabric.json: {e!r}") from e

    def by_guid(self, guid: str) -> FabricNode | None:
        """The node whose port GUID is ``guid`` (any case, with ``0x``), or ``None``."""
        want = f"0x{int(guid, 16):016x}"
        return next((n for n in self.nodes.values() if n.port_guid == want), None)


def _peers(topology: Path) -> dict[str, tuple[str, int]]:
    """HCA node id → (switch node id, port) of its port 1, from ``gen_topology.py``'s JSON."""
    if not topology.is_file():
        return {}
    out: dict[str, tuple[str, int]] = {}
    for n in json.loads(topology.read_text()).get("nodes", []):
        link = n.get("links", {}).get("1")
        if n.get("kind") == "hca" and link:
            out[str(n["nodeid"])] = (str(link[0]), int(link[1]))
    return out


def default_host_ports(state: FabricState, host: str) -> list[str]:
    """The default host → HCA mapping: a host named like an HCA node id (``node003``) is that HCA;
    otherwise a host name ending in a number N (``gpu-node-003``) is the Nth compute HCA of
    ``fabric.json`` (in file order, 1-based). Returns ``[]`` when neither applies (the host is
    not on the fabric)."""
    node = state.nodes.get(host)
    if node is not None and node.kind == "hca":
        return [host]
    m_num = _TRAILING_NUMBER.search(host)
    if not m_num:
        return []
    compute = [n.nodeid for n in state.nodes.values() if n.kind == "hca" and n.role == "compute"]
    idx = int(m_num.group(1)) - 1
    return [compute[idx]] if 0 <= idx < len(compute) else []


@dataclass(frozen=True)
class _Check:
    """One read-back. Without ``dlid``: the PKey table of ``lid`` (port ``port`` of a switch) must
    show ``expect``. With ``dlid``: the SA's PathRecord ``lid`` → ``dlid`` on the PKey must carry
    the partition's SL."""

    what: str
    lid: int
    port: int | None = None
    expect: Membership | None = None
    dlid: int | None = None


@dataclass
class _Change:
    """One queued change of the managed section: add ``entry`` (its PKey still to allocate) or
    remove the partition named ``remove``."""

    future: asyncio.Future[LeasePartition | None]
    add: LeasePartition | None = None
    remove: str | None = None


class OpenSmFabric:
    """Fabric isolation with OpenSM partitions, verified on the fabric (see the module docstring).

    Args:
        state: ``fabric.json`` of the fabric (``deploy/local/fabric.sh`` writes it).
        gateway: node id (or port GUID) of the edge gateway's HCA: the full member of every
            lease partition.
        host_ports: GPU host name → HCA node ids of ``fabric.json`` or port GUIDs; a mapping or a
            function. ``None``: :func:`default_host_ports`. A host with no port is not on the
            fabric: its leases are not isolated (and so not granted).
        sl: InfiniBand service level (0..15) of inference traffic.
        verify_timeout_s: how long to wait for the fabric to show a change, seconds.
        dry_run: change nothing: :meth:`isolate` reports the diff it would apply and raises
            :class:`FabricError`; :meth:`remove` reports its diff.
        verify_switch_ports: also check the switch port facing each member HCA (when known).
        verify_sl: also check the SL the SA gives for gateway → host paths on the PKey.
        command_timeout_s: timeout of one diag command, seconds.
        concurrency: diag commands run at once (ibsim serves at most 10 clients, OpenSM uses one).
        on_diff: called with each dry-run diff (e.g. the CLI prints it); it is logged anyway.
        qos_share_percent: the lent-share bound of the QoS plan, percent of a busy link
            (:func:`broker.fabric_qos.high_limit_for`); ``None``: QoS is not managed (partitions
            only, leases carry no ``qos``).
        qos_vl: the lent VL the inference SL maps to (1..14).
        audit_interval_s: seconds between QoS audits of :meth:`audit_forever` (the first one
            runs one interval after the start, or ``audit_delay_s`` if given).
        audit_concurrency: diag commands an audit runs at once, besides ``concurrency`` (an
            audit of a large fabric reads thousands of ports: it must not hold up claims).
        audit_delay_s: seconds before the first audit of :meth:`audit_forever`; ``None``: one
            ``audit_interval_s``.
        metrics: where this manager counts (``gpupool_broker_fabric_*``): the broker's
            ``BrokerMetrics.fabric``, so its ``/metrics`` shows them; ``None``: new ones on a
            registry of their own (:attr:`metrics`).

    Raises ``OSError`` / ``ValueError`` if ``state`` cannot be read, ``ValueError`` for an ``sl``
    outside 0..15, a gateway that is not an HCA of the fabric, a share outside the plan's bounds,
    or a QoS plan without ``opensm_conf`` in ``fabric.json``.
    """

    enforced = True

    def __init__(
        self,
        state: Path,
        *,
        gateway: str = "edge-gw",
        host_ports: HostPorts | None = None,
        sl: int = 1,
        verify_timeout_s: float = 20.0,
        dry_run: bool = False,
        verify_switch_ports: bool = True,
        verify_sl: bool = True,
        command_timeout_s: float = 5.0,
        concurrency: int = 4,
        on_diff: Callable[[str], None] | None = None,
        qos_share_percent: float | None = None,
        qos_vl: int = 1,
        audit_interval_s: float = 300.0,
        audit_concurrency: int = 2,
        audit_delay_s: float | None = None,
        metrics: FabricMetrics | None = None,
    ) -> None:
        self.metrics = metrics if metrics is not None else FabricMetrics()
        if not 0 <= sl <= 15:
            raise ValueError(f"sl must be 0..15, got {sl}")
        if not 1 <= qos_vl <= 14:
            raise ValueError(f"qos_vl must be 1..14, got {qos_vl}")
        if qos_share_percent is not None:
            try:
                share = 100.0 / (high_limit_for(qos_share_percent) + 1)
            except PlanError as e:
                raise ValueError(str(e)) from e
            self.metrics.lent_share.set(share / 100.0)
        self.state_path = Path(state)
        self._state = FabricState.load(self.state_path)
        self.gateway = gateway
        self.host_ports = host_ports
        self.sl = sl
        self.verify_timeout_s = verify_timeout_s
        self.dry_run = dry_run
        self.verify_switch_ports = verify_switch_ports
        self.verify_sl = verify_sl
        self.command_timeout_s = command_timeout_s
        self.on_diff = on_diff
        self._sem = asyncio.Semaphore(concurrency)
        self._lock = asyncio.Lock()
        self._queue: list[_Change] = []
        self.reloads = 0
        """SIGHUPs sent since construction (one per batch of changes written)."""
        self.qos_share_percent = qos_share_percent
        self.qos_vl = qos_vl
        self.audit_interval_s = audit_interval_s
        self.audit_delay_s = audit_interval_s if audit_delay_s is None else audit_delay_s
        self._audit_sem = asyncio.Semaphore(audit_concurrency)
        self._qos_plan: QosPlan | None = None
        self._graph_cache: tuple[int, LinkGraph] | None = None
        gw = self._resolve(gateway)
        if gw is None or gw.kind != "hca":
            raise ValueError(f"gateway {gateway!r} is not an HCA of {self.state_path}")
        if qos_share_percent is not None and self._state.opensm_conf is None:
            raise ValueError(f"{self.state_path} names no opensm_conf: the QoS plan has nowhere to go")

    @property
    def lent_share_percent(self) -> float | None:
        """The lent-share bound the QoS plan gives (percent, ≤ ``qos_share_percent``); ``None``
        without a QoS plan."""
        if self.qos_share_percent is None:
            return None
        return 100.0 / (high_limit_for(self.qos_share_percent) + 1)

    # public ---------------------------------------------------------------------------------------------
    def members(self, lease: LeaseLogRecord) -> tuple[list[str], list[str]]:
        """Port GUIDs of ``lease``: (limited: its hosts' HCAs, full: the gateway), sorted, unique.

        Raises :class:`FabricError` if a host has no HCA on the fabric or a configured port is
        not in ``fabric.json``.
        """
        state = self._fresh_state()
        limited: set[str] = set()
        for host in lease_hosts((), lease.gpus):
            ports = self._ports_of(state, host)
            if not ports:
                raise _Failure("unmapped_host", f"host {host} has no HCA on the fabric ({self.state_path})")
            for p in ports:
                node = self._resolve(p, state)
                if node is None:
                    raise _Failure("unknown_port", f"port {p} of host {host} is not on the fabric")
                limited.add(node.port_guid)
        gw = self._resolve(self.gateway, state)
        if gw is None:
            raise _Failure("unknown_port", f"gateway {self.gateway} is not on the fabric")
        if gw.port_guid in limited:
            raise _Failure("config_error", f"gateway port {gw.port_guid} is also a leased host's port")
        return sorted(limited), [gw.port_guid]

    def plan_isolate(self, lease: LeaseLogRecord) -> FilePlan:
        """The file change :meth:`isolate` would make for ``lease`` now; changes nothing.

        Raises :class:`FabricError` as :meth:`members`, or when the files cannot be read or planned.
        """
        limited, full = self.members(lease)
        texts = self._read_files()
        try:
            reserved = operator_pkeys(texts[0])
            state, _ = _add(self._parse(texts[0]), self._draft(lease.lease_id, limited, full), reserved)
        except PlanError as e:
            raise _Failure("config_error", str(e)) from e
        fp = self._plan(texts, state)
        if self.qos_share_percent is not None:
            conf, new, _ = self._plan_conf()
            fp = replace(fp, conf_old=conf, conf_new=new, conf_label=self._conf_path().name)
        return fp

    async def isolate(self, lease: LeaseLogRecord) -> Partition:
        """Give ``lease`` a partition of its own and verify it on the fabric.

        Returns the :class:`Partition` with ``verified=True``. Raises :class:`FabricError` when a
        host is not on the fabric, the files cannot be written, OpenSM is not running, the
        fabric does not show the partition within ``verify_timeout_s`` (the change is then
        taken back), or in dry-run mode (after reporting the diff).
        """
        t0 = time.perf_counter()
        try:
            limited, full = self.members(lease)
            if self.dry_run:
                self._report_dry_run("isolate", lease.lease_id, self.plan_isolate(lease))
                raise FabricError(f"dry run: partition for lease {lease.lease_id} not applied")
            entry = await self._commit(
                _Change(self._future(), add=self._draft(lease.lease_id, limited, full))
            )
            assert entry is not None
            results = await asyncio.gather(
                self._verify(entry, present=True), self._verify_qos(entry), return_exceptions=True
            )
            failure = next((r for r in results if isinstance(r, BaseException)), None)
            if failure is not None:
                await self._rollback(entry)
                raise failure
            qos = results[1]
            assert not isinstance(qos, BaseException)
        except _Failure as e:
            self.metrics.verify_failures.labels(reason=e.reason).inc()
            log.warning(
                "fabric_isolate_failed",
                extra={"lease_id": lease.lease_id, "reason": e.reason, "error": str(e)},
            )
            raise
        elapsed = time.perf_counter() - t0
        self.metrics.apply_seconds.labels(op="isolate").observe(elapsed)
        log.info(
            "fabric_partition_verified",
            extra={
                "lease_id": lease.lease_id,
                "pkey": f"0x{entry.pkey:04x}",
                "sl": entry.sl,
                "limited": list(entry.limited),
                "full": list(entry.full),
                "seconds": round(elapsed, 4),
            },
        )
        return Partition(
            pkey=entry.pkey,
            sl=entry.sl,
            limited_members=list(entry.limited),
            full_members=list(entry.full),
            verified=True,
            qos=qos,
        )

    async def remove(self, lease: LeaseLogRecord) -> None:
        """Take ``lease``'s partition off the fabric and verify it gone from every member port.

        No-op when the managed section has no partition for ``lease.lease_id``. Raises
        :class:`FabricError` when the files cannot be written, OpenSM is not running, or a port
        still shows the PKey after ``verify_timeout_s`` (the file no longer has it either way).
        """
        await self._remove_named(lease.lease_id)

    async def _remove_named(self, lease_id: str) -> None:
        t0 = time.perf_counter()
        try:
            if self.dry_run:
                texts = self._read_files()
                state = self._parse(texts[0])
                if state.find(lease_id) is not None:
                    self._report_dry_run("remove", lease_id, self._plan(texts, state.without(lease_id)))
                return
            gone = await self._commit(_Change(self._future(), remove=lease_id))
            if gone is None:
                return
            await self._verify(gone, present=False)
        except _Failure as e:
            self.metrics.verify_failures.labels(reason=e.reason).inc()
            log.warning(
                "fabric_remove_failed", extra={"lease_id": lease_id, "reason": e.reason, "error": str(e)}
            )
            raise
        elapsed = time.perf_counter() - t0
        self.metrics.apply_seconds.labels(op="remove").observe(elapsed)
        log.info(
            "fabric_partition_removed",
            extra={"lease_id": lease_id, "pkey": f"0x{gone.pkey:04x}", "seconds": round(elapsed, 4)},
        )

    def partitions(self) -> list[LeasePartition]:
        """The lease partitions in the managed section now. Raises :class:`FabricError` if the
        file cannot be read or parsed."""
        return list(self._parse(self._read_files()[0]).entries)

    async def remove_stale(self, keep: Collection[str]) -> list[str]:
        """Remove every managed partition whose lease id is not in ``keep`` (e.g. the live leases
        after a broker restart); returns the lease ids removed. Raises :class:`FabricError` as
        :meth:`remove` (the first failure; the others are still attempted)."""
        stale = [e for e in self.partitions() if e.name not in keep]
        results = await asyncio.gather(*(self._remove_named(e.name) for e in stale), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return [e.name for e in stale]

    # files ----------------------------------------------------------------------------------------------
    def _fresh_state(self) -> FabricState:
        try:
            if self.state_path.stat().st_mtime_ns != self._state.mtime_ns:
                self._state = FabricState.load(self.state_path)
        except (OSError, ValueError) as e:
            raise _Failure("config_error", f"cannot read {self.state_path}: {e}") from e
        return self._state

    def _read_files(self) -> tuple[str, str | None]:
        st = self._fresh_state()
        try:
            partitions = st.partitions_conf.read_text()
        except FileNotFoundError as e:
            raise _Failure(
                "config_error",
                f"{st.partitions_conf} does not exist: create it with the operator's Default partition first",
            ) from e
        except OSError as e:
            raise _Failure("config_error", f"cannot read {st.partitions_conf}: {e}") from e
        qos = None
        if st.qos_policy_conf is not None:
            try:
                qos = st.qos_policy_conf.read_text()
            except FileNotFoundError:
                qos = None  # no QoS policy: OpenSM uses the partition's sl=
            except OSError as e:
                raise _Failure("config_error", f"cannot read {st.qos_policy_conf}: {e}") from e
        return partitions, qos

    def _conf_path(self) -> Path:
        path = self._fresh_state().opensm_conf
        if path is None:
            raise _Failure("config_error", f"{self.state_path} names no opensm_conf")
        return path

    def _plan_conf(self) -> tuple[str, str, QosPlan]:
        """``opensm.conf`` now, with the QoS plan's managed block, and the plan. Raises
        :class:`_Failure` (``qos_config``) when the file cannot be read or planned against."""
        assert self.qos_share_percent is not None
        path = self._conf_path()
        try:
            text = path.read_text()
        except OSError as e:
            raise _Failure("qos_config", f"cannot read {path}: {e}") from e
        try:
            qos = plan_qos(text, sl=self.sl, vl=self.qos_vl, share_percent=self.qos_share_percent)
            return text, render_opensm_conf(text, qos), qos
        except PlanError as e:
            raise _Failure("qos_config", f"{path}: {e}") from e

    def _parse(self, partitions: str) -> ManagedState:
        try:
            return parse_partitions(partitions)
        except PlanError as e:
            raise _Failure("config_error", str(e)) from e

    def _plan(self, texts: tuple[str, str | None], state: ManagedState) -> FilePlan:
        st = self._state
        labels = (
            st.partitions_conf.name,
            st.qos_policy_conf.name if st.qos_policy_conf else "qos-policy.conf",
        )
        try:
            return plan(texts[0], texts[1], state, labels)
        except PlanError as e:
            raise _Failure("config_error", str(e)) from e

    def _draft(self, name: str, limited: Sequence[str], full: Sequence[str]) -> LeasePartition:
        """The entry to add, with a placeholder PKey (allocated when the batch is written)."""
        try:
            return LeasePartition(name, 0x0002, self.sl, tuple(limited), tuple(full))
        except PlanError as e:
            raise _Failure("config_error", str(e)) from e

    def _write(self, fp: FilePlan) -> None:
        """Write both files atomically (partitions first); on a failure, put partitions back."""
        st = self._state
        try:
            _atomic_write(st.partitions_conf, fp.partitions_new)
        except OSError as e:
            raise _Failure("write_failed", f"cannot write {st.partitions_conf}: {e}") from e
        if st.qos_policy_conf is not None and fp.qos_new is not None and fp.qos_new != fp.qos_old:
            try:
                _atomic_write(st.qos_policy_conf, fp.qos_new)
            except OSError as e:
                try:
                    _atomic_write(st.partitions_conf, fp.partitions_old)
                except OSError:
                    log.error("fabric_restore_failed", extra={"path": str(st.partitions_conf)})
                raise _Failure("write_failed", f"cannot write {st.qos_policy_conf}: {e}") from e
        if st.opensm_conf is not None and fp.conf_new is not None and fp.conf_new != fp.conf_old:
            try:
                _atomic_write(st.opensm_conf, fp.conf_new)
            except OSError as e:
                raise _Failure("write_failed", f"cannot write {st.opensm_conf}: {e}") from e

    def _sighup(self) -> None:
        pid_file = self._state.opensm_pid_file
        try:
            pid = int(pid_file.read_text().strip())
        except (OSError, ValueError) as e:
            raise _Failure("opensm_down", f"no OpenSM pid in {pid_file}: {e}") from e
        if not _opensm_alive(pid):
            raise _Failure("opensm_down", f"OpenSM (pid {pid} from {pid_file}) is not running")
        try:
            os.kill(pid, signal.SIGHUP)
        except OSError as e:
            raise _Failure("opensm_down", f"cannot signal OpenSM (pid {pid}): {e}") from e
        self.reloads += 1

    # batching -------------------------------------------------------------------------------------------
    @staticmethod
    def _future() -> asyncio.Future[LeasePartition | None]:
        return asyncio.get_running_loop().create_future()

    async def _commit(self, change: _Change) -> LeasePartition | None:
        """Queue ``change``; whoever holds the lock next writes every queued change at once (in a
        worker thread) and sends one SIGHUP. Returns the entry added (with its PKey) or removed
        (``None``: there was none). Raises :class:`FabricError` if the batch failed."""
        self._queue.append(change)
        async with self._lock:
            if not change.future.done():
                await asyncio.sleep(0)  # changes asked for in this turn of the loop join the batch
                batch, self._queue = self._queue, []
                try:
                    outcomes = await asyncio.to_thread(self._apply_batch, batch)
                except Exception as e:
                    log.exception("fabric_batch_error")
                    outcomes = [_Failure("config_error", f"fabric batch failed: {e!r}")] * len(batch)
                for c, outcome in zip(batch, outcomes, strict=True):
                    if isinstance(outcome, BaseException):
                        c.future.set_exception(outcome)
                    else:
                        c.future.set_result(outcome)
        return await change.future

    def _apply_batch(self, batch: list[_Change]) -> list[LeasePartition | _Failure | None]:
        """Read the files, apply ``batch`` in order, write and SIGHUP once if anything changed.
        Returns one outcome per change: the entry added or removed, ``None``, or the failure."""
        try:
            texts = self._read_files()
            state = self._parse(texts[0])
            reserved = operator_pkeys(texts[0])
        except PlanError as e:
            return [_Failure("config_error", str(e))] * len(batch)
        except _Failure as e:
            return [e] * len(batch)
        conf: tuple[str, str, QosPlan] | None = None
        qos_failure: _Failure | None = None
        if self.qos_share_percent is not None and any(c.add is not None for c in batch):
            try:
                conf = self._plan_conf()
            except _Failure as e:
                qos_failure = e  # the adds fail (their QoS cannot be applied); removals go on
        outcomes: list[LeasePartition | _Failure | None] = []
        for c in batch:
            try:
                if c.add is not None and qos_failure is not None:
                    outcomes.append(qos_failure)
                elif c.add is not None:
                    state, entry = _add(state, c.add, reserved)
                    outcomes.append(entry)
                else:
                    outcomes.append(state.find(c.remove or ""))
                    state = state.without(c.remove or "")
            except PlanError as e:
                outcomes.append(_Failure("config_error", str(e)))
        if all(isinstance(o, _Failure) for o in outcomes):
            return outcomes  # nothing to change: no write, no SIGHUP
        try:
            fp = self._plan(texts, state)
        except _Failure as e:
            return [e] * len(batch)
        if conf is not None:
            fp = replace(fp, conf_old=conf[0], conf_new=conf[1], conf_label=self._conf_path().name)
            self._qos_plan = conf[2]
        if not fp.changed:
            return outcomes
        try:
            self._write(fp)
            self._sighup()
        except _Failure as e:
            self.metrics.reloads.labels(result="failed").inc()
            if e.reason == "opensm_down":
                self._undo_adds(batch, outcomes, fp)
            return [e] * len(batch)
        self.metrics.reloads.labels(result="ok").inc()
        log.info(
            "fabric_files_written",
            extra={"changes": len(batch), "partitions": len(state.entries), "reloads": self.reloads},
        )
        return outcomes

    def _undo_adds(
        self, batch: list[_Change], outcomes: list[LeasePartition | _Failure | None], fp: FilePlan
    ) -> None:
        """OpenSM is down: take the entries just added back out of the written files (removals
        stay: OpenSM reads them when it is back)."""
        state = fp.state
        for c, outcome in zip(batch, outcomes, strict=True):
            if c.add is not None and isinstance(outcome, LeasePartition):
                state = state.without(outcome.name)
        try:
            self._write(plan(fp.partitions_new, fp.qos_new, state))
        except (_Failure, PlanError):
            log.error("fabric_undo_failed", extra={"path": str(self._state.partitions_conf)})

    async def _rollback(self, entry: LeasePartition) -> None:
        """Verification failed: take the partition back out of the files (not waited for)."""
        try:
            await self._commit(_Change(self._future(), remove=entry.name))
        except FabricError as e:
            log.error("fabric_rollback_failed", extra={"lease_id": entry.name, "error": str(e)})

    def _report_dry_run(self, op: str, lease_id: str, fp: FilePlan) -> None:
        diff = fp.diff()
        log.info("fabric_dry_run", extra={"op": op, "lease_id": lease_id, "diff": diff})
        if self.on_diff is not None:
            self.on_diff(diff)

    # verification ---------------------------------------------------------------------------------------
    def _checks(self, entry: LeasePartition, present: bool) -> list[_Check]:
        state = self._fresh_state()
        checks: list[_Check] = []
        for guids, kind in ((entry.limited, Membership.LIMITED), (entry.full, Membership.FULL)):
            for g in guids:
                node = state.by_guid(g)
                if node is None:
                    if present:
                        raise _Failure("unknown_port", f"port {g} is not on the fabric")
                    continue  # gone from the fabric: nothing there to hold the PKey
                expect = kind if present else None
                checks.append(_Check(f"{node.nodeid} ({g})", node.lid, None, expect))
                sw = state.nodes.get(node.peer[0]) if node.peer else None
                if self.verify_switch_ports and sw is not None and node.peer is not None:
                    checks.append(_Check(f"{sw.nodeid} port {node.peer[1]}", sw.lid, node.peer[1], expect))
        gw, host = state.by_guid(entry.full[0]), state.by_guid(entry.limited[0]) if entry.limited else None
        if present and self.verify_sl and gw is not None and host is not None:
            checks.append(_Check(f"path record {gw.nodeid} -> {host.nodeid}", gw.lid, dlid=host.lid))
        return checks

    async def _verify(self, entry: LeasePartition, *, present: bool) -> None:
        """Poll the fabric until every check of ``entry`` holds; raise :class:`_Failure` with the
        first problem (in check order: HCAs first) of the last round after ``verify_timeout_s``."""
        pending = self._checks(entry, present)
        deadline = time.monotonic() + self.verify_timeout_s
        delay = 0.01
        while True:
            results = await asyncio.gather(*(self._probe(c, entry) for c in pending))
            problems = {c.what: r for c, r in zip(pending, results, strict=True) if r is not None}
            pending = [c for c in pending if c.what in problems]
            if not pending:
                return
            if time.monotonic() + delay > deadline:
                what, (reason, text) = next(iter(problems.items()))
                raise _Failure(
                    reason,
                    f"partition 0x{entry.pkey:04x} of lease {entry.name} "
                    f"{'not verified' if present else 'still on the fabric'} after "
                    f"{self.verify_timeout_s:g}s: {what}: {text} ({len(problems)} check(s) failing)",
                )
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.5)

    async def _probe(self, c: _Check, entry: LeasePartition) -> tuple[str, str] | None:
        return await (self._check(c, entry.pkey) if c.dlid is None else self._check_sl(entry, c.lid, c.dlid))

    async def _check(self, c: _Check, pkey: int) -> tuple[str, str] | None:
        """``None`` if ``c`` holds, else (reason, text)."""
        args = ["smpquery", "pkeys", str(c.lid)] + ([str(c.port)] if c.port is not None else [])
        ok, out = await self._run(args)
        if not ok:
            return "unreachable", f"smpquery pkeys {c.lid}{'' if c.port is None else f' {c.port}'}: {out}"
        try:
            got = membership(parse_pkey_table(out), pkey)
        except ValueError as e:
            return "unreachable", str(e)
        if got == c.expect:
            return None
        if c.expect is None:
            return "not_removed", f"still a {got} member of 0x{pkey:04x}"
        if got is None:
            return "pkey_missing", f"0x{pkey:04x} not in the PKey table"
        return "wrong_membership", f"{got} member of 0x{pkey:04x}, want {c.expect}"

    async def _check_sl(self, entry: LeasePartition, slid: int, dlid: int) -> tuple[str, str] | None:
        args = ["saquery", "PR", "--slid", str(slid), "--dlid", str(dlid), "--pkey", f"0x{entry.pkey:04x}"]
        ok, out = await self._run(args)
        pr = parse_path_record(out) if ok else None
        if pr is None:
            return "sl_mismatch", f"saquery PR {slid}->{dlid} pkey 0x{entry.pkey:04x}: no path record"
        if pr.get("sl") != entry.sl or (pr.get("pkey", 0) & 0x7FFF) != entry.pkey:
            return (
                "sl_mismatch",
                f"path record has sl={pr.get('sl')} pkey=0x{pr.get('pkey', 0):04x}, want sl={entry.sl}",
            )
        return None

    async def _run(
        self,
        args: list[str],
        timeout_s: float | None = None,
        sem: asyncio.Semaphore | None = None,
        stdin: bytes | None = None,
    ) -> tuple[bool, str]:
        """Run a diag command under the fabric's env; (exit status 0, stdout or the error).
        ``timeout_s``: this command's timeout (default ``command_timeout_s``); ``sem``: the
        semaphore bounding it (default: the claims' one, ``concurrency``); ``stdin``: its input."""
        state = self._state
        timeout = self.command_timeout_s if timeout_s is None else timeout_s
        async with sem or self._sem:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *args,
                    cwd=state.workdir,
                    env={**os.environ, **state.env},
                    stdin=asyncio.subprocess.DEVNULL if stdin is None else asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                )
            except OSError as e:
                return False, f"cannot run {args[0]}: {e}"
            try:
                out, err = await asyncio.wait_for(proc.communicate(stdin), timeout)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                return False, f"{args[0]} timed out after {timeout:g}s"
        if proc.returncode != 0:
            # infiniband-diags print "iberror: ..." on stdout, ibwarn lines on stderr
            text = out.decode(errors="replace") + err.decode(errors="replace")
            lines = [ln.strip() for ln in text.splitlines() if ln.strip() and "sim_connect" not in ln]
            return False, "; ".join(lines[-2:]) or f"exit status {proc.returncode}"
        return True, out.decode(errors="replace")

    # QoS ------------------------------------------------------------------------------------------------
    async def _graph(self, refresh: bool = False, sem: asyncio.Semaphore | None = None) -> LinkGraph:
        """The fabric's links from ``ibnetdiscover -p``, cached until ``fabric.json`` changes or
        ``refresh`` (``sem``: as :meth:`_run`). Raises :class:`_Failure` (``qos_unreachable``)
        when discovery fails."""
        mtime = self._fresh_state().mtime_ns
        cached = self._graph_cache
        if not refresh and cached is not None and cached[0] == mtime:
            return cached[1]
        ok, out = await self._run(["ibnetdiscover", "-p"], max(self.command_timeout_s, 120.0), sem)
        graph = LinkGraph.parse(out) if ok else None
        if graph is None or not graph.ends:
            raise _Failure("qos_unreachable", f"ibnetdiscover -p found no link: {out if not ok else 'empty'}")
        self._graph_cache = (mtime, graph)
        return graph

    async def lease_ports(self, limited: Sequence[str], gateway: str) -> list[PathPort]:
        """Every port on the shortest paths between each port GUID in ``limited`` and the
        ``gateway`` port GUID, from the fabric's topology (rediscovered once when a GUID is not
        in it). Raises :class:`FabricError` (``no_path``) when a host has no path."""
        graph = await self._graph()
        if any(g not in graph for g in (*limited, gateway)):
            graph = await self._graph(refresh=True)
        paths = []
        for host in limited:
            ports = graph.path_ports(host, gateway)
            if not ports:
                raise _Failure("no_path", f"no path between {host} and the gateway {gateway} (ibnetdiscover)")
            paths.append(ports)
        return union(paths)

    def _port_name(self, port: PathPort) -> str:
        node = self._state.by_guid(port.guid)
        name = node.nodeid if node is not None else port.guid
        return f"{name} port {port.port}" if port.switch else name

    async def _qos_batch(
        self,
        plan: QosPlan,
        ports: Sequence[PathPort],
        paths: Sequence[PathPort],
        sem: asyncio.Semaphore | None = None,
    ) -> list[tuple[str, str] | None]:
        """For each of ``ports``: ``None`` if its SL2VL and VL arbitration tables are the plan's,
        else (reason, text); read in one child process (:mod:`broker.fabric_smp`). A switch
        port's SL2VL rows are read for the input ports of the same switch in ``paths`` (a
        lease's paths: its traffic; every switch port: all traffic). ``sem``: as :meth:`_run`."""
        on_path: dict[str, set[int]] = {}
        for p in paths:
            if p.switch:
                on_path.setdefault(p.guid, set()).add(p.port)
        requests = [
            {"lid": p.lid, "port": p.port, "in_ports": sorted(on_path[p.guid] - {p.port}) or [0]}
            if p.switch
            else {"lid": p.lid, "port": None}
            for p in ports
        ]
        ok, out = await self._run(
            [sys.executable, "-I", "-S", str(_FABRIC_SMP), "read"],  # stdlib only: no site, no package
            timeout_s=max(self.command_timeout_s, 0.05 * len(ports)),
            sem=sem,
            stdin=json.dumps(requests).encode(),
        )
        try:
            answers = json.loads(out) if ok else None
        except ValueError:
            answers = None
        if not isinstance(answers, list) or len(answers) != len(ports):
            return [("qos_unreachable", f"{self._port_name(p)}: broker.fabric_smp read: {out[:300]}") for p in ports]
        results: list[tuple[str, str] | None] = []
        for p, a in zip(ports, answers, strict=True):
            cp = plan.classes["ca" if not p.switch else "sw0" if p.port == 0 else "swe"]
            if "error" in a:
                results.append(("qos_unreachable", f"{self._port_name(p)}: {a['error']}"))
                continue
            rows = {(int(i), p.port if p.switch else 0): v for i, v in a["sl2vl"].items()}
            low, high = (tuple((int(v), int(w)) for v, w in a[t]) for t in ("low", "high"))
            problem = sl2vl_problem(cp, rows) or vlarb_problem(cp, low, high)
            results.append(("qos_mismatch", f"{self._port_name(p)}: {problem}") if problem else None)
        return results

    async def _verify_qos(self, entry: LeasePartition) -> LaneQos | None:
        """Poll the tables of every port on ``entry``'s paths until they show the QoS plan;
        ``None`` without a QoS plan. Raises :class:`_Failure` with the first problem after
        ``verify_timeout_s``."""
        if self.qos_share_percent is None:
            return None
        plan = self._qos_plan
        if plan is None:
            raise _Failure("qos_config", "no QoS plan was written")
        t0 = time.perf_counter()
        ports = await self.lease_ports(entry.limited, entry.full[0])
        pending = list(ports)
        deadline = time.monotonic() + self.verify_timeout_s
        delay = 0.05
        while True:
            results = await self._qos_batch(plan, pending, ports)
            problems = [(p, r) for p, r in zip(pending, results, strict=True) if r is not None]
            if not problems:
                break
            if time.monotonic() + delay > deadline:
                reason, text = problems[0][1]
                raise _Failure(
                    reason,
                    f"QoS of lease {entry.name} not verified after {self.verify_timeout_s:g}s: {text} "
                    f"({len(problems)} of {len(ports)} port(s) failing)",
                )
            pending = [p for p, _ in problems]
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.5)
        self.metrics.apply_seconds.labels(op="qos_verify").observe(time.perf_counter() - t0)
        return LaneQos(
            sl=plan.sl, vl=plan.vl, share_percent=plan.share_percent, ports_verified=len(ports), verified=True
        )

    async def audit(self) -> dict[str, list[str]]:
        """Read the SL2VL and VL arbitration tables of every connected switch port (topology
        rediscovered) and compare them with the QoS plan of ``opensm.conf`` now; sets
        ``gpupool_broker_fabric_qos_drift_ports`` per switch and counts the audit. Returns switch →
        the problems of its drifting ports (``{}``: no drift, or no plan written yet: nothing to
        audit). Raises :class:`FabricError` when the configuration or the fabric cannot be read.
        """
        if self.qos_share_percent is None:
            return {}
        t0 = time.perf_counter()
        try:
            path = self._conf_path()
            try:
                text = path.read_text()
            except OSError as e:
                raise _Failure("qos_config", f"cannot read {path}: {e}") from e
            if managed_block(text) is None:
                self.metrics.qos_audits.labels(result="not_applied").inc()
                return {}
            try:
                plan = plan_qos(text, sl=self.sl, vl=self.qos_vl, share_percent=self.qos_share_percent)
            except PlanError as e:
                raise _Failure("qos_config", f"{path}: {e}") from e
            ports = (await self._graph(refresh=True, sem=self._audit_sem)).switch_ports()
            chunks = [ports[i : i + _AUDIT_CHUNK] for i in range(0, len(ports), _AUDIT_CHUNK)]
            answers = await asyncio.gather(*(self._qos_batch(plan, c, ports, self._audit_sem) for c in chunks))
            results = [r for chunk in answers for r in chunk]
        except _Failure as e:
            self.metrics.qos_audits.labels(result="failed").inc()
            log.warning("fabric_qos_audit_failed", extra={"reason": e.reason, "error": str(e)})
            raise
        counts: dict[str, int] = {}
        drift: dict[str, list[str]] = {}
        for p, r in zip(ports, results, strict=True):
            node = self._state.by_guid(p.guid)
            switch = node.nodeid if node is not None else p.guid
            counts[switch] = counts.get(switch, 0) + (r is not None)
            if r is not None:
                drift.setdefault(switch, []).append(r[1])
        self.metrics.qos_drift = counts
        elapsed = time.perf_counter() - t0
        self.metrics.qos_audit_seconds.observe(elapsed)
        self.metrics.qos_audits.labels(result="drift" if drift else "ok").inc()
        self.metrics.qos_last_audit.set(time.time())
        (log.warning if drift else log.info)(
            "fabric_qos_audit",
            extra={
                "ports": len(ports),
                "switches": len(counts),
                "drift_ports": sum(len(v) for v in drift.values()),
                "drift": {k: v[:3] for k, v in sorted(drift.items())[:10]},
                "seconds": round(elapsed, 3),
            },
        )
        return drift

    async def audit_forever(self) -> None:
        """:meth:`audit` after ``audit_delay_s``, then every ``audit_interval_s``, until cancelled;
        never returns (without a QoS plan it only waits). A failed audit is logged and counted,
        and the next one runs."""
        if self.qos_share_percent is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.audit_delay_s)
        while True:
            try:
                await self.audit()
            except FabricError:
                pass  # logged and counted by audit()
            except Exception:  # noqa: BLE001 — an audit bug must not stop the broker
                log.exception("fabric_qos_audit_error")
            await asyncio.sleep(self.audit_interval_s)

    def _resolve(self, ref: str, state: FabricState | None = None) -> FabricNode | None:
        st = state or self._state
        if ref in st.nodes:
            return st.nodes[ref]
        if _GUID.match(ref):
            return st.by_guid(ref)
        return None

    def _ports_of(self, state: FabricState, host: str) -> list[str]:
        hp = self.host_ports
        if hp is None:
            return default_host_ports(state, host)
        if callable(hp):
            return list(hp(host))
        return list(hp.get(host, ()))


def _add(
    state: ManagedState, draft: LeasePartition, reserved: set[int]
) -> tuple[ManagedState, LeasePartition]:
    """``state`` plus ``draft`` with a fresh PKey; an identical existing entry is kept as it is.
    Raises :class:`PlanError` if the name exists with other members, or no PKey is left."""
    existing = state.find(draft.name)
    if existing is not None:
        same = (existing.limited, existing.full, existing.sl) == (draft.limited, draft.full, draft.sl)
        if same:
            return state, existing
        raise PlanError(f"partition {draft.name} exists with other members")
    pkey, state = state.allocate(reserved)
    entry = LeasePartition(draft.name, pkey, draft.sl, draft.limited, draft.full)
    return state.with_entry(entry), entry


def _atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory, fsync'd and
    renamed over it (keeping the old file's mode). Raises ``OSError``."""
    tmp = path.with_name(f".{path.name}.gpupool-tmp")
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _opensm_alive(pid: int) -> bool:
    """True if ``pid`` runs (not a zombie) and is an opensm (``/proc/<pid>``; Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[-1].split()[0] if ")" in stat else "?"
    return state not in ("Z", "X") and b"opensm" in cmdline
