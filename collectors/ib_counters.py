"""InfiniBand port counters: sysfs file names → IBTA PMA attribute names and widths.

Sources: Linux ``drivers/infiniband/core/sysfs.c`` (``PORT_PMA_ATTR(name, counter, width,
offset)`` gives each ``counters/`` file of the PortCounters attribute its width in bits;
``PORT_PMA_ATTR_EXT`` the 64-bit PortCountersExtended ones), IBTA specification vol. 1,
16.1.3 (PortCounters, PortCountersExtended: the names used on the bus), and prometheus/procfs
``sysfs/class_infiniband.go`` for the ``counters_ext/`` files of older mlx4 kernels.

The kernel fills ``counters/`` from one of three tables, chosen by the device's PMA
capabilities: ``pma_attrs`` (legacy: data and packet counters 32-bit), ``pma_attrs_ext``
(64-bit data and packet counters, plus the ``unicast_*``/``multicast_*`` files) and
``pma_attrs_noietf`` (64-bit data and packet counters, no unicast/multicast files). Error and
wait counters keep their PortCounters width in every table and *saturate* at all-ones.
"""

from __future__ import annotations

from typing import NamedTuple


class PmaCounter(NamedTuple):
    """A counter's PMA name and its width in bits (``None`` when the kernel does not define one)."""

    name: str
    bits: int | None


EXTENDED_WIDTH = 64
LEGACY_DATA_WIDTH = 32

COUNTERS: dict[str, PmaCounter] = {
    "symbol_error": PmaCounter("SymbolErrorCounter", 16),
    "link_error_recovery": PmaCounter("LinkErrorRecoveryCounter", 8),
    "link_downed": PmaCounter("LinkDownedCounter", 8),
    "port_rcv_errors": PmaCounter("PortRcvErrors", 16),
    "port_rcv_remote_physical_errors": PmaCounter("PortRcvRemotePhysicalErrors", 16),
    "port_rcv_switch_relay_errors": PmaCounter("PortRcvSwitchRelayErrors", 16),
    "port_xmit_discards": PmaCounter("PortXmitDiscards", 16),
    "port_xmit_constraint_errors": PmaCounter("PortXmitConstraintErrors", 8),
    "port_rcv_constraint_errors": PmaCounter("PortRcvConstraintErrors", 8),
    "local_link_integrity_errors": PmaCounter("LocalLinkIntegrityErrors", 4),
    "excessive_buffer_overrun_errors": PmaCounter("ExcessiveBufferOverrunErrors", 4),
    "VL15_dropped": PmaCounter("VL15Dropped", 16),
    "port_xmit_wait": PmaCounter("PortXmitWait", 32),
    # 32-bit in the legacy table, 64-bit in the extended ones (see data_width()).
    "port_xmit_data": PmaCounter("PortXmitData", LEGACY_DATA_WIDTH),
    "port_rcv_data": PmaCounter("PortRcvData", LEGACY_DATA_WIDTH),
    "port_xmit_packets": PmaCounter("PortXmitPkts", LEGACY_DATA_WIDTH),
    "port_rcv_packets": PmaCounter("PortRcvPkts", LEGACY_DATA_WIDTH),
    # Only in the extended table.
    "unicast_xmit_packets": PmaCounter("PortUnicastXmitPkts", EXTENDED_WIDTH),
    "unicast_rcv_packets": PmaCounter("PortUnicastRcvPkts", EXTENDED_WIDTH),
    "multicast_xmit_packets": PmaCounter("PortMulticastXmitPkts", EXTENDED_WIDTH),
    "multicast_rcv_packets": PmaCounter("PortMulticastRcvPkts", EXTENDED_WIDTH),
    # Not a kernel PMA attribute; some OFED builds expose it (procfs reads it as PortRcvDiscards).
    "port_rcv_discards": PmaCounter("PortRcvDiscards", None),
}
"""``ports/<n>/counters/<file>`` → PMA counter."""

