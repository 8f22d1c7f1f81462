"""``gpupool demo`` on the terminal: the command, its live table and its summary (rich).

The demo itself is :func:`gpupool.demo.run_demo`; this module only turns its snapshots and
summary into tables. Per lease both show: site, GPUs (count and hosts), PKey, SL, whether the
partition was verified on the fabric, and the isolate→verified time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table

from gpupool.demo_fabric import FabricMode, FabricUnavailable
from gpupool.demo_leases import LeaseRow
from gpupool.demo_slurm import SchedulerMode, SlurmUnavailable

if TYPE_CHECKING:
    from gpupool.demo import DemoSummary

_LEASE_COLUMNS = ("lease", "site", "GPUs", "PKey", "SL", "verified", "isolate→\nverified")


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{1000 * seconds:.0f} ms"


def _lease_cells(row: LeaseRow) -> list[str]:
    return [row.lease_id.removeprefix("lease-")[:8], row.site, f"{len(row.gpus)}× {', '.join(row.hosts())}",
            row.pkey or "—", "—" if row.sl is None else str(row.sl), _verified_cell(row), _ms(row.isolate_s)]


def _qos_note(rows: Sequence[LeaseRow]) -> str:
    """`` — QoS: SL 1 → VL 1, share ≤10% of a busy link`` from the rows' QoS (the plan is
    fabric-wide: one lane and bound for every lease), else ``""``."""
    lanes = sorted({(r.sl, r.qos_vl, r.qos_share_percent) for r in rows if r.qos_vl is not None}, key=str)
    return "".join(f" — QoS: SL {sl} → VL {vl}, share ≤{share:g}% of a busy link" for sl, vl, share in lanes)


def _verified_cell(row: LeaseRow) -> str:
    """What was read back before the grant: ``PKey+QoS``, ``PKey`` (no QoS managed), ``no``."""
    if not row.verified:
        return "no"
    if row.qos_verified:
        return "PKey+QoS"
    return "PKey" if row.qos_vl is None else "PKey only"


def lease_table(rows: Sequence[LeaseRow], title: str, *, with_state: bool = False) -> Table:
    """A table of ``rows``: lease (first 8 hex digits of its id), site, GPUs, PKey, SL, verified
    (``PKey+QoS``: partition and QoS read back; ``PKey``: no QoS managed; ``no``),
    isolate→verified (ms); plus the lease's state when ``with_state``. The title gets the QoS
    lane and share bound."""
    t = Table(title=title + _qos_note(rows), title_justify="left")
    # the GPUs column never gets narrower than "N× <longest host>," and folds between hosts, so
    # host names stay whole even in 80-column (piped) output
    widest = max((len(h) for r in rows for h in r.hosts()), default=8)
    for col in (*_LEASE_COLUMNS, *(("state",) if with_state else ())):
        gpus = col == "GPUs"
        t.add_column(
            col,
            justify="right" if col in ("SL", _LEASE_COLUMNS[-1]) else "left",
            min_width=min(widest + 4, 40) if gpus else None,
            overflow="fold" if gpus else "ellipsis",
        )
    for r in rows:
        t.add_row(*_lease_cells(r), *((r.state,) if with_state else ()))
    return t


def progress_view(snap: dict[str, object], duration: float) -> RenderableType:
    """The live view of one :func:`gpupool.demo.run_demo` snapshot: the counts, and a row per
    live lease."""
    t = Table(title=f"gpupool demo — {snap['elapsed_s']:.0f}/{duration:.0f} s", title_justify="left")
    for col in ("GPUs busy", "idle", "unknown", "offers", "live leases", "granted", "reclaims", "reclaimed",
                "bad offers"):
        t.add_column(col, justify="right")
    t.add_row(*(str(snap[k]) for k in ("busy", "idle", "unknown", "offers", "live_leases", "leases_granted",
                                        "reclaims_started", "reclaims_completed", "violations")))
    rows = snap.get("lease_rows") or []
    assert isinstance(rows, list)
    p50 = snap.get("isolate_p50_s")
    title = "live leases" + (f" — isolate→verified p50 {_ms(p50)}" if isinstance(p50, float) else "")
    return Group(t, lease_table(rows, title))


def summary_view(s: DemoSummary) -> RenderableType:
    """The final summary: the counts, fabric isolation (verified leases, isolate→verified p50 and
    p99), and a row per lease granted, in grant order."""
    t = Table(title="gpupool demo — summary", title_justify="left", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    leases = [LeaseRow(**{**d, "gpus": tuple(d["gpus"])}) for d in s.leases]  # type: ignore[arg-type]
    rows = [
        ("simulated GPUs", s.gpus),
        ("idle share of the replayed trace window", f"{100 * s.trace_idle_share:.1f} %"),
        ("samples ingested into DuckDB", s.samples_ingested),
        ("GPUs found idle", s.gpus_seen_idle),
        ("offers published (GPUs offered)", f"{s.offers} ({s.gpus_offered})"),
        ("offers for a GPU the " + ("telemetry (Slurm's jobs)" if s.scheduler.get("enabled") else "trace")
         + " showed busy", s.offer_violations),
        ("  …turned busy within one scrape interval", s.offer_races),
        ("leases granted", s.leases_granted),
        ("reclaims started / completed", f"{s.reclaims_started} / {s.reclaims_completed}"),
        ("leases expired (no renewal)", s.expired),
        ("claims rejected, by reason", ", ".join(f"{k}={v}" for k, v in s.rejections.items()) or "none"),
        ("fabric isolation", "on" if s.fabric.get("enabled") else "off (leases not isolated)"),
        ("leases with a partition verified on the fabric", f"{s.leases_verified} / {len(leases)}"),
        ("  …and their QoS on every port of their paths", f"{s.leases_qos_verified} / {len(leases)}"),
        ("isolate→verified p50 / p99", f"{_ms(s.isolate_p50_s)} / {_ms(s.isolate_p99_s)}"),
        *_scheduler_rows(s.scheduler),
        *_edge_rows(s.edge_load),
    ]
    for k, v in rows:
        t.add_row(k, str(v))
    return Group(t, lease_table(leases, "leases (in grant order)", with_state=True))


def _s(seconds: object) -> str:
    return f"{seconds:.1f} s" if isinstance(seconds, float | int) else "—"


def _share(part: object, whole: object) -> str:
    """``part / whole`` as a percentage, ``—`` when either is missing or ``whole`` is 0."""
    if isinstance(part, float | int) and isinstance(whole, float | int) and whole > 0:
        return f"{part / whole:.0%}"
    return "—"


def _added(needed: object, free: object) -> str:
    """Submit → start of the training jobs that needed lent GPUs minus that of the others
    (seconds, signed), ``—`` when either is missing."""
    if isinstance(needed, float | int) and isinstance(free, float | int):
        return f"{needed - free:+.1f} s (needed lent GPUs vs the others)"
    return "—"


def _scheduler_rows(sc: dict[str, object]) -> list[tuple[str, object]]:
    """The summary's rows about lending through Slurm (``DemoSummary.scheduler``)."""
    if not sc.get("enabled"):
        return [("training scheduler", f"none ({sc.get('detail', '--scheduler none')})")]
    x = sc.get("compression")
    return [
        ("training scheduler", f"Slurm, notice = GraceTime {sc.get('grace_s')} s"),
        ("training jobs submitted / started", f"{sc.get('training_submitted')} / {sc.get('training_started')}"),
        (f"GPU-hours idle / lent (simulated, {x}× compressed)",
         f"{sc.get('gpu_hours_idle')} / {sc.get('gpu_hours_lent')}"),
        ("training jobs that needed lent GPUs (held by gpupool)", sc.get("needed_lent")),
        ("  …submit → start p50 / max (wall)",
         f"{_s(sc.get('needed_lent_wait_p50_s'))} / {_s(sc.get('needed_lent_wait_max_s'))}"),
        ("  …of which on a lease's GPUs", sc.get("needed_leased")),
        ("  …other training jobs, submit → start p50", _s(sc.get("free_wait_p50_s"))),
        ("harvest: share of idle GPU-hours lent", _share(sc.get("gpu_hours_lent"), sc.get("gpu_hours_idle"))),
        ("harvest: training delay added by lending (p50, wall)",
         _added(sc.get("needed_lent_wait_p50_s"), sc.get("free_wait_p50_s"))),
        ("leases reclaimed by Slurm preemption", sc.get("reclaimed_by_slurm")),
        ("  …notice at the site before its deadline",
         f"{sc.get('notices_before_deadline')} / {sc.get('notices_seen')} seen"
         f" (shortest lead {_s(sc.get('notice_lead_min_s'))})"),
    ]


