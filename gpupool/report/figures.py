"""The plots of ``gpupool report``, as plotly figures (``plotly.graph_objects``).

Every time axis is naive UTC (the store's ``TIMESTAMP``); Unix seconds of the lease log are
converted with :func:`utc`. Each ``*_figure`` function returns a complete figure; its heading (one
of the ``*_TITLE`` constants) is the page's, so the figure itself has none. Empty input gives an
empty figure: callers skip empty data.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from gpupool.report.data import FabricData, Grid, IdleWindow, TimeSpan
from gpupool.report.leases import LeaseSpan

UTILISATION_TITLE = "GPU utilisation per GPU over time"
IDLE_TITLE = "Idle windows: predicted vs real"
LEASES_TITLE = "Leases and reclaims"
FABRIC_TITLE = "Fabric headroom per leaf and port"

OUTCOME_COLOURS: dict[str, str] = {
    "kept": "#2ca02c",
    "broken": "#d62728",
    "censored": "#8c8c8c",
    "open": "#1f77b4",
    "no_prediction": "#c7c7c7",
}
"""Colour of each :attr:`IdleWindow.outcome`."""

SITE_COLOURS: tuple[str, ...] = ("#4c78a8", "#54a24b", "#b279a2", "#72b7b2", "#9d755d", "#79706e", "#1f3a5f")
"""Colours of edge sites' held leases (none orange or red: those mark reclaims)."""

_RECLAIM_COLOUR = "#ff7f0e"
_DEADLINE_COLOUR = "#b00020"
_TEMPLATE = "plotly_white"
_LEGEND_TOP = {"orientation": "h", "yanchor": "bottom", "y": 1.02, "xanchor": "left", "x": 0}


def utc(ts: float) -> datetime:
    """Unix seconds → naive UTC ``datetime`` (the store's convention)."""
    return datetime.fromtimestamp(ts, UTC).replace(tzinfo=None)


def gpu_labels(keys: Sequence[str]) -> list[str]:
    """Short labels of GPU keys: ``host/GPU-0123abcd[/gi]`` (the UUID cut to 12 characters), or the
    keys themselves if the short forms collide."""
    short = []
    for key in keys:
        parts = key.split("/")
        if len(parts) >= 2:
            parts[1] = parts[1][:12]
        short.append("/".join(parts))
    return short if len(set(short)) == len(short) else list(keys)


def _height(rows: int, per_row: int = 16, base: int = 160, lo: int = 360, hi: int = 1400) -> int:
    return max(lo, min(hi, base + per_row * rows))


def utilisation_figure(grid: Grid) -> go.Figure:
    """Heatmap of mean GPU utilisation (%, 0..100) per GPU (rows) and time bucket (columns)."""
    fig = go.Figure(
        go.Heatmap(
            z=grid.values,
            x=grid.times,
            y=gpu_labels(grid.rows),
            zmin=0,
            zmax=100,
            colorscale="Viridis",
            colorbar={"title": {"text": "util %"}},
            hoverongaps=False,
            hovertemplate="%{y}<br>%{x}<br>%{z:.1f} %<extra></extra>",
        )
    )
    fig.update_layout(
        template=_TEMPLATE,
        margin={"t": 30},
        height=_height(len(grid.rows)),
        xaxis={"title": {"text": f"time (UTC), {grid.bucket_s:.3g} s buckets"}},
        yaxis={"title": {"text": "GPU"}, "autorange": "reversed"},
    )
    return fig


