"""UFM Telemetry's Prometheus endpoint → :class:`contracts.IbPortSample` per switch / HCA port.

Format: NVIDIA UFM Telemetry documentation, "Prometheus Endpoint Support" (v1.8 and later: one
sample line per counter and port, with the sample time in ms)::

    PortXmitDataExtended{source="0x0002c90300f172a0", node_guid="2c90300f172a0",
        port_guid="2c90300f172a2", port_num="2"} 85554128244 1628683905941

(the Prometheus text exposition format, read with :mod:`collectors.exposition`). A port is
``(node_guid, port_num)``; the GUID comes without ``0x`` and leading zeros and is normalised to
``0x`` + 16 hex digits (``source`` is used when ``node_guid`` is absent). UFM's counter names are
the IBTA PMA names with ``Extended`` appended (UFM-SDN "High-Frequency (Primary) Telemetry Fields",
UFM Cyber-AI "Supported Counters"): they are mapped to the same PMA names perfquery's and sysfs'
samples carry (:data:`PMA_NAMES`: ``PortXmitDataExtended`` → ``PortXmitData``,
``PortUniCastXmitPktsExtended`` → ``PortUnicastXmitPkts``, ``QP1DroppedExtended`` →
``QP1Dropped`` ...), all 64-bit (``counter_bits`` 64). The values are the PMA's own, as UFM reads
them with ibdiagnet: ``PortXmitData``/``PortRcvData`` in 4-octet words, like perfquery's.
Counters without a PMA name (``PortFECCorrectableBlockCounter``, ``PortInactiveDiscards``...)
go to ``hw_counters``; other metrics (BER, temperatures, grades) are ignored and counted per line
as ``unknown_metric``.

The host of a port (its Kafka key) is the first word of a ``node_description`` label when UFM's
labels metadata file adds one (rdma-ndd's ``%h %d``, as for perfquery), else the node GUID; the
device is the rest of the description, else the node GUID. A value that is not a non-negative
integer below 2**64 is rejected (``bad_value``/``out_of_range``); a duplicate counter of one
port keeps the first (``duplicate_series``). No width or speed: the primary telemetry has none.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from collectors.dcgm import Rejection
from collectors.exposition import ExpositionError, parse_labels, parse_timestamp_ms
from collectors.sysfs_ib import normalise_guid
from contracts import IbPortSample

__all__ = ["PMA_NAMES", "UfmParseResult", "parse_ufm_telemetry"]

_MAX64 = (1 << 64) - 1
_MAX_DETAIL = 160

PMA_NAMES: dict[str, str] = {
    "PortXmitDataExtended": "PortXmitData",
    "PortRcvDataExtended": "PortRcvData",
    "PortXmitPktsExtended": "PortXmitPkts",
    "PortRcvPktsExtended": "PortRcvPkts",
    "PortUniCastXmitPktsExtended": "PortUnicastXmitPkts",
    "PortUniCastRcvPktsExtended": "PortUnicastRcvPkts",
    "PortMultiCastXmitPktsExtended": "PortMulticastXmitPkts",
    "PortMultiCastRcvPktsExtended": "PortMulticastRcvPkts",
    "PortXmitWaitExtended": "PortXmitWait",
    "SymbolErrorCounterExtended": "SymbolErrorCounter",
    "LinkErrorRecoveryCounterExtended": "LinkErrorRecoveryCounter",
    "LinkDownedCounterExtended": "LinkDownedCounter",
    "PortRcvErrorsExtended": "PortRcvErrors",
    "PortRcvRemotePhysicalErrorsExtended": "PortRcvRemotePhysicalErrors",
    "PortRcvSwitchRelayErrorsExtended": "PortRcvSwitchRelayErrors",
    "PortXmitDiscardsExtended": "PortXmitDiscards",
    "PortXmitConstraintErrorsExtended": "PortXmitConstraintErrors",
    "PortRcvConstraintErrorsExtended": "PortRcvConstraintErrors",
    "LocalLinkIntegrityErrorsExtended": "LocalLinkIntegrityErrors",
    "ExcessiveBufferOverrunErrorsExtended": "ExcessiveBufferOverrunErrors",
    "VL15DroppedExtended": "VL15Dropped",
    "QP1DroppedExtended": "QP1Dropped",
}
"""UFM Telemetry counter → IBTA PMA counter name (PortCountersExtended, extended speeds)."""

HW_COUNTERS = frozenset(
    {
        "PortFECCorrectableBlockCounter",
        "PortFECCorrectedSymbolCounter",
        "PortFECUncorrectableBlockCounter",
        "PortInactiveDiscards",
        "PortLocalPhysicalErrors",
        "PortLoopingErrors",
        "PortMalformedPacketErrors",
        "PortNeighborMTUDiscards",
        "PortSwHOQLifetimeLimitDiscards",
        "PortSwLifetimeLimitDiscards",
        "PortVLMappingErrors",
        "PortDLIDMappingErrors",
        "PortBufferOverrunErrors",
        "SyncHeaderErrorCounter",
        "UnknownBlockCounter",
    }
)
"""UFM counters with no PMA PortCounters name: kept in ``hw_counters`` under UFM's name."""


