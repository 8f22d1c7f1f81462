"""Per-lease InfiniBand partitions as OpenSM configuration: PKey allocation, the gpupool-managed
sections of ``partitions.conf`` and ``qos-policy.conf``, and reading PKey tables back.

Pure logic (text in, text out); :mod:`broker.fabric_opensm` does the files, signals and commands.

Formats:

* ``partitions.conf`` — OpenSM partition configuration (``man opensm``, "PARTITION
  CONFIGURATION"; ``doc/partition-config.txt`` of linux-rdma/opensm). One statement per lease::

      lease-1f2e=0x0002, ipoib, sl=1, defmember=limited : 0x0002c90300b00001=limited, \
          0x0002c90300b00101=full ;     (one line in the file)

  More than :data:`MEMBERS_PER_LINE` members continue on indented lines (each but the last ending
  in a comma): OpenSM reads lines into a 4096-byte buffer (``osm_prtn_config_parse_file``) and
  carries a statement over lines until its ``;``. (Repeating the statement with the same PKey
  instead would reset the partition's SL: ``partition_create`` sets it again from the repeat.)
  The leased hosts' port GUIDs are limited members (they reach the gateway, never each other),
  the edge gateway's port is a full member. ``sl=`` sets the partition's service level, which the
  SA puts in PathRecords for this PKey *unless a QoS level sets one* (``osm_sa_path_record.c``:
  an SL asked for in the query > LASH > the matched QoS level's SL > the partition's SL); with
  ``qos FALSE`` in ``opensm.conf`` OpenSM drops a partition's ``sl=`` (``partition_create``).
* ``qos-policy.conf`` — OpenSM QoS policy (``doc/QoS_management_in_OpenSM.txt``, section 6,
  "Simplified QoS Policy"). A policy whose ``qos-ulps`` has ``default : 0`` gives *every*
  PathRecord query without a better match SL 0, overriding the partition's ``sl=`` (seen on the
  simulated fabric). So each lease also gets a rule at the top of ``qos-ulps``::

      any, pkey 0x0002 : 1

  which OpenSM honours for PathRecord/MultiPathRecord queries that name the PKey (what an
  application on the lease's partition — RDMA CM, an IPoIB child interface — sends). Rules in
  ``qos-match-rules`` of a full policy are matched before ``qos-ulps``; an operator rule there
  that matches lease traffic wins (documented, not detected). The SL is mapped to a VL by the
  operator's ``qos_sl2vl`` in ``opensm.conf``; this module does not touch that.

Ownership: everything outside the marker lines belongs to the operator and is kept byte for byte.
The managed sections look like::

    # BEGIN gpupool-managed partitions: written by the gpupool broker, do not edit
    # gpupool-state next=0x0004 reuse=0x0002
    lease-1f2e=0x0002, ipoib, sl=1, defmember=limited : 0x...=limited, 0x...=full ;
    # END gpupool-managed partitions

The state line keeps the allocator's high-water mark and its reuse cursor (a fixed length: a
comment line longer than OpenSM's 4096-byte line buffer would be cut and its rest parsed as a
statement), so allocation is deterministic across broker restarts. A managed section that does not
parse (edited by hand, markers missing or doubled) raises :class:`PlanError`: nothing is written
then.

PKey tables: ``smpquery pkeys <lid> [port]`` (infiniband-diags) prints rows of 8 entries::

       0: 0xffff 0x0002 0x0000 0x0000 0x0000 0x0000 0x0000 0x0000
       8: 0x0000 ...
    64 pkeys capacity for this port

Bit 15 (0x8000) of an entry is the membership type: set = full, clear = limited
(InfiniBand Architecture Specification vol. 1, "Partitioning"). ``saquery PR`` prints a
"PathRecord dump" of ``field....value`` lines (:func:`parse_path_record`).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

PKEY_MIN = 0x0002
"""Lowest PKey handed to a lease."""
PKEY_MAX = 0x7FFE
"""Highest PKey handed to a lease (0x7fff is the default partition)."""
DEFAULT_PKEY = 0x7FFF
"""The default partition's PKey: never handed out."""
MEMBERS_PER_LINE = 8
"""Port GUIDs per line of a rendered partition statement."""
FULL_BIT = 0x8000
"""PKey table entry bit 15: full membership."""

