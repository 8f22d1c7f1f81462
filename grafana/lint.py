"""Static checks of PromQL in dashboards and rules: it parses, and it names real metrics and labels.

Parsing uses promql-parser (Python bindings of the Rust ``promql-parser`` crate, which follows
Prometheus' PromQL grammar). Grafana template variables are replaced first
(:func:`expand_variables`), since PromQL has no ``$var``.

Typical use::

    known = catalog.exposed_series(catalog.gpupool_metrics(root)) | {"up": frozenset()}
    problems = check_expr('sum by (state) (gpupool_analytics_gpus{state="idle"})', known)
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import promql_parser

__all__ = [
    "Selector",
    "check_expr",
    "check_variable_query",
    "dashboard_expressions",
    "expand_variables",
    "selectors",
    "string_literals",
]

_RANGE_VARIABLES = re.compile(
    r"\$(?:__rate_interval|__interval|__range)\b|\$\{(?:__rate_interval|__interval|__range)\}"
)
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(?P<metric>[^,()]+?)\s*,\s*)?(?P<label>\w+)\s*\)\s*$")
_OPS = (
    (promql_parser.MatchOp.Equal, "="),
    (promql_parser.MatchOp.NotEqual, "!="),
    (promql_parser.MatchOp.Re, "=~"),
    (promql_parser.MatchOp.NotRe, "!~"),
)  # MatchOp is not hashable: compared with ==


@dataclass(frozen=True)
class Selector:
    """One vector selector of an expression: metric ``name`` and its label matchers as
    ``(label, op, value)`` with ``op`` one of ``=``, ``!=``, ``=~``, ``!~``."""

    name: str
    matchers: tuple[tuple[str, str, str], ...]


def expand_variables(expr: str) -> str:
    """``expr`` with Grafana variables replaced so that it is plain PromQL: the range variables
    ``$__rate_interval``, ``$__interval``, ``$__range`` by ``5m``, any other ``$var`` / ``${var}`` /
    ``${var:format}`` by ``.*`` (dashboards use variables only inside regex matchers).
    Variable syntax: https://grafana.com/docs/grafana/latest/dashboards/variables/variable-syntax/"""
    return _VARIABLE.sub(".*", _RANGE_VARIABLES.sub("5m", expr))


def selectors(expr: str) -> list[Selector]:
    """Every vector selector in ``expr`` (plain PromQL), in source order.

    Raises ``ValueError`` with the parser's message if ``expr`` does not parse.
    """
    tree = promql_parser.parse(expr)
    found: list[Selector] = []

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            matchers = tuple((m.name, _op(m.op), m.value) for m in node.matchers.matchers)
            name = node.name or next(
                (v for label, op, v in matchers if label == "__name__" and op == "="), ""
            )
            found.append(Selector(name=name, matchers=tuple(m for m in matchers if m[0] != "__name__")))
        return True

    promql_parser.walk(tree, visit)
    return found


def check_expr(
    expr: str,
    known: Mapping[str, frozenset[str] | None],
    literals: frozenset[str] | None = None,
    target_labels: frozenset[str] = frozenset({"job", "instance"}),
) -> list[str]:
    """Problems of one PromQL expression (empty list: none).

    Args:
        expr: plain PromQL (run :func:`expand_variables` first on dashboard queries).
        known: metric name → label names it carries (besides ``target_labels``), or ``None`` for
            "any label" (recording rules, whose labels come from their aggregation).
        literals: if given, the value of every ``=`` matcher on a ``gpupool_*`` metric label
            (other than ``target_labels``) must be one of these strings (the string constants of
            gpupool's code, :func:`string_literals`): it catches a misspelt state or reason.
        target_labels: labels Prometheus adds to every scraped series.

    Problems reported: the expression does not parse; a selector without a metric name; an unknown
    metric; a matcher on a label the metric does not carry; an ``=`` value the code never uses.
    """
    try:
        found = selectors(expr)
    except ValueError as exc:
        return [f"does not parse: {exc}: {expr!r}"]
    problems: list[str] = []
    for sel in found:
        if not sel.name:
            problems.append(f"selector without a metric name in {expr!r}")
            continue
        if sel.name not in known:
            problems.append(f"unknown metric {sel.name}")
            continue
        labels = known[sel.name]
        for label, op, value in sel.matchers:
            if labels is not None and label not in labels | target_labels:
                problems.append(f"{sel.name} has no label {label!r} (it has {sorted(labels)})")
            elif (
                literals is not None
                and op == "="
                and sel.name.startswith("gpupool_")
                and label not in target_labels | {"le"}
                and value not in literals
            ):
                problems.append(f'{sel.name}{{{label}="{value}"}}: no gpupool code uses the value {value!r}')
    return problems


def check_variable_query(query: str, known: Mapping[str, frozenset[str] | None]) -> list[str]:
    """Problems of a Prometheus template-variable query ``label_values([metric,] label)``
    (Grafana's Prometheus data source syntax). The metric part is checked as PromQL by
    :func:`check_expr`; the label must be one the metric carries. Other query forms are reported."""
    m = _LABEL_VALUES.match(query)
    if not m:
        return [f"unsupported variable query {query!r} (expected label_values(metric, label))"]
    metric, label = m.group("metric"), m.group("label")
    if metric is None:
        return []
    problems = check_expr(expand_variables(metric), known)
    if problems:
        return problems
    name = selectors(expand_variables(metric))[0].name
    labels = known[name]
    if labels is not None and label not in labels | {"job", "instance"}:
        problems.append(f"label_values: {name} has no label {label!r}")
    return problems


def dashboard_expressions(dashboard: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    """``(panel title, expr)`` for every Prometheus target of every panel of a dashboard JSON
    model (rows' nested panels included). Dashboard JSON model:
    https://grafana.com/docs/grafana/latest/dashboards/build-dashboards/view-dashboard-json-model/"""
    for panel in _panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []) or []:
            if "expr" in target:
                yield str(panel.get("title", "")), str(target["expr"])


def string_literals(files: Iterable[Path]) -> frozenset[str]:
    """Every string constant (f-string parts included) in the given Python files.
    Raises ``SyntaxError`` for a file that does not parse."""
    out: set[str] = set()
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.add(node.value)
    return frozenset(out)


def _op(op: Any) -> str:
    for member, text in _OPS:
        if op == member:
            return text
    raise ValueError(f"unknown label match operator {op!r}")


def _panels(panels: Iterable[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []) or [])
