"""The Alibaba GenAI 2026 GPU trace, loaded straight from its tar.gz files and aligned per pod.

Source: ``alibaba/clusterdata`` ``cluster-trace-v2026-GenAI/`` (see
``../shared/data/traces/alibaba_genai_2026/PROVENANCE.md``): two CSV files, each inside its own
``.tar.gz``, with the columns ``value,timestamp_anon,container_ip`` (in either order):

* ``pod_gpu_duty_cycle_anon.tar.gz`` — GPU duty cycle, % (0..100), of one GPU-serving pod;
* ``pod_gpu_memory_used_bytes_anon.tar.gz`` — the same pods' GPU memory in use, bytes
  (anonymised by a metric scaling: absolute values are not a real GPU's).

``container_ip`` (an MD5 of the container IP) is the pod identity and the join key;
``timestamp_anon`` are shifted epoch seconds on a common 57 s grid. The trace is never copied into
the project: it is read from the shared data folder each time (in memory, ~18 MB of CSV).

Alignment: step ``k`` is ``t0 + 57·k`` where ``t0`` is the earliest timestamp of either file. A
pod *lives* from its first to its last duty-cycle sample. Inside that span a step without a sample
carries the pod's previous value (counted in :class:`TraceStats`); outside it the pod does not
exist and its GPU is free: duty cycle 0 and no memory.
"""

from __future__ import annotations

import logging
import math
import os
import time
from array import array
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from contracts.gpu_trace import COLUMNS, DUTY_CYCLE_FILE, MEMORY_FILE, STEP_S, TraceReadError, read_trace_csv

log = logging.getLogger(__name__)

TRACE_DIR_ENV = "GPUPOOL_TRACE_DIR"
"""Environment variable that overrides :func:`default_trace_dir`."""

_GRID_TOLERANCE_S = 1e-3


class TraceError(ValueError):
    """The trace files are missing a column, hold a value out of range, a timestamp off the 57 s
    grid, a duplicate sample, or are not the expected archives."""


@dataclass(frozen=True, slots=True)
class TraceStats:
    """What loading found; every number is a count of samples (rows) unless said otherwise.

    Attributes:
        util_rows: rows of the duty-cycle file.
        mem_rows: rows of the memory file.
        zero_fraction: share (0..1) of duty-cycle rows whose value is exactly 0.
        carried_util: (pod, step) cells inside a pod's life without a duty-cycle sample, filled
            with the pod's previous value.
        carried_mem: such cells without a memory sample, filled with the previous memory value.
        backfilled_mem: cells before a pod's first memory sample (but inside its life), filled
            with that first memory value.
        mem_only_pods: pods present in the memory file only (ignored).
        mem_outside_life: memory rows outside their pod's duty-cycle life (ignored).
        t0_anon: anonymised epoch seconds of step 0.
        load_s: wall seconds the load took.
    """

    util_rows: int
    mem_rows: int
    zero_fraction: float
    carried_util: int
    carried_mem: int
    backfilled_mem: int
    mem_only_pods: int
    mem_outside_life: int
    t0_anon: float
    load_s: float


class Trace:
    """Per-pod duty cycle and memory on a common 57 s grid (built by :func:`load_trace`).

    Attributes:
        pods: pod ids (``container_ip`` hashes), sorted; a pod's index is its position here.
        steps: number of grid steps (1,441 for the 2026 trace).
        step_s: grid period, seconds (57).
        first_step / last_step: per pod, the first and last step with a duty-cycle sample.
        stats: counts from loading (:class:`TraceStats`).
    """

    def __init__(
        self,
        pods: list[str],
        util: list[array[float]],
        mem: list[array[int]],
        first_step: list[int],
        last_step: list[int],
        steps: int,
        stats: TraceStats,
        step_s: float = STEP_S,
    ) -> None:
        self.pods = pods
        self.steps = steps
        self.step_s = step_s
        self.first_step = first_step
        self.last_step = last_step
        self.stats = stats
        self._util = util
        self._mem = mem

    def util(self, pod_idx: int, step: int) -> float:
        """Duty cycle of pod ``pod_idx`` at ``step``, % (0..100); 0 outside the pod's life.

        Raises:
            IndexError: ``pod_idx`` or ``step`` out of range (``0 <= step < steps``).
        """
        if not 0 <= step < self.steps:
            raise IndexError(f"step {step} outside 0..{self.steps - 1}")
        return float(self._util[pod_idx][step])

    def mem_bytes(self, pod_idx: int, step: int) -> int:
        """GPU memory in use by pod ``pod_idx`` at ``step``, bytes (trace scale); 0 outside its life.

        Raises:
            IndexError: ``pod_idx`` or ``step`` out of range.
        """
        if not 0 <= step < self.steps:
            raise IndexError(f"step {step} outside 0..{self.steps - 1}")
        return int(self._mem[pod_idx][step])

    def alive(self, pod_idx: int, step: int) -> bool:
        """True if pod ``pod_idx`` exists at ``step`` (between its first and last sample)."""
        return self.first_step[pod_idx] <= step <= self.last_step[pod_idx]

    def coverage(self, pod_idx: int) -> float:
        """Share (0..1) of the trace's steps during which pod ``pod_idx`` lives."""
        return (self.last_step[pod_idx] - self.first_step[pod_idx] + 1) / self.steps

    def busy_fraction(self, pod_idx: int) -> float:
        """Share (0..1) of all steps at which pod ``pod_idx``'s duty cycle is above 0."""
        return sum(1 for v in self._util[pod_idx] if v > 0.0) / self.steps

    def max_mem_bytes(self, pod_idx: int) -> int:
        """Largest memory value of pod ``pod_idx``, bytes (trace scale)."""
        return int(max(self._mem[pod_idx]))

    def util_series(self, pod_idx: int) -> array[float]:
        """Pod ``pod_idx``'s duty cycle at every step (a copy, ``array('d')``, %)."""
        return array("d", self._util[pod_idx])


