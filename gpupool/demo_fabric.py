"""The demo's InfiniBand fabric: a private simulated fabric (ibsim + OpenSM) whose compute HCAs are
the demo's simulated hosts, and a fabric manager that times each lease's isolation.

``gpupool demo --fabric auto|on|off`` (:class:`FabricMode`). With the tools present
(:data:`FABRIC_TOOLS` on ``PATH`` and ``libumad2sim.so``, Debian packages installed by
``deploy/local/install-system.sh``) the demo starts ``deploy/local/fabric.sh start`` with
``GPUPOOL_FABRIC_DIR`` pointing into the demo's own state directory (so its ibsim socket name, and
everything else, is private to the run), and stops it at the end — on Ctrl-C and on errors too,
and from an ``atexit`` hook as a last resort.

Topology: a two-level fat tree (``deploy/local/fabric/gen_topology.py``) with exactly one compute
HCA per simulated host — ``leaves × hcas_per_leaf = nodes`` (:func:`fabric_shape`) — plus the edge
gateway HCA ``edge-gw`` on leaf 1. Host ``i`` of the fleet (``gpu-node-00i``, 1-based) is the
``i``-th compute HCA of ``fabric.json`` (``node00i``): the mapping
:func:`broker.fabric_opensm.default_host_ports` uses, passed explicitly (:meth:`DemoFabric.host_ports`)
so a mismatch fails at start rather than per lease. The simulator's sysfs trees give each host four
HCAs of their own GUIDs; the simulated fabric models one port per host (the partition's limited
member), so those GUIDs are not the fabric's.

Every lease then gets a PKey and SL from :class:`broker.fabric_opensm.OpenSmFabric`, read back with
``smpquery``/``saquery`` before it is granted; :class:`TimedOpenSmFabric` records, per lease, the
seconds from the start of isolation to the verified partition.
"""

from __future__ import annotations

import asyncio
import atexit
import glob
import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from broker.fabric_opensm import OpenSmFabric
from contracts import LeaseLogRecord
from contracts.leases import Partition

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
FABRIC_SH = REPO / "deploy" / "local" / "fabric.sh"
"""The start/stop script of the simulated fabric."""
FABRIC_TOOLS = ("ibsim", "opensm", "smpquery", "saquery", "sminfo", "iblinkinfo", "ibnetdiscover")
"""Programs the demo's fabric needs on ``PATH``: the simulator, the subnet manager, and the
infiniband-diags that ``fabric.sh`` waits with and :class:`OpenSmFabric` verifies with."""
UMAD2SIM_GLOBS = ("/usr/lib/*/umad2sim/libumad2sim.so", "/usr/lib/umad2sim/libumad2sim.so")
"""Where Debian's libumad2sim0 puts the library that attaches the diags to ibsim."""
INSTALL_HINT = "bash deploy/local/install-system.sh"
"""How to get the fabric tools (Debian packages ibsim-utils, libumad2sim0, opensm, infiniband-diags)."""


class FabricMode(StrEnum):
    """``--fabric`` of ``gpupool demo``.

    ``auto``: start the simulated fabric when its tools are present, else run without fabric
    isolation (and say so once); ``on``: the fabric is required (:class:`FabricUnavailable` when
    it cannot start); ``off``: never start it.
    """

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class FabricUnavailable(RuntimeError):
    """The demo's fabric cannot run: tools missing, or ``fabric.sh start`` failed. The message
    says which tools or gives the script's output, and how to install the tools."""


def missing_tools() -> list[str]:
    """The fabric tools not installed here: names from :data:`FABRIC_TOOLS` not on ``PATH``, plus
    ``libumad2sim.so`` when neither ``GPUPOOL_UMAD2SIM`` nor :data:`UMAD2SIM_GLOBS` finds it.
    ``[]`` when everything is present."""
    missing = [t for t in FABRIC_TOOLS if shutil.which(t) is None]
    sim_so = os.environ.get("GPUPOOL_UMAD2SIM")
    if not (sim_so and Path(sim_so).is_file()) and not any(glob.glob(g) for g in UMAD2SIM_GLOBS):
        missing.append("libumad2sim.so")
    return missing


