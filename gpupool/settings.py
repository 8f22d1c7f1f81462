"""gpupool's settings as the ``gpupool`` CLI shows them: the deployment model of
:mod:`runtime.settings`, checked against the stages' own configurations.

The model itself (fields, ``GPUPOOL_*`` environment variables, the TOML file of ``--config`` /
``GPUPOOL_CONFIG``, precedence flags > environment > file > defaults) is
:class:`runtime.settings.DeploymentSettings`: it lives in ``runtime`` because every stage's
``run`` command loads it and a stage may import nothing but ``contracts`` and ``runtime``
(tests/test_architecture.py). This module, part of the root ``gpupool`` package that may import
every stage, adds what needs the stages' classes: :class:`GpupoolSettings` refuses values the
stages would refuse (``analytics.classify.IdleConfig``'s thresholds,
``broker.config.BrokerConfig``), and :func:`idle_config` / :func:`broker_config` build those
configurations; plus the masked, printable form ``gpupool config show`` prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomli_w
from pydantic import SecretStr, model_validator

from analytics.classify import IdleConfig, idle_config_from
from broker.config import BrokerConfig, broker_config_from
from runtime.settings import (
    CONFIG_ENV,
    BrokerSettings,
    DeploymentSettings,
    IdleSettings,
)

__all__ = [
    "CONFIG_ENV",
    "MASK",
    "GpupoolSettings",
    "broker_config",
    "effective_config",
    "idle_config",
    "load_settings",
    "to_toml",
]

MASK = "**********"
"""What a secret that is set shows as in :func:`effective_config`."""


def idle_config(idle: IdleSettings) -> IdleConfig:
    """The analytics stage's :class:`IdleConfig` of ``idle`` (:func:`analytics.classify.idle_config_from`).
    Raises ``ValueError`` on thresholds IdleConfig refuses (``idle_threshold > busy_threshold``)."""
    return idle_config_from(idle)


def broker_config(broker: BrokerSettings) -> BrokerConfig:
    """The broker stage's :class:`BrokerConfig` of ``broker`` (:func:`broker.config.broker_config_from`).
    Raises ``pydantic.ValidationError`` on a value it refuses."""
    return broker_config_from(broker)


class GpupoolSettings(DeploymentSettings):
    """:class:`runtime.settings.DeploymentSettings` (every field and source), also refusing
    what the stages would refuse at start.

    Raises (as ``pydantic.ValidationError``, like any invalid value): idle thresholds
    :class:`IdleConfig` refuses, broker times :class:`BrokerConfig` refuses; plus
    ``FileNotFoundError`` / ``tomllib.TOMLDecodeError`` for the TOML file.
    """

    @model_validator(mode="after")
    def _stages_accept(self) -> GpupoolSettings:
        try:
            idle_config(self.idle)
        except ValueError as exc:  # IdleConfig's own message, prefixed with the group
            raise ValueError(f"idle: {exc}") from exc
        broker_config(self.broker)
        return self


def load_settings(config: Path | None = None, **overrides: Any) -> GpupoolSettings:
    """The effective settings: ``overrides`` (flag values by field name, groups as dicts),
    ``GPUPOOL_*``, the TOML file ``config`` (or ``$GPUPOOL_CONFIG``), defaults. Raises like
    :class:`GpupoolSettings`."""
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
    if isinstance(value, list):
        return [_plain(v) for v in value]
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
