"""``ibstat`` output → :class:`contracts.IbPortSample` (port state, physical state, rate).

Format: rdma-core ``infiniband-diags/ibstat.c`` (``ca_dump`` / ``port_dump``) and ibstat(8)::

    CA 'mlx5_0'
    	CA type: MT4123
    	Number of ports: 1
    	Firmware version: 20.31.1014
    	Hardware version: 0
    	Node GUID: 0x0c42a10300b0c3d4
    	System image GUID: 0x0c42a10300b0c3d4
    	Port 1:
    		State: Active
    		Physical state: LinkUp
    		Rate: 200
    		Base lid: 12
    		LMC: 0
    		SM lid: 1
    		Capability mask: 0xa651e848
    		Port GUID: 0x0c42a10300b0c3d4
    		Link layer: InfiniBand

``Rate`` is the port's rate in Gb/s (``2.5`` for 1X SDR, ``<n> (FDR10)`` for FDR10): it becomes
``rate_bytes_per_second`` = Gb/s × 125,000,000 (the sysfs convention). ibstat prints no link
width, so ``link_width`` is ``None``; ``link_speed`` is ``FDR10`` when it says so, else ``None``
(a rate alone does not tell 4X EDR from 2X HDR). ``State`` names map to the PortInfo ids
(``Down`` 1, ``Initializing`` 2, ``Armed`` 3, ``Active`` 4), physical states likewise
(``Sleep`` 1, ``Polling`` 2, ``Disabled`` 3, ``PortConfigurationTraining`` 4, ``LinkUp`` 5,
``LinkErrorRecovery`` 6, ``PhyTest`` 7); ``???`` is unknown. ``ibstat CA PORT`` prints ``CA: 'name'``
and that one port without indentation. The node GUID is the CA's ``Node GUID`` (the ``Port
GUID`` when the output has no CA header lines).

ibstat stops at the first device it cannot read (``ibpanic: ... stat of IB device 'x' failed``):
what it printed before is kept, and every line that is not ibstat's is a
:class:`collectors.fabric_parse.LineProblem`; a port block cut off before its ``Link layer``
line is kept with what it has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from collectors.fabric_parse import LineProblem
from collectors.sysfs_ib import RATE_BYTES_PER_GBIT, normalise_guid
from contracts import IbPortSample

__all__ = ["IbstatResult", "PORT_STATES", "PHYS_STATES", "parse_ibstat"]

PORT_STATES: dict[str, int] = {"Down": 1, "Initializing": 2, "Armed": 3, "Active": 4}
"""ibstat's ``port_state_str`` → PortInfo:PortState."""
PHYS_STATES: dict[str, int] = {
    "No state change": 0,
    "Sleep": 1,
    "Polling": 2,
    "Disabled": 3,
    "PortConfigurationTraining": 4,
    "LinkUp": 5,
    "LinkErrorRecovery": 6,
    "PhyTest": 7,
}
"""ibstat's ``port_phy_state_str`` → PortInfo:PortPhysicalState."""

_CA_KEYS = frozenset(
    {"CA type", "Switch type", "Router type", "Number of ports", "Firmware version", "Hardware version",
     "Node GUID", "System image GUID"}
)  # fmt: skip
_PORT_KEYS = frozenset(
    {"State", "Physical state", "Rate", "Base lid", "LMC", "SM lid", "Capability mask", "Port GUID", "Link layer"}
)
_NODE_TYPES = ("CA", "Switch", "Router", "iWARP RNIC", "???")


@dataclass(slots=True)
class _Port:
    device: str
    node_guid: str | None
    number: int
    values: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class IbstatResult:
    """What one ibstat output yielded.

    Attributes:
        ports: one sample per port, in output order, ``seq`` counted from ``seq_start``.
        problems: lines that are not ibstat's (an ``ibpanic`` message, garbage) or whose value
            does not parse; the rest is kept.
        error: ``empty_output`` when there was nothing, else ``None``.
    """

    ports: list[IbPortSample] = field(default_factory=list)
    problems: list[LineProblem] = field(default_factory=list)
    error: str | None = None