def idle_windows_figure(windows: Sequence[IdleWindow]) -> go.Figure:
    """Left: each idle window as a bar from its start to its real end (coloured by outcome), with
    the predicted end marked. Right: promised vs seen idle seconds, one point per window; points
    under the diagonal are promises broken early."""
    fig = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.62, 0.38],
        horizontal_spacing=0.1,
        subplot_titles=("Idle windows per GPU (bar: real, ◆: predicted end)", "Promised vs seen idle time"),
    )
    labels = dict(zip([w.gpu_key for w in windows], gpu_labels([w.gpu_key for w in windows]), strict=True))
    for outcome, colour in OUTCOME_COLOURS.items():
        group = [w for w in windows if w.outcome == outcome]
        if not group:
            continue
        ends = [w.ended_at if w.ended_at is not None else w.last_seen_idle for w in group]
        fig.add_trace(
            go.Bar(
                orientation="h",
                y=[labels[w.gpu_key] for w in group],
                base=[w.since for w in group],
                x=[(e - w.since).total_seconds() * 1000.0 for w, e in zip(group, ends, strict=True)],
                marker={"color": colour},
                name=outcome.replace("_", " "),
                legendgroup=outcome,
                customdata=[
                    [w.since.isoformat(sep=" "), e.isoformat(sep=" ")]
                    for w, e in zip(group, ends, strict=True)
                ],
                hovertemplate="%{y}<br>idle %{customdata[0]} → %{customdata[1]}<extra>"
                + outcome
                + "</extra>",
            ),
            row=1,
            col=1,
        )
        scored = [w for w in group if w.predicted_s is not None]
        if scored:
            fig.add_trace(
                go.Scatter(
                    x=[w.predicted_s for w in scored],
                    y=[w.real_s for w in scored],
                    mode="markers",
                    marker={"color": colour, "size": 8},
                    name=outcome.replace("_", " "),
                    legendgroup=outcome,
                    showlegend=False,
                    text=[labels[w.gpu_key] for w in scored],
                    hovertemplate="%{text}<br>promised %{x:.1f} s, seen %{y:.1f} s<extra></extra>",
                ),
                row=1,
                col=2,
            )
    predicted = [w for w in windows if w.predicted_until is not None]
    if predicted:
        fig.add_trace(
            go.Scatter(
                x=[w.predicted_until for w in predicted],
                y=[labels[w.gpu_key] for w in predicted],
                mode="markers",
                marker={"symbol": "diamond", "color": "black", "size": 7},
                name="predicted idle until",
                customdata=[w.confidence if w.confidence is not None else float("nan") for w in predicted],
                hovertemplate="%{y}<br>predicted idle until %{x}<br>confidence %{customdata:.2f}"
                "<extra></extra>",
            ),
            row=1,
            col=1,
        )
    top = max([0.0] + [max(w.predicted_s or 0.0, w.real_s or 0.0) for w in windows])
    fig.add_trace(
        go.Scatter(
            x=[0, top],
            y=[0, top],
            mode="lines",
            line={"color": "gray", "dash": "dot"},
            name="seen = promised",
            hoverinfo="skip",
        ),
        row=1,
        col=2,
    )
    rows = len(labels)
    fig.update_layout(
        template=_TEMPLATE,
        barmode="overlay",
        height=_height(rows, lo=420),
        margin={"t": 90},
        legend={**_LEGEND_TOP, "y": 1.12},
    )
    fig.update_xaxes(type="date", title={"text": "time (UTC)", "standoff": 18}, row=1, col=1)
    fig.update_yaxes(autorange="reversed", row=1, col=1)
    fig.update_xaxes(title={"text": "promised idle, s"}, rangemode="tozero", row=1, col=2)
    fig.update_yaxes(title={"text": "seen idle, s"}, rangemode="tozero", row=1, col=2)
    return fig


def leases_figure(spans: Sequence[LeaseSpan], until: datetime) -> go.Figure:
    """Timeline of leases, one row per lease (``site · lease id · GPUs``): held (coloured by site)
    from grant to reclaim start or end, the reclaim notice in orange up to the end, ✕ at the reclaim
    deadline. Leases still live are drawn up to ``until`` (naive UTC)."""
    fig = go.Figure()
    labels = [
        f"{s.site} · …{s.lease_id[-8:]} · {len(s.gpus)} GPU{'s' if len(s.gpus) != 1 else ''}" for s in spans
    ]
    sites = sorted({s.site for s in spans})
    palette = SITE_COLOURS
    for i, site in enumerate(sites):
        idx = [j for j, s in enumerate(spans) if s.site == site]
        starts = [utc(spans[j].granted_at) for j in idx]
        stops = [_held_until(spans[j], until) for j in idx]
        fig.add_trace(
            go.Bar(
                orientation="h",
                y=[labels[j] for j in idx],
                base=starts,
                x=[(b - a).total_seconds() * 1000.0 for a, b in zip(starts, stops, strict=True)],
                marker={"color": palette[i % len(palette)]},
                name=f"held by {site}",
                customdata=[
                    [
                        a.isoformat(sep=" "),
                        b.isoformat(sep=" "),
                        spans[j].state.value,
                        spans[j].reason,
                        ", ".join(spans[j].gpus),
                    ]
                    for j, a, b in zip(idx, starts, stops, strict=True)
                ],
                hovertemplate="%{y}<br>held %{customdata[0]} → %{customdata[1]}<br>now %{customdata[2]}"
                " (%{customdata[3]})<br>%{customdata[4]}<extra></extra>",
            )
        )
    reclaimed = [j for j, s in enumerate(spans) if s.reclaim_started_at is not None]
    if reclaimed:
        starts = [utc(spans[j].reclaim_started_at) for j in reclaimed]  # type: ignore[arg-type]
        stops = [utc(spans[j].ended_at) if spans[j].ended_at is not None else until for j in reclaimed]  # type: ignore[arg-type]
        fig.add_trace(
            go.Bar(
                orientation="h",
                y=[labels[j] for j in reclaimed],
                base=starts,
                x=[max(0.0, (b - a).total_seconds() * 1000.0) for a, b in zip(starts, stops, strict=True)],
                marker={"color": _RECLAIM_COLOUR, "pattern": {"shape": "/"}},
                name="reclaim notice",
                customdata=[
                    [a.isoformat(sep=" "), spans[j].state.value, spans[j].reason]
                    for j, a in zip(reclaimed, starts, strict=True)
                ],
                hovertemplate="%{y}<br>reclaiming from %{customdata[0]}<br>now %{customdata[1]}"
                " (%{customdata[2]})<extra></extra>",
            )
        )
        fig.add_trace(
            go.Scatter(
                x=[utc(spans[j].reclaim_deadline) for j in reclaimed],  # type: ignore[arg-type]
                y=[labels[j] for j in reclaimed],
                mode="markers",
                marker={"symbol": "x", "color": _DEADLINE_COLOUR, "size": 10},
                name="reclaim deadline",
                hovertemplate="%{y}<br>deadline %{x}<extra></extra>",
            )
        )
    fig.update_layout(
        template=_TEMPLATE,
        barmode="overlay",
        height=_height(len(spans), per_row=22),
        margin={"t": 40},
        xaxis={"type": "date", "title": {"text": "time (UTC)", "standoff": 18}},
        yaxis={"autorange": "reversed", "title": {"text": "lease"}},
        legend=_LEGEND_TOP,
    )
    return fig