def default_trace_dir() -> Path:
    """The trace folder: ``$GPUPOOL_TRACE_DIR`` if set, else
    ``<repo>/../shared/data/traces/alibaba_genai_2026`` (``<repo>`` = the folder holding
    ``simulator/``). The path is returned whether or not it exists."""
    env = os.environ.get(TRACE_DIR_ENV)
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[1]
    return (repo / ".." / "shared" / "data" / "traces" / "alibaba_genai_2026").resolve()


_CACHE: dict[Path, Trace] = {}


def load_trace(trace_dir: Path | str | None = None, *, cache: bool = True) -> Trace:
    """Load and align both trace files from ``trace_dir`` (default :func:`default_trace_dir`).

    With ``cache`` (default) a folder is read once per process and the same :class:`Trace` is
    returned afterwards (it is read-only).

    Raises:
        FileNotFoundError: a tarball is missing.
        TraceError: malformed content (see :class:`TraceError`).
    """
    d = Path(trace_dir) if trace_dir is not None else default_trace_dir()
    key = d.resolve()
    if cache and key in _CACHE:
        return _CACHE[key]
    trace = _load(d)
    if cache:
        _CACHE[key] = trace
    return trace


def _read_csv_from_tar(path: Path) -> pa.Table:
    """The single CSV member of the tarball at ``path`` as an Arrow table with
    :data:`~contracts.gpu_trace.COLUMNS` (:func:`~contracts.gpu_trace.read_trace_csv`), none blank."""
    try:
        table = read_trace_csv(path)
    except TraceReadError as e:
        raise TraceError(str(e)) from e
    for col in COLUMNS:
        if table.column(col).null_count:
            raise TraceError(f"{path.name}: {table.column(col).null_count} empty values in column {col!r}")
    return table


def _grid_steps(table: pa.Table, t0: float, name: str) -> list[int]:
    """Step index of each row's timestamp; raises :class:`TraceError` for off-grid ones."""
    rel = pc.divide(pc.subtract(table.column("timestamp_anon"), t0), STEP_S)
    rounded = pc.round(rel)
    off = pc.sum(pc.greater(pc.abs(pc.subtract(rel, rounded)), _GRID_TOLERANCE_S / STEP_S)).as_py() or 0
    if off:
        raise TraceError(f"{name}: {off} timestamps are off the {STEP_S:g} s grid")
    return [int(x) for x in rounded.to_pylist()]