def _lat(seconds: object) -> str:
    return f"{1000 * seconds:.1f} ms" if isinstance(seconds, float | int) else "—"


def _edge_rows(e: dict[str, object]) -> list[tuple[str, object]]:
    """The summary's rows about the serving site's request load (``DemoSummary.edge_load``):
    requests sent, served and failed; p50 / p99 latency in steady state and during reclaims;
    reclaims survived. Without a load, one row saying why; none without a serving site."""
    if not e:
        return []
    if not e.get("enabled"):
        return [("edge requests across reclaims", e.get("detail"))]
    failed_by = e.get("failed_by") or {}
    assert isinstance(failed_by, dict)
    why = f" ({', '.join(f'{k}={v}' for k, v in sorted(failed_by.items()))})" if failed_by else ""
    reclaims = e.get("reclaims")
    losses = e.get("losses") or {}
    assert isinstance(losses, dict)
    during = (f"{_lat(e.get('reclaim_p50_s'))} / {_lat(e.get('reclaim_p99_s'))} "
              f"({e.get('reclaim_sent')} requests, {e.get('reclaim_failed')} failed)") if reclaims else \
        "— (no lease of the site was reclaimed while the load ran)"
    return [
        ("edge requests across reclaims",
         f"{e.get('site')}: {e.get('rate_per_s'):g} requests/s over {e.get('target')} kept leases "
         f"of {e.get('gpus_per_lease')} GPUs, {e.get('load_s')} s"),
        ("  …sent / served / failed", f"{e.get('sent')} / {e.get('served')} / {e.get('failed')}{why}"),
        ("  …latency p50 / p99 (sent → answered), steady state",
         f"{_lat(e.get('steady_p50_s'))} / {_lat(e.get('steady_p99_s'))} ({e.get('steady_sent')} requests, "
         f"{e.get('steady_failed')} failed)"),
        ("  …latency p50 / p99 (sent → answered), during reclaims", during),
        ("  …the load driver's own lateness (due → sent), p99", _lat(e.get("driver_lag_p99_s"))),
        ("  …leases lost without a hand-over",
         ", ".join(f"{k}={v}" for k, v in sorted(losses.items())) if losses else "none"),
        ("  …reclaims survived (released early, no failed request)",
         f"{e.get('reclaims_survived')} / {reclaims} ({e.get('reclaims_with_deadline')} with a deadline)"),
    ]


