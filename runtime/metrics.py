"""The base of a stage's metrics (:class:`MetricSet`: every metric of one service on one registry)
and gauges computed at scrape time from a stage's state (:class:`StateGauge`).

A gauge that mirrors state the stage already holds (leases by state, idle GPUs, pending Slurm
GPUs) is read when ``/metrics`` is scraped instead of being set on every change: no copy to keep
in step, and a label set that is gone from the state is gone from the scrape. Format: the
Prometheus text exposition (``prometheus_client.core.GaugeMetricFamily``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

__all__ = ["MetricSet", "Samples", "StateGauge"]

Samples = Callable[[], Mapping[tuple[str, ...], float]]
"""What a :class:`StateGauge` calls at each scrape: label values → value."""


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
        read: Samples,
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


class MetricSet:
    """Base of a stage's metrics: a subclass builds every metric of one service in its
    ``__init__`` with :meth:`counter`, :meth:`gauge`, :meth:`histogram` and :meth:`state_gauge`,
    all on :attr:`registry` (what that service's ``/metrics`` serves).

    Args:
        registry: where the metrics are registered; ``None``: a new
            :class:`prometheus_client.CollectorRegistry`. Building raises ``ValueError`` if a
            name is already there (one set per registry).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()

    def counter(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Counter:
        """A counter on :attr:`registry` (``name`` with or without ``_total``)."""
        return Counter(name, documentation, labelnames, registry=self.registry)

    def gauge(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> Gauge:
        """A gauge on :attr:`registry`, set by the service."""
        return Gauge(name, documentation, labelnames, registry=self.registry)

    def histogram(
        self, name: str, documentation: str, labelnames: Sequence[str] = (), *, buckets: Sequence[float]
    ) -> Histogram:
        """A histogram on :attr:`registry` with upper bounds ``buckets`` (``+Inf`` added)."""
        return Histogram(name, documentation, labelnames, registry=self.registry, buckets=buckets)

    def state_gauge(self, name: str, documentation: str, labelnames: Sequence[str], read: Samples) -> StateGauge:
        """A :class:`StateGauge` on :attr:`registry`, read by ``read()`` at each scrape."""
        return StateGauge(name, documentation, labelnames, read, self.registry)