def fabric_shape(nodes: int) -> dict[str, int]:
    """Fat-tree shape with exactly ``nodes`` compute HCAs: ``{"spines", "leaves", "hcas_per_leaf"}``.

    Two leaves (and two spines) when ``nodes`` is even, else one leaf; HCAs split evenly.
    Raises ``ValueError`` for ``nodes < 1``.
    """
    if nodes < 1:
        raise ValueError(f"the fabric needs at least one host, got {nodes}")
    leaves = 2 if nodes % 2 == 0 else 1
    return {"spines": 2, "leaves": leaves, "hcas_per_leaf": nodes // leaves}


@dataclass
class DemoFabric:
    """A running simulated fabric of the demo.

    Attributes:
        state_dir: its private state directory (``fabric.json``, ``partitions.conf``, logs).
        info: the parsed ``fabric.json`` (format: ``deploy/local/fabric/fabric_state.py``).
        start_seconds: wall time ``fabric.sh start`` took, s.
    """

    state_dir: Path
    info: dict[str, Any]
    start_seconds: float
    _stopped: bool = field(default=False, repr=False)

    @property
    def fabric_json(self) -> Path:
        """``fabric.json`` of this fabric (the ``state`` of :class:`OpenSmFabric`)."""
        return self.state_dir / "fabric.json"

    @classmethod
    async def start(cls, state_dir: Path, nodes: int, *, timeout_s: float = 120.0) -> DemoFabric:
        """Start ``deploy/local/fabric.sh`` in ``state_dir`` with :func:`fabric_shape` ``(nodes)``
        and wait until OpenSM has brought it up (every link Active, every node a LID).

        Raises :class:`FabricUnavailable` when tools are missing, or the script fails or takes
        longer than ``timeout_s`` seconds (what it started is stopped again).
        """
        missing = missing_tools()
        if missing:
            raise FabricUnavailable(f"fabric tools not installed: {', '.join(missing)} ({INSTALL_HINT})")
        state_dir.mkdir(parents=True, exist_ok=True)
        env = _script_env(state_dir, nodes, timeout_s)
        t0 = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                "bash", str(FABRIC_SH), "start", env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            )
        except OSError as e:
            raise FabricUnavailable(f"cannot run {FABRIC_SH}: {e}") from e
        fabric = cls(state_dir, {}, 0.0)
        atexit.register(fabric.stop)  # a hard exit before stop() still stops ibsim and OpenSM
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), timeout_s + 30.0)
        except BaseException as e:  # timeout, Ctrl-C, cancellation: take down what was started
            if proc.returncode is None:
                proc.kill()
                await asyncio.shield(proc.wait())
            fabric.stop()
            if isinstance(e, TimeoutError):
                raise FabricUnavailable(f"{FABRIC_SH} start did not finish in {timeout_s + 30.0:g} s") from e
            raise
        text = out.decode(errors="replace").strip()
        if proc.returncode != 0:
            fabric.stop()
            raise FabricUnavailable(f"{FABRIC_SH} start failed (exit {proc.returncode}): {text[-2000:]}")
        try:
            fabric.info = json.loads(fabric.fabric_json.read_text())
        except (OSError, ValueError) as e:
            fabric.stop()
            raise FabricUnavailable(f"{fabric.fabric_json} unreadable after start: {e}") from e
        fabric.start_seconds = time.monotonic() - t0
        log.info("demo_fabric_started", extra={"state_dir": str(state_dir), "nodes": nodes,
                                               "seconds": round(fabric.start_seconds, 2)})
        return fabric

    def compute_hcas(self) -> list[str]:
        """Node ids of the compute HCAs in ``fabric.json`` order (``node001``...)."""
        return [nid for nid, n in self.info.get("nodes", {}).items()
                if n.get("kind") == "hca" and n.get("role") == "compute"]

    def host_ports(self, hosts: Sequence[str]) -> dict[str, list[str]]:
        """Host name → ``[HCA node id]``: the ``i``-th host is the ``i``-th compute HCA.

        Raises ``ValueError`` when the fabric has fewer compute HCAs than ``hosts``.
        """
        hcas = self.compute_hcas()
        if len(hcas) < len(hosts):
            raise ValueError(
                f"fabric has {len(hcas)} compute HCAs for {len(hosts)} hosts ({self.fabric_json})")
        return {h: [hcas[i]] for i, h in enumerate(hosts)}

    def stop(self) -> None:
        """Stop ibsim, OpenSM and the reaper (``fabric.sh stop``); idempotent, blocking (≤ ~60 s),
        never raises (a failure is logged: ``demo_fabric_stop_failed``)."""
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        try:
            done = subprocess.run(["bash", str(FABRIC_SH), "stop"], env=_script_env(self.state_dir, 1, 0),
                                  stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
                                  check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            log.error("demo_fabric_stop_failed", extra={"state_dir": str(self.state_dir), "error": str(e)})
            return
        if done.returncode != 0:
            log.error("demo_fabric_stop_failed", extra={"state_dir": str(self.state_dir),
                                                        "error": (done.stdout + done.stderr)[-500:]})
            return
        log.info("demo_fabric_stopped", extra={"state_dir": str(self.state_dir)})


def _script_env(state_dir: Path, nodes: int, timeout_s: float) -> dict[str, str]:
    """Environment of ``fabric.sh``: its state directory and the shape for ``nodes`` hosts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUPOOL_FABRIC_")}
    shape = fabric_shape(nodes)
    env.update({
        "GPUPOOL_FABRIC_DIR": str(state_dir),
        "GPUPOOL_FABRIC_SPINES": str(shape["spines"]),
        "GPUPOOL_FABRIC_LEAVES": str(shape["leaves"]),
        "GPUPOOL_FABRIC_HCAS_PER_LEAF": str(shape["hcas_per_leaf"]),
    })
    if timeout_s > 0:
        env["GPUPOOL_FABRIC_TIMEOUT"] = str(int(timeout_s))
    return env


class TimedOpenSmFabric(OpenSmFabric):
    """:class:`OpenSmFabric` that records how long each lease's isolation took.

    Attributes:
        isolate_seconds: lease id → seconds from the start of :meth:`isolate` to the verified
            partition (files written, OpenSM re-read them on SIGHUP, every PKey table and the SL
            read back). Only successful isolations are recorded.

    Constructor arguments and errors: those of :class:`OpenSmFabric`.
    """

    def __init__(self, state: Path, **kwargs: Any) -> None:  # OpenSmFabric's keywords
        super().__init__(state, **kwargs)
        self.isolate_seconds: dict[str, float] = {}

    async def isolate(self, lease: LeaseLogRecord) -> Partition:
        """:meth:`OpenSmFabric.isolate`, timed into :attr:`isolate_seconds`; raises as it does."""
        t0 = time.perf_counter()
        partition = await super().isolate(lease)
        if partition.verified:
            self.isolate_seconds[lease.lease_id] = time.perf_counter() - t0
        return partition
