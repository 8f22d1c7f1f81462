"""The metrics a dashboard panel or a Prometheus rule may query, with their label names.

Three sources, each read from where it is defined:

* gpupool's own metrics: the ``prometheus_client`` ``Counter`` / ``Gauge`` / ``Histogram`` /
  ``Summary`` / ``Info`` / ``Enum`` objects (and those :class:`runtime.metrics.MetricSet` builds)
  created in the stages' ``metrics.py`` modules (``collectors/metrics.py``,
  ``analytics/metrics.py``, ``broker/metrics.py``, ``simulator/metrics.py``), read by parsing
  those files (no stage is imported). Exposed sample names follow the OpenMetrics rules
  prometheus_client applies: a counter ``x`` or ``x_total`` exposes ``x_total`` and ``x_created``; a
  histogram ``x`` exposes ``x_bucket`` (label ``le``), ``x_sum``, ``x_count``, ``x_created``; a
  summary ``x_sum``, ``x_count``, ``x_created``; an info ``x_info``; a gauge or enum ``x`` (an enum
  adds the label named after itself).
* dcgm-exporter's metrics: the DCGM field names listed in its field CSV
  (``../shared/data/telemetry/dcgm_exporter/default-counters.csv``, copied from
  NVIDIA/dcgm-exporter ``etc/``), with the labels dcgm-exporter puts on every GPU series.
* node_exporter's InfiniBand metrics (prometheus/node_exporter ``collector/infiniband_linux.go``):
  :data:`NODE_EXPORTER_INFINIBAND`.

Every series also carries the target labels Prometheus adds: :data:`TARGET_LABELS`.
"""

from __future__ import annotations

import ast
import csv
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = [
    "DCGM_LABELS",
    "NODE_EXPORTER_INFINIBAND",
    "STAGE_METRICS_MODULES",
    "TARGET_LABELS",
    "dcgm_fields",
    "exposed_series",
    "gpupool_metrics",
]

TARGET_LABELS: frozenset[str] = frozenset({"job", "instance"})
"""Labels Prometheus attaches to every scraped series (``up`` has only these)."""

STAGE_METRICS_MODULES: tuple[str, ...] = (
    "collectors/metrics.py",
    "analytics/metrics.py",
    "broker/metrics.py",
    "simulator/metrics.py",
)
"""Files (relative to the repository root) that define gpupool's Prometheus metrics."""

DCGM_LABELS: frozenset[str] = frozenset(
    {
        "gpu",
        "UUID",
        "device",
        "modelName",
        "Hostname",
        "hostname",
        "pci_bus_id",
        "DCGM_FI_DRIVER_VERSION",
        "GPU_I_PROFILE",
        "GPU_I_ID",
        "container",
        "namespace",
        "pod",
        "err_code",
        "err_msg",
    }
)
"""Labels dcgm-exporter puts on GPU series: device identity (``gpu``, ``UUID``, ``device``,
``modelName``, ``Hostname`` — ``hostname`` in some versions, ``pci_bus_id``), MIG instance
(``GPU_I_PROFILE``, ``GPU_I_ID``), Kubernetes pod mapping (``container``, ``namespace``, ``pod``)
and XID details (``err_code``, ``err_msg``). Source: the dcgm-exporter samples in
``../shared/data/cases/dcgm_exporter_samples/`` and its README."""

_IB_PORT = frozenset({"device", "port"})
NODE_EXPORTER_INFINIBAND: Mapping[str, frozenset[str]] = {
    "node_infiniband_state_id": _IB_PORT,
    "node_infiniband_physical_state_id": _IB_PORT,
    "node_infiniband_rate_bytes_per_second": _IB_PORT,
    "node_infiniband_link_downed_total": _IB_PORT,
    "node_infiniband_link_error_recovery_total": _IB_PORT,
    "node_infiniband_symbol_error_total": _IB_PORT,
    "node_infiniband_port_errors_received_total": _IB_PORT,
    "node_infiniband_port_transmit_wait_total": _IB_PORT,
    "node_infiniband_port_data_transmitted_bytes_total": _IB_PORT,
    "node_infiniband_port_data_received_bytes_total": _IB_PORT,
    "node_infiniband_port_discards_transmitted_total": _IB_PORT,
    "node_infiniband_port_discards_received_total": _IB_PORT,
}
"""node_exporter's infiniband collector: metric → labels (besides :data:`TARGET_LABELS`).
``*_bytes_total`` data counters are PortXmitData/PortRcvData × 4 (the PMA counts 4-byte words);
``state_id``: 1 down, 2 init, 3 armed, 4 active, 5 act defer; ``symbol_error_total`` exists from
node_exporter 1.6 on. Source: prometheus/node_exporter ``collector/infiniband_linux.go``; all but
``symbol_error_total`` also appear in ``../shared/data/telemetry/node_exporter_e2e_output_infiniband.prom``."""