PARTITIONS_BEGIN = "# BEGIN gpupool-managed partitions: written by the gpupool broker, do not edit"
PARTITIONS_END = "# END gpupool-managed partitions"
QOS_BEGIN = "# BEGIN gpupool-managed qos-ulps: written by the gpupool broker, do not edit"
QOS_END = "# END gpupool-managed qos-ulps"
_STATE_PREFIX = "# gpupool-state "

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_GUID = re.compile(r"^0x[0-9a-f]{16}$")
_STATE = re.compile(r"^# gpupool-state next=0x([0-9a-f]{4}) reuse=0x([0-9a-f]{4})$")
_ENTRY = re.compile(
    r"^(?P<name>[A-Za-z0-9_.-]{1,64})=0x(?P<pkey>[0-9a-f]{4}), ipoib, sl=(?P<sl>\d{1,2}), "
    r"defmember=limited : (?P<members>[^;]*) ;$"
)
_MEMBER = re.compile(r"^(0x[0-9a-f]{16})=(full|limited)$")
_QOS_RULE = re.compile(r"^\s*any, pkey 0x(?P<pkey>[0-9a-f]{4}) : (?P<sl>\d{1,2})\s+# (?P<name>\S+)$")
_PKEY_ROW = re.compile(r"^\s*(\d+):((?:\s+0x[0-9a-fA-F]{1,4})+)\s*$")
_PR_FIELD = re.compile(r"^\s*(\w+)\.{2,}(\S+)\s*$")


class PlanError(ValueError):
    """A configuration file cannot be planned against (bad markers, a hand-edited managed line,
    no PKey left, a bad name or GUID); the message says which line or value."""


class Membership(StrEnum):
    """How a port is in a partition, from bit 15 of its PKey table entries."""

    FULL = "full"
    LIMITED = "limited"
    BOTH = "both"
    """Two entries, one of each (OpenSM ``allow_both_pkeys``)."""


@dataclass(frozen=True)
class LeasePartition:
    """One lease's partition as written in the managed section.

    Attributes:
        name: the partition name in OpenSM's file: the lease id (``[A-Za-z0-9_.-]``, 1..64 chars).
        pkey: 15-bit PKey, :data:`PKEY_MIN`..:data:`PKEY_MAX`.
        sl: service level 0..15 of the lease's traffic.
        limited: port GUIDs of the leased hosts (``0x`` + 16 lowercase hex digits).
        full: port GUIDs of the edge gateway(s).

    Raises :class:`PlanError` for a value outside these ranges, a port both limited and full, or
    no full member.
    """

    name: str
    pkey: int
    sl: int
    limited: tuple[str, ...]
    full: tuple[str, ...]

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise PlanError(f"partition name {self.name!r} must match {_NAME.pattern}")
        if not PKEY_MIN <= self.pkey <= PKEY_MAX:
            raise PlanError(f"pkey 0x{self.pkey:04x} outside 0x{PKEY_MIN:04x}..0x{PKEY_MAX:04x}")
        if not 0 <= self.sl <= 15:
            raise PlanError(f"sl {self.sl} outside 0..15")
        for g in (*self.limited, *self.full):
            if not _GUID.match(g):
                raise PlanError(f"port GUID {g!r} must be 0x + 16 lowercase hex digits")
        both = set(self.limited) & set(self.full)
        if both:
            raise PlanError(f"port(s) {sorted(both)} both limited and full in {self.name}")
        if not self.full:
            raise PlanError(f"partition {self.name} has no full member (the gateway)")

    def render(self) -> str:
        """The ``partitions.conf`` statement: one line up to :data:`MEMBERS_PER_LINE` members,
        continuation lines after that (format in the module docstring); no final newline."""
        members = [f"{g}=limited" for g in self.limited] + [f"{g}=full" for g in self.full]
        chunks = [
            ", ".join(members[i : i + MEMBERS_PER_LINE]) for i in range(0, len(members), MEMBERS_PER_LINE)
        ]
        head = f"{self.name}=0x{self.pkey:04x}, ipoib, sl={self.sl}, defmember=limited : "
        return head + ",\n    ".join(chunks) + " ;"

    def render_qos(self) -> str:
        """The ``qos-ulps`` rule mapping this PKey to :attr:`sl`, commented with the name."""
        return f"    any, pkey 0x{self.pkey:04x} : {self.sl}  # {self.name}"


