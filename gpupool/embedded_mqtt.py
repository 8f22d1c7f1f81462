"""The demo's embedded MQTT broker: amqtt in this process, MQTT 3.1.1, anonymous, loopback.

Used only when no ``--mqtt`` URL is given (DESIGN.md "Real services": amqtt speaks 3.1.1 only,
retained messages work). Production and the integration tests use Mosquitto.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (bind to 0, read, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EmbeddedMqttBroker:
    """An amqtt broker on ``127.0.0.1:port`` (a free port when ``port`` is 0).

    Use as ``async with EmbeddedMqttBroker() as b: ... b.port``. Raises ``OSError`` if the port
    cannot be bound.
    """

    def __init__(self, port: int = 0, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port or free_port(host)
        self._broker: Any = None

    async def start(self) -> None:
        """Start listening; returns once the socket is bound."""
        from amqtt.broker import Broker  # imported here: only the demo needs it

        config = {
            "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
            "plugins": {
                "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
            },
        }
        # amqtt logs every connection at INFO; keep the demo's terminal readable.
        for name in ("amqtt", "transitions"):
            logging.getLogger(name).setLevel(logging.WARNING)
        self._broker = Broker(config)
        await self._broker.start()
        log.info("embedded_mqtt_started", extra={"host": self.host, "port": self.port})

    async def stop(self) -> None:
        """Shut the broker down (disconnects every client)."""
        if self._broker is not None:
            await self._broker.shutdown()
            self._broker = None

    async def __aenter__(self) -> EmbeddedMqttBroker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
