"""The deployment's settings: one typed model (pydantic-settings) that every stage reads.

One TOML file configures a whole deployment, so its shape is shared by every stage: the
collectors, analytics and broker ``run`` commands each load it (``--config FILE``). The model
imports no stage (a stage may import only ``contracts`` and ``runtime``,
tests/test_architecture.py): the stage CLIs turn their group into their own configuration
(``analytics.classify.IdleConfig``, ``broker.config.BrokerConfig``), and :mod:`gpupool.settings`,
which may import every stage, adds the cross-checks that need those classes for
``gpupool config show``.

Sources, highest priority first:

1. the ``overrides`` given to :func:`load_settings` (the command-line flags of a stage);
2. environment variables ``GPUPOOL_<FIELD>``, nested groups with ``__``:
   ``GPUPOOL_KAFKA``, ``GPUPOOL_MQTT_PASSWORD``, ``GPUPOOL_IDLE__MIN_IDLE_S``,
   ``GPUPOOL_BROKER__NOTICE_S``, ``GPUPOOL_METRICS__BROKER``,
   ``GPUPOOL_COLLECTORS__DCGM_TARGETS='["http://..."]'`` (names are case-insensitive; lists and
   whole groups as JSON, ``GPUPOOL_IDLE='{"min_idle_s": 10}'``);
3. a TOML file named by ``--config`` or ``GPUPOOL_CONFIG`` (top-level keys are the fields of
   :class:`DeploymentSettings`, tables ``[metrics]``, ``[idle]``, ``[collectors]``,
   ``[analytics]``, ``[broker]`` the groups);
4. the defaults below. The metrics ports are the ones ``deploy/prometheus/prometheus.yml``
   scrapes (9410 collectors, 9411 analytics, 9412 broker).

Other ``GPUPOOL_*`` variables (``GPUPOOL_SITE``, ``GPUPOOL_STATE`` of the Makefile...) are not
settings and are ignored; an unknown key in the TOML file is an error.

Example file::

    kafka = "kafka-1:9092,kafka-2:9092"
    mqtt = "mqtt.example.internal:1883"
    [idle]
    min_idle_s = 120
    [collectors]
    dcgm_targets = ["http://127.0.0.1:9400/metrics"]
    [broker]
    notice_s = 60
"""

from __future__ import annotations

import fnmatch
import os
import tomllib
from dataclasses import dataclass
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic.fields import FieldInfo
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from contracts.mqtt import LIMITS

__all__ = [
    "CONFIG_ENV",
    "AnalyticsSettings",
    "BrokerPolicy",
    "BrokerSettings",
    "CollectorsSettings",
    "DeploymentSettings",
    "Flag",
    "IdleSettings",
    "MetricsSettings",
    "SettingsError",
    "load_settings",
    "settings_field",
]

CONFIG_ENV = "GPUPOOL_CONFIG"
"""Environment variable naming the TOML settings file (``--config`` wins over it)."""


def _host_port(value: str) -> str:
    host, sep, port = value.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {value!r}")
    return f"{host}:{port}"


@dataclass(frozen=True)
class Flag:
    """Marks a settings field that is also a command-line option (``Annotated[T, Flag()]``): the
    option ``--NAME`` of every command that takes the field (:class:`RunFlags`, options derived by
    :mod:`runtime.run_options`). ``name`` is in Python spelling (``_`` for ``-``); ``None``: the
    field's own name. A field without it is set only by the environment or the file."""

    name: str | None = None


class MetricsSettings(BaseModel):
    """Where each stage serves Prometheus ``/metrics`` (port 0: off). The ports are the ones
    ``deploy/prometheus`` scrapes. Each field's docstring is its description (the run commands'
    help, :mod:`runtime.run_options`)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    addr: Annotated[str, Flag("metrics_addr")] = "127.0.0.1"
    """Address every stage's /metrics server binds to."""
    collectors: Annotated[int, Flag("metrics_port")] = Field(default=9410, ge=0, le=65535)
    """Serve the collectors' Prometheus /metrics on this port (0: off)."""
    analytics: Annotated[int, Flag("metrics_port")] = Field(default=9411, ge=0, le=65535)
    """Serve the analytics stage's Prometheus /metrics on this port (0: off)."""
    broker: Annotated[int, Flag("metrics_port")] = Field(default=9412, ge=0, le=65535)
    """Serve the broker's Prometheus /metrics on this port (0: off)."""


