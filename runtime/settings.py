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

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

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
    "BrokerSettings",
    "CollectorsSettings",
    "DeploymentSettings",
    "IdleSettings",
    "MetricsSettings",
    "SettingsError",
    "load_settings",
]

CONFIG_ENV = "GPUPOOL_CONFIG"
"""Environment variable naming the TOML settings file (``--config`` wins over it)."""


def _host_port(value: str) -> str:
    host, sep, port = value.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {value!r}")
    return f"{host}:{port}"


class MetricsSettings(BaseModel):
    """Where each stage serves Prometheus ``/metrics`` (port 0: off).

    Attributes:
        addr: listen address of every stage's ``/metrics``.
        collectors / analytics / broker: port of each stage (the ones ``deploy/prometheus``
            scrapes: 9410, 9411, 9412).
    """

    model_config = ConfigDict(extra="forbid")

    addr: str = "127.0.0.1"
    collectors: int = Field(default=9410, ge=0, le=65535)
    analytics: int = Field(default=9411, ge=0, le=65535)
    broker: int = Field(default=9412, ge=0, le=65535)


class IdleSettings(BaseModel):
    """Idle detection of the analytics stage (``analytics.classify.IdleConfig``; activity is a
    ratio 0..1). The cross-check ``idle_threshold <= busy_threshold`` is IdleConfig's own: the
    analytics CLI and :mod:`gpupool.settings` apply it.

    Attributes:
        idle_threshold: activity at or below this is an idle sample.
        busy_threshold: activity at or above this makes a GPU busy (>= ``idle_threshold``).
        min_idle_s: seconds of idle samples before a GPU is idle.
        stale_after_s: a GPU not sampled this long is unknown, seconds.
        refresh_s: analytics re-publishes every GPU's capacity update at least this often, s.
        forget_after_s: a GPU not sampled this long is forgotten, seconds (> ``stale_after_s``):
            analytics stops re-publishing it (unknown) and drops it from its gauges; a later
            sample makes it new again.
        pool: pool name put on capacity updates.
    """

    model_config = ConfigDict(extra="forbid")

    idle_threshold: float = Field(default=0.05, ge=0, le=1)
    busy_threshold: float = Field(default=0.10, ge=0, le=1)
    min_idle_s: float = Field(default=60.0, ge=0)
    stale_after_s: float = Field(default=30.0, gt=0)
    refresh_s: float = Field(default=30.0, gt=0)
    forget_after_s: float = Field(default=3600.0, gt=0)
    pool: str = "default"

    @model_validator(mode="after")
    def _forget_after_stale(self) -> IdleSettings:
        if not self.forget_after_s > self.stale_after_s:
            raise ValueError(
                f"forget_after_s ({self.forget_after_s}) must be above stale_after_s ({self.stale_after_s})"
            )
        return self


class CollectorsSettings(BaseModel):
    """Sources and timing of the collector stage (``gpupool collect run``).

    Attributes:
        dcgm_targets: dcgm-exporter ``/metrics`` URLs.
        sysfs_roots: ``HOST=PATH`` of folders holding ``class/infiniband`` (e.g. ``node-1=/sys``).
        nvidia_smi: ``HOST=COMMAND`` printing ``nvidia-smi -q -x`` XML, or a
            ``nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]`` query.
        ufm_telemetry: UFM Telemetry Prometheus endpoint URLs (InfiniBand port counters of the
            whole fabric, without host-side perfquery sweeps).
        nvml_host: read this machine's GPUs through NVML under this host name; ``None``: no NVML.
        file_sd: Prometheus file_sd JSON files of dcgm-exporter targets (last component may be a glob).
        file_sd_refresh_s: seconds between two checks of the file_sd files.
        spool_dir: spool records here while Kafka is unreachable; ``None``: memory only.
        spool_memory_records: records the spool holds in memory before it writes to ``spool_dir``.
        spool_disk_bytes: bytes the spool may take in ``spool_dir``.
        interval_s: seconds between the starts of two collection cycles.
        timeout_s: deadline of one scrape, seconds.
        concurrency: scrapes in flight at most.
        fabric: also run the switch-side fabric collector (:mod:`collectors.fabric_collector`):
            ``ibnetdiscover -p`` → ``fabric.topology``, ``perfquery -x`` on every switch and HCA
            port → ``telemetry.ib_port``. Only on a host whose HCA reaches the fabric's subnet
            management (a ``/dev/infiniband/umad*`` device, infiniband-diags installed), and on
            one such host per fabric.
        fabric_interval_s: seconds between the starts of two fabric sweeps.
        fabric_discover_every: re-discover the topology every Nth sweep (1 = every sweep).
        fabric_concurrency: perfquery processes at once.
        fabric_timeout_s: deadline of one perfquery run, seconds (its process group is killed).
        fabric_command_prefix: argv prefix of every diag command (e.g. ``["sudo", "-n"]``).
        forget_after_s: a dcgm-exporter target gone from the configuration (static list and
            file_sd) this long is forgotten, seconds: its ``target`` series are removed.
        slurm_conf: read this Slurm cluster (its ``slurm.conf``, given to ``scontrol`` as
            ``SLURM_CONF``) every ``slurm_interval_s``; ``None``: no Slurm source.
        slurm_interval_s: seconds between the starts of two reads of Slurm.
    """

    model_config = ConfigDict(extra="forbid")

    dcgm_targets: list[str] = Field(default_factory=list)
    sysfs_roots: list[str] = Field(default_factory=list)
    nvidia_smi: list[str] = Field(default_factory=list)
    ufm_telemetry: list[str] = Field(default_factory=list)
    nvml_host: str | None = None
    file_sd: list[Path] = Field(default_factory=list)
    file_sd_refresh_s: float = Field(default=5.0, gt=0)
    spool_dir: Path | None = None
    spool_memory_records: int = Field(default=100_000, ge=0)
    spool_disk_bytes: int = Field(default=1 << 30, ge=0)
    interval_s: float = Field(default=5.0, gt=0)
    timeout_s: float = Field(default=2.0, gt=0)
    concurrency: int = Field(default=64, ge=1)
    fabric: bool = False
    fabric_interval_s: float = Field(default=30.0, gt=0)
    fabric_discover_every: int = Field(default=10, ge=1)
    fabric_concurrency: int = Field(default=8, ge=1)
    fabric_timeout_s: float = Field(default=5.0, gt=0)
    fabric_command_prefix: list[str] = Field(default_factory=list)
    forget_after_s: float = Field(default=300.0, gt=0)
    slurm_conf: Path | None = None
    slurm_interval_s: float = Field(default=10.0, gt=0)