def _load(d: Path) -> Trace:
    started = time.perf_counter()
    duty = _read_csv_from_tar(d / DUTY_CYCLE_FILE)
    memt = _read_csv_from_tar(d / MEMORY_FILE)
    if duty.num_rows == 0:
        raise TraceError(f"{DUTY_CYCLE_FILE}: no rows")

    uvals = duty.column("value")
    bad = pc.sum(pc.or_(pc.less(uvals, 0.0), pc.or_(pc.greater(uvals, 100.0), pc.is_nan(uvals)))).as_py() or 0
    if bad:
        raise TraceError(f"{DUTY_CYCLE_FILE}: {bad} duty-cycle values outside 0..100 %")
    mvals = memt.column("value")
    bad = pc.sum(pc.or_(pc.less(mvals, 0.0), pc.is_nan(mvals))).as_py() or 0
    if bad:
        raise TraceError(f"{MEMORY_FILE}: {bad} negative or NaN memory values")

    ts_min = [pc.min(t.column("timestamp_anon")).as_py() for t in (duty, memt) if t.num_rows]
    ts_max = [pc.max(t.column("timestamp_anon")).as_py() for t in (duty, memt) if t.num_rows]
    t0, t1 = min(ts_min), max(ts_max)
    steps = int(round((t1 - t0) / STEP_S)) + 1

    u_steps = _grid_steps(duty, t0, DUTY_CYCLE_FILE)
    m_steps = _grid_steps(memt, t0, MEMORY_FILE) if memt.num_rows else []
    u_pods_raw = duty.column("container_ip").to_pylist()
    pods = sorted(set(u_pods_raw))
    index = {p: i for i, p in enumerate(pods)}
    n = len(pods)

    util, zeros = _util_grid(u_pods_raw, u_steps, uvals.to_pylist(), index, steps)
    first, last, carried_util = _carry_util(util, steps)
    mem_raw, mem_only, outside = _mem_cells(
        memt.column("container_ip").to_pylist(), m_steps, mvals.to_pylist(), index, first, last, steps)
    mem, carried_mem, backfilled = _carry_mem(mem_raw, first, last, steps)

    stats = TraceStats(
        util_rows=duty.num_rows,
        mem_rows=memt.num_rows,
        zero_fraction=zeros / duty.num_rows,
        carried_util=carried_util,
        carried_mem=carried_mem,
        backfilled_mem=backfilled,
        mem_only_pods=len(mem_only),
        mem_outside_life=outside,
        t0_anon=t0,
        load_s=time.perf_counter() - started,
    )
    log.info(
        "trace_loaded",
        extra={"trace_dir": str(d), "pods": n, "steps": steps, "rows": duty.num_rows,
               "carried_util": carried_util, "carried_mem": carried_mem, "load_s": round(stats.load_s, 3)},
    )
    return Trace(pods, util, mem, first, last, steps, stats)


def _util_grid(
    pods: list[str], steps_of_rows: list[int], values: list[float], index: dict[str, int], steps: int
) -> tuple[list[array[float]], int]:
    """Per-pod duty-cycle rows (NaN where no sample) and the count of exact zeros."""
    util = [array("d", [math.nan]) * steps for _ in range(len(index))]
    zeros = 0
    for pod, step, val in zip(pods, steps_of_rows, values, strict=True):
        row = util[index[pod]]
        if not math.isnan(row[step]):
            raise TraceError(f"{DUTY_CYCLE_FILE}: duplicate sample for pod {pod} at step {step}")
        row[step] = val
        if val == 0.0:
            zeros += 1
    return util, zeros


def _carry_util(util: list[array[float]], steps: int) -> tuple[list[int], list[int], int]:
    """Fill each pod's gaps with its previous value inside its life and 0 outside (in place);
    returns first steps, last steps and the number of carried cells."""
    first: list[int] = []
    last: list[int] = []
    carried = 0
    for row in util:
        present = [k for k in range(steps) if not math.isnan(row[k])]
        lo, hi = present[0], present[-1]
        first.append(lo)
        last.append(hi)
        prev = 0.0
        for k in range(steps):
            if not lo <= k <= hi:
                row[k] = 0.0
            elif math.isnan(row[k]):
                row[k] = prev
                carried += 1
            else:
                prev = row[k]
    return first, last, carried


def _mem_cells(
    pods: list[str], steps_of_rows: list[int], values: list[float], index: dict[str, int],
    first: list[int], last: list[int], steps: int,
) -> tuple[list[list[int | None]], set[str], int]:
    """Memory samples per pod cell inside the pod's life; pods unknown to the duty-cycle file and
    the number of rows outside a life are returned for the stats."""
    cells: list[list[int | None]] = [[None] * steps for _ in range(len(index))]
    unknown: set[str] = set()
    outside = 0
    for pod, step, val in zip(pods, steps_of_rows, values, strict=True):
        i = index.get(pod)
        if i is None:
            unknown.add(pod)
            continue
        if not first[i] <= step <= last[i]:
            outside += 1
            continue
        if cells[i][step] is not None:
            raise TraceError(f"{MEMORY_FILE}: duplicate sample for pod {pod} at step {step}")
        cells[i][step] = int(val)
    return cells, unknown, outside


def _carry_mem(
    cells: list[list[int | None]], first: list[int], last: list[int], steps: int
) -> tuple[list[array[int]], int, int]:
    """Per-pod memory rows: gaps carry the previous value, cells before the first sample take
    that first value, outside the life 0; returns rows, carried and back-filled counts."""
    mem: list[array[int]] = []
    carried = backfilled = 0
    for i, raw in enumerate(cells):
        first_val = next((v for v in raw[first[i] : last[i] + 1] if v is not None), 0)
        out = array("q", bytes(8 * steps))
        prev: int | None = None
        for k in range(first[i], last[i] + 1):
            v = raw[k]
            if v is not None:
                out[k] = prev = v
            elif prev is None:
                out[k] = first_val
                backfilled += 1
            else:
                out[k] = prev
                carried += 1
        mem.append(out)
    return mem, carried, backfilled