@contextlib.contextmanager
def logs_to_file(path: Path) -> Iterator[None]:
    """While inside, send what gpupool's JSON log handlers (:func:`gpupool.logs.setup_logging`)
    would write to the terminal to ``path`` instead (appended, same JSON lines, same level), so
    log lines do not tear the live table; the handlers are put back on exit. The file is opened on
    the first record (``logging.FileHandler(delay=True)``); without such handlers nothing changes.
    Raises ``OSError`` when the folder cannot be created."""
    root = logging.getLogger()
    ours = [h for h in root.handlers if getattr(h, "_gpupool", False)]
    if not ours:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    to_file = logging.FileHandler(path, encoding="utf-8", delay=True)
    to_file.setFormatter(ours[0].formatter)
    to_file.setLevel(ours[0].level)
    for h in ours:
        root.removeHandler(h)
    root.addHandler(to_file)
    try:
        yield
    finally:
        root.removeHandler(to_file)
        to_file.close()
        for h in ours:
            root.addHandler(h)


def demo(
    duration: Annotated[float, typer.Option(help="How long to run, wall-clock seconds.")] = 60.0,
    nodes: Annotated[int, typer.Option(help="Simulated GPU nodes (8 GPUs each).")] = 4,
    speedup: Annotated[float, typer.Option(help="Trace seconds replayed per wall second (57 = one trace sample/s).")] = 57.0,
    kafka: Annotated[str | None, typer.Option(help="Kafka bootstrap host:port; default: in-process bus.")] = None,
    mqtt: Annotated[str | None, typer.Option(help="MQTT broker host:port; default: embedded amqtt (MQTT 3.1.1).")] = None,
    mqtt_credentials: Annotated[Path | None, typer.Option(help="credentials.json from deploy/local/mosquitto.sh.")] = None,
    state_dir: Annotated[Path | None, typer.Option(
        help="Where the DuckDB file, the simulated sysfs, the fabric, the lease files and the log go "
             "(default: $GPUPOOL_STATE/demo when GPUPOOL_STATE is set, else .state/demo).")] = None,
    metrics_port: Annotated[int, typer.Option(help="Serve Prometheus /metrics of every stage on this port (0: off).")] = 0,
    fabric: Annotated[FabricMode, typer.Option(
        help="Fabric isolation on a simulated InfiniBand fabric (ibsim + OpenSM, started and stopped by the "
             "demo): auto = when the tools are installed (bash deploy/local/install-system.sh), on = required "
             "(exit 2 if it cannot start), off = never.")] = FabricMode.AUTO,
    scheduler: Annotated[SchedulerMode, typer.Option(
        help="Lend through a real Slurm cluster (deploy/local/slurm.sh, started or reused by the demo, its "
             "jobs cancelled at the end): training jobs arrive, idle GPUs are lent, Slurm preempts them for "
             "training. auto = when Slurm's tools are installed and the cluster starts, slurm = required "
             "(exit 2 if it cannot), none = training demand from the trace.")] = SchedulerMode.AUTO,
    edge_rate: Annotated[float, typer.Option(
        help="Lending through a training scheduler: requests/s the first site sends at the endpoints of "
             "the leases it keeps (the simulated inference server) through reclaims; 0: no load.")] = 50.0,
    json_summary: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Run the simulator and every stage for DURATION seconds, show live progress, print a summary.

    GPUs replay the real Alibaba GenAI 2026 trace (../shared/data/traces). Collectors scrape the
    simulated dcgm-exporter endpoints and sysfs trees; analytics finds idle GPUs; the broker offers
    them over MQTT; simulated edge sites claim and renew; training demand reclaims. With fabric
    isolation every lease gets its own InfiniBand partition (PKey + SL) verified on the fabric
    before it is granted; per lease the tables show site, GPUs, PKey, SL, verified and the
    isolate→verified time. While the live view runs, log lines go to demo-<run>.log in the state
    directory instead of the terminal. With --scheduler slurm (or auto and Slurm installed) the
    hosts are the nodes of a local Slurm cluster: training jobs (AcmeTrace Seren fit, 120x
    compressed) drive the telemetry, idle GPUs are held by placeholder jobs and lent, Slurm
    preempts leases for training with the lent partition's GraceTime as notice; the summary adds
    GPU-hours idle and lent, submit -> start of training jobs that needed lent GPUs, leases Slurm
    reclaimed and whether each notice came before its deadline; the first site keeps two leases
    of the workload and sends --edge-rate requests/s at them through the reclaims (requests
    served and failed, p50/p99 latency steady and during reclaims, reclaims survived). Exit code 1 if an offer was made
    for a GPU the telemetry showed busy, 2 if --fabric on or --scheduler slurm cannot run.
    """
    from gpupool.demo import DemoConfig, default_state_dir, new_run_id, run_demo

    run_id = new_run_id()
    cfg = DemoConfig(duration_s=duration, nodes=nodes, speedup=speedup, kafka=kafka, mqtt=mqtt,
                     mqtt_credentials=mqtt_credentials, state_dir=state_dir or default_state_dir(),
                     metrics_port=metrics_port, fabric=fabric, scheduler=scheduler, run_id=run_id)
    if edge_rate < 0:
        raise typer.BadParameter("must be >= 0", param_hint="--edge-rate")
    if edge_rate > 0:
        cfg.serving_site, cfg.serving_rate_per_s = cfg.sites[0], edge_rate
    log_path = cfg.state_dir / f"demo-{run_id}.log"
    console = Console(stderr=False)
    told = False
    try:
        with logs_to_file(log_path), Live(console=console, auto_refresh=False, transient=False) as live:
            def progress(snap: dict[str, object]) -> None:
                nonlocal told
                status = snap.get("fabric")
                if not told and status is not None:
                    live.console.print(status.notice(),  # type: ignore[attr-defined]
                                       markup=False, highlight=False)
                    told = True
                live.update(progress_view(snap, duration), refresh=True)

            summary = asyncio.run(run_demo(cfg, progress))
    except (FabricUnavailable, SlurmUnavailable) as e:
        console.print(f"gpupool demo: {e}", markup=False, highlight=False)
        raise typer.Exit(2) from e
    except KeyboardInterrupt:
        console.print("gpupool demo: interrupted; every stage and the fabric were stopped")
        raise typer.Exit(130) from None
    console.print()
    if json_summary:
        console.print_json(json.dumps(summary.as_dict()))
    else:
        console.print(summary_view(summary))
        log_file = str(log_path) if log_path.exists() else None
        for what, path in (("lease log", summary.leases_file), ("per-lease rows", summary.lease_rows_file),
                           ("edge requests and hand-overs", summary.edge_requests_file), ("log (JSON lines)", log_file)):
            if path:
                console.print(f"{what}: {path}", markup=False, highlight=False)
    if summary.offer_violations:
        raise typer.Exit(1)
