"""InfiniBand (and RoCE) ports from ``/sys/class/infiniband`` → :class:`contracts.IbPortSample`.

Layout (Linux ``drivers/infiniband/core/sysfs.c``; the same tree node_exporter reads through
prometheus/procfs ``sysfs/class_infiniband.go``)::

    <sys_root>/class/infiniband/<device>/{board_id,fw_ver,hca_type,node_guid}
    <sys_root>/class/infiniband/<device>/ports/<n>/{state,phys_state,rate,link_layer}
    <sys_root>/class/infiniband/<device>/ports/<n>/counters/<PMA counter>
    <sys_root>/class/infiniband/<device>/ports/<n>/counters_ext/<64-bit counter>   (old mlx4 kernels)
    <sys_root>/class/infiniband/<device>/ports/<n>/hw_counters/<driver counter>

Semantics (node_exporter's, and the cases in ``../shared/data/cases/sysfs_cases``):

* counters are raw ``int`` (``PortXmitData``/``PortRcvData`` count 4-octet words: bytes =
  4 × raw, never × link width); a 64-bit ``counters_ext/`` value is preferred over a 32-bit
  ``counters/`` one;
* a counter file reading ``N/A (no PMA)`` (iWARP i40iw) is ``None`` (IB-01); an unreadable file
  (``EINVAL``, ``EACCES``...) or unparseable content is ``None`` for that counter only and is
  recorded in :attr:`SysfsReadResult.errors`; nothing else is lost;
* counters at their all-ones maximum are listed in ``saturated`` (IB-14) with their widths in
  ``counter_bits``;
* ``rate`` ``"<N> Gb/sec (<W>X <SPEED>)"`` → N × 125,000,000 bytes/s, ``link_width`` ``<W>X``
  and ``link_speed`` ``<SPEED>``; ``"0 GB/sec"`` of an empty cage → 0, width and speed
  unknown (IB-04); ``state``/``phys_state`` ``"<id>: <NAME>"``;
* ``counters/``, ``counters_ext/`` and ``hw_counters/`` are found with ``stat()``, never by
  device name (IB-06: irdma has only ``hw_counters/``); ``link_layer`` tells RoCE (``Ethernet``)
  from InfiniBand (IB-10);
* no ``class/infiniband`` directory is an empty, successful result (IB-08).
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import NamedTuple

from collectors.ib_counters import (
    COUNTERS,
    COUNTERS_EXT,
    DATA_COUNTERS,
    EXTENDED_WIDTH,
    data_width,
    is_saturated,
    rate_width_speed,
)
from contracts import IbPortSample

log = logging.getLogger(__name__)

RATE_BYTES_PER_GBIT = 125_000_000
"""Bytes per second in one Gb/s: the procfs/node_exporter conversion of the ``rate`` file."""
_NO_PMA = "N/A (no PMA)"


class SysfsError(NamedTuple):
    """A file that could not be used: ``path`` and a snake_case ``reason`` (an errno name such as
    ``einval``/``eacces``, or ``unparseable_counter``/``unparseable_rate``/``unparseable_state``/
    ``unparseable_guid``)."""

    path: str
    reason: str


@dataclass(frozen=True, slots=True)
class IbDevice:
    """Static facts about one HCA; ``None`` where the device has no such file or it is empty
    (irdma has no ``board_id``/``hca_type``, i40iw no ``node_guid``).

    Attributes:
        name: device directory name (``mlx5_0``).
        board_id / hca_type / fw_ver: the files' text, stripped.
        node_guid: ``0x`` + 16 lowercase hex digits.
        ports: port numbers found under ``ports/``.
    """

    name: str
    board_id: str | None
    hca_type: str | None
    fw_ver: str | None
    node_guid: str | None
    ports: tuple[int, ...]


@dataclass(slots=True)
class SysfsReadResult:
    """One read of a sysfs root.

    Attributes:
        ports: one sample per port, devices and ports in name / number order.
        errors: files that could not be used (each lost only its own value).
        devices: device name → :class:`IbDevice`.
        raw_counters: every counter file's value as read, by path relative to
            ``class/infiniband`` (``mlx4_0/ports/1/counters_ext/port_xmit_data_64``), including
            files with no PMA name; ``None`` where unreadable.
    """

    ports: list[IbPortSample] = field(default_factory=list)
    errors: list[SysfsError] = field(default_factory=list)
    devices: dict[str, IbDevice] = field(default_factory=dict)
    raw_counters: dict[str, int | None] = field(default_factory=dict)


def _read_file(path: str) -> bytes:
    """Read a whole sysfs file (one ``read`` per file: sysfs attributes are small)."""
    with open(path, "rb") as f:
        return f.read()


def _reason(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, "oserror").lower()


class _Reader:
    """Reads one sysfs root, collecting errors as it goes."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.errors: list[SysfsError] = []
        self.raw: dict[str, int | None] = {}

    def text(self, path: str) -> str | None:
        """A file's stripped text; ``None`` if absent (silently) or unreadable (recorded)."""
        try:
            return _read_file(path).decode("utf-8", "replace").strip()
        except FileNotFoundError:
            return None
        except OSError as e:
            self.errors.append(SysfsError(path, _reason(e)))
            return None

    def counter(self, path: str) -> int | None:
        """A counter file's value; ``None`` for ``N/A (no PMA)``, unreadable or unparseable
        content (the last two recorded)."""
        text = self.text(path)
        value: int | None = None
        if text is not None and text != _NO_PMA:
            if text.isascii() and text.isdigit():
                value = int(text)
            else:
                self.errors.append(SysfsError(path, "unparseable_counter"))
        self.raw[os.path.relpath(path, self.base)] = value
        return value

    def listdir(self, path: str) -> list[os.DirEntry[str]] | None:
        """Entries of a directory sorted by name; ``None`` if it is absent (or not a directory)."""
        try:
            with os.scandir(path) as it:
                return sorted(it, key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            self.errors.append(SysfsError(path, _reason(e)))
            return None


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()  # follows symlinks: stat(), as the devices are links into /sys/devices
    except OSError:
        return False


def _is_file(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_file()
    except OSError:
        return False


def parse_rate(text: str) -> int:
    """``"<N> Gb/sec (<W>X <SPEED>)"`` → ``N × 125,000,000`` bytes/s (exact for decimals such as
    ``2.5``); the unit is matched without case, so MLNX_OFED's ``"0 GB/sec"`` is 0.

    Raises:
        ValueError: the text does not start with a non-negative number and ``Gb/sec``.
    """
    parts = text.split()
    if len(parts) < 2 or parts[1].lower() != "gb/sec":
        raise ValueError(f"not a rate: {text!r}")
    number = parts[0]
    if not number.replace(".", "", 1).isdigit() or not number.isascii():
        raise ValueError(f"not a rate: {text!r}")
    return int(Fraction(number) * RATE_BYTES_PER_GBIT)


def parse_state(text: str) -> tuple[int, str]:
    """``"4: ACTIVE"`` → ``(4, "ACTIVE")``; the id is authoritative.

    Raises:
        ValueError: no ``<int>:`` prefix.
    """
    head, sep, name = text.partition(":")
    head = head.strip()
    if not sep or not (head.isascii() and head.isdigit()):
        raise ValueError(f"not a port state: {text!r}")
    return int(head), name.strip()


def normalise_guid(text: str) -> str:
    """``"0002:c903:00a1:b2c3"`` (sysfs) or ``"0x0002c90300a1b2c3"`` → ``"0x0002c90300a1b2c3"``.

    Raises:
        ValueError: not 64 bits of hex.
    """
    t = text.strip().lower()
    if t.startswith("0x"):
        digits = t[2:]
    else:
        groups = t.split(":")
        if len(groups) != 4 or not all(1 <= len(g) <= 4 for g in groups):
            raise ValueError(f"not a GUID: {text!r}")
        digits = "".join(g.rjust(4, "0") for g in groups)
    if not 1 <= len(digits) <= 16 or any(c not in "0123456789abcdef" for c in digits):
        raise ValueError(f"not a GUID: {text!r}")
    return "0x" + digits.rjust(16, "0")


def read_sysfs_infiniband(sys_root: Path, host: str, ts: float, *, seq_start: int = 0) -> SysfsReadResult:
    """Read every port under ``<sys_root>/class/infiniband``.

    Args:
        sys_root: the folder that holds ``class/infiniband`` (``/sys``, or a test tree's ``sys``).
        host: host name put on every sample.
        ts: read time, Unix seconds.
        seq_start: ``seq`` of the first port sample; the following ones count up by one.

    Returns:
        The port samples, device facts, raw counter values and the per-file errors. No
        ``class/infiniband`` directory gives an empty result (not an error). Never raises for
        anything found in the tree; blocking file I/O, so async callers run it in a thread.
    """
    base = os.path.join(os.fspath(sys_root), "class", "infiniband")
    reader = _Reader(base)
    result = SysfsReadResult(errors=reader.errors, raw_counters=reader.raw)
    entries = reader.listdir(base)
    if entries is None:
        if not reader.errors:
            log.debug("no_infiniband_class", extra={"path": base})
        return result
    seq = seq_start
    for dev in entries:
        if not _is_dir(dev):
            continue
        device, samples = _read_device(reader, dev.path, dev.name, host, ts, seq)
        seq += len(samples)
        result.devices[dev.name] = device
        result.ports.extend(samples)
    return result


def _read_device(
    reader: _Reader, path: str, name: str, host: str, ts: float, seq: int
) -> tuple[IbDevice, list[IbPortSample]]:
    guid_text = reader.text(os.path.join(path, "node_guid"))
    node_guid: str | None = None
    if guid_text:
        try:
            node_guid = normalise_guid(guid_text)
        except ValueError:
            reader.errors.append(SysfsError(os.path.join(path, "node_guid"), "unparseable_guid"))
    port_entries = reader.listdir(os.path.join(path, "ports")) or []
    ports = sorted(
        (int(e.name), e.path) for e in port_entries if e.name.isascii() and e.name.isdigit() and _is_dir(e)
    )
    samples = [
        _read_port(reader, port_path, name, number, node_guid, host, ts, seq + i)
        for i, (number, port_path) in enumerate(ports)
    ]
    device = IbDevice(
        name=name,
        board_id=reader.text(os.path.join(path, "board_id")) or None,
        hca_type=reader.text(os.path.join(path, "hca_type")) or None,
        fw_ver=reader.text(os.path.join(path, "fw_ver")) or None,
        node_guid=node_guid,
        ports=tuple(number for number, _ in ports),
    )
    return device, samples


def _read_port(
    reader: _Reader, path: str, device: str, port: int, node_guid: str | None, host: str, ts: float, seq: int
) -> IbPortSample:
    state_id, state = _state(reader, os.path.join(path, "state"))
    phys_state_id, phys_state = _state(reader, os.path.join(path, "phys_state"))
    rate: int | None = None
    width = speed = None
    rate_path = os.path.join(path, "rate")
    rate_text = reader.text(rate_path)
    if rate_text is not None:
        try:
            rate = parse_rate(rate_text)
            width, speed = rate_width_speed(rate_text)
        except ValueError:
            reader.errors.append(SysfsError(rate_path, "unparseable_rate"))
    counters, bits = _pma_counters(reader, path)
    hw: dict[str, int | None] = {}
    for entry in reader.listdir(os.path.join(path, "hw_counters")) or []:
        if _is_file(entry):
            hw[entry.name] = reader.counter(entry.path)
    return IbPortSample(
        ts=ts,
        host=host,
        device=device,
        node_guid=node_guid,
        port=port,
        link_layer=reader.text(os.path.join(path, "link_layer")) or None,
        state_id=state_id,
        state=state,
        phys_state_id=phys_state_id,
        phys_state=phys_state,
        rate_bytes_per_second=rate,
        link_width=width,
        link_speed=speed,
        counters=counters,
        counter_bits=bits,
        saturated=[n for n, v in counters.items() if is_saturated(v, bits.get(n))],
        hw_counters=hw,
        source="sysfs",
        seq=seq,
    )


def _state(reader: _Reader, path: str) -> tuple[int | None, str | None]:
    text = reader.text(path)
    if text is None:
        return None, None
    try:
        return parse_state(text)
    except ValueError:
        reader.errors.append(SysfsError(path, "unparseable_state"))
        return None, None


def _pma_counters(reader: _Reader, port_path: str) -> tuple[dict[str, int | None], dict[str, int]]:
    """The port's PMA counters by PMA name and their widths.

    ``counters/`` first; a ``counters_ext/`` value (always 64-bit) replaces a counter that is
    missing, unreadable or narrower (the legacy 32-bit table of old mlx4 kernels). When both are
    64-bit the kernel's ``counters/`` value stays; an unreadable extended value never hides a
    readable one.
    """
    counters: dict[str, int | None] = {}
    bits: dict[str, int] = {}
    files = [e for e in reader.listdir(os.path.join(port_path, "counters")) or [] if _is_file(e)]
    names = frozenset(e.name for e in files)
    for entry in files:
        value = reader.counter(entry.path)
        pma = COUNTERS.get(entry.name)
        if pma is None:
            continue  # a driver extra with no PMA name: kept in raw_counters only
        counters[pma.name] = value
        width = data_width(names, value) if entry.name in DATA_COUNTERS else pma.bits
        if width is not None:
            bits[pma.name] = width
    for entry in reader.listdir(os.path.join(port_path, "counters_ext")) or []:
        if not _is_file(entry):
            continue
        value = reader.counter(entry.path)
        pma = COUNTERS_EXT.get(entry.name)
        if pma is None:
            continue
        have = counters.get(pma.name)
        if pma.name not in counters or (
            value is not None and (have is None or bits.get(pma.name, 0) < EXTENDED_WIDTH)
        ):
            counters[pma.name] = value
            bits[pma.name] = EXTENDED_WIDTH
    return counters, bits
