"""``gpupool report``: a self-contained HTML report with plots, from the analytics DuckDB store and
the lease log.

* :func:`build_report` (:mod:`gpupool.report.build`) — the whole report, one HTML file;
* :mod:`gpupool.report.data` — the read-only DuckDB queries behind each plot;
* :mod:`gpupool.report.leases` — the lease log: JSON lines or the bus → :class:`LeaseSpan`;
* :mod:`gpupool.report.figures` — the plotly figures; :mod:`gpupool.report.page` — the HTML page.

plotly is imported only by :mod:`~gpupool.report.figures` and :mod:`~gpupool.report.page`; import
them (or :func:`build_report`) when a report is made, not at CLI start.
"""

from gpupool.report.leases import (
    LeaseSpan,
    dump_lease_log,
    lease_spans,
    load_jsonl,
    read_from_bus,
    write_jsonl,
)

__all__ = ["LeaseSpan", "dump_lease_log", "lease_spans", "load_jsonl", "read_from_bus", "write_jsonl"]
