"""The seam between leases and InfiniBand fabric isolation (DESIGN.md "Broker protocol").

A lease is granted only after the fabric manager has put the leased hosts' ports in a partition of
their own and read it back from the fabric. The broker calls :meth:`FabricManager.isolate` between
reserving a claim's GPUs and granting the lease, and :meth:`FabricManager.remove` when the lease
ends (released, expired or revoked — whether or not the site released).

The grant rule is :func:`isolation_problem`: a manager that *enforces* isolation must return a
:class:`contracts.leases.Partition` with ``verified=True``, or the claim is rejected with
``isolation_failed``. The only manager here, :class:`NoIsolation`, is the explicit "fabric isolation
disabled by configuration" mode: it does not enforce, returns no partition, and leases then say so
honestly (``partition: null``). The OpenSM manager (PKey + SL per lease, verified with
``smpquery pkeys``) is :class:`broker.fabric_opensm.OpenSmFabric`.

A manager may also manage QoS: the partition then carries ``qos`` (:class:`contracts.leases.LaneQos`:
the lease's own virtual lane and its share bound, read back on every port of its paths), and it
must be verified too. A manager with an ``audit_forever()`` coroutine (the OpenSM one: QoS drift of
every switch port) gets it run by the broker as one of its service loops, cancelled at stop.

The broker runs :meth:`FabricManager.isolate` and :meth:`FabricManager.remove` outside its
service lock (a verification may take seconds), so a manager must accept concurrent calls for
different leases.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol

from contracts import LeaseLogRecord
from contracts.leases import Partition


class FabricError(Exception):
    """Isolation could not be applied, verified or removed; the message says which and why."""


class FabricManager(Protocol):
    """Applies and removes per-lease fabric isolation.

    Attributes:
        enforced: True if leases must not be granted without a verified partition. A manager
            that cannot isolate must say False here, never pretend.
    """

    enforced: bool

    async def isolate(self, lease: LeaseLogRecord) -> Partition | None:
        """Put ``lease.gpus``' hosts in a partition of their own and verify it on the fabric.

        Returns the partition (``verified=True`` once read back), or ``None`` when this manager
        does not isolate. Raises :class:`FabricError` if it cannot be applied or verified.
        """
        ...

    async def remove(self, lease: LeaseLogRecord) -> None:
        """Take ``lease``'s partition off the fabric and verify it is gone; no-op without one.

        Raises :class:`FabricError` if it cannot be removed or verified gone.
        """
        ...

    async def remove_stale(self, keep: Collection[str]) -> list[str]:
        """Take off the fabric, verified gone, every partition this manager made whose lease id
        is not in ``keep`` (the live leases and claims in progress): after a broker restart,
        partitions of leases that ended while it was down. Returns the lease ids removed.

        Raises :class:`FabricError` (the first failure; the other removals are still attempted).
        """
        ...


class NoIsolation:
    """Fabric isolation disabled by configuration: leases are granted without a partition.

    Nothing is applied and nothing is claimed: :meth:`isolate` returns ``None`` and every lease
    carries ``partition = None``, so sites, the lease log and the demo all show that no isolation
    was given. Use only where the fabric is not shared with training (or for the demo).
    """

    enforced = False

    async def isolate(self, lease: LeaseLogRecord) -> Partition | None:
        """No partition: returns ``None``."""
        return None

    async def remove(self, lease: LeaseLogRecord) -> None:
        """Nothing to remove."""

    async def remove_stale(self, keep: Collection[str]) -> list[str]:
        """No partitions: returns ``[]``."""
        return []


def isolation_problem(fabric: FabricManager, partition: Partition | None) -> str:
    """Why a lease with ``partition`` must not be granted under ``fabric``; ``""`` if it may.

    An enforcing manager needs a verified partition; a non-enforcing one must not hand out a
    partition it has not verified either (a partition in a lease message is a promise).
    """
    if partition is None:
        return "fabric isolation is enforced but no partition was made" if fabric.enforced else ""
    if not partition.verified:
        return f"partition 0x{partition.pkey:04x} was not verified on the fabric"
    if partition.qos is not None and not partition.qos.verified:
        return f"QoS of partition 0x{partition.pkey:04x} (vl {partition.qos.vl}) was not verified on the fabric"
    return ""


def describe(partition: Partition | None) -> str:
    """One line for logs and the demo: ``pkey=0x0012 sl=1 verified``, then the QoS when managed
    (``; qos vl=1 share<=10% verified on 14 ports``), or ``none``."""
    if partition is None:
        return "none (fabric isolation disabled)"
    state = "verified" if partition.verified else "NOT verified"
    line = f"pkey=0x{partition.pkey:04x} sl={partition.sl} {state}"
    q = partition.qos
    if q is not None:
        qstate = f"verified on {q.ports_verified} ports" if q.verified else "NOT verified"
        line += f"; qos vl={q.vl} share<={q.share_percent:g}% {qstate}"
    return line
