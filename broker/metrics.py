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
    "From a partition change being asked for (isolate or remove) to it being verified on the fabric.",
    ["op"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0),
)
FABRIC_VERIFY_FAILURES = Counter(
    "gpupool_broker_fabric_verify_failures_total",
    "Partition changes that could not be applied or verified, by reason (unmapped_host, unknown_port, "
    "config_error, write_failed, opensm_down, pkey_missing, wrong_membership, unreachable, sl_mismatch, "
    "not_removed).",
    ["reason"],
)
FABRIC_RELOADS = Counter(
    "gpupool_broker_fabric_reloads_total",
    "Partition files rewritten and OpenSM told to re-read them (SIGHUP), by result: ok, failed.",
    ["result"],
)
