"""The QoS plan for lent traffic as OpenSM configuration, and reading the QoS tables back.

Pure logic (text in, text out); :mod:`broker.fabric_opensm` does the files, signals and commands.

The plan (per port class: CA ports, switch port 0, switch external ports):

* **SL2VL**: the inference SL maps to the lent VL; every other SL keeps the VL the operator's
  configuration gives it, except an SL the operator mapped to the lent VL, which moves to VL 0
  (the rule that gives the lent VL to lent traffic alone; the dry-run diff shows it).
* **VL arbitration**: every VL some other SL maps to (the training VLs) sits in the
  high-priority table with the operator's weight for it (its high-table weight, else its
  low-table weight, else :data:`TRAINING_WEIGHT`); the low-priority table holds the lent VL alone
  with weight :data:`LENT_WEIGHT` (64 × 64 bytes: one 4 KB packet per turn).
* **High limit**: ``qos_high_limit`` = ``ceil(100 / share - 1)`` (1..254) for the lent-share bound
  ``share`` (percent). The high-priority table may send ``high_limit`` × 4096 bytes before the
  low-priority table gets a turn (InfiniBand Architecture Specification vol. 1, "VL Arbitration",
  LimitOfHighPriority), so while training keeps its VLs busy, lent traffic gets at most one 4 KB
  packet per ``high_limit`` × 4 KB of training: a share of ``100 / (high_limit + 1)`` percent
  (:func:`effective_share_percent`, ≤ the setting). Idle training bandwidth is not reserved: the
  arbiter is work-conserving, lent traffic uses what training leaves.

Format: ``opensm.conf`` (``man opensm``, "QoS"; ``doc/QoS_management_in_OpenSM.txt`` section 7 of
linux-rdma/opensm): ``qos_<class>_<option> <value>`` lines, class ``ca_``, ``sw0_``, ``swe_`` (or
none: every class), options ``high_limit``, ``vlarb_high`` / ``vlarb_low`` (``VL:weight,...``,
weights in 64-byte units, table entries in order) and ``sl2vl`` (16 VLs, SL 0 first). OpenSM reads
the file top to bottom and a later line of an option replaces an earlier one, so the managed block
goes last and sets every class explicitly (a class line beats the generic one)::

    # BEGIN gpupool-managed qos: written by the gpupool broker, do not edit
    qos_high_limit 9
    qos_vlarb_high 0:4,2:4,3:4,4:4,5:4,6:4,7:4
    qos_vlarb_low 1:64
    qos_sl2vl 0,1,2,3,4,5,6,7,0,0,2,3,4,5,6,7
    qos_ca_high_limit 9
    ...
    # END gpupool-managed qos

Ownership as for the partitions (:mod:`broker.fabric_plan`): everything outside the markers is the
operator's, kept byte for byte and read as the base of the plan; a managed block that was edited
by hand raises :class:`broker.fabric_plan.PlanError`, and nothing is written then. ``qos FALSE``
in the operator's lines makes OpenSM program no QoS table at all: planning refuses then.

Reading back: the tables are read with SMPs (:mod:`broker.fabric_smp`) and compared here
(:func:`sl2vl_problem`, :func:`vlarb_problem`; entries of weight 0 are unused). What OpenSM sets
as the ports' VLHighLimit (``PortInfo``) is not read back: ibsim does not keep it (it reads 0
whatever OpenSM configures).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from broker.fabric_plan import PlanError

QOS_BEGIN = "# BEGIN gpupool-managed qos: written by the gpupool broker, do not edit"
QOS_END = "# END gpupool-managed qos"
PORT_CLASSES = ("ca", "sw0", "swe")
"""OpenSM's port classes gpupool plans for: CA ports, switch port 0, switch external ports."""
OPTIONS = ("high_limit", "vlarb_high", "vlarb_low", "sl2vl")
"""The ``qos_*`` options of a class the plan sets (``max_vls`` stays the operator's)."""
LENT_WEIGHT = 64
"""Weight of the lent VL in the low-priority table, 64-byte units (64 = one 4 KB packet)."""
TRAINING_WEIGHT = 64
"""Weight of a training VL the operator gave no weight to, 64-byte units."""
MAX_HIGH_LIMIT = 254
"""Highest finite ``qos_high_limit`` (255 = unlimited: lent traffic could starve)."""
MIN_SHARE_PERCENT = 100 / (MAX_HIGH_LIMIT + 1)
"""Smallest lent-share bound a plan can give, percent (≈ 0.39)."""
MAX_SHARE_PERCENT = 50.0
"""Largest lent-share bound, percent (``high_limit`` 1: one lent packet per training packet)."""

