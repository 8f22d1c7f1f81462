"""Parsers of Slurm's ``scontrol show node|job -d -o`` output: nodes, GPUs by GRES index, jobs.

Format source: Slurm 22.05 ``scontrol(1)`` (``-o, --oneliner``: one record per line, ``-d,
--details``: per-node GRES indices of a job) and the printers that write these lines,
``src/api/node_info.c:slurm_sprint_node_table`` and ``src/api/job_info.c:slurm_sprint_job_info``.
A record is ``Key=Value`` pairs separated by spaces. Values normally hold no space, but a few
do (``OS=Linux 6.1 #1 SMP``, a node's ``Reason=maint window [root@2026-12-01T14:03:46]``, a
``JobName`` or ``Comment`` with spaces), so a field runs until the next space-separated token
that looks like ``Key=`` (a key starts with a letter and holds letters, digits, ``_ : /``).
A value that itself holds `` Word=`` cannot be told from a new field; no field this module reads
is affected except a ``JobName`` with such text, which then reads short.

Keys may repeat: with ``-d`` a running job has one ``Nodes=<hostlist> CPU_IDs=... Mem=...
GRES=gpu:h100:4(IDX:0-3)`` group per set of nodes with the same allocation (a job spanning
nodes with different GPU indices has several groups), so a record is a list of pairs.

GRES strings (``gres.conf(5)``, ``scontrol(1)``): ``name[:type][:count][(IDX:list)|(S:list)]``,
comma separated, e.g. ``gpu:h100:8``, ``gpu:4`` (no type), ``gpu:h100:6(IDX:0-5)``,
``gpu:h100:0(IDX:N/A)``, ``gpu:a100:2(IDX:0,2-3)``. Index lists are Slurm bitmap strings
(``0,2-3``). Host lists (``gpu-node-[001-003,007]``) are expanded with ``python-hostlist``, which
implements Slurm's hostlist syntax.

Times (``StartTime=2026-12-01T15:03:26``) are printed in the local time of the client that ran
``scontrol``; ``Unknown``, ``None``, ``N/A`` and ``(null)`` mean no time.

Everything here is a pure function: text in, values out; malformed input raises
:class:`SlurmParseError` (a record) or is reported per line (:func:`parse_records`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, tzinfo
from typing import TypeVar

import hostlist

__all__ = [
    "GresEntry",
    "JobInfo",
    "NodeInfo",
    "ParseProblem",
    "SlurmParseError",
    "expand_hostlist",
    "parse_gres",
    "parse_index_list",
    "parse_job",
    "parse_node",
    "parse_records",
    "parse_slurm_time",
    "parse_tres_gpus",
    "pending_gpus",
]

_T = TypeVar("_T")

MAX_GPUS_PER_NODE = 1024
"""Most GPUs a node record may declare (``Gres=gpu:N``); more is refused as ``bad_gres`` rather
than building that many GPU records from one line."""
_FIELD = re.compile(r"(?:^|(?<=\s))([A-Za-z][A-Za-z0-9_:/]*)=")
_NO_VALUE = frozenset({"", "(null)", "N/A", "None", "Unknown", "n/a"})


class SlurmParseError(ValueError):
    """A Slurm record or value that does not have the documented shape; ``reason`` is the metric
    label (``no_fields``, ``missing_key``, ``bad_gres``, ``bad_index``, ``bad_hostlist``,
    ``bad_time``, ``bad_number``)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        """Build with a reason code and a short detail (the offending text)."""
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class ParseProblem:
    """A line of ``scontrol`` output that did not parse: 1-based line number, reason, the line."""

    lineno: int
    reason: str
    line: str


def split_fields(line: str) -> list[tuple[str, str]]:
    """``Key=Value`` pairs of one ``scontrol -o`` line, in order, values stripped (module
    docstring: a value runs to the next `` Key=`` token). Raises :class:`SlurmParseError`
    (``no_fields``) when the line has none."""
    starts = list(_FIELD.finditer(line))
    if not starts:
        raise SlurmParseError("no_fields", line[:80])
    out = []
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(line)
        out.append((m.group(1), line[m.end():end].strip()))
    return out


def _value(text: str | None) -> str | None:
    """``None`` for Slurm's empty markers (``(null)``, ``N/A``, ``None``, ``Unknown``, empty)."""
    return None if text is None or text.strip() in _NO_VALUE else text.strip()