class IdleSettings(BaseModel):
    """Idle detection of the analytics stage (``analytics.classify.IdleConfig``; activity is a
    ratio 0..1). The cross-check ``idle_threshold <= busy_threshold`` is IdleConfig's own: the
    analytics CLI and :mod:`gpupool.settings` apply it. Each field's docstring is its description."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    idle_threshold: Annotated[float, Flag()] = Field(default=0.05, ge=0, le=1)
    """Activity ratio at or below which a sample is idle."""
    busy_threshold: Annotated[float, Flag()] = Field(default=0.10, ge=0, le=1)
    """Activity ratio at or above which a GPU is busy (>= idle_threshold)."""
    min_idle_s: Annotated[float, Flag()] = Field(default=60.0, ge=0)
    """Seconds of idle samples before a GPU is idle."""
    stale_after_s: Annotated[float, Flag()] = Field(default=30.0, gt=0)
    """A GPU not sampled this long is unknown, seconds."""
    refresh_s: Annotated[float, Flag()] = Field(default=30.0, gt=0)
    """Re-publish every GPU's capacity update at least this often, seconds."""
    forget_after_s: float = Field(default=3600.0, gt=0)
    """A GPU not sampled this long is forgotten, seconds (> stale_after_s): analytics stops
    re-publishing it (unknown) and drops it from its gauges; a later sample makes it new again."""
    pool: Annotated[str, Flag()] = "default"
    """Pool name put on capacity updates."""

    @model_validator(mode="after")
    def _forget_after_stale(self) -> IdleSettings:
        if not self.forget_after_s > self.stale_after_s:
            raise ValueError(
                f"forget_after_s ({self.forget_after_s}) must be above stale_after_s ({self.stale_after_s})"
            )
        return self


