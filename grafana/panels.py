"""Panel, query and variable builders shared by gpupool's dashboards (grafana-foundation-sdk builders).

Every panel queries the Prometheus data source picked by the dashboard's ``datasource`` variable
(:func:`datasource_variable`), so the dashboards work with whatever Prometheus data source a Grafana
has; ``grafana/provisioning/datasources/prometheus.yaml`` provides one as the default.
Units are Grafana unit ids (``percent``, ``percentunit``, ``bytes``, ``watt``, ``celsius``, ``s``,
``ops``, ``short``: https://github.com/grafana/grafana/blob/main/packages/grafana-data/src/valueFormats/categories.ts).
Widths are grid columns out of 24; heights grid rows (30 px each).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol, Self, TypeVar

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dashboard_b
from grafana_foundation_sdk.builders import prometheus as prometheus_b
from grafana_foundation_sdk.builders import stat as stat_b
from grafana_foundation_sdk.builders import statetimeline as statetimeline_b
from grafana_foundation_sdk.builders import timeseries as timeseries_b
from grafana_foundation_sdk.models import common as common_m
from grafana_foundation_sdk.models import dashboard as dashboard_m

__all__ = [
    "ANY_IS_BAD",
    "ANY_IS_WARNING",
    "DATASOURCE",
    "Query",
    "dashboard",
    "dashboard_links",
    "datasource_variable",
    "label_variable",
    "row",
    "stat",
    "state_timeline",
    "timeseries",
]

DATASOURCE = dashboard_m.DataSourceRef(type_val="prometheus", uid="${datasource}")
"""Reference to the data source chosen by the ``datasource`` template variable."""


ANY_IS_WARNING: Sequence[tuple[float | None, str]] = ((None, "green"), (1, "orange"))
"""Stat thresholds for a count that should stay 0: green at 0, orange from 1."""
ANY_IS_BAD: Sequence[tuple[float | None, str]] = ((None, "green"), (1, "red"))
"""Stat thresholds for a count that must stay 0: green at 0, red from 1."""


class Query(NamedTuple):
    """One PromQL target: ``expr`` (may use Grafana variables such as ``$__rate_interval``) and
    its ``legend`` format (``{{label}}`` placeholders; empty: Grafana's default series name)."""

    expr: str
    legend: str = ""


def dashboard_links() -> dashboard_b.DashboardLink:
    """A drop-down of every dashboard tagged ``gpupool``, keeping the time range."""
    return (
        dashboard_b.DashboardLink("gpupool")
        .type(dashboard_m.DashboardLinkType.DASHBOARDS)
        .tags(["gpupool"])
        .as_dropdown(True)
        .keep_time(True)
        .include_vars(False)
        .target_blank(False)
    )


def dashboard(
    title: str,
    uid: str,
    description: str,
    *variables: dashboard_b.QueryVariable,
    time_from: str = "now-6h",
) -> dashboard_b.Dashboard:
    """A gpupool dashboard ``title`` (uid ``uid``) before its panels: tagged ``gpupool`` with
    :func:`dashboard_links`, refreshed every 30 s, showing ``time_from`` to now in the browser's
    time zone, with the :func:`datasource_variable` and then ``variables``."""
    board = (
        dashboard_b.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["gpupool"])
        .link(dashboard_links())
        .refresh("30s")
        .time(time_from, "now")
        .timezone("browser")
        .with_variable(datasource_variable())
    )
    for variable in variables:
        board = board.with_variable(variable)
    return board


def datasource_variable() -> dashboard_b.DatasourceVariable:
    """The ``datasource`` variable: any Prometheus data source, the default one preselected."""
    return dashboard_b.DatasourceVariable("datasource").label("Data source").type("prometheus")


def label_variable(name: str, metric: str, label: str, title: str) -> dashboard_b.QueryVariable:
    """A multi-value variable ``name`` over the values of ``label`` on ``metric``
    (``label_values(metric, label)``), "All" meaning the regex ``.*``; refreshed with the time range."""
    return (
        dashboard_b.QueryVariable(name)
        .label(title)
        .query(f"label_values({metric}, {label})")
        .datasource(DATASOURCE)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .refresh(dashboard_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dashboard_m.VariableSort.NATURAL_ASC)
    )


def row(title: str) -> dashboard_b.Row:
    """An expanded row header; the panels added after it belong to it."""
    return dashboard_b.Row(title).collapsed(False)