# OpenSM 3.3 defaults as read back from an 8-VL port when opensm.conf sets nothing
_DEFAULTS = {
    "high_limit": "0",
    "vlarb_high": "0:4,1:0,2:0,3:0,4:0,5:0,6:0,7:0",
    "vlarb_low": "0:0,1:4,2:4,3:4,4:4,5:4,6:4,7:4",
    "sl2vl": "0,1,2,3,4,5,6,7,0,1,2,3,4,5,6,7",
}
_OPTION_LINE = re.compile(
    r"^\s*(qos(?:_(?:ca|sw0|swe|rtr))?_(?:max_vls|high_limit|vlarb_high|vlarb_low|sl2vl)|qos)\s+(\S+)\s*$"
)
_MANAGED_LINE = re.compile(
    r"^qos_(?:(ca|sw0|swe)_)?(high_limit|vlarb_high|vlarb_low|sl2vl) (\S+)$"
)

VlArb = tuple[tuple[int, int], ...]
"""A VL arbitration table: ``(vl, weight)`` entries in order, unused (weight 0) entries left out."""


def effective_share_percent(share_percent: float) -> float:
    """The lent-share bound a plan gives for the setting ``share_percent``: ``100 / (high_limit +
    1)`` with :func:`high_limit_for` (≤ the setting). Raises :class:`PlanError` outside
    :data:`MIN_SHARE_PERCENT`..:data:`MAX_SHARE_PERCENT`."""
    return 100.0 / (high_limit_for(share_percent) + 1)


def high_limit_for(share_percent: float) -> int:
    """``qos_high_limit`` that bounds lent traffic to ``share_percent`` of a contended link:
    ``ceil(100 / share - 1)`` (module docstring). Raises :class:`PlanError` for a share outside
    :data:`MIN_SHARE_PERCENT`..:data:`MAX_SHARE_PERCENT`."""
    if not MIN_SHARE_PERCENT - 1e-9 <= share_percent <= MAX_SHARE_PERCENT:
        raise PlanError(
            f"lent share {share_percent:g}% outside {MIN_SHARE_PERCENT:.2f}..{MAX_SHARE_PERCENT:g}%"
        )
    return max(1, min(MAX_HIGH_LIMIT, math.ceil(100.0 / share_percent - 1 - 1e-9)))


@dataclass(frozen=True)
class ClassPlan:
    """The planned tables of one port class.

    Attributes:
        sl2vl: VL of each SL 0..15.
        high / low: the high- and low-priority VL arbitration tables (:data:`VlArb`).
        high_limit: ``qos_high_limit`` (4096-byte units of high-priority traffic per low turn).
        moved: SLs moved off the lent VL to VL 0 by the plan's rule.
    """

    sl2vl: tuple[int, ...]
    high: VlArb
    low: VlArb
    high_limit: int
    moved: tuple[int, ...] = ()

    def lines(self, cls: str) -> list[str]:
        """The ``opensm.conf`` lines of this plan for class ``cls`` (``""``: the generic options)."""
        p = f"qos_{cls}_" if cls else "qos_"
        return [
            f"{p}high_limit {self.high_limit}",
            f"{p}vlarb_high {_render_vlarb(self.high)}",
            f"{p}vlarb_low {_render_vlarb(self.low)}",
            f"{p}sl2vl {','.join(str(v) for v in self.sl2vl)}",
        ]


