"""A simulated GPU pool: N nodes × M H100 GPUs, each replaying one pod of the real trace.

Time: wall-clock ``at`` (Unix s) maps to a *fleet step*
``step = start_step + floor((at - t0) · speedup / step_s)`` (``t0`` = construction time unless
given, ``step_s`` = 57 s). GPU ``g`` replays its pod at trace step ``(step + g.offset) mod steps``:
the trace wraps around, so a fleet runs forever.

Ground truth: a GPU is *busy* at ``at`` iff its pod's duty cycle there is above
:data:`BUSY_THRESHOLD_PCT` (0 %): the trace's own semantics, where 66.8 % of samples are exactly 0
and the smallest non-zero value is 1/15 % (one active sub-sample of 15).

Exported values (what dcgm-exporter would print for an H100 SXM5, per trace step; ``u`` = duty
cycle %, ``n`` = deterministic noise in [-1, 1) seeded by (seed, GPU, step, field)):

* ``DCGM_FI_DEV_GPU_UTIL`` = ``u`` rounded, never rounded down to 0 when ``u > 0`` (so
  ``GPU_UTIL > 0`` ⇔ busy);
* ``DCGM_FI_PROF_GR_ENGINE_ACTIVE`` = ``u/100 · (1 + 0.03n)``; ``SM_ACTIVE`` = that ``· (0.93 +
  0.04n)``; tensor-pipe and DRAM activity smaller fractions of it; every ``PROF`` ratio is exactly
  0 when idle and at least 1e-6 when busy;
* ``DCGM_FI_DEV_FB_USED`` = the pod's memory scaled so that its trace maximum is a per-GPU
  fraction (55..90 %) of the usable framebuffer (the trace's bytes are anonymised-scaled);
  ``FB_FREE`` = total − reserved − used (81,559 MiB total, 579 MiB reserved);
* ``POWER_USAGE`` 68.5 W + 5.6 W/% ± 4 W; ``TOTAL_ENERGY_CONSUMPTION`` its exact integral over
  wall time (mJ, monotonic); temperatures, clocks (345 MHz idle / 1,980 MHz busy SM; 2,619 MHz
  HBM3), PCIe rates and the NVLink counter follow ``u``; XID, remapped rows, PCIe replays 0.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
import uuid
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from contracts.topics import gpu_key
from simulator.trace import Trace

BUSY_THRESHOLD_PCT = 0.0
FOLLOW_BUSY_PCT = 35.0
"""Duty cycle, %, a GPU held by a training job reports at least while the fleet follows the
scheduler (:meth:`Fleet.follow_scheduler`)."""
"""A GPU is busy iff its trace duty cycle is strictly above this (%)."""
FB_TOTAL_MIB = 81559
"""Framebuffer of an H100 80GB HBM3 as NVML reports it, MiB."""
FB_RESERVED_MIB = 579
"""Framebuffer reserved by the driver, MiB (``FB_TOTAL = FB_USED + FB_FREE + FB_RESERVED``)."""
SM_CLOCK_IDLE_MHZ = 345
SM_CLOCK_BUSY_MHZ = 1980
MEM_CLOCK_MHZ = 2619
DEFAULT_MODEL = "NVIDIA H100 80GB HBM3"
DEFAULT_DRIVER = "570.86.15"
XID_NONE = {"err_code": "0", "err_msg": "No Error"}
"""Labels dcgm-exporter puts on ``DCGM_FI_DEV_XID_ERRORS`` when no XID occurred."""

# PCI bus numbers of the 8 GPUs of an HGX H100 board (DGX H100 layout).
_PCI_BUSES = ("18", "2A", "3A", "5D", "9A", "AB", "BA", "DB")
_MASK64 = (1 << 64) - 1

# noise channels (one per exported quantity)
_N_GR, _N_SM, _N_TENSOR, _N_DRAM, _N_TEMP, _N_MTEMP, _N_PCIE_TX, _N_PCIE_RX = range(8)


def _mix64(x: int) -> int:
    """splitmix64 finaliser: a well-spread 64-bit hash of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _noise(*parts: int) -> float:
    """Deterministic noise in [-1, 1) from integer ``parts``."""
    h = 0
    for p in parts:
        h = _mix64(h ^ (p & _MASK64))
    return (h >> 11) / float(1 << 52) - 1.0


