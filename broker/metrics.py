"""Prometheus metrics of the broker stage (``gpupool_broker_`` prefix), built on the registry a
:class:`BrokerMetrics` is given: one object per broker service, whose ``/metrics`` serves that
registry (two services in one process never share a series).

The gauges ``gpupool_broker_leases{state}`` and ``gpupool_broker_site_up{site}`` are read from the
service's state at scrape time (:meth:`BrokerMetrics.lease_gauge`, :meth:`BrokerMetrics.site_up_gauge`); the fabric manager's metrics are :class:`FabricMetrics`
(``BrokerMetrics.fabric``, handed to :class:`broker.fabric_opensm.OpenSmFabric`).
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry

from runtime.metrics import MetricSet, Samples, StateGauge

__all__ = ["BrokerMetrics", "FabricMetrics"]


class FabricMetrics(MetricSet):
    """Metrics of the OpenSM fabric manager (``gpupool_broker_fabric_*``): partition changes,
    verification failures, OpenSM reloads, QoS audits and drift.

    On the registry it is given (:class:`runtime.metrics.MetricSet`; a new one when ``None``).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.qos_drift: Mapping[str, int] = {}
        """Connected ports that differ from the QoS plan, by switch, at the last audit: replaced
        whole by the manager, read by ``gpupool_broker_fabric_qos_drift_ports`` at scrape time."""
        self.state_gauge(
            "gpupool_broker_fabric_qos_drift_ports",
            "Connected ports of a switch whose SL2VL or VLArbitration tables, read back by the last QoS audit, "
            "differ from gpupool's QoS plan (0: as planned); by switch (node id or GUID).",
            ["switch"],
            lambda: {(switch,): n for switch, n in self.qos_drift.items()},
        )
        self.apply_seconds = self.histogram(
            "gpupool_broker_fabric_apply_seconds",
            "From a partition change being asked for (isolate or remove) to it being verified on the fabric; "
            "op qos_verify: reading a lease's path ports back until their QoS tables match the plan.",
            ["op"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0),
        )
        self.verify_failures = self.counter(
            "gpupool_broker_fabric_verify_failures_total",
            "Partition changes that could not be applied or verified, by reason (unmapped_host, unknown_port, "
            "config_error, write_failed, opensm_down, pkey_missing, wrong_membership, unreachable, sl_mismatch, "
            "not_removed; QoS: qos_config, qos_mismatch, qos_unreachable, no_path).",
            ["reason"],
        )
        self.qos_audits = self.counter(
            "gpupool_broker_fabric_qos_audits_total",
            "QoS audits of every switch port, by result: ok, drift (a port differs from the plan), failed (the "
            "fabric could not be read), not_applied (no QoS plan written yet).",
            ["result"],
        )
        self.qos_audit_seconds = self.histogram(
            "gpupool_broker_fabric_qos_audit_seconds",
            "Wall time of one QoS audit (topology discovery and every switch port's tables read back).",
            buckets=(0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
        )
        self.qos_last_audit = self.gauge(
            "gpupool_broker_fabric_qos_last_audit_timestamp_seconds",
            "Unix time the last QoS audit finished (any result but failed).",
        )
        self.lent_share = self.gauge(
            "gpupool_broker_fabric_lent_share_ratio",
            "The lent-share bound of the QoS plan: the largest fraction (0..1) of a link lent traffic can take "
            "while training keeps it busy (broker setting lent_share_percent, rounded down to what "
            "qos_high_limit can give).",
        )
        self.reloads = self.counter(
            "gpupool_broker_fabric_reloads_total",
            "Partition files rewritten and OpenSM told to re-read them (SIGHUP), by result: ok, failed.",
            ["result"],
        )


class BrokerMetrics(MetricSet):
    """Every metric of one broker service (counters and histograms; the gauges read from its
    state are added by the service with :meth:`lease_gauge` and :meth:`site_up_gauge`), and :attr:`fabric` (:class:`FabricMetrics`) on the same
    registry.

    On the registry it is given (:class:`runtime.metrics.MetricSet`; a new one when ``None``).
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.fabric = FabricMetrics(self.registry)
        self.offers_published = self.counter(
            "gpupool_broker_offers_published_total", "Offers published (retained) on MQTT.",
        )
        self.offers_withdrawn = self.counter(
            "gpupool_broker_offers_withdrawn_total",
            "Offers withdrawn (empty retained payload): claimed, changed, expired.",
        )
        self.claims = self.counter(
            "gpupool_broker_claims_total", "Claims answered, by result (ok or the reason code).", ["result"],
        )
        self.rejected_messages = self.counter(
            "gpupool_broker_rejected_messages_total",
            "Site messages (claims, renewals, releases) and bus records rejected, by reason.",
            ["reason"],
        )
        self.leases_granted = self.counter(
            "gpupool_broker_leases_granted_total", "Leases granted.",
        )
        self.reclaims = self.counter(
            "gpupool_broker_reclaims_total",
            "Reclaims, by outcome: started, released_in_notice, revoked_at_deadline, expired_in_notice.",
            ["outcome"],
        )
        self.claim_to_lease = self.histogram(
            "gpupool_broker_claim_to_lease_seconds",
            "From a claim's arrival at the broker to its lease being logged and published.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
        )
        self.demands = self.counter(
            "gpupool_broker_demands_total",
            "Pool demands read, by result: reclaimed, nothing_to_reclaim, duplicate, stale.",
            ["result"],
        )
        self.records_consumed = self.counter(
            "gpupool_broker_records_consumed_total", "Bus records consumed, by topic.", ["topic"],
        )
        self.records_produced = self.counter(
            "gpupool_broker_records_produced_total", "Bus records produced, by topic.", ["topic"],
        )
        self.mqtt_connections = self.counter(
            "gpupool_broker_mqtt_connections_total",
            "MQTT connection attempts and ends, by result: connected, failed (never connected), lost.",
            ["result"],
        )
        self.claim_decisions = self.counter(
            "gpupool_broker_claim_decisions_total",
            "Claims decided by the lease book, by site, kind (offer: names an offer_id; match: requirements) "
            "and result (ok, or the reason code: no_match, quota_exceeded, gpu_unavailable, isolation_failed...).",
            ["site", "kind", "result"],
        )
        self.match_placements = self.counter(
            "gpupool_broker_match_placements_total",
            "Matched claims reserved, by locality tier: node (one node), leaf (several nodes under one leaf "
            "switch), cross_leaf.",
            ["tier"],
        )
        self.guarantees_broken = self.counter(
            "gpupool_broker_guarantees_broken_total",
            "Leases reclaimed by a forced demand (PoolDemand.force) before their minimum guaranteed duration ended.",
        )
        self.reclaims_deferred = self.counter(
            "gpupool_broker_reclaims_deferred_total",
            "Leases a demand wanted back inside their minimum guaranteed duration: their reclaim deadline was "
            "moved to the end of the guarantee (the GPUs come back then).",
        )
        self.leases_at_risk = self.counter(
            "gpupool_broker_leases_at_risk_total",
            "Leases warned at risk (the training scheduler planned a pending job onto their GPUs), or whose "
            "expected reclaim moved earlier: each is a lease message with reason at_risk.",
        )
        self.windows_cut = self.counter(
            "gpupool_broker_windows_cut_total",
            "Window leases a training job is planned onto before their promised window_until ends (the promise "
            "is broken by the scheduler's plan).",
        )
        self.fabric_stale_removed = self.counter(
            "gpupool_broker_fabric_stale_partitions_removed_total",
            "Lease partitions removed (verified gone) at start because no live lease holds them: leases that "
            "ended while no broker ran, or claims a stopped broker never granted.",
        )
        self.malformed_messages = self.counter(
            "gpupool_broker_malformed_messages_total",
            "Site messages answered malformed or unsupported_version, by request (claim, renewal, release) and "
            "failed check (size, utf8, json, depth, non_finite, object, version, schema; broker/wire.py).",
            ["request", "check"],
        )
        self.ignored_requests = self.counter(
            "gpupool_broker_ignored_requests_total",
            "Site requests dropped without an answer, by reason: retained (a retained claim, renewal or release "
            "is never acted on, and is cleared), stale (its ts older than request_max_age_s).",
            ["reason"],
        )
        self.rate_limited = self.counter(
            "gpupool_broker_rate_limited_requests_total",
            "Site requests answered rate_limited (the site's token bucket was empty).",
            ["site"],
        )
        self.lease_log_write_failures = self.counter(
            "gpupool_broker_lease_log_write_failures_total",
            "Lease transitions the lease log did not take (record refused, Kafka unreachable past "
            "lease_log_timeout_s): undone in memory, never published, the request answered internal.",
        )
        self.mqtt_publish_failures = self.counter(
            "gpupool_broker_mqtt_publish_failures_total",
            "MQTT publishes that failed, by what happened next: retried (sent again on the connection), "
            "queued (kept for the next connection), resync (retained state: republished at reconnect), "
            "dropped (the outbox was full).",
            ["outcome"],
        )

        self.placeholder_gpus = self.gauge(
            "gpupool_broker_placeholder_gpus",
            "GPUs held by idle placeholder jobs in the training scheduler (ready to be carved into leases).",
        )
        self.hold_release = self.histogram(
            "gpupool_broker_hold_release_seconds",
            "From a lease's end (release, expiry, revocation) to the scheduler no longer running its hold.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
        )
        self.preemption_notice = self.histogram(
            "gpupool_broker_preemption_notice_seconds",
            "From the training scheduler choosing a lease's hold for preemption to the reclaim notice logged.",
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0),
        )
        self.scheduler_errors = self.counter(
            "gpupool_broker_scheduler_errors_total",
            "Training-scheduler commands that failed, by operation: read, submit, retag, extend, release, signal, "
            "start (health check).",
            ["operation"],
        )

    def site_up_gauge(self, read: Samples) -> StateGauge:
        """Register ``gpupool_broker_site_up{site}``, read by ``read()`` at each scrape
        (``{(site,): 1 or 0}``). Raises ``ValueError`` when already registered."""
        return self.state_gauge(
            "gpupool_broker_site_up",
            "Edge site online (1) or offline (0), from its retained sites/{site}/state birth or Last Will "
            "(contracts.mqtt.PeerState); a site whose state was cleared has no series.",
            ["site"],
            read,
        )

    def lease_gauge(self, read: Samples) -> StateGauge:
        """Register ``gpupool_broker_leases{state}``, read by ``read()`` at each scrape
        (``{(state,): leases}``). Raises ``ValueError`` when already registered."""
        return self.state_gauge("gpupool_broker_leases", "Leases the broker remembers, by state.", ["state"], read)
