"""Settings of the broker stage (one typed model; every time is in seconds)."""

from __future__ import annotations

from pydantic import ConfigDict, Field

from broker.fabric_qos import effective_share_percent
from runtime.settings import BrokerPolicy, BrokerSettings

DEFAULT_SITE_QUOTA = BrokerPolicy.model_fields["default_site_quota"].default
"""GPUs a site may hold at once unless configured (``[broker] default_site_quota``)."""


class BrokerConfig(BrokerPolicy):
    """How the broker offers, leases and reclaims; shared by :class:`broker.leases.LeaseBook` and
    :class:`broker.service.BrokerService`: the lease policy of the ``[broker]`` settings
    (:class:`runtime.settings.BrokerPolicy`: times, consumer group, zones, quotas, fair share,
    request limits) plus the fields below, which the settings do not set. Frozen.

    Attributes:
        tick_s: how often the service looks for expired offers, lease TTLs and reclaim deadlines.
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
        lent_share_percent: the lent-share bound shown in each offer and lease (percent of a busy
            link lent traffic can take at most, as the fabric manager's QoS plan gives it);
            ``None``: no fabric QoS is managed.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    tick_s: float = Field(default=0.5, gt=0)
    retain_terminal_s: float = Field(default=900.0, ge=0)
    capacity_max_age_s: float = Field(default=120.0, gt=0)
    reclaim_hold_s: float = Field(default=300.0, ge=0)
    demand_max_age_s: float = Field(default=300.0, gt=0)
    reconnect_min_s: float = Field(default=0.2, gt=0)
    reconnect_max_s: float = Field(default=30.0, gt=0)
    rebuild_timeout_s: float = Field(default=60.0, gt=0)
    lent_share_percent: float | None = Field(default=None, gt=0, le=100)

    def quota_of(self, site: str) -> int | None:
        """The most GPUs ``site`` may hold at once; ``None``: unlimited."""
        return self.site_quotas.get(site, self.default_site_quota)

    def weight_of(self, site: str) -> float:
        """Fair-share weight of ``site`` (1.0 unless configured)."""
        return self.site_weights.get(site, 1.0)


def broker_config_from(settings: BrokerSettings) -> BrokerConfig:
    """The :class:`BrokerConfig` of the ``[broker]`` settings group (its lease policy,
    :class:`runtime.settings.BrokerPolicy`, and the lent-share bound when fabric QoS is managed;
    the rest at their defaults) — the one mapping used by ``gpupool broker run`` and
    ``gpupool config show``.

    Raises:
        pydantic.ValidationError: a value :class:`BrokerConfig` refuses.
    """
    return BrokerConfig(
        **settings.model_dump(include=set(BrokerPolicy.model_fields)),
        lent_share_percent=(
            effective_share_percent(settings.lent_share_percent)
            if settings.fabric_state is not None and settings.fabric_qos
            else None
        ),
    )