def _held_until(span: LeaseSpan, until: datetime) -> datetime:
    if span.reclaim_started_at is not None:
        return utc(span.reclaim_started_at)
    return utc(span.ended_at) if span.ended_at is not None else until


def fabric_figure(data: FabricData) -> go.Figure:
    """Top: headroom (``1 − utilisation``, 0..1) per port over time. Bottom: per port, headroom
    left 95 % of the time (bar) and at the busiest interval (◆)."""
    labels = [p.label for p in data.ports]
    fig = make_subplots(
        rows=2,
        cols=1,
        row_heights=[0.6, 0.4],
        vertical_spacing=0.16,
        subplot_titles=(
            f"Headroom over time (1 − link utilisation), {data.grid.bucket_s:.3g} s buckets, UTC",
            "Headroom per port: p95 (bar) and worst interval (◆)",
        ),
    )
    headroom = [[None if v is None else 1.0 - v for v in row] for row in data.grid.values]
    fig.add_trace(
        go.Heatmap(
            z=headroom,
            x=data.grid.times,
            y=labels,
            zmin=0,
            zmax=1,
            colorscale="RdYlGn",
            colorbar={"title": {"text": "headroom"}, "len": 0.55, "y": 0.75},
            hoverongaps=False,
            hovertemplate="%{y}<br>%{x}<br>headroom %{z:.1%}<extra></extra>",
        ),
        row=1,
        col=1,
    )
    fig.add_trace(
        go.Bar(
            x=labels,
            y=[p.headroom_p95 for p in data.ports],
            marker={"color": "#4c78a8"},
            name="p95 headroom",
            customdata=[[p.intervals, p.port_key] for p in data.ports],
            hovertemplate="%{x} (%{customdata[1]})<br>p95 headroom %{y:.1%}<br>%{customdata[0]} intervals"
            "<extra></extra>",
        ),
        row=2,
        col=1,
    )
    fig.add_trace(
        go.Scatter(
            x=labels,
            y=[None if p.max_utilisation is None else 1.0 - p.max_utilisation for p in data.ports],
            mode="markers",
            marker={"symbol": "diamond", "color": "#d62728", "size": 8},
            name="worst interval",
            hovertemplate="%{x}<br>headroom at the busiest interval %{y:.1%}<extra></extra>",
        ),
        row=2,
        col=1,
    )
    fig.update_layout(
        template=_TEMPLATE,
        height=max(560, _height(len(labels), per_row=14) + 320),
        margin={"t": 40},
        showlegend=False,
    )
    fig.update_yaxes(autorange="reversed", row=1, col=1)
    lowest = min([0.0] + [1.0 - p.max_utilisation for p in data.ports if p.max_utilisation is not None])
    fig.update_yaxes(title={"text": "headroom"}, tickformat=".0%", range=[lowest - 0.02, 1.05], row=2, col=1)
    return fig


def span_end(span: TimeSpan | None, spans: Sequence[LeaseSpan]) -> datetime:
    """Right end of the lease timeline: the data's end, or the newest lease time if later (naive UTC).
    Raises ``ValueError`` if both are empty."""
    times = [span.end] if span is not None else []
    for s in spans:
        times += [utc(t) for t in (s.granted_at, s.ended_at, s.reclaim_deadline) if t is not None]
    if not times:
        raise ValueError("no time to end the lease timeline at")
    return max(times)
