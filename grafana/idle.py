"""The Idle capacity dashboard: idle GPUs by pool, model and grade (analytics), capacity updates,
GPUs the training scheduler has allocated but that idle (analytics joined with Slurm), offers,
leases, claims, reclaims and pool demands (broker).

Predicted idle windows are not exported as a metric yet (they travel on the capacity topic only),
so no panel shows them.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dashboard_b

from grafana import panels
from grafana.panels import Query

__all__ = ["UID", "dashboard"]

UID = "gpupool-idle"
"""Dashboard uid (stable: links and provisioning refer to it)."""

_POOL = 'pool=~"$pool"'
_LIVE = 'state=~"granted|active|reclaiming"'


def dashboard() -> dashboard_b.Dashboard:
    """The Idle capacity dashboard builder (uid :data:`UID`); variables ``datasource`` and ``pool``."""
    return (
        panels.dashboard(
            "gpupool / Idle capacity",
            UID,
            "Idle GPUs found by analytics, and what the broker makes of them: offers, leases, reclaims.",
            panels.label_variable("pool", "gpupool_analytics_idle_gpus", "pool", "Pool"),
        )
        .with_row(panels.row("Idle GPUs (analytics)"))
        .with_panel(
            panels.stat(
                "Idle GPUs",
                [Query(f"sum(gpupool_analytics_idle_gpus{{{_POOL}}})")],
                description="Idle GPUs and MIG instances in the selected pools, both grades.",
            )
        )
        .with_panel(
            panels.stat(
                "Idle, free",
                [Query(f'sum(gpupool_analytics_idle_gpus{{{_POOL}, grade="free"}})')],
                description="Idle GPUs holding no framebuffer memory: the first grade offered.",
            )
        )
        .with_panel(
            panels.stat(
                "Idle, memory held",
                [Query(f'sum(gpupool_analytics_idle_gpus{{{_POOL}, grade="memory_held"}})')],
                description="Compute idle, but a resident model holds framebuffer memory: offered as a lower grade.",
                thresholds=[(None, "yellow")],
            )
        )
        .with_panel(
            panels.stat(
                "Idle share of the fleet",
                [Query('sum(gpupool_analytics_gpus{state="idle"}) / sum(gpupool_analytics_gpus)')],
                description="Idle GPUs over all GPUs known to analytics (every pool).",
                unit="percentunit",
            )
        )
        .with_panel(
            panels.timeseries(
                "Idle GPUs by pool and model",
                [
                    Query(
                        f"sum by (pool, model) (gpupool_analytics_idle_gpus{{{_POOL}}})", "{{pool}} {{model}}"
                    )
                ],
                description="Idle GPUs by pool and GPU model (modelName from DCGM).",
                stack=True,
            )
        )
        .with_panel(
            panels.timeseries(
                "Idle GPUs by grade",
                [Query(f"sum by (grade) (gpupool_analytics_idle_gpus{{{_POOL}}})", "{{grade}}")],
                description="free: no memory held; memory_held: a resident model holds framebuffer memory.",
                stack=True,
            )
        )
        .with_panel(
            panels.timeseries(
                "Capacity updates published by state",
                [
                    Query(
                        "sum by (state) (rate(gpupool_analytics_capacity_updates_total[$__rate_interval]))",
                        "{{state}}",
                    )
                ],
                description="CapacityUpdate records analytics publishes to the capacity topic, per second, by GPU state.",
                unit="ops",
                width=24,
            )
        )
        .with_row(panels.row("Training scheduler: GPUs allocated but idle (analytics + Slurm)"))
        .with_panel(
            panels.timeseries(
                "GPUs allocated to jobs but idle",
                [
                    Query(
                        "sum by (partition, user, job) (gpupool_analytics_allocated_idle_gpus)",
                        "{{partition}} {{user}} job {{job}}",
                    )
                ],
                description="GPUs the training scheduler has allocated to a job while their telemetry says "
                "idle, by partition, user and job (analytics run --scheduler). Slurm's accounting counts "
                "them as used.",
                stack=True,
            )
        )
        .with_panel(
            panels.stat(
                "GPU-hours allocated but idle in range, by job",
                [
                    Query(
                        "sort_desc(sum by (partition, user, job) "
                        "(sum_over_time(gpupool_analytics_allocated_idle_gpus[$__range:1m])) / 60)",
                        "{{partition}} {{user}} job {{job}}",
                    )
                ],
                description="Per job, the GPU-hours its GPUs were allocated and idle over the time range "
                "(the gauge sampled each minute). The analytics view allocated_idle_gpu_hours gives the "
                "same per scheduler read.",
                unit="h",
                width=12,
                height=8,
                thresholds=panels.ANY_IS_WARNING,
            )
        )
        .with_panel(
            panels.timeseries(
                "Slurm source errors by command and reason",
                [
                    Query(
                        "sum by (command, reason) "
                        "(rate(gpupool_collector_slurm_errors_total[$__rate_interval]))",
                        "{{command}} {{reason}}",
                    )
                ],
                description="Failed reads of Slurm (scontrol not found, exit status, timeout...: the read is "
                "skipped and the node states go stale) and output lines that did not parse, per second.",
                unit="ops",
                width=24,
            )
        )
        .with_panel(
            panels.timeseries(
                "Kubernetes source errors by resource and reason",
                [
                    Query(
                        "sum by (resource, reason) "
                        "(rate(gpupool_collector_kubernetes_errors_total[$__rate_interval]))",
                        "{{resource}} {{reason}}",
                    ),
                    Query(
                        'sum(rate(gpupool_collector_kubernetes_reads_total{outcome="failed"}[$__rate_interval]))',
                        "failed reads",
                    ),
                ],
                description="Failed lists and watches of the API server (unreachable, http_403...: reads fail "
                "until it is listed again and the node states go stale), expired watches (listed again), "
                "objects that did not parse, and failed reads, per second.",
                unit="ops",
                width=24,
            )
        )
        .with_row(panels.row("Offers and leases (broker)"))
        .with_panel(
            panels.stat(
                "Live leases",
                [Query(f"sum(gpupool_broker_leases{{{_LIVE}}})")],
                description="Leases holding GPUs: granted, active or reclaiming.",
            )
        )
        .with_panel(
            panels.stat(
                "Reclaiming",
                [Query('sum(gpupool_broker_leases{state="reclaiming"})')],
                description="Leases given notice because training wants their GPUs back.",
                thresholds=panels.ANY_IS_WARNING,
            )
        )
        .with_panel(
            panels.stat(
                "Leases granted in range",
                [Query("sum(increase(gpupool_broker_leases_granted_total[$__range]))")],
                description="Leases granted over the dashboard's time range.",
            )
        )
        .with_panel(
            panels.stat(
                "Revoked at deadline in range",
                [
                    Query(
                        'sum(increase(gpupool_broker_reclaims_total{outcome="revoked_at_deadline"}[$__range]))'
                    )
                ],
                description="Reclaims where the site did not release within notice and the broker revoked the lease.",
                thresholds=panels.ANY_IS_WARNING,
            )
        )
        .with_panel(
            panels.timeseries(
                "Offers published and withdrawn",
                [
                    Query("sum(rate(gpupool_broker_offers_published_total[$__rate_interval]))", "published"),
                    Query("sum(rate(gpupool_broker_offers_withdrawn_total[$__rate_interval]))", "withdrawn"),
                ],
                description="Retained offers published on MQTT and withdrawn (claimed, changed, expired), per second.",
                unit="ops",
            )
        )
        .with_panel(
            panels.timeseries(
                "Leases by state",
                [Query("sum by (state) (gpupool_broker_leases)", "{{state}}")],
                description="Leases the broker remembers, by state (released, expired and revoked ones until forgotten).",
            )
        )
        .with_panel(
            panels.timeseries(
                "Claims by result",
                [
                    Query(
                        "sum by (result) (rate(gpupool_broker_claims_total[$__rate_interval]))", "{{result}}"
                    )
                ],
                description="Claims answered per second: ok, or the reason code of the rejection.",
                unit="ops",
            )
        )
        .with_panel(
            panels.timeseries(
                "Reclaims by outcome",
                [
                    Query(
                        "sum by (outcome) (increase(gpupool_broker_reclaims_total[$__rate_interval]))",
                        "{{outcome}}",
                    )
                ],
                description="Reclaims started, and how they ended: released_in_notice, revoked_at_deadline, "
                "expired_in_notice.",
            )
        )
        .with_panel(
            panels.timeseries(
                "Pool demands by result",
                [
                    Query(
                        "sum by (result) (rate(gpupool_broker_demands_total[$__rate_interval]))", "{{result}}"
                    )
                ],
                description="Training demands for GPUs back, per second: reclaimed, nothing_to_reclaim, duplicate, stale.",
                unit="ops",
                width=24,
            )
        )
    )