@dataclass(slots=True)
class UfmParseResult:
    """What one UFM Telemetry body yielded.

    Attributes:
        ports: one sample per ``(node GUID, port)``, in order of first appearance.
        rejected: every line or value not used, with its reason.
        sample_lines: sample lines read.
    """

    ports: list[IbPortSample] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    sample_lines: int = 0

    def rejected_by_reason(self) -> Counter[str]:
        """Count of :attr:`rejected` by reason."""
        return Counter(r.reason for r in self.rejected)


@dataclass(slots=True)
class _Port:
    host: str
    device: str
    guid: str
    port: int
    ts_ms: int | None = None
    counters: dict[str, int | None] = field(default_factory=dict)
    hw: dict[str, int | None] = field(default_factory=dict)


def _guid(labels: dict[str, str]) -> str | None:
    for key in ("node_guid", "source"):
        text = labels.get(key, "")
        if text:
            digits = text[2:] if text[:2] in ("0x", "0X") else text
            try:
                return normalise_guid("0x" + digits)
            except ValueError:
                return None
    return None


def parse_ufm_telemetry(body: str, *, ts: float, seq_start: int = 0) -> UfmParseResult:
    """Parse one UFM Telemetry Prometheus body (module docstring); never raises on bad input.

    Args:
        body: the response text.
        ts: scrape time, Unix seconds: a port's ``ts`` is its newest line timestamp, else this.
        seq_start: ``seq`` of the first sample.
    """
    result = UfmParseResult()
    ports: dict[tuple[str, int], _Port] = {}
    for lineno, raw in enumerate(body.split("\n"), 1):
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        result.sample_lines += 1
        brace = line.find("{")
        close = line.rfind("}")
        if brace <= 0 or close < brace:
            result.rejected.append(Rejection("malformed_line", "", f"line {lineno}: {line[:_MAX_DETAIL]}"))
            continue
        name = line[:brace].strip()
        pma = PMA_NAMES.get(name)
        if pma is None and name not in HW_COUNTERS:
            result.rejected.append(Rejection("unknown_metric", name[:_MAX_DETAIL], f"line {lineno}"))
            continue
        tokens = line[close + 1 :].split()
        try:
            labels = parse_labels(line[brace + 1 : close])
            if not 1 <= len(tokens) <= 2:
                raise ExpositionError("malformed_line", line[:_MAX_DETAIL])
            ts_ms = parse_timestamp_ms(tokens[1]) if len(tokens) == 2 else None
        except ExpositionError as e:
            result.rejected.append(Rejection(e.reason, name, f"line {lineno}: {str(e)[:_MAX_DETAIL]}"))
            continue
        guid = _guid(labels)
        port_text = labels.get("port_num", "")
        if guid is None or not (port_text.isascii() and port_text.isdigit()):
            result.rejected.append(Rejection("missing_port", name, f"line {lineno}"))
            continue
        vtext = tokens[0]
        if not (vtext.isascii() and vtext.isdigit()):
            result.rejected.append(Rejection("bad_value", name, f"line {lineno}: {vtext[:40]}"))
            continue
        value = int(vtext)
        if value > _MAX64:
            result.rejected.append(Rejection("out_of_range", name, f"line {lineno}: {vtext[:40]}"))
            continue
        key = (guid, int(port_text))
        p = ports.get(key)
        if p is None:
            desc = labels.get("node_description", "")
            host, _, device = desc.partition(" ")
            p = ports[key] = _Port(host or guid, device.strip() or desc or guid, guid, key[1])
        if ts_ms is not None and (p.ts_ms is None or ts_ms > p.ts_ms):
            p.ts_ms = ts_ms
        target = p.counters if pma is not None else p.hw
        cname = pma or name
        if cname in target:
            result.rejected.append(Rejection("duplicate_series", name, f"line {lineno}: {guid}/{key[1]}"))
            continue
        target[cname] = value
    for i, p in enumerate(ports.values()):
        result.ports.append(
            IbPortSample(
                ts=p.ts_ms / 1000.0 if p.ts_ms is not None else ts,
                host=p.host,
                device=p.device,
                node_guid=p.guid,
                port=p.port,
                link_layer="InfiniBand",
                counters=p.counters,
                counter_bits={n: 64 for n in p.counters},
                saturated=[n for n, v in p.counters.items() if v == _MAX64],
                hw_counters=p.hw,
                source="ufm-telemetry",
                seq=seq_start + i,
            )
        )
    return result