@dataclass(frozen=True, slots=True)
class SimGpu:
    """One simulated GPU.

    Attributes:
        host: node name (``gpu-node-001``...).
        index: GPU index on the node (the exporter's ``gpu`` label; ``/dev/nvidia<index>``).
        uuid: ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``, deterministic by (seed, host, index).
        pci_bus_id: ``00000000:18:00.0`` style (NVML's 8-digit domain).
        device: ``nvidia<index>``.
        pod_idx: index of the trace pod it replays (:attr:`simulator.trace.Trace.pods`).
        offset: trace steps added to the fleet step for this GPU (0 unless a pod is reused).
        fb_fraction: share of the usable framebuffer the pod's trace maximum maps to.
        key: :func:`contracts.topics.gpu_key` of ``host`` and ``uuid``.
    """

    host: str
    index: int
    uuid: str
    pci_bus_id: str
    device: str
    pod_idx: int
    offset: int
    fb_fraction: float
    key: str


class _Series:
    """A GPU's per-step quantities over one trace cycle, with prefix sums for exact integrals."""

    __slots__ = ("util", "power", "util_prefix", "power_prefix", "max_mem")

    def __init__(self, util: array[float], power: array[float], max_mem: int) -> None:
        self.util = util
        self.power = power
        self.util_prefix = _prefix(util)
        self.power_prefix = _prefix(power)
        self.max_mem = max_mem


def _prefix(values: array[float]) -> array[float]:
    out = array("d", [0.0]) * (len(values) + 1)
    acc = 0.0
    for i, v in enumerate(values):
        acc += v
        out[i + 1] = acc
    return out