def timeseries(
    title: str,
    queries: Sequence[Query],
    *,
    description: str,
    unit: str = "short",
    stack: bool = False,
    width: int = 12,
    height: int = 8,
    min_value: float | None = None,
    max_value: float | None = None,
) -> timeseries_b.Panel:
    """A time series panel of ``queries`` (refIds A, B, ...), legend as a table under the graph
    with last and max values; ``stack`` stacks the series (for parts of a whole)."""
    panel = (
        _framed(timeseries_b.Panel(), title, description, unit, width, height)
        .fill_opacity(25 if stack else 10)
        .legend(
            common_b.VizLegendOptions()
            .display_mode(common_m.LegendDisplayMode.TABLE)
            .placement(common_m.LegendPlacement.BOTTOM)
            .show_legend(True)
            .calcs(["lastNotNull", "max"])
        )
        .tooltip(
            common_b.VizTooltipOptions()
            .mode(common_m.TooltipDisplayMode.MULTI)
            .sort(common_m.SortOrder.DESCENDING)
        )
    )
    if stack:
        panel = panel.stacking(common_b.StackingConfig().mode(common_m.StackingMode.NORMAL))
    if min_value is not None:
        panel = panel.min(min_value)
    if max_value is not None:
        panel = panel.max(max_value)
    return _with_targets(panel, queries)


def stat(
    title: str,
    queries: Sequence[Query],
    *,
    description: str,
    unit: str = "short",
    width: int = 6,
    height: int = 4,
    thresholds: Sequence[tuple[float | None, str]] = ((None, "green"),),
) -> stat_b.Panel:
    """A stat panel showing the last value of each series, coloured by ``thresholds``:
    ``(from value, colour)`` pairs, the first one's value ``None`` (minus infinity)."""
    panel = (
        _framed(stat_b.Panel(), title, description, unit, width, height)
        .color_mode(common_m.BigValueColorMode.VALUE)
        .graph_mode(common_m.BigValueGraphMode.AREA)
        .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .thresholds(_thresholds(thresholds))
    )
    return _with_targets(panel, queries)


def state_timeline(
    title: str,
    query: Query,
    *,
    description: str,
    states: Mapping[int, tuple[str, str]],
    width: int = 24,
    height: int = 8,
) -> statetimeline_b.Panel:
    """A state timeline of one query whose values are state codes; ``states`` maps each code to
    ``(text, colour)`` (e.g. ``{4: ("Active", "green")}``)."""
    mapping = dashboard_m.ValueMap(
        options={
            str(code): dashboard_m.ValueMappingResult(text=text, color=color, index=i)
            for i, (code, (text, color)) in enumerate(sorted(states.items()))
        }
    )
    return (
        statetimeline_b.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .span(width)
        .height(height)
        .mappings([mapping])
        .show_value(common_m.VisibilityMode.NEVER)
        .with_target(_target(query, "A"))
    )


class _Framed(Protocol):
    def title(self, title: str) -> Self: ...
    def description(self, description: str) -> Self: ...
    def datasource(self, datasource: dashboard_m.DataSourceRef) -> Self: ...
    def unit(self, unit: str) -> Self: ...
    def span(self, w: int) -> Self: ...
    def height(self, h: int) -> Self: ...


_F = TypeVar("_F", bound=_Framed)


def _framed(panel: _F, title: str, description: str, unit: str, width: int, height: int) -> _F:
    """``panel`` titled and described, on the :data:`DATASOURCE`, in ``unit``, ``width`` columns by
    ``height`` rows."""
    return panel.title(title).description(description).datasource(DATASOURCE).unit(unit).span(width).height(height)


class _Targeted(Protocol):
    def with_target(self, target: prometheus_b.Dataquery) -> Self: ...


_P = TypeVar("_P", bound=_Targeted)


def _with_targets(panel: _P, queries: Sequence[Query]) -> _P:
    """``panel`` with one target per query, refIds A, B, ... in order."""
    for ref, query in zip(_ref_ids(), queries, strict=False):
        panel = panel.with_target(_target(query, ref))
    return panel


def _target(query: Query, ref: str) -> prometheus_b.Dataquery:
    target = prometheus_b.Dataquery().expr(query.expr).ref_id(ref).range()
    if query.legend:
        target = target.legend_format(query.legend)
    return target


def _thresholds(steps: Sequence[tuple[float | None, str]]) -> dashboard_b.ThresholdsConfig:
    return (
        dashboard_b.ThresholdsConfig()
        .mode(dashboard_m.ThresholdsMode.ABSOLUTE)
        .steps([dashboard_m.Threshold(value=value, color=color) for value, color in steps])
    )


def _ref_ids() -> list[str]:
    return [chr(ord("A") + i) for i in range(26)]