class CollectorsSettings(BaseModel):
    """Sources and timing of the collector stage (``gpupool collect run``). Each field's
    docstring is its description."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    dcgm_targets: Annotated[list[str], Flag("dcgm_target")] = Field(default_factory=list)
    """dcgm-exporter /metrics URLs."""
    sysfs_roots: Annotated[list[str], Flag("sysfs_root")] = Field(default_factory=list)
    """HOST=PATH of a folder holding class/infiniband, e.g. node-1=/sys."""
    nvidia_smi: Annotated[list[str], Flag()] = Field(default_factory=list)
    """HOST=COMMAND printing nvidia-smi -q -x XML, e.g. node-1="nvidia-smi -q -x", or a CSV query,
    e.g. node-1="nvidia-smi --query-gpu=index,uuid,utilization.gpu,memory.used,memory.total
    --format=csv,noheader,nounits"."""
    ufm_telemetry: Annotated[list[str], Flag()] = Field(default_factory=list)
    """UFM Telemetry Prometheus endpoint URLs: InfiniBand port counters of the whole fabric, without
    host-side perfquery sweeps."""
    nvml_host: Annotated[str | None, Flag()] = None
    """Read this machine's GPUs through NVML under this host name; none: no NVML."""
    file_sd: Annotated[list[Path], Flag()] = Field(default_factory=list)
    """Prometheus file_sd JSON files of dcgm-exporter targets, re-read when they change; the last
    component may be a glob, e.g. targets/*.json."""
    file_sd_refresh_s: Annotated[float, Flag("file_sd_refresh")] = Field(default=5.0, gt=0)
    """Seconds between two checks of the file_sd files for changes."""
    spool_dir: Annotated[Path | None, Flag()] = None
    """Spool records here (after spool_memory_records in memory) while Kafka is unreachable, and
    resume them after a restart; none: records wait for Kafka only inside aiokafka's buffer."""
    spool_memory_records: Annotated[int, Flag()] = Field(default=100_000, ge=0)
    """Records the spool holds in memory before it writes to spool_dir."""
    spool_disk_bytes: Annotated[int, Flag()] = Field(default=1 << 30, ge=0)
    """Bytes the spool may take in spool_dir."""
    interval_s: Annotated[float, Flag("interval")] = Field(default=5.0, gt=0)
    """Seconds between the starts of two collection cycles."""
    sysfs_interval_s: Annotated[float | None, Flag("sysfs_interval")] = Field(default=None, gt=0)
    """Seconds between the starts of two reads of the sysfs roots (InfiniBand port counters), on
    their own schedule so that a slow read never delays a GPU scrape; none: every cycle."""
    timeout_s: Annotated[float, Flag("timeout")] = Field(default=2.0, gt=0)
    """Deadline of one scrape, seconds."""
    concurrency: Annotated[int, Flag()] = Field(default=64, ge=1)
    """Scrapes in flight at most."""
    fabric: Annotated[bool, Flag()] = False
    """Also run the switch-side fabric collector: ibnetdiscover -p (topology to fabric.topology) and
    perfquery -x on every switch and HCA port (to telemetry.ib_port). On one host per fabric whose
    HCA reaches the subnet management (a /dev/infiniband/umad* device, infiniband-diags installed)."""
    fabric_interval_s: Annotated[float, Flag("fabric_interval")] = Field(default=30.0, gt=0)
    """Seconds between the starts of two fabric sweeps."""
    fabric_discover_every: Annotated[int, Flag()] = Field(default=10, ge=1)
    """Re-discover the fabric's topology every Nth sweep (1: every sweep)."""
    fabric_concurrency: Annotated[int, Flag()] = Field(default=8, ge=1)
    """perfquery processes at once."""
    fabric_timeout_s: Annotated[float, Flag("fabric_timeout")] = Field(default=5.0, gt=0)
    """Deadline of one perfquery run, seconds (its process group is killed)."""
    fabric_command_prefix: list[str] = Field(default_factory=list)
    """argv prefix of every diag command, e.g. ["sudo", "-n"]."""
    forget_after_s: float = Field(default=300.0, gt=0)
    """A dcgm-exporter target gone from the configuration (static list and file_sd) this long is
    forgotten, seconds: its target series are removed."""
    slurm_conf: Annotated[Path | None, Flag()] = None
    """Read this Slurm cluster (its slurm.conf, given to scontrol as SLURM_CONF) every
    slurm_interval_s: nodes, GPUs by GRES index and job, pending jobs with their planned start ->
    telemetry.scheduler; none: no Slurm source."""
    slurm_interval_s: Annotated[float, Flag("slurm_interval")] = Field(default=10.0, gt=0)
    """Seconds between the starts of two reads of Slurm."""
    kubernetes: Annotated[bool, Flag()] = False
    """Read the Kubernetes cluster (kubeconfig, else the pod's service account) every
    kubernetes_interval_s: nodes, GPUs held by pods, gpupool's lent pods, pending pods and Kueue
    workloads -> telemetry.scheduler, the records of the Slurm source (list + watch; read-only
    RBAC of deploy/kubernetes/collector/collector.yaml); not with slurm_conf."""
    kubeconfig: Annotated[Path | None, Flag()] = None
    """kubeconfig of the Kubernetes cluster read by kubernetes; none: the in-cluster service account."""
    kubernetes_interval_s: Annotated[float, Flag("kubernetes_interval")] = Field(default=10.0, gt=0)
    """Seconds between the starts of two reads of Kubernetes (the state is watched in between)."""
    k8s_kueue: bool = True
    """Also read Kueue's Workloads, LocalQueues and ClusterQueues (kueue.x-k8s.io/v1beta2): pending
    workloads are demand; false on a cluster without Kueue."""
    k8s_lent_namespace: str = Field(default="gpupool-lent", pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
    """The broker's lent namespace ([broker] k8s_namespace): its gpupool pods are gpupool's holds,
    reported as lendable."""
    k8s_gpu_resource: str = Field(default="nvidia.com/gpu", pattern=r"^[A-Za-z0-9.-]+/[A-Za-z0-9_.-]+$")
    """The GPUs' extended resource (the device plugin's)."""

    @model_validator(mode="after")
    def _one_scheduler(self) -> CollectorsSettings:
        if self.kubernetes and self.slurm_conf is not None:
            raise ValueError("read one training scheduler: kubernetes or slurm_conf, not both")
        return self


class AnalyticsSettings(BaseModel):
    """Kafka and DuckDB options of the analytics stage (the database file is the top-level
    ``analytics_db``, idle detection the ``[idle]`` group). Each field's docstring is its
    description."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    group_id: Annotated[str, Flag()] = "gpupool-analytics"
    """Kafka consumer group of the telemetry consumers (one per deployment)."""
    memory_limit: Annotated[str | None, Flag()] = None
    """Memory the whole analytics process may use, e.g. 2GB; DuckDB gets
    analytics.store.DUCKDB_MEMORY_SHARE (60 %) of it, the rest is left for Python; none: DuckDB's
    own limit."""
    max_uplink_xmit_wait: Annotated[float, Flag()] = Field(default=0.5, ge=0, le=1)
    """A node is not offered while an uplink of its leaf switch waits for credits more than this
    over the headroom window: XmitWait / (XmitWait + XmitData), 0..1 (0.5, one tick waited per word
    sent, is the GpupoolIbXmitWaitHigh alert's threshold); 1: no check."""
    scheduler: Annotated[bool, Flag()] = False
    """Join the training scheduler's state (telemetry.scheduler, from gpupool collect run
    --slurm-conf or --kubernetes): offer a GPU only when the scheduler has it unallocated, never promise past a
    pending job's planned start on its node."""
    plan_lead_s: Annotated[float, Flag()] = Field(default=600.0, ge=0)
    """With scheduler: a GPU the scheduler's plan needs for a pending job is offered until this
    long before the job's planned start (seconds), as the scheduler's backfill fills it, and its
    lease is told it is at risk then; keep it above the lease notice. A very large value lends
    nothing the plan needs."""


class BrokerPolicy(BaseModel):
    """The lease policy the broker runs with: offer and lease times, quotas, fair share, request
    limits. Both the ``[broker]`` settings (:class:`BrokerSettings`) and the broker's own
    ``broker.config.BrokerConfig`` are this policy plus their own fields. Each field's docstring is
    its description."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    offer_ttl_s: Annotated[float, Flag("offer_ttl")] = Field(default=60.0, gt=0)
    """Offer lifetime: an offer lapses this long after it is published (Offer.expires_at and the
    MQTT 5 message expiry), seconds; still-idle GPUs are then offered again under a new id."""
    notice_s: Annotated[float, Flag("notice")] = Field(default=30.0, ge=0)
    """Reclaim notice each lease gets, seconds: on a training demand the site has this long to
    release before the lease is revoked."""
    lease_ttl_s: Annotated[float, Flag("lease_ttl")] = Field(default=60.0, gt=0)
    """A lease expires unless renewed within this long, seconds; a renewal never extends it by more."""
    window_price: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    """Price of a window lease (promised until the offer's available_until), credits per GPU-hour,
    stated in every offer (Offer.window_price); none: not priced."""
    preemptible_price: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    """Price of a preemptible lease (promises only the notice), credits per GPU-hour, stated in
    every offer (Offer.preemptible_price); none: not priced."""
    group_id: Annotated[str, Flag()] = "gpupool-broker"
    """Kafka consumer group of capacity and pool demand (one per deployment)."""
    pool_zones: dict[str, str] = Field(default_factory=dict)
    """Pool name → latency zone stamped on its offers (Offer.zone, [broker.pool_zones]), so claims
    can ask for a zone; a pool not listed has no zone."""
    site_quotas: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    """Site → the most GPUs it may hold at once, live leases plus claims being granted
    ([broker.site_quotas]); a site not listed gets default_site_quota."""
    default_site_quota: int | None = Field(default=64, ge=0)
    """Quota of sites not in site_quotas, GPUs (so no site takes a whole pool by flooding); none:
    unlimited."""
    site_weights: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)
    """Site → fair-share weight, > 0 ([broker.site_weights]); a site not listed weighs 1 (policy,
    weighted max-min: broker.quota)."""
    fair_share_window_s: float = Field(default=60.0, ge=0)
    """A site refused this recently (for want of GPUs or quota) still counts as waiting for its
    fair share, seconds."""
    site_forget_after_s: float = Field(default=3600.0, gt=0)
    """A site offline this long (its Last Will, or a death) with no live lease is forgotten,
    seconds: its site series (gpupool_broker_site_up, claim decisions) are removed; a later birth
    makes it new again."""
    site_request_rate_per_s: float = Field(default=LIMITS.site_request_rate_per_s, gt=0)
    """Per-site token bucket of claims, renewals and releases together (broker.ratelimit): refill
    rate, per second; past it a request is answered rate_limited."""
    site_request_burst: float = Field(default=LIMITS.site_request_burst, ge=1)
    """Per-site token bucket of claims, renewals and releases: burst size."""
    request_max_age_s: float = Field(default=LIMITS.request_max_age_seconds, gt=0)
    """A claim, renewal or release whose ts is older than this when it arrives is ignored (counted
    as stale), seconds: a site's queued backlog after an outage is not acted on long after."""
    lease_log_timeout_s: float = Field(default=5.0, gt=0)
    """How long writing a change to the lease log may take, seconds; past it (or on any refusal)
    the change is undone and the request answered internal."""


class BrokerSettings(BrokerPolicy):
    """The ``[broker]`` settings: the lease policy (:class:`BrokerPolicy`), the broker's identity,
    fabric isolation and process tuning. MQTT connection settings are the top-level ``mqtt*``
    fields. Each field's docstring is its description."""

    client_id: Annotated[str, Flag()] = "gpupool-broker"
    """MQTT client id; the broker's persistent session is kept under it."""
    fabric_state: Annotated[Path | None, Flag()] = None
    """fabric.json of an OpenSM fabric (deploy/local/fabric.sh): isolate every lease in a partition
    verified on the fabric; none: fabric isolation disabled."""
    fabric_gateway: Annotated[str, Flag()] = "edge-gw"
    """Node id or port GUID of the edge gateway's HCA, a full member."""
    fabric_hosts: Annotated[Path | None, Flag()] = None
    """JSON file {"<gpu host>": ["<HCA node id or port GUID>", ...]}; none: hosts ending in N map to
    the Nth compute HCA."""
    fabric_sl: Annotated[int, Flag()] = Field(default=1, ge=0, le=15)
    """Service level of inference traffic, 0..15."""
    fabric_timeout_s: Annotated[float, Flag("fabric_timeout")] = Field(default=20.0, gt=0)
    """Seconds to wait for the fabric to show a partition change."""
    fabric_dry_run: Annotated[bool, Flag()] = False
    """Print the partitions.conf/qos-policy.conf diff of each lease on stderr and change nothing
    (leases are then refused: isolation_failed)."""
    fabric_qos: bool = True
    """Manage fabric QoS with the partitions (the lent VL and its share bound in opensm.conf,
    verified on each lease's paths); off: partitions only."""
    lent_share_percent: Annotated[float, Flag()] = Field(default=10.0, ge=0.4, le=50)
    """The lent-share bound: the most of a link's bandwidth lent traffic may take while training
    keeps the link busy, percent (0.4..50; the plan rounds it down to 100 / (qos_high_limit + 1));
    shown in each offer and lease. Analytics offers a node's idle GPUs only while the busiest uplink
    of its leaf switch has at least this share of headroom left by training."""
    fabric_lent_vl: int = Field(default=1, ge=1, le=14)
    """The virtual lane of lent traffic (1..14; the inference SL maps to it)."""
    fabric_qos_audit_s: float = Field(default=300.0, gt=0)
    """Seconds between audits of every switch port's QoS tables."""
    lease_log_linger_ms: Annotated[float, Flag()] = Field(default=0.0, ge=0)
    """Batching delay of the lease-log producer, ms: every claim waits for its lease to be logged,
    so keep it small (Kafka's throughput default is 20)."""
    tune_gc: Annotated[bool, Flag()] = True
    """After the start, freeze the objects alive then and re-freeze the young survivors every
    second, with a full collection once an hour (broker.service.tune_gc): no full GC pause walks
    the lease book."""
    scheduler: Annotated[Literal["none", "slurm", "kubernetes"], Flag()] = "none"
    """The training scheduler that fences lent GPUs: slurm (each lease held by jobs in the lent
    partition and reclaimed by Slurm's own preemption, broker.lending), kubernetes (each lease held
    by low-priority pods in the lent namespace and reclaimed by kube-scheduler's priority
    preemption with the notice as grace period, broker.lending_kubernetes) or none (leases are
    bookkeeping and a fabric partition only)."""
    slurm_conf: Annotated[Path | None, Flag()] = None
    """slurm.conf of the cluster (SLURM_CONF of every Slurm command the broker runs); none: the
    environment's."""
    slurm_partition: str = Field(default="lent", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    """The lent partition (low PriorityTier, PreemptMode=CANCEL, GraceTime = notice_s)."""
    slurm_gres_type: str = Field(default="h100", pattern=r"^[A-Za-z0-9_.-]{0,64}$")
    """GRES type of the GPUs (gpu:<type>:N); empty: untyped gpu:N."""
    slurm_gpu_map: Path | None = None
    """JSON file {"<node>": ["<GPU UUID of index 0>", ...]} mapping Slurm's GRES indices to the GPU
    UUIDs of the telemetry (nvidia-smi --query-gpu=index,uuid on each node); none: GPU keys are
    <node>/gpu<index>."""
    slurm_poll_s: float = Field(default=0.25, gt=0, le=5)
    """Seconds between reads of Slurm's jobs while placeholders are wanted, starting or unwanted
    (else once a second); a preemption is seen from the hold's own SIGTERM, not from this read."""
    slurm_placeholder_minutes: int = Field(default=60, ge=1)
    """Time limit of an idle placeholder job, minutes (it is replaced when it ends)."""
    slurm_output_dir: Path | None = None
    """Where hold jobs write their output and read their workload's start file (on a filesystem the
    nodes share with the broker); none: a folder under GPUPOOL_STATE."""
    kubeconfig: Annotated[Path | None, Flag()] = None
    """kubeconfig of the Kubernetes cluster (scheduler = "kubernetes"); none: the in-cluster
    service account of the broker's pod."""
    k8s_namespace: str = Field(default="gpupool-lent", pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
    """The lent namespace: placeholder and lease pods (the broker's Role is granted there)."""
    k8s_priority_class: str = Field(default="gpupool-lent", pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
    """PriorityClass of lent pods: a value below every training pod's priority and
    preemptionPolicy Never, so kube-scheduler preempts them for training and they preempt nothing."""
    k8s_image: str = Field(default="registry.k8s.io/pause:3.10", min_length=1)
    """Image of placeholder pods (they only hold their GPU)."""
    k8s_gpu_resource: str = Field(default="nvidia.com/gpu", pattern=r"^[A-Za-z0-9.-]+/[A-Za-z0-9_.-]+$")
    """The GPUs' extended resource (the device plugin's)."""
    k8s_poll_s: float = Field(default=0.25, gt=0, le=5)
    """Seconds between two passes that keep placeholder pods on the GPUs to hold (in memory; the
    API is called only for pods to create or delete; preemptions come from a watch)."""
    workloads: list[dict[str, Any]] = Field(default_factory=list)
    """The operator's workload profiles, [[broker.workloads]] tables with name, argv (template
    fields {port} {lease_id} {site} {gpus}), port_min, port_max, health_path, health_timeout_s,
    cpus_per_gpu, sites (validated by broker.workloads.WorkloadProfile); a site never sends a
    command."""


class DeploymentSettings(BaseSettings):
    """Every setting of a gpupool deployment (sources and precedence: module docstring). Each
    field's docstring is its description (the help of the run commands' options).

    Raises:
        pydantic.ValidationError: a value of any source is invalid (the message names the field).
        FileNotFoundError: the TOML file named does not exist.
        tomllib.TOMLDecodeError: the TOML file does not parse.
    """

    model_config = SettingsConfigDict(
        env_prefix="GPUPOOL_",
        env_nested_delimiter="__",
        extra="forbid",
        case_sensitive=False,
        use_attribute_docstrings=True,
    )

    config: Path | None = None
    """The TOML file these settings were read from (--config or GPUPOOL_CONFIG)."""
    kafka: Annotated[str | None, Flag()] = None
    """Kafka bootstrap servers, host:port[,host:port]; required by the stage commands (the demo
    uses its in-process bus without it)."""
    topic_prefix: Annotated[str, Flag()] = ""
    """Prefix of every Kafka topic name (the same for every stage)."""
    mqtt: Annotated[str, Flag()] = "127.0.0.1:1883"
    """MQTT server host:port."""
    mqtt_username: Annotated[str | None, Flag("username")] = "gpupool-broker"
    """MQTT user of the broker."""
    mqtt_password: Annotated[SecretStr | None, Flag("password")] = None
    """MQTT password of the broker (a secret: masked when shown); better GPUPOOL_MQTT_PASSWORD,
    which keeps it off the command line."""
    mqtt_root: Annotated[str, Flag("root")] = "gpupool/v1"
    """MQTT topic root."""
    mqtt_protocol: Annotated[Literal[4, 5], Flag("protocol")] = 5
    """MQTT protocol: 5, or 4 for MQTT 3.1.1."""
    mqtt_cafile: Annotated[Path | None, Flag()] = None
    """Connect to MQTT over TLS, trusting this CA (PEM) for the server's certificate (the mqtt
    address is then the TLS listener); none: plain TCP unless a client certificate is given (then
    the system's CAs)."""
    mqtt_certfile: Annotated[Path | None, Flag()] = None
    """TLS client certificate (PEM), for a listener that requires one."""
    mqtt_keyfile: Annotated[Path | None, Flag()] = None
    """Private key (PEM) of mqtt_certfile, if not in it."""
    state_dir: Path = Path(".state")
    """Where the demo and local services keep files."""
    analytics_db: Annotated[Path, Flag("db")] = Path("gpupool-analytics.duckdb")
    """The analytics DuckDB file, created if new."""
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    """[metrics]: the /metrics servers."""
    idle: IdleSettings = Field(default_factory=IdleSettings)
    """[idle]: idle detection."""
    collectors: CollectorsSettings = Field(default_factory=CollectorsSettings)
    """[collectors]: the collector stage."""
    analytics: AnalyticsSettings = Field(default_factory=AnalyticsSettings)
    """[analytics]: the analytics stage."""
    broker: BrokerSettings = Field(default_factory=BrokerSettings)
    """[broker]: the broker stage."""

    @field_validator("kafka")
    @classmethod
    def _kafka(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None
        return ",".join(_host_port(part) for part in v.split(","))

    @field_validator("mqtt")
    @classmethod
    def _mqtt(cls, v: str) -> str:
        return _host_port(v)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags, then ``GPUPOOL_*`` variables, then the TOML file if one is named; no ``.env``
        file, no secrets folder. Raises ``FileNotFoundError`` if the named TOML file is missing."""
        given = (
            init_settings.init_kwargs.get("config") if isinstance(init_settings, InitSettingsSource) else None
        )
        path = given or os.environ.get(CONFIG_ENV) or None
        if path is None:
            return init_settings, env_settings
        toml = Path(path)
        if not toml.is_file():
            raise FileNotFoundError(f"settings file {toml} does not exist")
        return init_settings, env_settings, TomlConfigSettingsSource(settings_cls, toml_file=toml)


class SettingsError(ValueError):
    """The settings cannot be loaded: the file is missing or does not parse, or a value is
    invalid. The message says which (file name, or the field and pydantic's reason)."""


def load_settings(
    config: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    model: type[DeploymentSettings] = DeploymentSettings,
) -> DeploymentSettings:
    """The effective settings: ``overrides`` (flags), ``GPUPOOL_*``, the TOML file ``config``
    (else ``$GPUPOOL_CONFIG``), defaults.

    ``overrides`` maps dotted field paths to values (``{"kafka": "k:9092",
    "collectors.interval_s": 5.0}``); ``None`` values mean "flag not given" and are skipped, and
    so are empty lists and tuples (a repeatable flag not given: Typer passes ``[]``/``()``).
    Raises :class:`SettingsError` (a ``ValueError``) when the file is missing or not TOML or a
    value is invalid; an unknown path in ``overrides`` is invalid too.
    """
    init: dict[str, Any] = {}
    for path, value in (overrides or {}).items():
        if value is None or (isinstance(value, list | tuple) and not value):
            continue
        *groups, leaf = path.split(".")
        node = init
        for group in groups:
            node = node.setdefault(group, {})
        node[leaf] = value
    if config is not None:
        init["config"] = config
    try:
        return model(**init)
    except FileNotFoundError as exc:
        raise SettingsError(str(exc)) from exc
    except tomllib.TOMLDecodeError as exc:
        named = config or os.environ.get(CONFIG_ENV)
        raise SettingsError(f"settings file {named} does not parse: {exc}") from exc
    except ValidationError as exc:
        raise SettingsError(f"invalid settings: {exc}") from exc


CONFIG_OPTION_HELP = (
    "TOML settings file of the deployment (default: $GPUPOOL_CONFIG); every option not given takes "
    "its value from GPUPOOL_* variables, then this file, then the defaults."
)
"""``--config`` help of every stage's ``run`` command."""


def settings_field(path: str) -> FieldInfo:
    """The :class:`DeploymentSettings` field at dotted ``path`` (``"collectors.interval_s"``).

    Raises:
        KeyError: no such field.
    """
    model: type[BaseModel] = DeploymentSettings
    *groups, leaf = path.split(".")
    for group in groups:
        annotation = model.model_fields[group].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            raise KeyError(f"{group} in {path} is not a settings group")
        model = annotation
    return model.model_fields[leaf]


def _flagged(model: type[BaseModel], prefix: str = "") -> dict[str, str]:
    """Dotted path → option name of every field of ``model`` (groups included) marked :class:`Flag`,
    in the model's order."""
    found: dict[str, str] = {}
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found.update(_flagged(annotation, f"{prefix}{name}."))
        for mark in field.metadata:
            if isinstance(mark, Flag):
                found[prefix + name] = mark.name or name
    return found


class RunFlags:
    """The options of one command: the :class:`Flag` fields of :class:`DeploymentSettings` it takes,
    as ``--<flag>`` (:attr:`fields` maps each option's Python name to its dotted field). The one
    place that turns flags into settings (:meth:`load`); :func:`runtime.run_options.settings_command`
    derives the options from it.

    Args:
        command: the command, for messages (``gpupool broker run``).
        selection: dotted fields, or ``fnmatch`` patterns over them (``"collectors.*"``,
            ``"mqtt*"``) taking every :class:`Flag` field that matches, in the model's order.

    Raises:
        ValueError: a pattern that matches no :class:`Flag` field, or two fields with one flag.
    """

    def __init__(self, command: str, *selection: str) -> None:
        """Resolve ``selection`` to ``fields``."""
        self.command = command
        flagged = _flagged(DeploymentSettings)
        self.fields: dict[str, str] = {}
        for pattern in selection:
            matched = [path for path in flagged if fnmatch.fnmatchcase(path, pattern)]
            if not matched:
                raise ValueError(f"{command}: no settings field with a Flag matches {pattern!r}")
            for path in matched:
                flag = flagged[path]
                if self.fields.setdefault(flag, path) != path:
                    raise ValueError(f"{command}: --{flag} would set {self.fields[flag]} and {path}")

    def load(self, config: Path | None = None, **flags: Any) -> DeploymentSettings:
        """The settings the command runs with: ``flags`` (its parameters by name; ``None`` = not
        given) over ``GPUPOOL_*`` over the TOML file ``config`` (else ``$GPUPOOL_CONFIG``) over the
        defaults (:func:`load_settings`).

        Raises:
            SettingsError: a missing or unparsable file or an invalid value.
            KeyError: a parameter the command does not have.
        """
        return load_settings(config, {self.fields[name]: value for name, value in flags.items()})
