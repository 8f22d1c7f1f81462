"""gpupool's Grafana dashboards as code, on grafana-foundation-sdk (Grafana 11.6 schema, schemaVersion 41).

Modules:

* :mod:`grafana.panels` — panel and query builders shared by the dashboards (Prometheus data source
  chosen by the ``datasource`` template variable);
* :mod:`grafana.fleet`, :mod:`grafana.idle`, :mod:`grafana.fabric`, :mod:`grafana.pipeline` — one
  dashboard each;
* :mod:`grafana.generate` — renders every dashboard to ``grafana/dashboards/*.json`` (``python -m
  grafana.generate``; ``--check`` compares instead of writing);
* :mod:`grafana.catalog` — the metric names (and their labels) a query may use: what gpupool's
  stages export, and the dcgm-exporter / node_exporter metrics operators scrape beside them;
* :mod:`grafana.lint` — parses every PromQL expression of a rendered dashboard (promql-parser)
  and checks its metric names and label matchers against the catalog.

Provisioning files for Grafana live in ``grafana/provisioning/`` (data source and dashboard provider).
"""

from __future__ import annotations

__all__ = ["catalog", "fabric", "fleet", "generate", "idle", "lint", "panels", "pipeline"]
