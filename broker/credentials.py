"""Clients logged in to a Mosquitto set up by :mod:`broker.acl`, from the credentials it wrote.

``credentials`` below is the mapping :func:`broker.acl.write_mosquitto_files` returns and writes
to ``credentials.json``: ``{"host": str, "port": int, "root": str, "users": {user: password}}``
(plus ``"tls"`` with a TLS listener). Every client here connects with MQTT 5 to ``host:port``
as one of ``users``; a user that is not there raises ``KeyError``.

Used by the tests and benchmarks that run a real Mosquitto (``deploy/local/mosquitto.sh``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiomqtt

from broker.acl import BROKER_USER
from broker.config import BrokerConfig
from broker.edge import EdgeClient
from broker.service import BrokerService
from contracts import KafkaTopics
from contracts.bus import Bus


def broker_service(
    credentials: Mapping[str, Any],
    *,
    bus: Bus,
    topics: KafkaTopics,
    config: BrokerConfig,
    client_id: str,
    user: str = BROKER_USER,
    **options: Any,
) -> BrokerService:
    """The broker stage on ``bus`` / ``topics`` with ``config``, connecting as ``user`` under the
    credentials' MQTT root with client id ``client_id``; ``options`` are further
    :class:`~broker.service.BrokerService` keyword arguments (``fabric``, ``clock``...)."""
    return BrokerService(
        bus=bus,
        topics=topics,
        mqtt_host=credentials["host"],
        mqtt_port=credentials["port"],
        mqtt_username=user,
        mqtt_password=credentials["users"][user],
        root=credentials["root"],
        protocol=5,
        config=config,
        client_id=client_id,
        **options,
    )


def edge_client(credentials: Mapping[str, Any], site: str, **options: Any) -> EdgeClient:
    """Edge site ``site``'s :class:`~broker.edge.EdgeClient`, logged in as the user of that name;
    ``options`` are further ``EdgeClient`` keyword arguments (``client_id``, ``persistent``,
    ``reconnect_min_s``...)."""
    return EdgeClient(
        site=site,
        host=credentials["host"],
        port=credentials["port"],
        username=site,
        password=credentials["users"][site],
        root=credentials["root"],
        protocol=5,
        **options,
    )


def mqtt_client(credentials: Mapping[str, Any], user: str, *, identifier: str, **options: Any) -> aiomqtt.Client:
    """A plain :class:`aiomqtt.Client` logged in as ``user`` with client id ``identifier``;
    ``options`` are further ``aiomqtt.Client`` keyword arguments (``clean_start``,
    ``max_queued_incoming_messages``...)."""
    return aiomqtt.Client(
        credentials["host"],
        credentials["port"],
        username=user,
        password=credentials["users"][user],
        identifier=identifier,
        protocol=aiomqtt.ProtocolVersion.V5,
        **options,
    )