def parse_index_list(text: str) -> list[int]:
    """GRES indices of a bitmap string: ``"0-3"`` → ``[0, 1, 2, 3]``, ``"0,2-3"`` → ``[0, 2, 3]``,
    ``"N/A"`` or ``""`` → ``[]``. Sorted, without duplicates.

    Raises:
        SlurmParseError: ``bad_index`` for anything else (a descending range, a non-number).
    """
    text = text.strip()
    if text in _NO_VALUE:
        return []
    out: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise SlurmParseError("bad_index", text)
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a or b - a > 65535:
            raise SlurmParseError("bad_index", text)
        out.update(range(a, b + 1))
    return sorted(out)


@dataclass(frozen=True, slots=True)
class GresEntry:
    """One GRES of a GRES string: ``name`` (``gpu``), ``type`` (``h100`` or ``None``), ``count``
    (``None`` when not given), ``indices`` (from ``(IDX:...)``; ``None`` when the entry has no
    index list)."""

    name: str
    type: str | None
    count: int | None
    indices: tuple[int, ...] | None


def _split_top(text: str) -> list[str]:
    """Split at commas outside parentheses."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(0, depth - 1)
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


_GRES_ENTRY = re.compile(r"^(?P<spec>[^()]+?)(?:\((?P<extra>[^()]*)\))?$")


def parse_gres(text: str) -> list[GresEntry]:
    """Entries of a GRES string (module docstring): ``"gpu:h100:6(IDX:0-5)"`` →
    ``[GresEntry("gpu", "h100", 6, (0, 1, 2, 3, 4, 5))]``; ``"gpu:4"`` → type ``None``, count 4;
    ``"(null)"`` → ``[]``. A ``gres:`` or ``gres/`` prefix (TRES spelling) is dropped, and a
    ``name[/type]=count`` entry (``gres/gpu:h100=2``) is read too. An ``(S:0-1)`` socket list is
    ignored.

    Raises:
        SlurmParseError: ``bad_gres`` for an entry without a name or with a non-numeric count;
            ``bad_index`` for a bad ``IDX`` list.
    """
    if _value(text) is None:
        return []
    out = []
    for raw in _split_top(text):
        m = _GRES_ENTRY.match(raw)
        if m is None:
            raise SlurmParseError("bad_gres", raw)
        spec, extra = m.group("spec").strip(), m.group("extra")
        for prefix in ("gres:", "gres/"):
            if spec.startswith(prefix):
                spec = spec[len(prefix):]
        spec, eq, eq_count = spec.partition("=")
        tokens = spec.replace("/", ":").split(":")
        count: int | None = None
        if eq:
            if not eq_count.isdigit():
                raise SlurmParseError("bad_gres", raw)
            count = int(eq_count)
        elif len(tokens) > 1 and tokens[-1].isdigit():
            count = int(tokens.pop())
        name = tokens[0]
        if not name or len(tokens) > 2 or any(not t for t in tokens):
            raise SlurmParseError("bad_gres", raw)
        gtype = tokens[1] if len(tokens) == 2 else None
        indices: tuple[int, ...] | None = None
        if extra is not None and extra.startswith("IDX:"):
            indices = tuple(parse_index_list(extra[4:]))
        out.append(GresEntry(name, gtype, count, indices))
    return out


def expand_hostlist(text: str) -> list[str]:
    """Host names of a Slurm host list (``gpu-node-[001-003],login1``); ``[]`` for an empty or
    ``(null)`` value. Raises :class:`SlurmParseError` (``bad_hostlist``) for a malformed one."""
    value = _value(text)
    if value is None:
        return []
    try:
        return list(hostlist.expand_hostlist(value))
    except hostlist.BadHostlist as exc:
        raise SlurmParseError("bad_hostlist", value) from exc


def parse_slurm_time(text: str, tz: tzinfo | None = None) -> float | None:
    """Unix seconds of a Slurm time (``2026-12-01T15:03:26``, in the local time of ``tz``;
    ``None``: this process's local time zone, which is what ``scontrol`` printed in). ``None``
    for ``Unknown``, ``None``, ``N/A``, ``(null)``. Raises :class:`SlurmParseError`
    (``bad_time``) otherwise."""
    value = _value(text)
    if value is None:
        return None
    try:
        when = datetime.strptime(value, "%Y-%m-%dT%H:%M:%S")
    except ValueError as exc:
        raise SlurmParseError("bad_time", value) from exc
    return when.replace(tzinfo=tz).timestamp() if tz is not None else when.timestamp()


def parse_tres_gpus(text: str | None) -> int | None:
    """GPUs in a ``TresPerNode`` / ``TresPerJob`` / ``TresPerTask`` value
    (``gres:gpu:h100:8``, ``gres:gpu:8``, ``gres/gpu=2``, ``cpu=2,gres:gpu:4``): the sum over
    ``gpu`` entries, ``None`` when it names no GPU. Raises :class:`SlurmParseError` like
    :func:`parse_gres`."""
    if text is None or _value(text) is None:
        return None
    total: int | None = None
    for part in _split_top(text):
        if not (part.startswith("gres:") or part.startswith("gres/")):
            continue
        for entry in parse_gres(part):
            if entry.name == "gpu":
                total = (total or 0) + (entry.count if entry.count is not None else 1)
    return total


def _int(text: str | None) -> int | None:
    """First number of ``text`` (``NumNodes=4-4`` → 4), ``None`` if absent."""
    value = _value(text)
    if value is None:
        return None
    m = re.match(r"\d+", value)
    if m is None:
        raise SlurmParseError("bad_number", value)
    return int(m.group(0))


def _user(text: str | None) -> str | None:
    """``root(0)`` → ``root``."""
    value = _value(text)
    return None if value is None else value.split("(", 1)[0] or None


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """One node of ``scontrol show node -d -o``.

    Attributes:
        name: ``NodeName``.
        state: base state (``MIXED`` of ``MIXED+DRAIN``); a trailing ``*`` (not responding, as
            ``sinfo`` prints it) becomes the ``NOT_RESPONDING`` flag.
        flags: the ``+`` flags, in order.
        reason: ``Reason`` (why down or drained), ``None`` if none.
        partitions: ``Partitions``.
        gpus: ``(index, type)`` of every GPU of ``Gres`` (indices 0.. in the order of the
            ``gpu`` entries), type ``None`` when type-less.
        gpus_used: GRES indices in ``GresUsed`` (``IDX`` lists of ``gpu`` entries).
    """

    name: str
    state: str
    flags: tuple[str, ...]
    reason: str | None
    partitions: tuple[str, ...]
    gpus: tuple[tuple[int, str | None], ...]
    gpus_used: frozenset[int]


def parse_node(line: str) -> NodeInfo:
    """Parse one line of ``scontrol show node -d -o`` (module docstring).

    Raises:
        SlurmParseError: ``missing_key`` without ``NodeName`` or ``State``; the reasons of
            :func:`parse_gres` for a bad ``Gres`` / ``GresUsed``; ``bad_gres`` for more than
            :data:`MAX_GPUS_PER_NODE` GPUs.
    """
    fields = dict(split_fields(line))  # node keys do not repeat
    name, state_text = _value(fields.get("NodeName")), _value(fields.get("State"))
    if name is None or state_text is None:
        raise SlurmParseError("missing_key", "NodeName/State")
    base, *flags = state_text.split("+")
    if base.endswith("*"):
        base = base.rstrip("*")
        if "NOT_RESPONDING" not in flags:
            flags.append("NOT_RESPONDING")
    gpus: list[tuple[int, str | None]] = []
    for entry in parse_gres(fields.get("Gres", "")):
        if entry.name == "gpu":
            if len(gpus) + (entry.count or 1) > MAX_GPUS_PER_NODE:
                raise SlurmParseError("bad_gres", f"more than {MAX_GPUS_PER_NODE} GPUs")
            for _ in range(entry.count if entry.count is not None else 1):
                gpus.append((len(gpus), entry.type))
    used: set[int] = set()
    for entry in parse_gres(fields.get("GresUsed", "")):
        if entry.name == "gpu" and entry.indices:
            used.update(entry.indices)
    partitions = _value(fields.get("Partitions"))
    return NodeInfo(
        name=name,
        state=base,
        flags=tuple(flags),
        reason=_value(fields.get("Reason")),
        partitions=tuple(partitions.split(",")) if partitions else (),
        gpus=tuple(gpus),
        gpus_used=frozenset(used),
    )


@dataclass(frozen=True, slots=True)
class JobInfo:
    """One job of ``scontrol show job -d -o``.

    Attributes:
        job_id / name / user / partition / state / reason: ``JobId``, ``JobName``, ``UserId``
            (the name part), ``Partition``, ``JobState``, ``Reason`` (``None`` for ``None``).
        gpus_by_node: host → GRES indices of ``gpu`` it holds there (from the ``Nodes= ...
            GRES=`` groups; empty for a job that holds none, or a pending one).
        start: ``StartTime`` (Unix s): for a pending job the backfill estimate, ``None`` if unknown.
        sched_nodes: ``SchedNodeList`` (the nodes a pending job is planned onto), expanded.
        req_nodes: ``ReqNodeList`` (nodes the job asked for), expanded.
        num_nodes / num_tasks: ``NumNodes`` (lower bound of a range), ``NumTasks``.
        gpus_per_node / gpus_per_job / gpus_per_task: from ``TresPerNode`` / ``TresPerJob`` /
            ``TresPerTask``.
    """

    job_id: str
    name: str | None
    user: str | None
    partition: str | None
    state: str
    reason: str | None
    gpus_by_node: dict[str, tuple[int, ...]] = field(default_factory=dict)
    start: float | None = None
    sched_nodes: tuple[str, ...] = ()
    req_nodes: tuple[str, ...] = ()
    num_nodes: int | None = None
    num_tasks: int | None = None
    gpus_per_node: int | None = None
    gpus_per_job: int | None = None
    gpus_per_task: int | None = None

    @property
    def gpus_requested(self) -> int | None:
        """GPUs the job asks in all: per node × nodes, else per job, else per task × tasks;
        ``None`` when it asks for none."""
        if self.gpus_per_node is not None:
            return self.gpus_per_node * (self.num_nodes or 1)
        if self.gpus_per_job is not None:
            return self.gpus_per_job
        if self.gpus_per_task is not None:
            return self.gpus_per_task * (self.num_tasks or 1)
        return None


def pending_gpus(jobs: Iterable[JobInfo]) -> dict[str, int]:
    """GPUs asked by the ``PENDING`` jobs of ``jobs``, by partition (``""``: none given);
    jobs that ask for none add nothing, so a partition without such a job is absent."""
    out: dict[str, int] = {}
    for job in jobs:
        n = job.gpus_requested
        if job.state == "PENDING" and n:
            part = job.partition or ""
            out[part] = out.get(part, 0) + n
    return out


def parse_job(line: str, tz: tzinfo | None = None) -> JobInfo:
    """Parse one line of ``scontrol show job -d -o`` (module docstring); times in ``tz``
    (:func:`parse_slurm_time`).

    Raises:
        SlurmParseError: ``missing_key`` without ``JobId`` or ``JobState``; the reasons of the
            value parsers for a bad ``GRES``, host list, time or number.
    """
    pairs = split_fields(line)
    first: dict[str, str] = {}
    groups: dict[str, tuple[int, ...]] = {}
    nodes: list[str] = []
    for key, value in pairs:
        first.setdefault(key, value)
        if key == "Nodes":  # a -d allocation group: Nodes= CPU_IDs= Mem= GRES=
            nodes = expand_hostlist(value)
        elif key == "GRES" and nodes:
            idx = sorted({i for e in parse_gres(value) if e.name == "gpu" for i in (e.indices or ())})
            for host in nodes:
                groups[host] = tuple(sorted(set(groups.get(host, ())) | set(idx)))
            nodes = []
    job_id, state = _value(first.get("JobId")), _value(first.get("JobState"))
    if job_id is None or state is None:
        raise SlurmParseError("missing_key", "JobId/JobState")
    return JobInfo(
        job_id=job_id,
        name=_value(first.get("JobName")),
        user=_user(first.get("UserId")),
        partition=_value(first.get("Partition")),
        state=state,
        reason=_value(first.get("Reason")),
        gpus_by_node={h: idx for h, idx in groups.items() if idx},
        start=parse_slurm_time(first.get("StartTime", ""), tz),
        sched_nodes=tuple(expand_hostlist(first.get("SchedNodeList", ""))),
        req_nodes=tuple(expand_hostlist(first.get("ReqNodeList", ""))),
        num_nodes=_int(first.get("NumNodes")),
        num_tasks=_int(first.get("NumTasks")),
        gpus_per_node=parse_tres_gpus(first.get("TresPerNode")),
        gpus_per_job=parse_tres_gpus(first.get("TresPerJob")),
        gpus_per_task=parse_tres_gpus(first.get("TresPerTask")),
    )


def parse_records(text: str, parse: Callable[[str], _T]) -> tuple[list[_T], list[ParseProblem]]:
    """Apply ``parse`` (:func:`parse_node`, or :func:`parse_job` with its time zone bound) to
    every non-blank line of ``text``; a line that raises :class:`SlurmParseError` becomes a
    :class:`ParseProblem` and the others are still returned. ``No jobs in the system`` (what
    ``scontrol show job`` prints with none) gives no record and no problem."""
    out: list[_T] = []
    problems: list[ParseProblem] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.strip() in {"No jobs in the system", "No nodes in the system"}:
            continue
        try:
            out.append(parse(line))
        except SlurmParseError as exc:
            problems.append(ParseProblem(n, exc.reason, line[:300]))
    return out, problems