@dataclass(frozen=True)
class ManagedState:
    """The gpupool-managed partitions and the PKey allocator's memory.

    Attributes:
        entries: lease partitions in file order.
        next_pkey: lowest PKey never handed out (:data:`PKEY_MAX` + 1 once all were).
        reuse_from: once every key was handed out, keys given back are reused round-robin from
            here (so the key freed longest ago tends to come first).
    """

    entries: tuple[LeasePartition, ...] = ()
    next_pkey: int = PKEY_MIN
    reuse_from: int = PKEY_MIN

    def find(self, name: str) -> LeasePartition | None:
        """The entry named ``name``, or ``None``."""
        return next((e for e in self.entries if e.name == name), None)

    def allocate(self, reserved: Iterable[int] = ()) -> tuple[int, ManagedState]:
        """Pick a PKey: the lowest never-used one not in ``reserved`` (the operator's PKeys) nor in
        use; when none is left, a freed one, round-robin from :attr:`reuse_from`. Returns the key
        and the state with its high-water mark or cursor moved (the entry itself is added by
        :meth:`with_entry`). Deterministic: the same state and ``reserved`` give the same key.

        Raises :class:`PlanError` when every key of 0x0002..0x7ffe is taken.
        """
        taken = {e.pkey for e in self.entries} | {k & ~FULL_BIT for k in reserved} | {DEFAULT_PKEY}
        key = self.next_pkey
        while key <= PKEY_MAX and key in taken:
            key += 1
        if key <= PKEY_MAX:
            return key, replace(self, next_pkey=key + 1)
        span = PKEY_MAX - PKEY_MIN + 1
        start = min(max(self.reuse_from, PKEY_MIN), PKEY_MAX) - PKEY_MIN
        for i in range(span):
            k = PKEY_MIN + (start + i) % span
            if k not in taken:
                nxt = k + 1 if k < PKEY_MAX else PKEY_MIN
                return k, replace(self, next_pkey=PKEY_MAX + 1, reuse_from=nxt)
        raise PlanError(f"no PKey left: {len(self.entries)} lease partitions and {len(taken)} keys taken")

    def with_entry(self, entry: LeasePartition) -> ManagedState:
        """This state plus ``entry``. Raises :class:`PlanError` if its name or PKey is in use."""
        if self.find(entry.name) is not None:
            raise PlanError(f"partition {entry.name} already exists")
        if any(e.pkey == entry.pkey for e in self.entries):
            raise PlanError(f"pkey 0x{entry.pkey:04x} already in use")
        return replace(self, entries=(*self.entries, entry))

    def without(self, name: str) -> ManagedState:
        """This state without the entry ``name`` (unchanged if there is none); its PKey is free
        again, reused only once no never-used key is left."""
        return replace(self, entries=tuple(e for e in self.entries if e.name != name))

    def state_line(self) -> str:
        """The ``# gpupool-state`` comment line."""
        return f"{_STATE_PREFIX}next=0x{min(self.next_pkey, 0x7FFF):04x} reuse=0x{self.reuse_from:04x}"


@dataclass(frozen=True)
class _Split:
    """A file cut at the managed section: ``head`` + section + ``tail`` (both keep their newlines)."""

    head: str
    body: list[str]
    tail: str
    found: bool


def _split(text: str, begin: str, end: str, what: str) -> _Split:
    lines = text.splitlines(keepends=True)
    starts = [i for i, ln in enumerate(lines) if ln.rstrip("\r\n") == begin]
    ends = [i for i, ln in enumerate(lines) if ln.rstrip("\r\n") == end]
    if not starts and not ends:
        return _Split(text, [], "", False)
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise PlanError(
            f"{what}: expected one {begin!r} line before one {end!r} line, "
            f"found {len(starts)} and {len(ends)}"
        )
    s, e = starts[0], ends[0]
    return _Split(
        "".join(lines[:s]), [ln.rstrip("\r\n") for ln in lines[s + 1 : e]], "".join(lines[e + 1 :]), True
    )


def parse_partitions(text: str) -> ManagedState:
    """The managed section of ``partitions.conf`` text (empty state when there is none).

    Raises :class:`PlanError` for bad markers or a line inside them that this module did not write.
    """
    sp = _split(text, PARTITIONS_BEGIN, PARTITIONS_END, "partitions.conf")
    next_pkey, reuse_from = PKEY_MIN, PKEY_MIN
    entries: list[LeasePartition] = []
    raw: list[str] = []  # lines of the statement being read
    for n, line in enumerate(sp.body, 1):
        st = _STATE.match(line)
        if st and not raw:
            next_pkey, reuse_from = int(st.group(1), 16), int(st.group(2), 16)
            continue
        raw.append(line)
        if not line.endswith(";"):
            continue
        statement, raw = raw, []
        m = _ENTRY.match(" ".join(ln.strip() for ln in statement))
        if not m:
            first = n - len(statement) + 1
            raise PlanError(
                f"partitions.conf: managed line {first} was not written by gpupool: {statement[0]!r}"
            )
        limited: list[str] = []
        full: list[str] = []
        for member in m.group("members").split(", "):
            mm = _MEMBER.match(member)
            if not mm:
                raise PlanError(f"partitions.conf: managed line {n}: bad member {member!r}")
            (full if mm.group(2) == "full" else limited).append(mm.group(1))
        entry = LeasePartition(
            m.group("name"), int(m.group("pkey"), 16), int(m.group("sl")), tuple(limited), tuple(full)
        )
        if entry.render() != "\n".join(statement):
            raise PlanError(
                f"partitions.conf: managed statement ending on line {n} was not written by gpupool"
            )
        entries.append(entry)
    if raw:
        raise PlanError(f"partitions.conf: managed statement not ended by ';': {raw[0]!r}")
    return ManagedState(tuple(entries), next_pkey, reuse_from)