class AnalyticsSettings(BaseModel):
    """Kafka and DuckDB options of the analytics stage (the database file is the top-level
    ``analytics_db``, idle detection the ``[idle]`` group).

    Attributes:
        group_id: Kafka consumer group of the telemetry consumers (one per deployment).
        memory_limit: memory the whole analytics process may use (e.g. ``"2GB"``); DuckDB gets
            ``analytics.store.DUCKDB_MEMORY_SHARE`` of it, the rest is left for Python; ``None``:
            DuckDB's default.
        max_uplink_xmit_wait: an idle GPU is not offered while an uplink of its leaf switch waits
            more than this: ΔPortXmitWait / (ΔPortXmitWait + ΔPortXmitData) over the headroom
            window, 0..1 (0.5 = one tick waited per word sent, the GpupoolIbXmitWaitHigh alert's
            threshold); 1 turns the check off.
        scheduler: join the training scheduler's state (``telemetry.scheduler``) with the GPU
            telemetry: a GPU is offered only when the scheduler has it unallocated, and no promise
            runs past a pending job's planned start on its node (``analytics.scheduler``).
    """

    model_config = ConfigDict(extra="forbid")

    group_id: str = "gpupool-analytics"
    memory_limit: str | None = None
    max_uplink_xmit_wait: float = Field(default=0.5, ge=0, le=1)
    scheduler: bool = False