COUNTERS_EXT: dict[str, PmaCounter] = {
    "port_xmit_data_64": PmaCounter("PortXmitData", EXTENDED_WIDTH),
    "port_rcv_data_64": PmaCounter("PortRcvData", EXTENDED_WIDTH),
    "port_xmit_packets_64": PmaCounter("PortXmitPkts", EXTENDED_WIDTH),
    "port_rcv_packets_64": PmaCounter("PortRcvPkts", EXTENDED_WIDTH),
    "port_unicast_xmit_packets": PmaCounter("PortUnicastXmitPkts", EXTENDED_WIDTH),
    "port_unicast_rcv_packets": PmaCounter("PortUnicastRcvPkts", EXTENDED_WIDTH),
    "port_multicast_xmit_packets": PmaCounter("PortMulticastXmitPkts", EXTENDED_WIDTH),
    "port_multicast_rcv_packets": PmaCounter("PortMulticastRcvPkts", EXTENDED_WIDTH),
}
"""``ports/<n>/counters_ext/<file>`` (mlx4 on kernels before 4.5) → PMA counter, all 64-bit."""

DATA_COUNTERS = frozenset({"port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets"})
"""``counters/`` files whose width depends on the table the kernel chose."""
_EXTENDED_ONLY = frozenset(
    {"unicast_xmit_packets", "unicast_rcv_packets", "multicast_xmit_packets", "multicast_rcv_packets"}
)


def data_width(files: set[str] | frozenset[str], value: int | None) -> int:
    """Width of a :data:`DATA_COUNTERS` file of a port whose ``counters/`` holds ``files``.

    64 when the extended table is in use — the unicast/multicast files exist only there — or
    when ``value`` does not fit in 32 bits (the no-IETF table); 32 otherwise (legacy table).
    """
    if files & _EXTENDED_ONLY or (value is not None and value >> LEGACY_DATA_WIDTH):
        return EXTENDED_WIDTH
    return LEGACY_DATA_WIDTH


def is_saturated(value: int | None, bits: int | None) -> bool:
    """True when ``value`` sits at the all-ones maximum of a ``bits``-wide PMA counter: the
    counter stopped counting (PMA counters saturate, they never wrap)."""
    return value is not None and bits is not None and value == (1 << bits) - 1


LINK_WIDTHS = frozenset({"1X", "2X", "4X", "8X", "12X"})
"""Active link widths as the IBTA names them (PortInfo:LinkWidthActive)."""
LINK_SPEEDS = frozenset({"SDR", "DDR", "QDR", "FDR10", "FDR", "EDR", "HDR", "NDR", "XDR"})
"""Active per-lane speeds as the IBTA and the kernel name them."""


def link_width_speed(width: str | None, speed: str | None) -> tuple[str | None, str | None]:
    """``(width, speed)`` normalised to :data:`LINK_WIDTHS` / :data:`LINK_SPEEDS` (``4x`` →
    ``4X``); ``None`` for anything else (``???``, empty, unknown)."""
    w = width.upper() if width else None
    s = speed.upper() if speed else None
    return (w if w in LINK_WIDTHS else None), (s if s in LINK_SPEEDS else None)


def rate_width_speed(text: str) -> tuple[str | None, str | None]:
    """Width and speed from the parenthesis of a kernel ``rate`` text (``"100 Gb/sec (4X EDR)"``
    → ``("4X", "EDR")``; ``"10 Gb/sec (4X)"`` → ``("4X", None)``; ``"0 GB/sec"`` → ``(None,
    None)``). Linux ``drivers/infiniband/core/sysfs.c`` ``rate_show``: ``"%d%s Gb/sec (%dX%s)"``."""
    open_, close = text.find("("), text.rfind(")")
    if open_ < 0 or close < open_:
        return None, None
    parts = text[open_ + 1 : close].split()
    if not parts:
        return None, None
    return link_width_speed(parts[0], parts[1] if len(parts) > 1 else None)
