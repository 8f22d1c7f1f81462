"""Build the ``gpupool report`` HTML file: DuckDB (+ lease log) → plotly figures → one HTML file.

:func:`build_report` runs the steps of :data:`STEPS` in order and calls ``on_step(step)`` before
each, so a caller can drive a progress bar (the CLI uses rich's).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from contracts import LeaseLogRecord, LeaseState
from gpupool.report import data, figures
from gpupool.report.leases import LeaseSpan, lease_spans
from gpupool.report.page import Section, render_page

log = logging.getLogger(__name__)

STEPS: tuple[str, ...] = (
    "open database",
    "GPU utilisation",
    "idle windows",
    "leases",
    "fabric headroom",
    "render HTML",
    "write file",
)
"""The steps of :func:`build_report`, in order (``on_step`` receives each)."""

PLOT_IDS: dict[str, str] = {
    "utilisation": "plot-utilisation",
    "idle": "plot-idle-windows",
    "leases": "plot-leases",
    "fabric": "plot-fabric",
}
"""``<div>`` id of each plot in the page."""


@dataclass(frozen=True, slots=True)
class ReportOptions:
    """Knobs of the report.

    Attributes:
        title: page title.
        max_columns: most time buckets of a heatmap.
        max_cells: most cells of a heatmap (rows × buckets); fewer buckets on a large fleet.
        max_idle_windows: newest idle windows drawn (all are counted).
        lease_source: where the lease log came from, shown on the page (``None``: no lease log).
        leases_rejected: lease-log records that did not decode, shown on the page.
    """

    title: str = "gpupool report"
    max_columns: int = 400
    max_cells: int = 1_000_000
    max_idle_windows: int = 5000
    lease_source: str | None = None
    leases_rejected: int = 0


@dataclass(frozen=True, slots=True)
class ReportSummary:
    """What a report contains (returned by :func:`build_report`).

    Attributes:
        out: the file written; ``bytes_written``: its size.
        span: first and last timestamp of the data (naive UTC), ``None`` if the store is empty.
        gpus / gpu_samples: GPUs and samples in the utilisation heatmap.
        idle_windows: idle windows in the store; ``idle_outcomes``: count per
            :attr:`data.IdleWindow.outcome` among those drawn.
        leases / reclaims: leases in the lease log and how many were reclaimed (``None`` without
            a lease log).
        ports / port_samples: InfiniBand ports and their samples.
        plots: ids of the plot ``<div>``s rendered (a section without data has none).
        seconds: time taken.
    """

    out: Path
    bytes_written: int
    span: data.TimeSpan | None
    gpus: int
    gpu_samples: int
    idle_windows: int
    idle_outcomes: dict[str, int]
    leases: int | None
    reclaims: int | None
    ports: int
    port_samples: int
    plots: tuple[str, ...]
    seconds: float


def build_report(
    db: Path,
    out: Path,
    *,
    lease_records: Sequence[LeaseLogRecord] | None = None,
    options: ReportOptions | None = None,
    on_step: Callable[[str], None] | None = None,
) -> ReportSummary:
    """Write the HTML report of the analytics store ``db`` to ``out`` (atomically).

    Args:
        db: the analytics DuckDB file (opened read-only: :func:`data.open_store`).
        out: the HTML file to write (its folder is created).
        lease_records: the lease log (:mod:`gpupool.report.leases`); ``None``: the page says
            no lease log was given.
        options: :class:`ReportOptions`.
        on_step: called with each name of :data:`STEPS` before that step runs.

    Raises:
        FileNotFoundError, duckdb.IOException, data.ReportDataError: from :func:`data.open_store`.
        OSError: ``out`` cannot be written.
    """
    opts = options or ReportOptions()
    step = on_step or (lambda _name: None)
    started = time.perf_counter()

    step(STEPS[0])
    con = data.open_store(db)
    try:
        span = data.data_span(con)
        step(STEPS[1])
        grid = data.utilisation_grid(con, max_columns=opts.max_columns, max_cells=opts.max_cells)
        step(STEPS[2])
        windows, windows_total = data.idle_windows(con, limit=opts.max_idle_windows)
        step(STEPS[3])
        spans = lease_spans(lease_records) if lease_records is not None else None
        step(STEPS[4])
        fabric = data.fabric(con, max_columns=opts.max_columns, max_cells=opts.max_cells)
    finally:
        con.close()

    step(STEPS[5])
    outcomes = Counter(w.outcome for w in windows)
    sections = [
        _utilisation_section(grid),
        _idle_section(windows, windows_total, opts.max_idle_windows),
        _leases_section(spans, span, opts),
        _fabric_section(fabric),
    ]
    page = render_page(
        opts.title,
        f"from {db.name}"
        + (f" and the lease log {opts.lease_source}" if opts.lease_source else "")
        + f"; generated {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
        _summary_rows(span, grid, windows_total, outcomes, spans, fabric, opts),
        sections,
    )

    step(STEPS[6])
    encoded = page.encode("utf-8")
    _write_atomic(out, encoded)
    summary = ReportSummary(
        out=out,
        bytes_written=len(encoded),
        span=span,
        gpus=len(grid.rows) if grid else 0,
        gpu_samples=grid.samples if grid else 0,
        idle_windows=windows_total,
        idle_outcomes=dict(outcomes),
        leases=None if spans is None else len(spans),
        reclaims=None if spans is None else sum(1 for s in spans if s.reclaimed),
        ports=len(fabric.ports) if fabric else 0,
        port_samples=fabric.grid.samples if fabric else 0,
        plots=tuple(s.div_id for s in sections if s.figure is not None),
        seconds=time.perf_counter() - started,
    )
    log.info("report_written", extra={"out": str(out), "bytes": len(encoded), "plots": list(summary.plots)})
    return summary


def _utilisation_section(grid: data.Grid | None) -> Section:
    return Section(
        PLOT_IDS["utilisation"],
        figures.UTILISATION_TITLE,
        "Mean DCGM_FI_DEV_GPU_UTIL (%) of each GPU per time bucket (DCGM_FI_PROF_GR_ENGINE_ACTIVE × 100 "
        "where a source lacks it); dark is idle, blank is no sample.",
        figures.utilisation_figure(grid) if grid else None,
        "No GPU samples in this database.",
    )


def _idle_section(windows: list[data.IdleWindow], total: int, limit: int) -> Section:
    shown = f" The newest {len(windows)} of {total} windows are drawn." if total > len(windows) else ""
    return Section(
        PLOT_IDS["idle"],
        figures.IDLE_TITLE,
        "Each bar is one idle run (from its first idle sample to the last sample seen idle), coloured by "
        "whether the GPU stayed idle until the predicted_idle_until analytics first published for it (◆): "
        "kept, broken (busy earlier), censored (went unknown earlier), open (still idle)." + shown,
        figures.idle_windows_figure(windows) if windows else None,
        "No GPU was found idle in this database.",
    )


def _leases_section(
    spans: list[LeaseSpan] | None, span: data.TimeSpan | None, opts: ReportOptions
) -> Section:
    how = (
        "One row per lease: held by its edge site from grant until a reclaim started (or it ended); the "
        "reclaim notice in orange; ✕ marks the reclaim deadline, when the GPUs are taken back regardless."
    )
    if spans is None:
        note = "No lease log given: pass --leases FILE.jsonl or --kafka (the leases.log topic)."
    else:
        note = "The lease log has no lease." + (
            f" {opts.leases_rejected} records did not decode." if opts.leases_rejected else ""
        )
    figure = figures.leases_figure(spans, figures.span_end(span, spans)) if spans else None
    return Section(PLOT_IDS["leases"], figures.LEASES_TITLE, how, figure, note)


def _fabric_section(fabric: data.FabricData | None) -> Section:
    return Section(
        PLOT_IDS["fabric"],
        figures.FABRIC_TITLE,
        "Link utilisation of each InfiniBand port between consecutive reads, 4·ΔPortXmitData/(Δt·rate) "
        "(and the same for PortRcvData; the larger counts); headroom is 1 − utilisation. Ports are grouped "
        "by host, or by leaf switch for switch ports read with perfquery.",
        figures.fabric_figure(fabric) if fabric else None,
        "No InfiniBand port samples in this database.",
    )


def _summary_rows(
    span: data.TimeSpan | None,
    grid: data.Grid | None,
    windows_total: int,
    outcomes: Counter[str],
    spans: list[LeaseSpan] | None,
    fabric: data.FabricData | None,
    opts: ReportOptions,
) -> list[tuple[str, str]]:
    rows = [
        ("data from", "—" if span is None else f"{span.start:%Y-%m-%d %H:%M:%S} UTC"),
        ("data to", "—" if span is None else f"{span.end:%Y-%m-%d %H:%M:%S} UTC ({span.seconds:,.0f} s)"),
        ("GPUs / samples", "0" if grid is None else f"{len(grid.rows):,} / {grid.samples:,}"),
        ("idle windows", f"{windows_total:,}"),
    ]
    judged = outcomes["kept"] + outcomes["broken"]
    if judged:
        rows.append(
            (
                "promises broken early",
                f"{outcomes['broken']:,} of {judged:,} ({outcomes['broken'] / judged:.0%})",
            )
        )
    if spans is None:
        rows.append(("leases", "no lease log given"))
    else:
        ended = Counter(s.state for s in spans)
        rows.append(("leases (reclaimed)", f"{len(spans):,} ({sum(1 for s in spans if s.reclaimed):,})"))
        rows.append(
            (
                "lease outcomes",
                ", ".join(f"{st.value} {ended[st]:,}" for st in LeaseState if ended[st]) or "—",
            )
        )
        if opts.leases_rejected:
            rows.append(("lease log records rejected", f"{opts.leases_rejected:,}"))
    if fabric is None:
        rows.append(("InfiniBand ports", "0"))
    else:
        rows.append(("InfiniBand ports / samples", f"{len(fabric.ports):,} / {fabric.grid.samples:,}"))
        worst = min(
            (p for p in fabric.ports if p.headroom_p95 is not None),
            key=lambda p: p.headroom_p95 or 0.0,
            default=None,
        )
        if worst is not None and worst.headroom_p95 is not None:
            rows.append(("lowest p95 headroom", f"{worst.headroom_p95:.0%} ({worst.label})"))
    return rows


def _write_atomic(path: Path, payload: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a report is for sharing
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