def operator_pkeys(text: str) -> set[int]:
    """PKeys (15-bit) the operator's own statements of ``partitions.conf`` name explicitly —
    everything outside the managed section — plus 0x7fff. Partitions without an explicit PKey get
    one generated by OpenSM that cannot be known here (give every operator partition a PKey).

    Raises :class:`PlanError` for bad markers.
    """
    sp = _split(text, PARTITIONS_BEGIN, PARTITIONS_END, "partitions.conf")
    own = "".join(ln.split("#", 1)[0] + "\n" for ln in (sp.head + sp.tail).splitlines())
    keys = {DEFAULT_PKEY}
    for statement in own.split(";"):
        header = statement.split(":", 1)[0]
        definition = header.split(",", 1)[0]
        if "=" not in definition:
            continue
        value = definition.split("=", 1)[1].strip()
        try:
            keys.add(int(value, 0) & ~FULL_BIT)
        except ValueError:
            continue
    return keys


def render_partitions(text: str, state: ManagedState) -> str:
    """``partitions.conf`` with its managed section replaced by ``state`` (appended at the end when
    there was none). The operator's lines are kept byte for byte.

    Raises :class:`PlanError` for bad markers or a hand-edited managed section (it is never
    overwritten silently).
    """
    parse_partitions(text)
    sp = _split(text, PARTITIONS_BEGIN, PARTITIONS_END, "partitions.conf")
    section = [PARTITIONS_BEGIN, state.state_line(), *(e.render() for e in state.entries), PARTITIONS_END]
    body = "\n".join(section) + "\n"
    if sp.found:
        return sp.head + body + sp.tail
    head = sp.head if not sp.head or sp.head.endswith("\n") else sp.head + "\n"
    return head + body


def render_qos(text: str, state: ManagedState) -> str:
    """``qos-policy.conf`` with its managed ``qos-ulps`` rules replaced by one rule per entry of
    ``state``. When the file has no managed section, it goes right after the first ``qos-ulps``
    line (first match wins, so lease PKeys are matched before the operator's ULP rules); with no
    ``qos-ulps`` section, one is appended — with a ``default : 0`` rule if the file has no
    ``qos-levels`` (OpenSM needs a default level).

    Raises :class:`PlanError` for bad markers or a managed section that is not inside ``qos-ulps``.
    """
    sp = _split(text, QOS_BEGIN, QOS_END, "qos-policy.conf")
    for n, line in enumerate(sp.body, 1):
        if not _QOS_RULE.match(line):
            raise PlanError(f"qos-policy.conf: managed line {n} was not written by gpupool: {line!r}")
    rules = "".join(e.render_qos() + "\n" for e in state.entries)
    section = f"{QOS_BEGIN}\n{rules}{QOS_END}\n"
    if sp.found:
        if not _inside_ulps(sp.head):
            raise PlanError("qos-policy.conf: the gpupool-managed section is not inside qos-ulps")
        return sp.head + section + sp.tail
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if _keyword(line) == "qos-ulps":
            nl = "" if line.endswith("\n") else "\n"
            return "".join(lines[: i + 1]) + nl + section + "".join(lines[i + 1 :])
    default = "" if any(_keyword(ln) == "qos-levels" for ln in lines) else "    default : 0\n"
    head = text if not text or text.endswith("\n") else text + "\n"
    return f"{head}qos-ulps\n{section}{default}end-qos-ulps\n"


def _keyword(line: str) -> str:
    return line.split("#", 1)[0].strip()


def _inside_ulps(head: str) -> bool:
    opened = False
    for line in head.splitlines():
        kw = _keyword(line)
        if kw == "qos-ulps":
            opened = True
        elif kw == "end-qos-ulps":
            opened = False
    return opened