@dataclass(frozen=True)
class QosPlan:
    """The fabric-wide QoS plan for lent traffic.

    Attributes:
        sl: the inference (lent) service level.
        vl: the lent VL.
        share_percent: the lent-share bound this plan gives, percent of a contended link.
        classes: port class (:data:`PORT_CLASSES`) → its tables.
    """

    sl: int
    vl: int
    share_percent: float
    classes: Mapping[str, ClassPlan]

    def block(self) -> str:
        """The managed block of ``opensm.conf``, markers included, ending in a newline. The
        generic options carry the CA plan (routers, the one class not planned, use them)."""
        lines = [QOS_BEGIN, *self.classes["ca"].lines("")]
        for cls in PORT_CLASSES:
            lines += self.classes[cls].lines(cls)
        return "\n".join([*lines, QOS_END]) + "\n"


def operator_options(text: str) -> dict[str, str]:
    """The QoS options the operator's lines of ``opensm.conf`` set (outside the managed block):
    option name → value of its last line. Unset values (``(null)``, ``high_limit -1``,
    ``max_vls 0``) are left out. Raises :class:`PlanError` for bad markers."""
    head, _, tail, _ = _split(text)
    out: dict[str, str] = {}
    for line in (head + tail).splitlines():
        m = _OPTION_LINE.match(line.split("#", 1)[0])
        if not m:
            continue
        name, value = m.group(1), m.group(2)
        unset = value == "(null)" or (name.endswith("high_limit") and value == "-1")
        unset = unset or (name.endswith("max_vls") and value == "0")
        if unset:
            out.pop(name, None)
        else:
            out[name] = value
    return out


def plan_qos(text: str, *, sl: int, vl: int, share_percent: float) -> QosPlan:
    """The plan for ``opensm.conf`` text ``text`` (its operator lines are the base; rules in the
    module docstring), inference SL ``sl`` and lent VL ``vl``.

    Raises :class:`PlanError` for ``sl`` outside 0..15, ``vl`` outside 1..14, a share outside
    the bounds of :func:`high_limit_for`, ``qos FALSE``, a malformed operator value, or bad markers.
    """
    if not 0 <= sl <= 15:
        raise PlanError(f"inference sl {sl} outside 0..15")
    if not 1 <= vl <= 14:
        raise PlanError(f"lent vl {vl} outside 1..14 (VL 0 is training's default, VL 15 management)")
    ops = operator_options(text)
    if ops.get("qos", "FALSE").upper() != "TRUE":
        raise PlanError("opensm.conf does not say 'qos TRUE': OpenSM programs no QoS table")
    limit = high_limit_for(share_percent)
    classes: dict[str, ClassPlan] = {}
    for cls in PORT_CLASSES:

        def value(option: str, cls: str = cls) -> str:
            return ops.get(f"qos_{cls}_{option}") or ops.get(f"qos_{option}") or _DEFAULTS[option]

        try:
            sl2vl = [int(v) for v in value("sl2vl").split(",")]
            high, low = parse_vlarb_option(value("vlarb_high")), parse_vlarb_option(value("vlarb_low"))
        except ValueError as e:
            raise PlanError(f"opensm.conf: qos_{cls} option does not parse: {e}") from e
        if len(sl2vl) != 16 or not all(0 <= v <= 15 for v in sl2vl):
            raise PlanError(f"opensm.conf: qos sl2vl of class {cls} must be 16 VLs 0..15")
        moved = tuple(s for s in range(16) if s != sl and sl2vl[s] == vl)
        for s in moved:
            sl2vl[s] = 0
        sl2vl[sl] = vl
        weights_high = {v: w for v, w in high if w}
        weights_low = {v: w for v, w in low if w}
        training = sorted({sl2vl[s] for s in range(16) if s != sl} - {vl, 15})
        high_plan = tuple(
            (v, weights_high.get(v) or weights_low.get(v) or TRAINING_WEIGHT) for v in training
        )
        classes[cls] = ClassPlan(tuple(sl2vl), high_plan, ((vl, LENT_WEIGHT),), limit, moved)
    return QosPlan(sl, vl, 100.0 / (limit + 1), classes)