class Fleet:
    """N nodes × M GPUs replaying the trace; see the module docstring for the model.

    Args:
        trace: the loaded trace.
        nodes: number of nodes (1..999), named ``gpu-node-001``...
        gpus_per_node: GPUs per node (1..8, HGX H100 PCI layout).
        speedup: trace seconds per wall second (57 plays one 57 s sample per second); > 0.
        start_step: fleet step at ``t0``.
        seed: makes the pod choice, UUIDs and noise reproducible.
        model_name: the ``modelName`` label.
        pool: name of the pool the GPUs belong to.
        clock: wall clock (Unix s), injectable for tests.
        t0: wall time of ``start_step``; default ``clock()`` at construction.
        driver_version: the ``DCGM_FI_DRIVER_VERSION`` label.
        min_coverage: pods living less than this share of the trace are not used.

    Raises:
        ValueError: an argument out of range, or no pod of the trace meets ``min_coverage``.
    """

    def __init__(
        self,
        trace: Trace,
        nodes: int = 8,
        gpus_per_node: int = 8,
        speedup: float = 57.0,
        start_step: int = 0,
        seed: int = 0,
        model_name: str = DEFAULT_MODEL,
        pool: str = "default",
        *,
        clock: Callable[[], float] = time.time,
        t0: float | None = None,
        driver_version: str = DEFAULT_DRIVER,
        min_coverage: float = 0.5,
    ) -> None:
        if not 1 <= nodes <= 999:
            raise ValueError(f"nodes must be 1..999, got {nodes}")
        if not 1 <= gpus_per_node <= len(_PCI_BUSES):
            raise ValueError(f"gpus_per_node must be 1..{len(_PCI_BUSES)}, got {gpus_per_node}")
        if not speedup > 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        self.trace = trace
        self.nodes = nodes
        self.gpus_per_node = gpus_per_node
        self.speedup = float(speedup)
        self.start_step = start_step
        self.seed = seed
        self.model_name = model_name
        self.pool = pool
        self.driver_version = driver_version
        self.clock = clock
        self.t0 = clock() if t0 is None else t0
        self.step_wall_s = trace.step_s / self.speedup
        """Wall seconds one trace step lasts."""

        rng = random.Random(seed)
        assignment = self._assign_pods(rng, nodes * gpus_per_node, min_coverage)
        self._hosts = [f"gpu-node-{n + 1:03d}" for n in range(nodes)]
        self._gpus: list[SimGpu] = []
        self._series: list[_Series] = []
        self._energy0: list[int] = []
        self._nvlink0: list[int] = []
        for n, host in enumerate(self._hosts):
            for i in range(gpus_per_node):
                pod, offset = assignment[n * gpus_per_node + i]
                uid = self._uuid(host, i)
                g = SimGpu(host=host, index=i, uuid=uid, pci_bus_id=f"00000000:{_PCI_BUSES[i]}:00.0",
                           device=f"nvidia{i}", pod_idx=pod, offset=offset,
                           fb_fraction=round(0.55 + 0.35 * rng.random(), 4), key=gpu_key(host, uid))
                self._gpus.append(g)
                self._series.append(self._build_series(g, rng))
                self._energy0.append(int(5e10 + rng.random() * 1.5e11))
                self._nvlink0.append(int(rng.random() * 1e12))
        self._by_key = {g.key: k for k, g in enumerate(self._gpus)}
        self._by_host_index = {(g.host, g.index): k for k, g in enumerate(self._gpus)}
        self._allocated: Callable[[str, float], bool] | None = None

    def follow_scheduler(self, allocated: Callable[[str, float], bool]) -> None:
        """From now on telemetry follows the training scheduler: ``allocated(gpu_key, at)`` says
        whether a training job holds the GPU at wall time ``at``. A held GPU reports its trace's
        duty cycle, at least :data:`FOLLOW_BUSY_PCT` (a job's GPU works), and its memory; any
        other GPU reports 0 % and no memory in use (nothing runs on it). :meth:`is_busy_at`
        answers the same way."""
        self._allocated = allocated

    # construction -----------------------------------------------------------------------------
    def _assign_pods(self, rng: random.Random, count: int, min_coverage: float) -> list[tuple[int, int]]:
        """``count`` (pod, offset) pairs: pods stratified by busy fraction so that the fleet holds
        near-always-idle, typical and busy pods; a pod reused in a later round gets a random offset."""
        t = self.trace
        cands = [p for p in range(len(t.pods)) if t.coverage(p) >= min_coverage]
        if not cands:
            raise ValueError(f"no trace pod lives for at least {min_coverage:.0%} of the trace")
        cands.sort(key=lambda p: (t.busy_fraction(p), t.pods[p]))
        out: list[tuple[int, int]] = []
        rnd = 0
        while len(out) < count:
            m = min(len(cands), count - len(out))
            for s in range(m):
                lo, hi = s * len(cands) // m, (s + 1) * len(cands) // m
                out.append((cands[rng.randrange(lo, hi)], 0 if rnd == 0 else rng.randrange(t.steps)))
            rnd += 1
        rng.shuffle(out)  # mix idle and busy pods across nodes
        return out

    def _uuid(self, host: str, index: int) -> str:
        digest = hashlib.sha256(f"gpupool-sim/{self.seed}/{host}/{index}".encode()).digest()
        return f"GPU-{uuid.UUID(bytes=digest[:16], version=4)}"

    def _build_series(self, g: SimGpu, rng: random.Random) -> _Series:
        t = self.trace
        raw = t.util_series(g.pod_idx)
        n = t.steps
        util = raw[g.offset:] + raw[: g.offset]
        power = array("d", [0.0]) * n
        for k in range(n):
            power[k] = round(68.5 + 5.6 * util[k] + 4.0 * (2.0 * rng.random() - 1.0), 3)
        return _Series(util, power, t.max_mem_bytes(g.pod_idx))

    # identity ---------------------------------------------------------------------------------
    def hosts(self) -> list[str]:
        """Node names, in order."""
        return list(self._hosts)

    def gpus(self, host: str | None = None) -> list[SimGpu]:
        """Every GPU (of ``host`` if given), in node then index order."""
        return [g for g in self._gpus if host is None or g.host == host]

    def gpu_keys(self) -> list[str]:
        """:func:`contracts.topics.gpu_key` of every GPU."""
        return [g.key for g in self._gpus]

    def gpu(self, host: str, gpu_index: int) -> SimGpu:
        """The GPU at ``host``/``gpu_index``. Raises ``KeyError`` if there is none."""
        return self._gpus[self._k(host, gpu_index)]

    def gpu_by_key(self, key: str) -> SimGpu:
        """The GPU whose key is ``key``. Raises ``KeyError`` if there is none."""
        return self._gpus[self._by_key[key]]

    def _k(self, host: str, gpu_index: int) -> int:
        try:
            return self._by_host_index[(host, gpu_index)]
        except KeyError:
            raise KeyError(f"no GPU {host}/{gpu_index}") from None

    # time ---------------------------------------------------------------------------------------
    def now(self) -> float:
        """The fleet's clock, Unix s."""
        return self.clock()

    def fstep(self, at: float) -> float:
        """Fractional fleet step at wall time ``at``."""
        return self.start_step + (at - self.t0) * self.speedup / self.trace.step_s

    def step_at(self, at: float | None = None) -> int:
        """Fleet step at wall time ``at`` (default now)."""
        return math.floor(self.fstep(self.now() if at is None else at))

    def trace_step(self, gpu: SimGpu, step: int) -> int:
        """The trace step GPU ``gpu`` replays at fleet step ``step``."""
        return (step + gpu.offset) % self.trace.steps

    def step_start(self, step: int) -> float:
        """Wall time at which fleet step ``step`` begins."""
        return self.t0 + (step - self.start_step) * self.step_wall_s

    # ground truth -----------------------------------------------------------------------------
    def gpu_util(self, host: str, gpu_index: int, at: float | None = None) -> float:
        """Trace duty cycle, % (0..100), of GPU ``host``/``gpu_index`` at ``at`` (default now).

        Raises ``KeyError`` for an unknown GPU."""
        k = self._k(host, gpu_index)
        return self._util_k(k, self.step_at(at))

    def _util_k(self, k: int, step: int) -> float:
        s = self._series[k]
        return s.util[step % len(s.util)]

    def util_at_step(self, gpu_key_: str, step: int) -> float:
        """Duty cycle, %, of GPU ``gpu_key_`` at fleet step ``step``. ``KeyError`` if unknown."""
        return self._util_k(self._by_key[gpu_key_], step)

    def is_busy_step(self, gpu_key_: str, step: int) -> bool:
        """True if GPU ``gpu_key_`` is busy at fleet step ``step`` (duty cycle > 0 %)."""
        return self.util_at_step(gpu_key_, step) > BUSY_THRESHOLD_PCT

    def is_busy_at(self, gpu_key_: str, at: float) -> bool:
        """True if GPU ``gpu_key_`` is busy at wall time ``at``: its trace duty cycle is above
        :data:`BUSY_THRESHOLD_PCT` (0 %), or, while the fleet follows the scheduler
        (:meth:`follow_scheduler`), a training job holds it. Raises ``KeyError`` for an unknown key."""
        if self._allocated is not None:
            if gpu_key_ not in self._by_key:
                raise KeyError(gpu_key_)
            return self._allocated(gpu_key_, at)
        return self.is_busy_step(gpu_key_, self.step_at(at))

    def idle_share(self) -> float:
        """Share (0..1) of (GPU, step) pairs over one trace cycle at which the fleet's GPUs are idle."""
        total = sum(len(s.util) for s in self._series)
        idle = sum(1 for s in self._series for v in s.util if v <= BUSY_THRESHOLD_PCT)
        return idle / total

    def fb_used_mib(self, host: str, gpu_index: int, at: float | None = None) -> int:
        """Framebuffer in use, MiB, of GPU ``host``/``gpu_index`` at ``at`` (default now)."""
        k = self._k(host, gpu_index)
        return self._fb_used_k(k, self.step_at(at))

    def _fb_used_k(self, k: int, step: int) -> int:
        g, s = self._gpus[k], self._series[k]
        if s.max_mem <= 0:
            return 0
        mem = self.trace.mem_bytes(g.pod_idx, self.trace_step(g, step))
        return round(mem / s.max_mem * g.fb_fraction * (FB_TOTAL_MIB - FB_RESERVED_MIB))

    def _integral(self, values: array[float], prefix: array[float], x: float) -> float:
        """∫ of the step function ``values`` (periodic) from fleet step 0 to fractional step ``x``."""
        n = len(values)
        s = math.floor(x)
        q, r = divmod(s, n)
        return q * prefix[n] + prefix[r] + values[r] * (x - s)

    def util_seconds(self, host: str, gpu_index: int, t1: float, t2: float) -> float:
        """∫ duty-cycle/100 dt over wall time [t1, t2] for GPU ``host``/``gpu_index``: seconds of
        full-utilisation equivalent (exact over step boundaries). Negative if ``t2 < t1``."""
        k = self._k(host, gpu_index)
        s = self._series[k]
        a = self._integral(s.util, s.util_prefix, self.fstep(t1))
        b = self._integral(s.util, s.util_prefix, self.fstep(t2))
        return (b - a) * self.step_wall_s / 100.0

    def energy_mj(self, host: str, gpu_index: int, at: float | None = None) -> int:
        """``DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION``: energy since driver load, mJ, at ``at``:
        a per-GPU base plus the exact integral of ``POWER_USAGE`` over wall time since ``t0``
        (monotonic non-decreasing in ``at``)."""
        k = self._k(host, gpu_index)
        return self._energy_k(k, self.now() if at is None else at)

    def _energy_k(self, k: int, at: float) -> int:
        s = self._series[k]
        joules = (self._integral(s.power, s.power_prefix, self.fstep(at))
                  - self._integral(s.power, s.power_prefix, self.start_step)) * self.step_wall_s
        return self._energy0[k] + math.floor(joules * 1000.0)

    # exporter view ----------------------------------------------------------------------------
    def fields(self, host: str, gpu_index: int, at: float | None = None) -> dict[str, int | float]:
        """Every field of :data:`simulator.dcgm_fields.FIELDS` for one GPU at ``at`` (default now),
        by DCGM field name; ``int`` for DCGM int64 fields, ``float`` for double ones (ratios rounded
        to 6 decimals, watts to 3). Raises ``KeyError`` for an unknown GPU."""
        at = self.now() if at is None else at
        k = self._k(host, gpu_index)
        s = self._series[k]
        step = self.step_at(at)
        r = step % len(s.util)
        u = s.util[r]
        held = None if self._allocated is None else self._allocated(self._gpus[k].key, at)
        if held is not None:
            u = max(u, FOLLOW_BUSY_PCT) if held else 0.0
        busy = u > BUSY_THRESHOLD_PCT
        seed = self.seed

        def nz(channel: int) -> float:
            return _noise(seed, k, step, channel)

        def ratio(v: float) -> float:
            return 0.0 if not busy else min(1.0, max(1e-6, round(v, 6)))

        gr = ratio(u / 100.0 * (1.0 + 0.03 * nz(_N_GR)))
        sm = ratio(gr * (0.93 + 0.04 * nz(_N_SM)))
        tensor = ratio(gr * (0.35 + 0.05 * nz(_N_TENSOR)))
        dram = ratio(gr * (0.45 + 0.1 * nz(_N_DRAM)))
        gpu_util = 0 if not busy else max(1, round(u))
        temp = round(31 + 0.42 * u + 1.5 * nz(_N_TEMP))
        fb_used = 0 if held is False else self._fb_used_k(k, step)
        resident = fb_used > 0
        pcie_idle = 32_000.0 if resident else 2_000.0
        util_s = self._integral(s.util, s.util_prefix, self.fstep(at)) - self._integral(
            s.util, s.util_prefix, self.start_step)
        return {
            "DCGM_FI_DEV_SM_CLOCK": SM_CLOCK_BUSY_MHZ if busy else SM_CLOCK_IDLE_MHZ,
            "DCGM_FI_DEV_MEM_CLOCK": MEM_CLOCK_MHZ,
            "DCGM_FI_DEV_MEMORY_TEMP": temp + 3 + round(nz(_N_MTEMP)),
            "DCGM_FI_DEV_GPU_TEMP": temp,
            "DCGM_FI_DEV_POWER_USAGE": s.power[r],
            "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": self._energy_k(k, at),
            "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 0,
            "DCGM_FI_DEV_GPU_UTIL": gpu_util,
            "DCGM_FI_DEV_MEM_COPY_UTIL": round(dram * 100),
            "DCGM_FI_DEV_ENC_UTIL": 0,
            "DCGM_FI_DEV_DEC_UTIL": 0,
            "DCGM_FI_DEV_XID_ERRORS": 0,
            "DCGM_FI_DEV_FB_FREE": FB_TOTAL_MIB - FB_RESERVED_MIB - fb_used,
            "DCGM_FI_DEV_FB_USED": fb_used,
            "DCGM_FI_DEV_FB_RESERVED": FB_RESERVED_MIB,
            "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": 0,
            "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": 0,
            "DCGM_FI_DEV_ROW_REMAP_FAILURE": 0,
            "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": self._nvlink0[k] + max(0, math.floor(
                util_s * self.step_wall_s * 4.0e7)),
            "DCGM_FI_DEV_VGPU_LICENSE_STATUS": 0,
            "DCGM_FI_PROF_GR_ENGINE_ACTIVE": gr,
            "DCGM_FI_PROF_SM_ACTIVE": sm,
            "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": tensor,
            "DCGM_FI_PROF_DRAM_ACTIVE": dram,
            "DCGM_FI_PROF_PCIE_TX_BYTES": round(pcie_idle * (1 + 0.2 * nz(_N_PCIE_TX)) + gr * 1.8e9),
            "DCGM_FI_PROF_PCIE_RX_BYTES": round(pcie_idle * (1 + 0.2 * nz(_N_PCIE_RX)) + gr * 2.4e9),
        }

    def field_labels(self, host: str, gpu_index: int, field: str) -> dict[str, str]:
        """Per-field extra labels dcgm-exporter adds: ``err_code``/``err_msg`` on
        ``DCGM_FI_DEV_XID_ERRORS`` (no XID ever occurs here), none elsewhere."""
        self._k(host, gpu_index)
        return dict(XID_NONE) if field == "DCGM_FI_DEV_XID_ERRORS" else {}