_KIND_OF = {
    "StateGauge": "Gauge",
    "counter": "Counter",
    "gauge": "Gauge",
    "histogram": "Histogram",
    "state_gauge": "Gauge",
}
"""Calls that build a metric of another name: :class:`runtime.metrics.StateGauge` (a gauge read at
scrape time) and the builders of :class:`runtime.metrics.MetricSet` (``self.counter(...)``, ...),
which take the name, help and label names in prometheus_client's order."""
_METRIC_CLASSES = frozenset({"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum", *_KIND_OF})


def gpupool_metrics(repo_root: Path) -> dict[str, tuple[str, frozenset[str]]]:
    """Metrics defined in :data:`STAGE_METRICS_MODULES` under ``repo_root``.

    Returns ``{name as passed to prometheus_client: (class name, label names)}``.
    Raises ``FileNotFoundError`` if a module is missing and ``ValueError`` if a metric's name or
    labels are not literals (the catalog must be readable without running stage code).
    """
    found: dict[str, tuple[str, frozenset[str]]] = {}
    for rel in STAGE_METRICS_MODULES:
        path = repo_root / rel
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            kind = _call_name(node) if isinstance(node, ast.Call) else None
            if isinstance(node, ast.Call) and kind in _METRIC_CLASSES:
                name, labels = _metric_literal(node, path)
                found[name] = (_KIND_OF.get(str(kind), str(kind)), labels)
    return found


def exposed_series(metrics: Mapping[str, tuple[str, frozenset[str]]]) -> dict[str, frozenset[str]]:
    """Sample names a ``/metrics`` scrape shows for ``metrics`` (from :func:`gpupool_metrics`),
    each with its label names (target labels not included). Naming rules: see the module docstring."""
    out: dict[str, frozenset[str]] = {}
    for name, (kind, labels) in metrics.items():
        if kind == "Counter":
            base = name.removesuffix("_total")
            out[f"{base}_total"] = labels
            out[f"{base}_created"] = labels
        elif kind == "Histogram":
            out[f"{name}_bucket"] = labels | {"le"}
            for suffix in ("_sum", "_count", "_created"):
                out[name + suffix] = labels
        elif kind == "Summary":
            for suffix in ("_sum", "_count", "_created"):
                out[name + suffix] = labels
            out[name] = labels | {"quantile"}
        elif kind == "Info":
            out[f"{name.removesuffix('_info')}_info"] = labels
        elif kind == "Enum":
            out[name] = labels | {name}
        else:
            out[name] = labels
    return out


def dcgm_fields(csv_paths: Iterable[Path]) -> frozenset[str]:
    """DCGM field names listed (uncommented) in dcgm-exporter field CSVs.

    Format (dcgm-exporter ``etc/*.csv``): ``# comment`` lines, blank lines, and
    ``DCGM_FIELD, prometheus type, help`` rows. Raises ``FileNotFoundError`` for a missing file.
    """
    names: set[str] = set()
    for path in csv_paths:
        with path.open(encoding="utf-8", newline="") as fh:
            for row in csv.reader(fh):
                if row and row[0].strip() and not row[0].lstrip().startswith("#"):
                    names.add(row[0].strip())
    return frozenset(names)


def _call_name(node: ast.Call) -> str | None:
    if isinstance(node.func, ast.Name):
        return node.func.id
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    return None


def _metric_literal(node: ast.Call, path: Path) -> tuple[str, frozenset[str]]:
    args = list(node.args)
    kwargs = {k.arg: k.value for k in node.keywords if k.arg}
    name_node = args[0] if args else kwargs.get("name")
    labels_node = args[2] if len(args) > 2 else kwargs.get("labelnames")
    if not isinstance(name_node, ast.Constant) or not isinstance(name_node.value, str):
        raise ValueError(f"{path}:{node.lineno}: metric name is not a string literal")
    if labels_node is None:
        return name_node.value, frozenset()
    try:
        labels = ast.literal_eval(labels_node)
    except ValueError as exc:
        raise ValueError(f"{path}:{node.lineno}: labels of {name_node.value} are not a literal") from exc
    return name_node.value, frozenset(str(x) for x in labels)
