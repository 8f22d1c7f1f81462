"""Simulated InfiniBand sysfs trees, one per node, whose counters advance with the GPUs' load.

Layout (Linux ``drivers/infiniband/core/sysfs.c`` with the mlx5 driver; compare the mlx5_0 device
of ``../shared/data/telemetry/procfs_sys_class_infiniband.ttar``)::

    <root>/<host>/sys/class/infiniband/mlx5_<n>/
        fw_ver board_id hca_type node_guid sys_image_guid node_type node_desc
        ports/1/{rate,state,phys_state,link_layer,lid,sm_lid,sm_sl,lid_mask_count,cap_mask}
        ports/1/counters/<PMA counter>      (port_xmit_data, port_xmit_wait, symbol_error ...)
        ports/1/hw_counters/<mlx5 counter>  (rx_write_requests, out_of_sequence, lifespan ...)

One ConnectX-7 NDR HCA (``400 Gb/sec (4X NDR)``, ``MT4129``) per ``gpus_per_hca`` GPUs (default
2, i.e. 4 HCAs on an 8-GPU node, GPU ``i`` behind ``mlx5_<i // gpus_per_hca>``); ``gpus_per_hca``
equal to the node's GPU count gives one HCA per node.

Counters follow the kernel: on a device with PortCountersExtended (every mlx5) the data and packet
counters in ``counters/`` are the 64-bit extended ones; the error counters and ``port_xmit_wait``
keep their PMA widths (:data:`COUNTER_BITS`) and *saturate* at all-ones. ``port_xmit_data`` and
``port_rcv_data`` count 4-octet words (bytes / 4).

Traffic model, integrated exactly over wall time from :meth:`Fleet.util_seconds`: each GPU at 100 %
duty cycle sends ``0.6 × link rate / gpus_per_hca`` bytes/s through its HCA (a fully busy HCA
runs its link at 60 %), receives a per-HCA 90..100 % of that, plus 256 B/s of management
datagrams each way; packets are 4,096-byte MTU; ``port_xmit_wait`` grows with the square of the
link utilisation above 50 %. Files are replaced atomically (written in ``<root>/.staging`` then
``os.replace``d), so a reader never sees a half-written value.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

from simulator.fleet import Fleet
from simulator.metrics import SYSFS_FILES_WRITTEN

log = logging.getLogger(__name__)

COUNTER_BITS: dict[str, int] = {
    "port_xmit_data": 64,
    "port_rcv_data": 64,
    "port_xmit_packets": 64,
    "port_rcv_packets": 64,
    "unicast_xmit_packets": 64,
    "unicast_rcv_packets": 64,
    "multicast_xmit_packets": 64,
    "multicast_rcv_packets": 64,
    "port_xmit_wait": 32,
    "symbol_error": 16,
    "port_rcv_errors": 16,
    "port_rcv_remote_physical_errors": 16,
    "port_rcv_switch_relay_errors": 16,
    "port_xmit_discards": 16,
    "VL15_dropped": 16,
    "link_error_recovery": 8,
    "link_downed": 8,
    "port_xmit_constraint_errors": 8,
    "port_rcv_constraint_errors": 8,
    "local_link_integrity_errors": 4,
    "excessive_buffer_overrun_errors": 4,
}
"""Width of each ``counters/`` file as the kernel shows it for an mlx5 port (64 = extended)."""

HW_COUNTERS: tuple[str, ...] = (
    "duplicate_request", "implied_nak_seq_err", "lifespan", "local_ack_timeout_err", "out_of_buffer",
    "out_of_sequence", "packet_seq_err", "req_cqe_error", "req_cqe_flush_error", "req_remote_access_errors",
    "req_remote_invalid_request", "resp_cqe_error", "resp_cqe_flush_error", "resp_local_length_error",
    "resp_remote_access_errors", "rnr_nak_retry_err", "rx_atomic_requests", "rx_dct_connect",
    "rx_read_requests", "rx_write_requests",
)
"""mlx5 ``hw_counters/`` files of an InfiniBand port (``lifespan`` is a setting, 10 ms)."""

RATE_TEXT = "400 Gb/sec (4X NDR)"
LINK_RATE_BYTES_PER_S = 400 * 125_000_000
"""Nominal rate of :data:`RATE_TEXT`, bytes/s (Gb/s × 125,000,000)."""
MTU_BYTES = 4096
_MGMT_BYTES_PER_S = 256.0
_FULL_LOAD_SHARE = 0.6
_WAIT_TICKS_PER_S = 2.0e7
_STATIC = {
    "fw_ver": "28.39.2048",
    "board_id": "MT_0000000838",
    "hca_type": "MT4129",
    "node_type": "1: CA",
}


@dataclass
class Hca:
    """One simulated HCA (single port 1) and its live counters.

    Attributes:
        host: node it sits in.
        device: ``mlx5_<n>``.
        gpu_indices: the node's GPUs whose traffic goes through it.
        guid: node GUID as an int (Mellanox OUI ``0002c9``); sysfs shows it as
            ``0002:c903:00xx:xxxx``.
        lid: the port's LID.
        counters: ``counters/`` values, raw (data counters in 4-octet words).
        hw_counters: ``hw_counters/`` values.
        rcv_ratio: received / sent bytes of its load.
        up: link state (``4: ACTIVE``/``5: LinkUp`` when up, ``1: DOWN``/``2: Polling`` when down).
    """

    host: str
    device: str
    gpu_indices: tuple[int, ...]
    guid: int
    lid: int
    counters: dict[str, int]
    hw_counters: dict[str, int]
    rcv_ratio: float
    up: bool = True
    residual: dict[str, float] = field(default_factory=dict)

    @property
    def node_guid(self) -> str:
        """The GUID as the kernel prints it: four groups of 4 hex digits joined by ``:``."""
        h = f"{self.guid:016x}"
        return ":".join(h[i : i + 4] for i in range(0, 16, 4))

    @property
    def guid_hex(self) -> str:
        """The GUID as ``0x`` + 16 lowercase hex digits (the port identity convention,
        :func:`contracts.topics.ib_port_key`)."""
        return f"0x{self.guid:016x}"


class SysfsTree:
    """Per-node ``sys/class/infiniband`` trees under ``root``; see the module docstring.

    The tree is written on construction (at ``at``, default the fleet's clock); call
    :meth:`update` to advance the counters to a later time.

    Args:
        fleet: the simulated fleet (its load drives the counters).
        root: folder to write into; ``<root>/<host>/sys`` is each node's sysfs root.
        gpus_per_hca: GPUs behind each HCA (default 2).
        seed: makes GUID-independent details (initial counter values, receive ratios) reproducible.
        at: wall time of the initial state.

    Raises:
        ValueError: ``gpus_per_hca`` < 1.
        OSError: ``root`` cannot be written.
    """

    def __init__(self, fleet: Fleet, root: Path, *, gpus_per_hca: int = 2, seed: int | None = None,
                 at: float | None = None) -> None:
        if gpus_per_hca < 1:
            raise ValueError(f"gpus_per_hca must be >= 1, got {gpus_per_hca}")
        self.fleet = fleet
        self.root = Path(root)
        self.gpus_per_hca = gpus_per_hca
        self._staging = self.root / ".staging"
        self._staging.mkdir(parents=True, exist_ok=True)
        rng = random.Random(fleet.seed if seed is None else seed)
        self._hcas: dict[tuple[str, str], Hca] = {}
        n_hca = math.ceil(fleet.gpus_per_node / gpus_per_hca)
        for n, host in enumerate(fleet.hosts()):
            for h in range(n_hca):
                gpus = tuple(range(h * gpus_per_hca, min((h + 1) * gpus_per_hca, fleet.gpus_per_node)))
                counters = {name: 0 for name in COUNTER_BITS}
                words = rng.randrange(10**9, 10**12)
                counters["port_xmit_data"] = words
                counters["port_rcv_data"] = int(words * (0.9 + 0.1 * rng.random()))
                for d in ("xmit", "rcv"):
                    pk = counters[f"port_{d}_data"] * 4 // MTU_BYTES
                    counters[f"port_{d}_packets"] = counters[f"unicast_{d}_packets"] = pk
                hw = {name: 0 for name in HW_COUNTERS}
                hw["lifespan"] = 10
                guid = (0x0002C903 << 32) | ((n + 1) << 8) | h
                hca = Hca(host=host, device=f"mlx5_{h}", gpu_indices=gpus, guid=guid, lid=2 + n * n_hca + h,
                          counters=counters, hw_counters=hw, rcv_ratio=0.9 + 0.1 * rng.random())
                self._hcas[(host, hca.device)] = hca
        self._written: dict[Path, str] = {}
        self._tmp_seq = itertools.count()
        self._at = fleet.now() if at is None else at
        for hca in self._hcas.values():
            self._write_static(hca)
            self._write_counters(hca)

    # layout -----------------------------------------------------------------------------------
    def roots(self) -> list[tuple[str, Path]]:
        """``(host, <root>/<host>/sys)`` for every node: the folder a collector reads as ``/sys``."""
        return [(h, self.root / h / "sys") for h in self.fleet.hosts()]

    def hcas(self, host: str | None = None) -> list[Hca]:
        """Every HCA (of ``host`` if given)."""
        return [x for x in self._hcas.values() if host is None or x.host == host]

    def hca(self, host: str, device: str) -> Hca:
        """HCA ``device`` of ``host``. Raises ``KeyError`` if there is none."""
        try:
            return self._hcas[(host, device)]
        except KeyError:
            raise KeyError(f"no HCA {host}/{device}") from None

    def hca_for_gpu(self, host: str, gpu_index: int) -> Hca:
        """The HCA GPU ``host``/``gpu_index`` sends through. Raises ``KeyError`` if unknown."""
        self.fleet.gpu(host, gpu_index)
        return self.hca(host, f"mlx5_{gpu_index // self.gpus_per_hca}")

    def device_dir(self, host: str, device: str) -> Path:
        """``<root>/<host>/sys/class/infiniband/<device>``."""
        return self.root / host / "sys" / "class" / "infiniband" / device

    def xmit_bytes(self, host: str, device: str) -> int:
        """Bytes sent by port 1 so far: 4 × ``port_xmit_data``."""
        return 4 * self.hca(host, device).counters["port_xmit_data"]

    def rcv_bytes(self, host: str, device: str) -> int:
        """Bytes received by port 1 so far: 4 × ``port_rcv_data``."""
        return 4 * self.hca(host, device).counters["port_rcv_data"]

    # fault injection --------------------------------------------------------------------------
    def set_counter(self, host: str, device: str, name: str, value: int) -> None:
        """Set ``counters/<name>`` (clamped to its width: a saturated PMA counter stays at all-ones
        afterwards) and write it now. Raises ``KeyError`` for an unknown HCA or counter,
        ``ValueError`` for a negative value."""
        hca = self.hca(host, device)
        if name not in COUNTER_BITS:
            raise KeyError(f"unknown counter {name!r}")
        if value < 0:
            raise ValueError("counter values are unsigned")
        hca.counters[name] = min(value, (1 << COUNTER_BITS[name]) - 1)
        self._write_counters(hca)

    def set_link(self, host: str, device: str, up: bool) -> None:
        """Bring port 1 of ``device`` down or up (a down link carries no traffic; going down
        increments ``link_downed``) and write its state files now. Raises ``KeyError``."""
        hca = self.hca(host, device)
        if hca.up and not up:
            self._bump(hca, "link_downed", 1)
        hca.up = up
        self._write_port_state(hca)
        self._write_counters(hca)

    # advancing --------------------------------------------------------------------------------
    def update(self, at: float | None = None) -> None:
        """Advance every counter from the previous update to wall time ``at`` (default the
        fleet's clock) and rewrite the files whose value changed. A time at or before the
        previous update changes nothing. Raises ``OSError`` if a file cannot be written."""
        at = self.fleet.now() if at is None else at
        if at <= self._at:
            if at < self._at:
                log.debug("sysfs_time_went_back", extra={"at": at, "previous": self._at})
            return
        t1, self._at = self._at, at
        dt = at - t1
        per_gpu_bps = _FULL_LOAD_SHARE * LINK_RATE_BYTES_PER_S / self.gpus_per_hca
        for hca in self._hcas.values():
            if hca.up:
                busy_s = sum(self.fleet.util_seconds(hca.host, i, t1, at) for i in hca.gpu_indices)
                load_bytes = busy_s * per_gpu_bps
                xmit = load_bytes + _MGMT_BYTES_PER_S * dt
                rcv = load_bytes * hca.rcv_ratio + _MGMT_BYTES_PER_S * dt
                self._accumulate(hca, "port_xmit_data", xmit / 4)
                self._accumulate(hca, "port_rcv_data", rcv / 4)
                for d, b in (("xmit", xmit), ("rcv", rcv)):
                    pk = self._accumulate(hca, f"port_{d}_packets", b / MTU_BYTES)
                    self._bump(hca, f"unicast_{d}_packets", pk)
                link_util = load_bytes / (dt * LINK_RATE_BYTES_PER_S)
                wait_ticks = _WAIT_TICKS_PER_S * max(0.0, link_util - 0.5) ** 2 * dt
                self._accumulate(hca, "port_xmit_wait", wait_ticks)
                self._accumulate_hw(hca, "rx_write_requests", rcv / 65536)
                self._accumulate_hw(hca, "rx_read_requests", rcv / (1 << 20))
            self._write_counters(hca)

    def _accumulate(self, hca: Hca, name: str, amount: float) -> int:
        """Add ``amount`` (carrying the fraction to the next update) to ``counters/name``;
        returns the whole units added."""
        exact = amount + hca.residual.get(name, 0.0)
        whole = math.floor(exact)
        hca.residual[name] = exact - whole
        self._bump(hca, name, whole)
        return whole

    def _accumulate_hw(self, hca: Hca, name: str, amount: float) -> None:
        key = f"hw:{name}"
        exact = amount + hca.residual.get(key, 0.0)
        whole = math.floor(exact)
        hca.residual[key] = exact - whole
        hca.hw_counters[name] += whole

    @staticmethod
    def _bump(hca: Hca, name: str, n: int) -> None:
        """Add ``n`` to a PMA counter, saturating at its width."""
        top = (1 << COUNTER_BITS[name]) - 1
        hca.counters[name] = min(top, hca.counters[name] + n)

    # writing ----------------------------------------------------------------------------------
    def _write(self, path: Path, text: str) -> None:
        if self._written.get(path) == text:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._staging / f"{os.getpid()}-{next(self._tmp_seq)}.tmp"
        tmp.write_text(text)
        os.replace(tmp, path)
        self._written[path] = text
        SYSFS_FILES_WRITTEN.inc()

    def _write_static(self, hca: Hca) -> None:
        d = self.device_dir(hca.host, hca.device)
        for name, value in _STATIC.items():
            self._write(d / name, value + "\n")
        self._write(d / "node_guid", hca.node_guid + "\n")
        self._write(d / "sys_image_guid", hca.node_guid + "\n")
        self._write(d / "node_desc", f"{hca.host} {hca.device}\n")
        p = d / "ports" / "1"
        port_files = {"lid": f"0x{hca.lid:x}", "sm_lid": "0x1", "sm_sl": "0", "lid_mask_count": "0",
                      "cap_mask": "0xa751e848", "link_layer": "InfiniBand"}
        for name, value in port_files.items():
            self._write(p / name, value + "\n")
        self._write_port_state(hca)

    def _write_port_state(self, hca: Hca) -> None:
        p = self.device_dir(hca.host, hca.device) / "ports" / "1"
        self._write(p / "rate", RATE_TEXT + "\n")
        self._write(p / "state", ("4: ACTIVE" if hca.up else "1: DOWN") + "\n")
        self._write(p / "phys_state", ("5: LinkUp" if hca.up else "2: Polling") + "\n")

    def _write_counters(self, hca: Hca) -> None:
        p = self.device_dir(hca.host, hca.device) / "ports" / "1"
        for name, value in hca.counters.items():
            self._write(p / "counters" / name, f"{value}\n")
        for name, value in hca.hw_counters.items():
            self._write(p / "hw_counters" / name, f"{value}\n")
