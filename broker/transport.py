"""MQTT plumbing shared by the broker service and the edge-site client (aiomqtt 2.x / paho 2.x).

* :func:`make_client` — one aiomqtt client per connection attempt (the Last Will carries the
  attempt's sequence number, and aiomqtt fixes the Will at construction), with an unbounded
  incoming queue (aiomqtt discards silently when its bound is hit) and a persistent session where
  asked: MQTT 5 ``clean_start=False`` + session expiry, MQTT 3.1.1 ``clean_session=False``.
* :func:`publish_properties` / :func:`subscriptions` / :func:`user_properties` — MQTT 5
  properties when the protocol is 5, nothing on 3.1.1 (every essential field is in the JSON
  payload anyway; the ``traceparent`` user property only continues a trace).
* :class:`Backoff` — exponential reconnect delay with jitter.
* :func:`serve_mqtt` — the one reconnect loop: connect, set up, serve messages, back off, again.
* :class:`TlsOptions` — MQTT over TLS (a listener made by ``gpupool broker acl --tls-port``):
  the CA that signed the server's certificate and, for mutual TLS, the client's certificate.
* :func:`connect_failure` — tells a failed connection attempt that retrying cannot fix (the
  server refused the login: :class:`LoginRefused`; the TLS handshake failed:
  :class:`TlsHandshakeFailed`; a plain client got no MQTT answer, likely a TLS port:
  :class:`NoMqttAnswer`) from a transient one (server down, connection lost).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiomqtt
from aiomqtt.exceptions import MqttConnectError
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from contracts import PeerState, encode
from runtime.backoff import Backoff as Backoff  # re-exported: the MQTT reconnect loops take it from here


def protocol_version(protocol: int) -> aiomqtt.ProtocolVersion:
    """``5`` → MQTT 5, ``4`` (or ``311``) → MQTT 3.1.1. Raises ``ValueError`` otherwise."""
    if protocol == 5:
        return aiomqtt.ProtocolVersion.V5
    if protocol in (4, 311):
        return aiomqtt.ProtocolVersion.V311
    raise ValueError(f"MQTT protocol must be 5 or 4 (3.1.1), not {protocol}")


def birth_seq() -> int:
    """A sequence number for a new birth: Unix milliseconds now, so it grows across restarts
    (a late Last Will of an older session carries a smaller number)."""
    return time.time_ns() // 1_000_000


@dataclass(frozen=True)
class TlsOptions:
    """TLS of an MQTT connection (the server's name or IP is verified against its certificate).

    Attributes:
        cafile: PEM file of the CA(s) that signed the server's certificate; ``None``: the
            system's default trust store.
        certfile: PEM client certificate (mutual TLS: a listener with ``require_certificate
            true``); ``None``: no client certificate.
        keyfile: PEM private key of ``certfile``; ``None``: the key is in ``certfile``.

    Raises ``ValueError`` (at construction) for a ``keyfile`` without a ``certfile``, or when
    the files cannot be read or are not a CA bundle / certificate and key (the message names
    the file).
    """

    cafile: Path | None = None
    certfile: Path | None = None
    keyfile: Path | None = None
    _context: ssl.SSLContext = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.keyfile is not None and self.certfile is None:
            raise ValueError("a TLS key file needs its certificate file")
        try:
            ctx = ssl.create_default_context(
                ssl.Purpose.SERVER_AUTH, cafile=str(self.cafile) if self.cafile is not None else None
            )
        except (OSError, ssl.SSLError) as e:
            raise ValueError(f"TLS CA file {self.cafile}: {e}") from e
        if self.certfile is not None:
            try:
                ctx.load_cert_chain(str(self.certfile), str(self.keyfile) if self.keyfile else None)
            except (OSError, ssl.SSLError) as e:
                raise ValueError(f"TLS certificate {self.certfile} / key {self.keyfile}: {e}") from e
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        object.__setattr__(self, "_context", ctx)

    @property
    def context(self) -> ssl.SSLContext:
        """The client-side ``ssl.SSLContext`` (made once; shared by every connection attempt)."""
        return self._context


LOGIN_REFUSED_CODES: dict[int, str] = {
    0x86: "bad user name or password",
    0x87: "not authorized",
    0x8C: "bad authentication method",
}
"""MQTT 5 CONNACK reason codes (OASIS MQTT 5.0, 3.2.2.2) that refuse the login itself."""

_V311_REFUSED: dict[int, int] = {4: 0x86, 5: 0x87}
"""MQTT 3.1.1 CONNACK return codes (OASIS MQTT 3.1.1, 3.2.2.3) → the MQTT 5 code they mean."""


class LoginRefused(ConnectionError):
    """The MQTT server refused the CONNECT of ``username`` (CONNACK 0x86 bad user name or password,
    0x87 not authorized, 0x8C bad authentication method; MQTT 3.1.1 return codes 4 and 5).

    Attributes:
        username: the user name sent (``None``: anonymous).
        code: the MQTT 5 reason code (3.1.1 codes mapped: 4 → 0x86, 5 → 0x87).
        reason: the code's meaning, lower case (``not authorized``).
    """

    def __init__(self, username: str | None, code: int, reason: str) -> None:
        super().__init__(f"MQTT server refused the login of {username or '(anonymous)'}: {reason}")
        self.username, self.code, self.reason = username, code, reason


class TlsHandshakeFailed(ConnectionError):
    """The TLS handshake with the server failed (certificate not trusted, name mismatch, the
    port does not speak TLS...); the message carries the TLS library's reason."""


class NoMqttAnswer(ConnectionError):
    """A plain-TCP client was accepted but got no CONNACK in time: most likely the port is a TLS
    listener (``--mqtt-cafile`` missing)."""


def connect_failure(
    error: BaseException, *, username: str | None, tls: bool
) -> LoginRefused | TlsHandshakeFailed | NoMqttAnswer | None:
    """Classify ``error``, the failure of one connection attempt (an ``aiomqtt.MqttError`` raised
    by entering the client, or anything it chained).

    Returns :class:`LoginRefused` for a refused login (:data:`LOGIN_REFUSED_CODES`, MQTT 3.1.1
    codes 4/5), :class:`TlsHandshakeFailed` for an ``ssl.SSLError`` (or a reset during the
    connect) with ``tls``, :class:`NoMqttAnswer` for a CONNACK timeout without ``tls``
    ("no MQTT answer: is this a TLS port? give --mqtt-cafile"); ``None`` for anything else
    (server down, refused TCP connection, lost connection: worth retrying). Raises nothing.
    """
    if isinstance(error, MqttConnectError):
        rc = error.rc
        if isinstance(rc, ReasonCode):
            code = rc.value
        elif isinstance(rc, int):
            code = _V311_REFUSED.get(rc, rc)
        else:
            return None
        if code in LOGIN_REFUSED_CODES:
            return LoginRefused(username, code, LOGIN_REFUSED_CODES[code])
        return None
    cause = error.__cause__ or error.__context__
    if isinstance(error, ssl.SSLError) or isinstance(cause, ssl.SSLError):
        reason = error if isinstance(error, ssl.SSLError) else cause
        return TlsHandshakeFailed(f"TLS handshake failed: {reason}")
    if tls and isinstance(cause, ConnectionResetError):
        return TlsHandshakeFailed(f"TLS handshake failed: {cause} (is this a TLS port?)")
    if not tls and isinstance(cause, TimeoutError):
        return NoMqttAnswer("no MQTT answer: is this a TLS port? give --mqtt-cafile")
    return None


def make_client(
    host: str,
    port: int,
    *,
    username: str | None,
    password: str | None,
    identifier: str,
    protocol: int,
    state_topic: str | None,
    peer: str,
    seq: int,
    persistent: bool,
    session_expiry_s: int = 3600,
    keepalive_s: int = 15,
    timeout_s: float = 10.0,
    tls: TlsOptions | None = None,
) -> aiomqtt.Client:
    """An aiomqtt client (not yet connected) whose Last Will is the retained
    ``PeerState(peer, online=False, seq)`` on ``state_topic``, QoS 1 (no Will if ``None``).

    The socket has ``TCP_NODELAY`` set (small request/reply packets go out at once). With
    ``tls`` the connection is MQTT over TLS (``port`` must then be a TLS listener's).

    ``persistent``: the server keeps the session (subscriptions, queued QoS 1 messages) across
    disconnects — MQTT 5 ``clean_start=False`` with ``SessionExpiryInterval = session_expiry_s``
    seconds, MQTT 3.1.1 ``clean_session=False``; ``identifier`` must then be stable. Raises
    ``ValueError`` for a bad ``protocol``.
    """
    version = protocol_version(protocol)
    will = None
    if state_topic is not None:
        will = aiomqtt.Will(
            topic=state_topic,
            payload=encode(PeerState(peer=peer, online=False, seq=seq, ts=time.time())),
            qos=1,
            retain=True,
        )
    common: dict[str, object] = {
        "username": username,
        "password": password,
        "identifier": identifier,
        "protocol": version,
        "will": will,
        "keepalive": keepalive_s,
        "timeout": timeout_s,
        "max_queued_incoming_messages": 0,  # unbounded: never drop a lease or reclaim notice
        # no Nagle: a claim, its reply and its lease are small packets each waiting on the other
        # side's delayed ACK otherwise (measured on loopback: ~45 ms per request/reply, not ~1 ms)
        "socket_options": ((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),),
        "tls_context": tls.context if tls is not None else None,
    }
    if version is aiomqtt.ProtocolVersion.V5:
        props = Properties(PacketTypes.CONNECT)
        if persistent:
            props.SessionExpiryInterval = session_expiry_s
        return aiomqtt.Client(host, port, clean_start=not persistent, properties=props, **common)  # type: ignore[arg-type]
    return aiomqtt.Client(host, port, clean_session=not persistent, **common)  # type: ignore[arg-type]


def publish_properties(
    protocol: int,
    *,
    expiry_s: float | None = None,
    response_topic: str | None = None,
    correlation: bytes | None = None,
    user_properties: Sequence[tuple[str, str]] = (),
) -> Properties | None:
    """MQTT 5 PUBLISH properties (message expiry rounded up to whole seconds, at least 1; response
    topic; correlation data; user properties such as ``traceparent``), or ``None`` on 3.1.1 or
    when none is given."""
    if protocol != 5 or (
        expiry_s is None and response_topic is None and correlation is None and not user_properties
    ):
        return None
    props = Properties(PacketTypes.PUBLISH)
    if expiry_s is not None:
        props.MessageExpiryInterval = max(1, int(-(-expiry_s // 1)))
    if response_topic is not None:
        props.ResponseTopic = response_topic
    if correlation is not None:
        props.CorrelationData = correlation
    if user_properties:
        props.UserProperty = list(user_properties)  # paho appends to the list it keeps
    return props


def subscriptions(
    protocol: int, topics: list[str], *, no_local: bool = False, retain_as_published: bool = False
) -> list[tuple[str, SubscribeOptions]] | list[tuple[str, int]]:
    """The argument of ``aiomqtt.Client.subscribe`` for ``topics`` at QoS 1 in one SUBSCRIBE
    packet; on MQTT 5 with ``no_local`` the server does not echo this client's own publishes, and
    with ``retain_as_published`` a message forwarded live keeps its retain flag (MQTT 3.1.1 and
    MQTT 5 without it clear the flag on live delivery: only retained messages sent at subscribe
    time carry it)."""
    if protocol == 5:
        return [
            (t, SubscribeOptions(qos=1, noLocal=no_local, retainAsPublished=retain_as_published))
            for t in topics
        ]
    return [(t, 1) for t in topics]


def response_route(message: aiomqtt.Message) -> tuple[str | None, bytes | None]:
    """``(response_topic, correlation_data)`` of an MQTT 5 request; ``(None, None)`` on 3.1.1."""
    props = message.properties
    if props is None:
        return None, None
    topic = getattr(props, "ResponseTopic", None)
    corr = getattr(props, "CorrelationData", None)
    return (topic or None), (bytes(corr) if corr else None)


def user_properties(message: aiomqtt.Message) -> list[tuple[str, str]]:
    """The MQTT 5 user properties of ``message`` as ``(name, value)`` pairs; ``[]`` on 3.1.1."""
    props = message.properties
    found = getattr(props, "UserProperty", None) if props is not None else None
    return [(str(k), str(v)) for k, v in found] if found else []


async def serve_mqtt(
    connect: Callable[[], aiomqtt.Client],
    on_connect: Callable[[aiomqtt.Client], Awaitable[None]],
    on_message: Callable[[aiomqtt.Message], Awaitable[None]],
    on_error: Callable[[Exception, bool], bool],
    on_disconnect: Callable[[], None],
    backoff: Backoff,
) -> None:
    """The one MQTT reconnect loop (broker service and edge-site client): connect with a fresh
    client from ``connect()`` (:func:`make_client`: each attempt has its own birth and Will), run
    ``on_connect`` (subscriptions, resync), then hand every incoming message to ``on_message``
    until the connection ends; then ``on_disconnect()``, sleep ``backoff.next()`` and connect again.
    ``backoff`` is reset once ``on_connect`` has returned (a connection that keeps failing while
    being set up keeps backing off).

    Every exception of an attempt (``aiomqtt.MqttError`` and any other) goes to
    ``on_error(error, connected)``, ``connected`` telling whether the server had accepted the
    connection; it logs and counts, and returns ``True`` to end the loop (a refused login: retrying
    cannot help), ``False`` to reconnect. Returns only then; runs until cancelled otherwise.
    """
    while True:
        connected = False
        try:
            client = connect()
            async with client:
                connected = True
                await on_connect(client)
                backoff.reset()
                async for msg in client.messages:
                    await on_message(msg)
        except Exception as e:  # noqa: BLE001 — on_error decides; the loop never dies of an attempt
            if on_error(e, connected):
                return
        finally:
            on_disconnect()
        await asyncio.sleep(backoff.next())
