"""Prometheus metrics of the broker stage (default registry, ``gpupool_broker_`` prefix)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

OFFERS_PUBLISHED = Counter("gpupool_broker_offers_published_total", "Offers published (retained) on MQTT.")
OFFERS_WITHDRAWN = Counter(
    "gpupool_broker_offers_withdrawn_total",
    "Offers withdrawn (empty retained payload): claimed, changed, expired.",
)
CLAIMS = Counter(
    "gpupool_broker_claims_total", "Claims answered, by result (ok or the reason code).", ["result"]
)
REJECTED_MESSAGES = Counter(
    "gpupool_broker_rejected_messages_total",
    "Site messages (claims, renewals, releases) and bus records rejected, by reason.",
    ["reason"],
)
LEASES = Gauge("gpupool_broker_leases", "Leases the broker remembers, by state.", ["state"])
LEASES_GRANTED = Counter("gpupool_broker_leases_granted_total", "Leases granted.")
RECLAIMS = Counter(
    "gpupool_broker_reclaims_total",
    "Reclaims, by outcome: started, released_in_notice, revoked_at_deadline, expired_in_notice.",
    ["outcome"],
)
CLAIM_TO_LEASE = Histogram(
    "gpupool_broker_claim_to_lease_seconds",
    "From a claim's arrival at the broker to its lease being logged and published.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
DEMANDS = Counter(
    "gpupool_broker_demands_total",
    "Pool demands read, by result: reclaimed, nothing_to_reclaim, duplicate, stale.",
    ["result"],
)
RECORDS_CONSUMED = Counter(
    "gpupool_broker_records_consumed_total", "Bus records consumed, by topic.", ["topic"]
)
RECORDS_PRODUCED = Counter(
    "gpupool_broker_records_produced_total", "Bus records produced, by topic.", ["topic"]
)
MQTT_CONNECTIONS = Counter(
    "gpupool_broker_mqtt_connections_total",
    "MQTT connection attempts and ends, by result: connected, failed (never connected), lost.",
    ["result"],
)
FABRIC_APPLY_SECONDS = Histogram(
    "gpupool_broker_fabric_apply_seconds",
    "From a partition change being asked for (isolate or remove) to it being verified on the fabric; "
    "op qos_verify: reading a lease's path ports back until their QoS tables match the plan.",
    ["op"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0),
)
FABRIC_VERIFY_FAILURES = Counter(
    "gpupool_broker_fabric_verify_failures_total",
    "Partition changes that could not be applied or verified, by reason (unmapped_host, unknown_port, "
    "config_error, write_failed, opensm_down, pkey_missing, wrong_membership, unreachable, sl_mismatch, "
    "not_removed; QoS: qos_config, qos_mismatch, qos_unreachable, no_path).",
    ["reason"],
)
FABRIC_QOS_DRIFT_PORTS = Gauge(
    "gpupool_broker_fabric_qos_drift_ports",
    "Connected ports of a switch whose SL2VL or VLArbitration tables, read back by the last QoS audit, "
    "differ from gpupool's QoS plan (0: as planned); by switch (node id or GUID).",
    ["switch"],
)
FABRIC_QOS_AUDITS = Counter(
    "gpupool_broker_fabric_qos_audits_total",
    "QoS audits of every switch port, by result: ok, drift (a port differs from the plan), failed (the "
    "fabric could not be read), not_applied (no QoS plan written yet).",
    ["result"],
)
FABRIC_QOS_AUDIT_SECONDS = Histogram(
    "gpupool_broker_fabric_qos_audit_seconds",
    "Wall time of one QoS audit (topology discovery and every switch port's tables read back).",
    buckets=(0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
)
FABRIC_QOS_LAST_AUDIT = Gauge(
    "gpupool_broker_fabric_qos_last_audit_timestamp_seconds",
    "Unix time the last QoS audit finished (any result but failed).",
)
FABRIC_LENT_SHARE = Gauge(
    "gpupool_broker_fabric_lent_share_ratio",
    "The lent-share bound of the QoS plan: the largest fraction (0..1) of a link lent traffic can take "
    "while training keeps it busy (broker setting lent_share_percent, rounded down to what "
    "qos_high_limit can give).",
)
FABRIC_RELOADS = Counter(
    "gpupool_broker_fabric_reloads_total",
    "Partition files rewritten and OpenSM told to re-read them (SIGHUP), by result: ok, failed.",
    ["result"],
)
SITE_UP = Gauge(
    "gpupool_broker_site_up",
    "Edge site online (1) or offline (0), from its retained sites/{site}/state birth or Last Will "
    "(contracts.mqtt.PeerState); a site whose state was cleared has no series.",
    ["site"],
)
CLAIM_DECISIONS = Counter(
    "gpupool_broker_claim_decisions_total",
    "Claims decided by the lease book, by site, kind (offer: names an offer_id; match: requirements) "
    "and result (ok, or the reason code: no_match, quota_exceeded, gpu_unavailable, isolation_failed...).",
    ["site", "kind", "result"],
)
MATCH_PLACEMENTS = Counter(
    "gpupool_broker_match_placements_total",
    "Matched claims reserved, by locality tier: node (one node), leaf (several nodes under one leaf "
    "switch), cross_leaf.",
    ["tier"],
)
GUARANTEES_BROKEN = Counter(
    "gpupool_broker_guarantees_broken_total",
    "Leases reclaimed by a forced demand (PoolDemand.force) before their minimum guaranteed duration ended.",
)
RECLAIMS_DEFERRED = Counter(
    "gpupool_broker_reclaims_deferred_total",
    "Leases a demand wanted back inside their minimum guaranteed duration: their reclaim deadline was "
    "moved to the end of the guarantee (the GPUs come back then).",
)
FABRIC_STALE_REMOVED = Counter(
    "gpupool_broker_fabric_stale_partitions_removed_total",
    "Lease partitions removed (verified gone) at start because no live lease holds them: leases that "
    "ended while no broker ran, or claims a stopped broker never granted.",
)
MALFORMED_MESSAGES = Counter(
    "gpupool_broker_malformed_messages_total",
    "Site messages answered malformed or unsupported_version, by request (claim, renewal, release) and "
    "failed check (size, utf8, json, depth, non_finite, object, version, schema; broker/wire.py).",
    ["request", "check"],
)
IGNORED_REQUESTS = Counter(
    "gpupool_broker_ignored_requests_total",
    "Site requests dropped without an answer, by reason: retained (a retained claim, renewal or release "
    "is never acted on, and is cleared), stale (its ts older than request_max_age_s).",
    ["reason"],
)
RATE_LIMITED = Counter(
    "gpupool_broker_rate_limited_requests_total",
    "Site requests answered rate_limited (the site's token bucket was empty).",
    ["site"],
)
LEASE_LOG_WRITE_FAILURES = Counter(
    "gpupool_broker_lease_log_write_failures_total",
    "Lease transitions the lease log did not take (record refused, Kafka unreachable past "
    "lease_log_timeout_s): undone in memory, never published, the request answered internal.",
)
MQTT_PUBLISH_FAILURES = Counter(
    "gpupool_broker_mqtt_publish_failures_total",
    "MQTT publishes that failed, by what happened next: retried (sent again on the connection), "
    "queued (kept for the next connection), resync (retained state: republished at reconnect), "
    "dropped (the outbox was full).",
    ["outcome"],
)
PLACEHOLDERS = Gauge(
    "gpupool_broker_placeholder_gpus",
    "GPUs held by idle placeholder jobs in the training scheduler (ready to be carved into leases).",
)
HOLD_RELEASE = Histogram(
    "gpupool_broker_hold_release_seconds",
    "From a lease's end (release, expiry, revocation) to the scheduler no longer running its hold.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)
PREEMPTION_NOTICE = Histogram(
    "gpupool_broker_preemption_notice_seconds",
    "From the training scheduler choosing a lease's hold for preemption to the reclaim notice logged.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0),
)
SCHEDULER_ERRORS = Counter(
    "gpupool_broker_scheduler_errors_total",
    "Training-scheduler commands that failed, by operation: read, submit, retag, release, signal, start (health check).",
    ["operation"],
)