class BrokerSettings(BaseModel):
    """Offers, leases and fabric isolation of the broker stage (``broker.config.BrokerConfig``
    for the times). MQTT connection settings are the top-level ``mqtt*`` fields.

    Attributes:
        offer_ttl_s: an offer lapses this long after it is published, seconds.
        notice_s: reclaim notice each lease gets, seconds.
        lease_ttl_s: a lease expires unless renewed within this long, seconds.
        group_id: Kafka consumer group of capacity and pool demand (one per deployment).
        client_id: MQTT client id; the broker's persistent session is kept under it.
        fabric_state: ``fabric.json`` of an OpenSM fabric; ``None``: fabric isolation disabled.
        fabric_gateway: node id or port GUID of the edge gateway's HCA (full member).
        fabric_hosts: JSON file ``{"<gpu host>": ["<HCA node id or port GUID>", ...]}``.
        fabric_sl: service level of inference traffic (0..15).
        fabric_timeout_s: seconds to wait for the fabric to show a partition change.
        fabric_dry_run: print partition diffs and change nothing.
        fabric_qos: manage fabric QoS with the partitions (the lent VL and its share bound in
            ``opensm.conf``, verified on each lease's paths); false: partitions only.
        lent_share_percent: the lent-share bound: the most of a link's bandwidth lent traffic may
            take while training keeps the link busy, percent (0.4..50; the plan rounds it down to
            ``100 / (qos_high_limit + 1)``). Shown in each offer and lease. Analytics offers a node's
            idle GPUs only while the busiest uplink of its leaf switch has at least this share of
            headroom left by training (``CapacityUpdate.leaf_headroom``).
        fabric_lent_vl: the virtual lane of lent traffic (1..14; the inference SL maps to it).
        fabric_qos_audit_s: seconds between audits of every switch port's QoS tables.
        lease_log_linger_ms: batching delay of the lease-log producer, ms (every claim waits for
            its lease to be logged: keep it small).
        tune_gc: freeze the objects alive at start and re-freeze the young survivors every second,
            with a full collection once an hour (GC pauses off the claim path:
            ``broker.service.tune_gc``).
        pool_zones: pool name → latency zone stamped on its offers (``[broker.pool_zones]``).
        site_quotas: site → the most GPUs it may hold at once (``[broker.site_quotas]``).
        default_site_quota: quota of sites not in ``site_quotas``; default 64 GPUs (so no
            site takes a whole pool by flooding); a large number for practically unlimited.
        site_weights: site → fair-share weight, > 0 (``[broker.site_weights]``; default 1).
        fair_share_window_s: a site refused this recently still counts as waiting for its share,
            seconds (policy: :mod:`broker.quota`).
        site_forget_after_s: a site offline this long with no live lease is forgotten, seconds:
            its ``site`` series (``gpupool_broker_site_up``, claim decisions) are removed.
        site_request_rate_per_s / site_request_burst: per-site token bucket of claims, renewals
            and releases (past it: ``rate_limited``); defaults 50/s and 100.
        request_max_age_s: requests older than this (by their ``ts``) are ignored, seconds.
        lease_log_timeout_s: a lease-log write not acknowledged within this is undone and the
            request answered ``internal``, seconds.
        scheduler: the training scheduler that fences lent GPUs: ``"slurm"`` (each lease held by
            jobs in the lent partition, reclaimed by Slurm's own preemption; see
            ``broker.lending``) or ``"none"`` (leases are bookkeeping and a fabric partition only).
        slurm_conf: ``slurm.conf`` of the cluster (``SLURM_CONF`` of every Slurm command);
            ``None``: the environment's.
        slurm_partition: the lent partition (low ``PriorityTier``, ``PreemptMode=CANCEL``,
            ``GraceTime`` = ``notice_s``).
        slurm_gres_type: GRES type of the GPUs (``gpu:<type>:N``); empty: untyped ``gpu:N``.
        slurm_gpu_map: JSON file ``{"<node>": ["<GPU UUID of index 0>", ...]}`` mapping Slurm's
            GRES indices to the GPU UUIDs of the telemetry (``nvidia-smi --query-gpu=index,uuid``
            on each node); ``None``: GPU keys are ``<node>/gpu<index>``.
        slurm_poll_s: seconds between reads of Slurm's jobs (preemption seen within this).
        slurm_placeholder_minutes: time limit of an idle placeholder job, minutes (it is
            replaced when it ends).
        slurm_output_dir: where hold jobs write their output and read their workload's start
            file (on a filesystem the nodes share with the broker); ``None``: a folder under
            ``GPUPOOL_STATE``.
        workloads: the operator's workload profiles, ``[[broker.workloads]]`` tables with
            ``name``, ``argv`` (template fields ``{port} {lease_id} {site} {gpus}``),
            ``port_min``, ``port_max``, ``health_path``, ``health_timeout_s``, ``cpus_per_gpu``,
            ``sites`` (validated by ``broker.workloads.WorkloadProfile``).
    """

    model_config = ConfigDict(extra="forbid")

    offer_ttl_s: float = Field(default=60.0, gt=0)
    notice_s: float = Field(default=30.0, ge=0)
    lease_ttl_s: float = Field(default=60.0, gt=0)
    group_id: str = "gpupool-broker"
    client_id: str = "gpupool-broker"
    fabric_state: Path | None = None
    fabric_gateway: str = "edge-gw"
    fabric_hosts: Path | None = None
    fabric_sl: int = Field(default=1, ge=0, le=15)
    fabric_timeout_s: float = Field(default=20.0, gt=0)
    fabric_dry_run: bool = False
    fabric_qos: bool = True
    lent_share_percent: float = Field(default=10.0, ge=0.4, le=50)
    fabric_lent_vl: int = Field(default=1, ge=1, le=14)
    fabric_qos_audit_s: float = Field(default=300.0, gt=0)
    lease_log_linger_ms: float = Field(default=0.0, ge=0)
    tune_gc: bool = True
    pool_zones: dict[str, str] = Field(default_factory=dict)
    site_quotas: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    default_site_quota: int | None = Field(default=64, ge=0)
    site_weights: dict[str, Annotated[float, Field(gt=0)]] = Field(default_factory=dict)
    fair_share_window_s: float = Field(default=60.0, ge=0)
    site_forget_after_s: float = Field(default=3600.0, gt=0)
    site_request_rate_per_s: float = Field(default=LIMITS.site_request_rate_per_s, gt=0)
    site_request_burst: float = Field(default=LIMITS.site_request_burst, ge=1)
    request_max_age_s: float = Field(default=LIMITS.request_max_age_seconds, gt=0)
    lease_log_timeout_s: float = Field(default=5.0, gt=0)
    scheduler: Literal["none", "slurm"] = "none"
    slurm_conf: Path | None = None
    slurm_partition: str = Field(default="lent", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    slurm_gres_type: str = Field(default="h100", pattern=r"^[A-Za-z0-9_.-]{0,64}$")
    slurm_gpu_map: Path | None = None
    slurm_poll_s: float = Field(default=0.25, gt=0, le=5)
    slurm_placeholder_minutes: int = Field(default=60, ge=1)
    slurm_output_dir: Path | None = None
    workloads: list[dict[str, Any]] = Field(default_factory=list)


class DeploymentSettings(BaseSettings):
    """Every setting of a gpupool deployment (sources and precedence: module docstring).

    Attributes:
        config: the TOML file these settings were read from (``--config`` or ``GPUPOOL_CONFIG``).
        kafka: Kafka bootstrap servers ``host:port[,host:port]``; ``None``: not configured (the
            stage commands refuse to run, the demo uses its in-process bus).
        topic_prefix: prefix of every Kafka topic name (the same for every stage).
        mqtt: MQTT server ``host:port``.
        mqtt_username / mqtt_password: MQTT credentials of the broker (the password is a secret:
            masked when shown, best given by environment, never on a command line).
        mqtt_root: MQTT topic root.
        mqtt_protocol: 5, or 4 for MQTT 3.1.1.
        mqtt_cafile: connect to MQTT over TLS, trusting this CA (PEM); ``None``: plain TCP unless
            a client certificate is given (then the system's CAs).
        mqtt_certfile / mqtt_keyfile: TLS client certificate (PEM) and its key, if separate.
        state_dir: where the demo and local services keep files.
        analytics_db: the analytics DuckDB file.
        metrics / idle / collectors / analytics / broker: the groups above.

    Raises:
        pydantic.ValidationError: a value of any source is invalid (the message names the field).
        FileNotFoundError: the TOML file named does not exist.
        tomllib.TOMLDecodeError: the TOML file does not parse.
    """

    model_config = SettingsConfigDict(
        env_prefix="GPUPOOL_", env_nested_delimiter="__", extra="forbid", case_sensitive=False
    )

    config: Path | None = None
    kafka: str | None = None
    topic_prefix: str = ""
    mqtt: str = "127.0.0.1:1883"
    mqtt_username: str | None = "gpupool-broker"
    mqtt_password: SecretStr | None = None
    mqtt_root: str = "gpupool/v1"
    mqtt_protocol: Literal[4, 5] = 5
    mqtt_cafile: Path | None = None
    mqtt_certfile: Path | None = None
    mqtt_keyfile: Path | None = None
    state_dir: Path = Path(".state")
    analytics_db: Path = Path("gpupool-analytics.duckdb")
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    idle: IdleSettings = Field(default_factory=IdleSettings)
    collectors: CollectorsSettings = Field(default_factory=CollectorsSettings)
    analytics: AnalyticsSettings = Field(default_factory=AnalyticsSettings)
    broker: BrokerSettings = Field(default_factory=BrokerSettings)

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


class RunFlags:
    """The parameters of one stage's ``run`` command, each mapped to the dotted
    :class:`DeploymentSettings` field it sets (``{"notice": "broker.notice_s"}``): one place that
    turns flags into settings (:meth:`load`) and names the setting in each flag's help
    (:meth:`help`).

    Args:
        command: the command, for messages (``gpupool broker run``).
        fields: parameter name → dotted settings field.
    """

    def __init__(self, command: str, fields: Mapping[str, str]) -> None:
        """Keep ``fields`` (copied)."""
        self.command = command
        self.fields: dict[str, str] = dict(fields)

    def load(self, config: Path | None = None, **flags: Any) -> DeploymentSettings:
        """The settings the command runs with: ``flags`` (its parameters by name; ``None`` = not
        given) over ``GPUPOOL_*`` over the TOML file ``config`` (else ``$GPUPOOL_CONFIG``) over the
        defaults (:func:`load_settings`).

        Raises:
            SettingsError: a missing or unparsable file or an invalid value.
            KeyError: a parameter the command does not have.
        """
        return load_settings(config, {self.fields[name]: value for name, value in flags.items()})

    def help(self, name: str) -> str:
        """The help suffix naming the setting parameter ``name`` overrides: ``" (setting X)"``.

        Raises:
            KeyError: ``name`` is not a parameter of the command.
        """
        return f" (setting {self.fields[name]})"
