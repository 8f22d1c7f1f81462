"""The Pipeline health dashboard: scrape targets, collectors (scrape errors and times), Kafka
(throughput per topic, the analytics consumer lag, backlog growth), analytics (DuckDB ingest) and
broker (latency, MQTT, edge sites online).
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dashboard_b

from grafana import panels
from grafana.panels import Query

__all__ = ["UID", "dashboard"]

UID = "gpupool-pipeline"
"""Dashboard uid (stable: links and provisioning refer to it)."""

_PRODUCED = "sum by (topic) (rate(gpupool_collector_records_produced_total[$__rate_interval]))"
_CONSUMED = "sum by (topic) (rate(gpupool_analytics_records_consumed_total[$__rate_interval]))"


def _quantiles(bucket: str, by: str = "", qs: tuple[float, ...] = (0.5, 0.95, 0.99)) -> list[Query]:
    labels = f"le, {by}" if by else "le"
    suffix = f" {{{{{by}}}}}" if by else ""
    return [
        Query(
            f"histogram_quantile({q}, sum by ({labels}) (rate({bucket}[$__rate_interval])))",
            f"p{round(q * 100)}{suffix}",
        )
        for q in qs
    ]


def dashboard() -> dashboard_b.Dashboard:
    """The Pipeline health dashboard builder (uid :data:`UID`); variable ``datasource``."""
    return (
        panels.dashboard(
            "gpupool / Pipeline health",
            UID,
            "Is telemetry flowing? Scrapes, Kafka throughput and backlog, DuckDB ingest, broker latency.",
            time_from="now-3h",
        )
        .with_row(panels.row("Targets"))
        .with_panel(
            panels.state_timeline(
                "Scrape targets up",
                Query('up{job=~"gpupool-.*|dcgm-exporter|node-exporter"}', "{{job}} {{instance}}"),
                description="Prometheus' own view of each gpupool stage and exporter: 1 up, 0 down.",
                states={0: ("down", "red"), 1: ("up", "green")},
            )
        )
        .with_row(panels.row("Collectors"))
        .with_panel(
            panels.timeseries(
                "Scrape error ratio by target",
                [
                    Query(
                        "sum by (target) (rate(gpupool_collector_scrape_errors_total[$__rate_interval]))"
                        " / sum by (target) (rate(gpupool_collector_scrapes_total[$__rate_interval]))",
                        "{{target}}",
                    )
                ],
                description="Failed share of dcgm-exporter scrapes per target. Alerts above 10 % for 10 minutes.",
                unit="percentunit",
                min_value=0,
                max_value=1,
            )
        )
        .with_panel(
            panels.timeseries(
                "Scrape errors by reason",
                [
                    Query(
                        "sum by (reason) (rate(gpupool_collector_scrape_errors_total[$__rate_interval]))",
                        "{{reason}}",
                    )
                ],
                description="timeout, connect_error, http_5xx, truncated, garbage ... per second.",
                unit="ops",
            )
        )
        .with_panel(
            panels.timeseries(
                "Scrape time p95 by source",
                _quantiles("gpupool_collector_scrape_duration_seconds_bucket", "source", (0.95,)),
                description="dcgm: HTTP request and parse of one /metrics; sysfs: reading one InfiniBand sysfs root.",
                unit="s",
            )
        )
        .with_panel(
            panels.timeseries(
                "Collection cycle time",
                _quantiles("gpupool_collector_cycle_duration_seconds_bucket"),
                description="One collection cycle over every target and sysfs root.",
                unit="s",
            )
        )
        .with_panel(
            panels.timeseries(
                "Rejected samples by reason",
                [
                    Query(
                        "sum by (reason) (rate(gpupool_collector_rejected_samples_total[$__rate_interval]))",
                        "{{reason}}",
                    )
                ],
                description="Values the dcgm parser refused: sentinel, out_of_range, not_a_number, truncated_line, "
                "unknown_metric ... Each makes a field missing, and the GPU possibly unknown.",
                unit="ops",
            )
        )
        .with_panel(
            panels.timeseries(
                "sysfs errors and loop errors by reason",
                [
                    Query(
                        "sum by (reason) (rate(gpupool_collector_sysfs_errors_total[$__rate_interval]))",
                        "sysfs {{reason}}",
                    ),
                    Query(
                        "sum by (reason) (rate(gpupool_collector_loop_errors_total[$__rate_interval]))",
                        "loop {{reason}}",
                    ),
                ],
                description="InfiniBand sysfs files that could not be used, and unexpected exceptions the collection "
                "loop caught (it goes on).",
                unit="ops",
            )
        )
        .with_row(panels.row("Kafka"))
        .with_panel(
            panels.timeseries(
                "Telemetry records produced and consumed by topic",
                [Query(_PRODUCED, "produced {{topic}}"), Query(_CONSUMED, "consumed {{topic}}")],
                description="Records collectors hand to the producer, and records analytics reads, per second.",
                unit="ops",
            )
        )
        .with_panel(
            panels.timeseries(
                "Telemetry backlog growth by topic",
                [Query(f"{_PRODUCED} - ({_CONSUMED} or {_PRODUCED} * 0)", "{{topic}}")],
                description="Produced minus consumed records per second: above 0 the consumer lag grows. "
                "Alert GpupoolTelemetryBacklogGrowing (topics without a reported lag).",
                unit="ops",
            )
        )
        .with_panel(
            panels.timeseries(
                "Analytics consumer lag by topic",
                [Query("sum by (topic) (gpupool_analytics_consumer_lag_records)", "{{topic}}")],
                description="Records of the owned partitions not yet committed to DuckDB (end offset minus the "
                "offset stored with the rows), summed over partitions and analytics instances. Alert "
                "GpupoolKafkaConsumerLagGrowing when above 1000 and growing for 10 minutes.",
                unit="short",
                min_value=0,
            )
        )
        .with_panel(
            panels.timeseries(
                "Capacity topic: published and consumed",
                [
                    Query(
                        "sum(rate(gpupool_analytics_capacity_updates_total[$__rate_interval]))",
                        "published by analytics",
                    ),
                    Query(
                        'sum(rate(gpupool_broker_records_consumed_total{topic=~".*capacity"}[$__rate_interval]))',
                        "consumed by the broker",
                    ),
                ],
                description="Capacity updates analytics publishes and the broker consumes, per second.",
                unit="ops",
            )
        )
        .with_panel(
            panels.timeseries(
                "Produce errors by topic",
                [
                    Query(
                        "sum by (topic, reason) (rate(gpupool_collector_produce_errors_total[$__rate_interval]))",
                        "{{topic}} {{reason}}",
                    )
                ],
                description="Records the collectors' Kafka producer refused (topic * : a failed flush); they are lost.",
                unit="ops",
            )
        )
        .with_row(panels.row("Analytics (DuckDB)"))
        .with_panel(
            panels.timeseries(
                "Rows ingested per second by table",
                [
                    Query(
                        "sum by (table) (rate(gpupool_analytics_ingest_rows_total[$__rate_interval]))",
                        "{{table}}",
                    )
                ],
                description="Rows committed to DuckDB, with their Kafka offsets in the same transaction.",
                unit="ops",
            )
        )
        .with_panel(
            panels.timeseries(
                "DuckDB batch time",
                _quantiles("gpupool_analytics_ingest_batch_seconds_bucket"),
                description="Writing one batch (rows, offsets, states) in one DuckDB transaction.",
                unit="s",
            )
        )
        .with_panel(
            panels.timeseries(
                "Ingest and publish failures",
                [
                    Query(
                        "sum(increase(gpupool_analytics_ingest_failures_total[$__rate_interval]))",
                        "DuckDB batch rolled back",
                    ),
                    Query(
                        "sum(increase(gpupool_analytics_publish_failures_total[$__rate_interval]))",
                        "capacity publish failed",
                    ),
                ],
                description="Rolled-back DuckDB batches (re-read from the stored offsets) and failed capacity publishing rounds.",
            )
        )
        .with_panel(
            panels.timeseries(
                "Rejected records by reason",
                [
                    Query(
                        "sum by (reason) (rate(gpupool_analytics_rejected_records_total[$__rate_interval]))",
                        "{{reason}}",
                    )
                ],
                description="Records or values analytics skipped: malformed_json, invalid_record, duplicate, "
                "counter_out_of_range ...",
                unit="ops",
            )
        )
        .with_row(panels.row("Broker"))
        .with_panel(
            panels.state_timeline(
                "Edge sites online",
                Query("max by (site) (gpupool_broker_site_up)", "{{site}}"),
                description="Each edge site's retained birth or Last Will on sites/{site}/state as the broker "
                "reads it: 1 online, 0 offline. Alert GpupoolEdgeSiteOffline after 5 minutes offline.",
                states={0: ("offline", "red"), 1: ("online", "green")},
            )
        )
        .with_panel(
            panels.timeseries(
                "Claim to lease latency",
                _quantiles("gpupool_broker_claim_to_lease_seconds_bucket"),
                description="From a claim's arrival to its lease logged on Kafka and published on MQTT (fabric "
                "partition applied and verified in between). Alert above 2 s at p95.",
                unit="s",
            )
        )
        .with_panel(
            panels.timeseries(
                "MQTT connections by result",
                [
                    Query(
                        "sum by (result) (increase(gpupool_broker_mqtt_connections_total[$__rate_interval]))",
                        "{{result}}",
                    )
                ],
                description="Broker MQTT connection attempts and ends: connected, failed (never connected), lost.",
            )
        )
        .with_panel(
            panels.timeseries(
                "Rejected site messages by reason",
                [
                    Query(
                        "sum by (reason) (rate(gpupool_broker_rejected_messages_total[$__rate_interval]))",
                        "{{reason}}",
                    )
                ],
                description="Claims, renewals, releases and bus records the broker rejected, by reason code.",
                unit="ops",
            )
        )
        .with_panel(
            panels.timeseries(
                "Broker bus records by topic",
                [
                    Query(
                        "sum by (topic) (rate(gpupool_broker_records_consumed_total[$__rate_interval]))",
                        "consumed {{topic}}",
                    ),
                    Query(
                        "sum by (topic) (rate(gpupool_broker_records_produced_total[$__rate_interval]))",
                        "produced {{topic}}",
                    ),
                ],
                description="Capacity and pool demand records consumed; lease log records produced.",
                unit="ops",
            )
        )
    )