def _device_header(line: str) -> str | None:
    """``CA 'mlx5_0'`` or ``CA: 'mlx5_0'`` → ``mlx5_0``; ``None`` if not a device header."""
    for kind in _NODE_TYPES:
        if line.startswith(kind):
            rest = line[len(kind) :].lstrip(":").strip()
            if len(rest) >= 2 and rest[0] == rest[-1] == "'":
                return rest[1:-1]
    return None


def _rate(text: str) -> tuple[int | None, str | None]:
    """``"200"``, ``"2.5"``, ``"40 (FDR10)"`` → (bytes/s, speed or ``None``)."""
    number, _, note = text.partition(" ")
    if not number.replace(".", "", 1).isdigit() or not number.isascii():
        return None, None
    speed = "FDR10" if note.strip() == "(FDR10)" else None
    return int(Fraction(number) * RATE_BYTES_PER_GBIT), speed


def parse_ibstat(text: str, *, host: str, ts: float, seq_start: int = 0) -> IbstatResult:
    """Parse ``ibstat`` / ``ibstat CA [PORT]`` output (module docstring); never raises.

    Args:
        text: the command's stdout (its stderr may follow: its lines become problems).
        host: host name of every sample.
        ts: read time, Unix seconds.
        seq_start: ``seq`` of the first sample.
    """
    result = IbstatResult()
    if not text.strip():
        result.error = "empty_output"
        return result
    ports: list[_Port] = []
    device: str | None = None
    node_guid: str | None = None
    port: _Port | None = None
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            continue
        name = _device_header(line)
        if name is not None:
            device, node_guid, port = name, None, None
            continue
        key, sep, value = line.partition(":")
        value = value.strip()
        if device is not None and key.startswith("Port ") and sep and not value:
            number = key[5:]
            if number.isascii() and number.isdigit():
                port = _Port(device, node_guid, int(number))
                ports.append(port)
                continue
        if device is not None and sep and key in _CA_KEYS and port is None:
            if key == "Node GUID":
                try:
                    node_guid = normalise_guid(value)
                except ValueError:
                    result.problems.append(LineProblem(lineno, raw, "bad_guid"))
            continue
        if port is not None and sep and key in _PORT_KEYS:
            if key in port.values:
                result.problems.append(LineProblem(lineno, raw, "duplicate_key"))
            else:
                port.values[key] = value
            continue
        result.problems.append(LineProblem(lineno, raw, "unrecognised_line"))
    for i, p in enumerate(ports):
        sample = _sample(p, host, ts, seq_start + i, result.problems)
        result.ports.append(sample)
    return result


def _sample(p: _Port, host: str, ts: float, seq: int, problems: list[LineProblem]) -> IbPortSample:
    v = p.values
    state = v.get("State")
    phys = v.get("Physical state")
    rate, speed = _rate(v["Rate"]) if "Rate" in v else (None, None)
    if "Rate" in v and rate is None:
        problems.append(LineProblem(0, f"Rate: {v['Rate']}", "bad_value"))
    guid = p.node_guid
    if guid is None and "Port GUID" in v:
        try:
            guid = normalise_guid(v["Port GUID"])
        except ValueError:
            problems.append(LineProblem(0, f"Port GUID: {v['Port GUID']}", "bad_guid"))
    return IbPortSample(
        ts=ts,
        host=host,
        device=p.device,
        node_guid=guid,
        port=p.number,
        link_layer=v.get("Link layer") or None,
        state_id=PORT_STATES.get(state) if state else None,
        state=state.upper() if state and state in PORT_STATES else None,
        phys_state_id=PHYS_STATES.get(phys) if phys else None,
        phys_state=phys if phys in PHYS_STATES else None,
        rate_bytes_per_second=rate,
        link_speed=speed,
        source="ibstat",
        seq=seq,
    )