def parse_vlarb_option(value: str) -> VlArb:
    """``0:4,2:64`` → ``((0, 4), (2, 64))`` without weight-0 entries. Raises ``ValueError``."""
    out: list[tuple[int, int]] = []
    for item in value.split(","):
        v, sep, w = item.partition(":")
        if not sep:
            raise ValueError(f"vlarb entry {item!r} is not VL:weight")
        vl, weight = int(v, 0), int(w, 0)
        if not (0 <= vl <= 15 and 0 <= weight <= 255):
            raise ValueError(f"vlarb entry {item!r} out of range")
        if weight:
            out.append((vl, weight))
    return tuple(out)


def _render_vlarb(table: VlArb) -> str:
    return ",".join(f"{v}:{w}" for v, w in table)


def _split(text: str) -> tuple[str, list[str], str, bool]:
    lines = text.splitlines(keepends=True)
    starts = [i for i, ln in enumerate(lines) if ln.rstrip("\r\n") == QOS_BEGIN]
    ends = [i for i, ln in enumerate(lines) if ln.rstrip("\r\n") == QOS_END]
    if not starts and not ends:
        return text, [], "", False
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise PlanError(
            f"opensm.conf: expected one {QOS_BEGIN!r} line before one {QOS_END!r} line, "
            f"found {len(starts)} and {len(ends)}"
        )
    s, e = starts[0], ends[0]
    body = [ln.rstrip("\r\n") for ln in lines[s + 1 : e]]
    return "".join(lines[:s]), body, "".join(lines[e + 1 :]), True


def render_opensm_conf(text: str, qos: QosPlan) -> str:
    """``opensm.conf`` with its managed block replaced by ``qos.block()`` (appended at the end when
    there was none). The operator's lines are kept byte for byte; an operator line *after* the
    block would override it, so a block is always re-appended at the very end.

    Raises :class:`PlanError` for bad markers or a managed line gpupool did not write.
    """
    head, body, tail, _ = _split(text)
    for n, line in enumerate(body, 1):
        if not _MANAGED_LINE.match(line):
            raise PlanError(f"opensm.conf: managed qos line {n} was not written by gpupool: {line!r}")
    rest = head + tail
    if rest and not rest.endswith("\n"):
        rest += "\n"
    return rest + qos.block()


def managed_block(text: str) -> str | None:
    """The managed block of ``opensm.conf`` text as :meth:`QosPlan.block` renders it, or ``None``
    when there is none. Raises :class:`PlanError` for bad markers."""
    _, body, _, found = _split(text)
    return "\n".join([QOS_BEGIN, *body, QOS_END]) + "\n" if found else None


# reading the fabric back -------------------------------------------------------------------------------
def sl2vl_problem(plan: ClassPlan, rows: Mapping[tuple[int, int], Sequence[int]]) -> str:
    """``""`` if every row shows ``plan.sl2vl``; else which row differs and how."""
    for (inp, out), vls in sorted(rows.items()):
        if tuple(vls) != plan.sl2vl:
            diff = [f"SL{s}→VL{v} (want VL{plan.sl2vl[s]})" for s, v in enumerate(vls) if v != plan.sl2vl[s]]
            return f"sl2vl in {inp} out {out}: {', '.join(diff)}"
    return ""


def vlarb_problem(plan: ClassPlan, low: VlArb, high: VlArb) -> str:
    """``""`` if the tables read back are the plan's; else what differs."""
    problems = []
    if low != plan.low:
        problems.append(f"low {_render_vlarb(low) or '-'} (want {_render_vlarb(plan.low)})")
    if high != plan.high:
        problems.append(f"high {_render_vlarb(high) or '-'} (want {_render_vlarb(plan.high)})")
    return "vlarb " + "; ".join(problems) if problems else ""
