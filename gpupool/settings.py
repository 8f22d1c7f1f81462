"""gpupool's settings: one typed model (pydantic-settings) for every stage and command.

Sources, highest priority first:

1. values passed to :class:`GpupoolSettings` / :func:`load_settings` (command-line flags);
2. environment variables ``GPUPOOL_<FIELD>``, nested groups with ``__``:
   ``GPUPOOL_KAFKA``, ``GPUPOOL_MQTT_PASSWORD``, ``GPUPOOL_IDLE__MIN_IDLE_S``,
   ``GPUPOOL_BROKER__NOTICE_S``, ``GPUPOOL_METRICS__BROKER``... (names are case-insensitive); a
   nested group may also be given whole as JSON, ``GPUPOOL_IDLE='{"min_idle_s": 10}'``;
3. a TOML file named by ``--config`` or ``GPUPOOL_CONFIG`` (top-level keys are the fields below,
   ``[metrics]``, ``[idle]`` and ``[broker]`` tables the groups);
4. the defaults below, which are the stage CLIs' defaults (``gpupool analytics run``,
   ``gpupool broker run``) and the conventional metrics ports of ``deploy/prometheus``.

The flat names are the environment variables the stage CLIs already read (``GPUPOOL_KAFKA``,
``GPUPOOL_MQTT``, ``GPUPOOL_MQTT_USERNAME``, ``GPUPOOL_MQTT_PASSWORD``, ``GPUPOOL_ANALYTICS_DB``),
so one environment configures both. Other ``GPUPOOL_*`` variables (``GPUPOOL_SITE``,
``GPUPOOL_STATE`` of the Makefile...) are not settings and are ignored; an unknown key in the TOML
file is an error.

Example file::

    kafka = "kafka-1:9092,kafka-2:9092"
    mqtt = "mqtt.example.internal:1883"
    [idle]
    min_idle_s = 120
    [broker]
    notice_s = 60
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from analytics.classify import IdleConfig
from broker.config import BrokerConfig

CONFIG_ENV = "GPUPOOL_CONFIG"
"""Environment variable naming the TOML settings file (``--config`` wins over it)."""

MASK = "**********"
"""What a secret that is set shows as in :func:`effective_config`."""


def _host_port(value: str) -> str:
    host, sep, port = value.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {value!r}")
    return f"{host}:{port}"


class MetricsSettings(BaseModel):
    """Where each stage serves Prometheus ``/metrics`` (0: off).

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
    """Idle detection basics (:class:`analytics.classify.IdleConfig`; activity is a ratio 0..1).

    Attributes:
        idle_threshold: activity at or below this is an idle sample.
        busy_threshold: activity at or above this makes a GPU busy (>= ``idle_threshold``).
        min_idle_s: seconds of idle samples before a GPU is idle.
        stale_after_s: a GPU not sampled this long is unknown.
        refresh_s: analytics re-publishes every GPU's capacity update at least this often.
        pool: pool name put on capacity updates.

    Raises (as ``pydantic.ValidationError``): thresholds that ``IdleConfig`` refuses.
    """

    model_config = ConfigDict(extra="forbid")

    idle_threshold: float = 0.05
    busy_threshold: float = 0.10
    min_idle_s: float = 60.0
    stale_after_s: float = 30.0
    refresh_s: float = Field(default=30.0, gt=0)
    pool: str = "default"

    @model_validator(mode="after")
    def _check(self) -> IdleSettings:
        self.to_idle_config()  # raises ValueError with IdleConfig's own message
        return self

    def to_idle_config(self) -> IdleConfig:
        """The analytics stage's :class:`IdleConfig` (other fields at their defaults).
        Raises ``ValueError`` on a bad threshold."""
        return IdleConfig(
            idle_threshold=self.idle_threshold,
            busy_threshold=self.busy_threshold,
            min_idle_s=self.min_idle_s,
            stale_after_s=self.stale_after_s,
        )


class BrokerSettings(BaseModel):
    """Offer and lease times of the broker, seconds (:class:`broker.config.BrokerConfig`).

    Attributes:
        offer_ttl_s: an offer lapses this long after it is published.
        notice_s: reclaim notice each lease gets.
        lease_ttl_s: a lease expires unless renewed within this long.
    """

    model_config = ConfigDict(extra="forbid")

    offer_ttl_s: float = Field(default=60.0, gt=0)
    notice_s: float = Field(default=30.0, ge=0)
    lease_ttl_s: float = Field(default=60.0, gt=0)

    def to_broker_config(self) -> BrokerConfig:
        """The broker stage's :class:`BrokerConfig` (other fields at their defaults)."""
        return BrokerConfig(
            offer_ttl_s=self.offer_ttl_s, notice_s=self.notice_s, lease_ttl_s=self.lease_ttl_s
        )


class GpupoolSettings(BaseSettings):
    """Every setting of gpupool (sources and precedence: module docstring).

    Attributes:
        config: the TOML file these settings were read from (``GPUPOOL_CONFIG`` or ``--config``).
        kafka: Kafka bootstrap servers ``host:port[,host:port]``; ``None``: the in-process bus.
        topic_prefix: prefix of every Kafka topic name.
        mqtt: MQTT server ``host:port``.
        mqtt_username / mqtt_password: MQTT credentials of the broker (the password is a secret:
            masked when shown).
        mqtt_root: MQTT topic root.
        mqtt_protocol: 5, or 4 for MQTT 3.1.1.
        state_dir: where the demo and local services keep files.
        analytics_db: the analytics DuckDB file.
        metrics / idle / broker: the groups above.

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
    state_dir: Path = Path(".state")
    analytics_db: Path = Path("gpupool-analytics.duckdb")
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    idle: IdleSettings = Field(default_factory=IdleSettings)
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


def load_settings(config: Path | None = None, **overrides: Any) -> GpupoolSettings:
    """The effective settings: ``overrides`` (flags), ``GPUPOOL_*``, the TOML file ``config`` (or
    ``$GPUPOOL_CONFIG``), defaults. Raises like :class:`GpupoolSettings`."""
    if config is not None:
        overrides["config"] = config
    return GpupoolSettings(**overrides)


def effective_config(settings: GpupoolSettings) -> dict[str, Any]:
    """The settings as plain data (``str``/``int``/``float``/``bool``/``None``, nested ``dict``s):
    paths as strings, every secret that is set as :data:`MASK`."""
    return {k: _plain(v) for k, v in settings.model_dump().items()}


def _plain(value: Any) -> Any:
    if isinstance(value, SecretStr):
        return MASK
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value


def to_toml(config: dict[str, Any]) -> str:
    """TOML text of :func:`effective_config`'s output. TOML has no null: unset (``None``) values are
    left out, which reads back as the default only where the default is ``None``, so they are
    listed in a leading comment."""
    unset = sorted(_unset_keys(config))
    body = tomli_w.dumps(_drop_none(config))
    head = "# effective gpupool settings (flags > GPUPOOL_* environment > TOML file > defaults)\n"
    if unset:
        head += f"# not set: {', '.join(unset)}\n"
    return head + body


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _drop_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}


def _unset_keys(d: dict[str, Any], prefix: str = "") -> list[str]:
    out: list[str] = []
    for k, v in d.items():
        if v is None:
            out.append(prefix + k)
        elif isinstance(v, dict):
            out += _unset_keys(v, f"{prefix}{k}.")
    return out