def qos_pkeys(text: str) -> dict[int, int]:
    """PKey → SL of the managed ``qos-ulps`` rules of ``qos-policy.conf`` text.

    Raises :class:`PlanError` for bad markers or a hand-edited managed line.
    """
    sp = _split(text, QOS_BEGIN, QOS_END, "qos-policy.conf")
    out: dict[int, int] = {}
    for n, line in enumerate(sp.body, 1):
        m = _QOS_RULE.match(line)
        if not m:
            raise PlanError(f"qos-policy.conf: managed line {n} was not written by gpupool: {line!r}")
        out[int(m.group("pkey"), 16)] = int(m.group("sl"))
    return out


@dataclass(frozen=True)
class FilePlan:
    """New contents of the OpenSM files for one change.

    Attributes:
        state: the managed state after the change.
        partitions_old / partitions_new: ``partitions.conf`` before and after.
        qos_old / qos_new: ``qos-policy.conf`` before and after (``None``: not managed).
        labels: file names shown in :meth:`diff`.
        conf_old / conf_new: ``opensm.conf`` before and after, for the QoS plan
            (:mod:`broker.fabric_qos`; ``None``: not managed).
        conf_label: its file name shown in :meth:`diff`.
    """

    state: ManagedState
    partitions_old: str
    partitions_new: str
    qos_old: str | None = None
    qos_new: str | None = None
    labels: tuple[str, str] = field(default=("partitions.conf", "qos-policy.conf"))
    conf_old: str | None = None
    conf_new: str | None = None
    conf_label: str = "opensm.conf"

    @property
    def changed(self) -> bool:
        """True if any file would change."""
        return (
            self.partitions_new != self.partitions_old
            or self.qos_new != self.qos_old
            or self.conf_new != self.conf_old
        )

    def diff(self) -> str:
        """Unified diff (``a/<file>`` → ``b/<file>``) of every file; ``""`` when nothing changes."""
        out = _udiff(self.partitions_old, self.partitions_new, self.labels[0])
        if self.qos_old is not None and self.qos_new is not None:
            out += _udiff(self.qos_old, self.qos_new, self.labels[1])
        if self.conf_old is not None and self.conf_new is not None:
            out += _udiff(self.conf_old, self.conf_new, self.conf_label)
        return out


def _udiff(old: str, new: str, label: str) -> str:
    return "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{label}", f"b/{label}"
        )
    )


def plan(partitions: str, qos: str | None, state: ManagedState, labels: Sequence[str] = ()) -> FilePlan:
    """Render ``state`` into both files (``qos`` ``None``: no QoS policy file is managed).

    Raises :class:`PlanError` for bad markers.
    """
    return FilePlan(
        state=state,
        partitions_old=partitions,
        partitions_new=render_partitions(partitions, state),
        qos_old=qos,
        qos_new=None if qos is None else render_qos(qos, state),
        labels=(labels[0], labels[1]) if len(labels) == 2 else ("partitions.conf", "qos-policy.conf"),
    )


# reading the fabric back -------------------------------------------------------------------------------
def parse_pkey_table(text: str) -> list[int]:
    """The entries of a ``smpquery pkeys`` table (index → 16-bit value, 0x0000 = empty slot).

    Raises ``ValueError`` when ``text`` has no table row, or rows are not contiguous from 0.
    """
    table: list[int] = []
    for line in text.splitlines():
        m = _PKEY_ROW.match(line)
        if not m:
            continue
        if int(m.group(1)) != len(table):
            raise ValueError(f"smpquery pkeys: row {m.group(1)} after {len(table)} entries")
        table.extend(int(v, 16) for v in m.group(2).split())
    if not table:
        raise ValueError("smpquery pkeys: no PKey table in the output")
    return table


def membership(table: Sequence[int], pkey: int) -> Membership | None:
    """How a port with PKey table ``table`` is in partition ``pkey`` (15-bit); ``None``: not at all."""
    kinds = {bool(v & FULL_BIT) for v in table if v & ~FULL_BIT == pkey & ~FULL_BIT and v & ~FULL_BIT}
    if not kinds:
        return None
    if kinds == {True, False}:
        return Membership.BOTH
    return Membership.FULL if True in kinds else Membership.LIMITED


def parse_path_record(text: str) -> dict[str, int] | None:
    """The numeric fields of the first ``saquery PR`` "PathRecord dump" (``sl``, ``pkey``, ``slid``,
    ``dlid``, ``mtu``...); ``None`` when the output has no PathRecord (the SA found no path)."""
    if "PathRecord dump" not in text:
        return None
    out: dict[str, int] = {}
    for line in text.split("PathRecord dump", 2)[1].splitlines():
        m = _PR_FIELD.match(line)
        if not m:
            continue
        try:
            out[m.group(1)] = int(m.group(2), 0)
        except ValueError:
            continue  # dgid/sgid (IPv6 text)
    return out or None
