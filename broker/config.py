"""Settings of the broker stage (one typed model; every time is in seconds)."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from broker.fabric_qos import effective_share_percent
from broker.workloads import WorkloadProfile
from contracts.mqtt import LIMITS
from runtime.settings import BrokerSettings

DEFAULT_SITE_QUOTA = 64
"""GPUs a site may hold at once unless configured (``[broker] default_site_quota``)."""


class BrokerConfig(BaseModel):
    """How the broker offers, leases and reclaims; shared by :class:`broker.leases.LeaseBook` and
    :class:`broker.service.BrokerService`.

    Attributes:
        offer_ttl_s: an offer lapses this long after it is published (``Offer.expires_at``, and the
            MQTT 5 message expiry); still-idle GPUs are then offered again under a new id.
        notice_s: reclaim notice a lease gets (``Offer.notice_seconds``): on a training demand the
            site has this long to release before the lease is revoked.
        lease_ttl_s: a lease expires unless renewed within this long; a renewal never extends it
            by more than this.
        tick_s: how often the service looks for expired offers, lease TTLs and reclaim deadlines.
        group_id: Kafka consumer group of the capacity and pool-demand consumer.
        retain_terminal_s: how long a released / expired / revoked lease (and every claim answer)
            is remembered for idempotent replies before it is forgotten and its retained MQTT lease
            message cleared.
        capacity_max_age_s: a GPU whose newest capacity update is older than this (by its ``ts``)
            counts as unknown and is not offered: analytics re-publishes every GPU regularly, so
            silence means it stopped watching (or a restarted broker replayed old history).
        reclaim_hold_s: GPUs taken back by a reclaim are not offered again until analytics reports
            them busy or unknown, or until this long has passed (training asked for them).
        demand_max_age_s: a pool demand older than this when read (by its ``ts``) is ignored, so a
            broker replaying an old ``pool.demand`` topic does not reclaim on stale demands.
        reconnect_min_s / reconnect_max_s: MQTT reconnect backoff (doubles per failure, jittered).
        rebuild_timeout_s: how long the start may take to read ``leases.log`` to its end.
        pool_zones: pool name → latency zone, stamped on each offer (``Offer.zone``) so claims
            can ask for a zone; a pool not listed has no zone.
        site_quotas: site → the most GPUs it may hold at once (live leases plus claims being
            granted); a site not listed gets ``default_site_quota``.
        default_site_quota: quota of sites not in ``site_quotas`` (default
            :data:`DEFAULT_SITE_QUOTA`, 64 GPUs, so no site takes a whole pool by flooding);
            ``None``: unlimited.
        site_weights: site → fair-share weight (> 0); a site not listed weighs 1. See
            :mod:`broker.quota` for the policy (weighted max-min).
        fair_share_window_s: a site whose claim was refused this recently (for want of GPUs or
            quota) still counts as waiting for its fair share.
        site_forget_after_s: a site offline (its Last Will, or a death) this long, by the
            broker's clock, and holding no live lease is forgotten: its ``site``
            series (``gpupool_broker_site_up``, ``gpupool_broker_claim_decisions_total``) are
            removed. A later birth makes it new again.
        site_request_rate_per_s / site_request_burst: per-site token bucket of claims, renewals
            and releases together (:mod:`broker.ratelimit`); past it a request is answered
            ``rate_limited``.
        request_max_age_s: a claim, renewal or release whose ``ts`` is older than this when it
            arrives is ignored (counted as ``stale``): a site's queued backlog after an outage is
            not acted on long after it was meant.
        lease_log_timeout_s: how long writing a change to the lease log may take; past it (or on
            any refusal) the change is undone and the request answered ``internal``.
        lent_share_percent: the lent-share bound shown in each offer and lease (percent of a busy
            link lent traffic can take at most, as the fabric manager's QoS plan gives it);
            ``None``: no fabric QoS is managed.
        workloads: the operator's workload profiles a claim may name (``Claim.workload``); a
            name that is not here, or not allowed to the site, is refused ``unknown_workload``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    offer_ttl_s: float = Field(default=60.0, gt=0)
    notice_s: float = Field(default=30.0, ge=0)
    lease_ttl_s: float = Field(default=60.0, gt=0)
    tick_s: float = Field(default=0.5, gt=0)
    group_id: str = "gpupool-broker"
    retain_terminal_s: float = Field(default=900.0, ge=0)
    capacity_max_age_s: float = Field(default=120.0, gt=0)
    reclaim_hold_s: float = Field(default=300.0, ge=0)
    demand_max_age_s: float = Field(default=300.0, gt=0)
    reconnect_min_s: float = Field(default=0.2, gt=0)
    reconnect_max_s: float = Field(default=30.0, gt=0)
    rebuild_timeout_s: float = Field(default=60.0, gt=0)
    pool_zones: dict[str, str] = Field(default_factory=dict)
    site_quotas: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    default_site_quota: int | None = Field(default=DEFAULT_SITE_QUOTA, ge=0)
    site_weights: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)
    fair_share_window_s: float = Field(default=60.0, ge=0)
    site_forget_after_s: float = Field(default=3600.0, gt=0)
    site_request_rate_per_s: float = Field(default=LIMITS.site_request_rate_per_s, gt=0)
    site_request_burst: float = Field(default=LIMITS.site_request_burst, ge=1)
    request_max_age_s: float = Field(default=LIMITS.request_max_age_seconds, gt=0)
    lease_log_timeout_s: float = Field(default=5.0, gt=0)
    lent_share_percent: float | None = Field(default=None, gt=0, le=100)
    workloads: tuple[WorkloadProfile, ...] = ()

    @field_validator("workloads")
    @classmethod
    def _names_unique(cls, workloads: tuple[WorkloadProfile, ...]) -> tuple[WorkloadProfile, ...]:
        names = [w.name for w in workloads]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"workload profiles declared twice: {twice}")
        return workloads

    def quota_of(self, site: str) -> int | None:
        """The most GPUs ``site`` may hold at once; ``None``: unlimited."""
        return self.site_quotas.get(site, self.default_site_quota)

    def weight_of(self, site: str) -> float:
        """Fair-share weight of ``site`` (1.0 unless configured)."""
        return self.site_weights.get(site, 1.0)


def broker_config_from(settings: BrokerSettings) -> BrokerConfig:
    """The :class:`BrokerConfig` of the ``[broker]`` settings group (times, consumer group, zones,
    quotas, fair-share weights, request limits; the rest at their defaults) — the one mapping used by
    ``gpupool broker run`` and ``gpupool config show``.

    Raises:
        pydantic.ValidationError: a value :class:`BrokerConfig` refuses.
    """
    return BrokerConfig(
        offer_ttl_s=settings.offer_ttl_s,
        notice_s=settings.notice_s,
        lease_ttl_s=settings.lease_ttl_s,
        group_id=settings.group_id,
        pool_zones=settings.pool_zones,
        site_quotas=settings.site_quotas,
        default_site_quota=settings.default_site_quota,
        site_weights=settings.site_weights,
        fair_share_window_s=settings.fair_share_window_s,
        site_forget_after_s=settings.site_forget_after_s,
        site_request_rate_per_s=settings.site_request_rate_per_s,
        site_request_burst=settings.site_request_burst,
        request_max_age_s=settings.request_max_age_s,
        lease_log_timeout_s=settings.lease_log_timeout_s,
        workloads=tuple(WorkloadProfile.model_validate(w) for w in settings.workloads),
        lent_share_percent=(
            effective_share_percent(settings.lent_share_percent)
            if settings.fabric_state is not None and settings.fabric_qos
            else None
        ),
    )
