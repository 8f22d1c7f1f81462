"""Gauges computed at scrape time from a stage's state (Prometheus custom collectors).

A gauge that mirrors state the stage already holds (leases by state, idle GPUs, pending Slurm
GPUs) is read when ``/metrics`` is scraped instead of being set on every change: no copy to keep
in step, and a label set that is gone from the state is gone from the scrape. Format: the
Prometheus text exposition (``prometheus_client.core.GaugeMetricFamily``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

__all__ = ["StateGauge"]


class StateGauge(Collector):
    """One gauge family whose samples ``read()`` returns at each scrape, registered on ``registry``.

    Args:
        name: the metric name (Prometheus naming: base unit suffix, no ``_total``).
        documentation: its HELP text.
        labelnames: the label names, in order.
        read: called at every scrape (in the thread of the HTTP server): label values (a tuple as
            long as ``labelnames``; ``()`` without labels) → value. It must not block and must
            be safe to call while the stage changes its state (read an immutable snapshot, or
            look up keys rather than iterate a dict that changes).
        registry: where the family is registered.

    Raises:
        ValueError: ``name`` is already registered on ``registry``.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        read: Callable[[], Mapping[tuple[str, ...], float]],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._read = read
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        """The empty family (the registry checks names with it, without reading the state)."""
        yield GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        """The family with one sample per entry of ``read()``, in its order."""
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, value in self._read().items():
            family.add_metric(list(labels), value)
        yield family
