"""Failed edge logins on a real Mosquitto (the session ``mosquitto`` fixture: per-site users):
a refused CONNECT is not retried and says so (:class:`broker.transport.LoginRefused`, exit 1 in
the CLI), and :func:`broker.transport.connect_failure` classifies the CONNACK codes of MQTT 5
and 3.1.1. TLS mismatches are tested in ``tests/test_broker_tls.py`` (private TLS Mosquitto)."""

from __future__ import annotations

import ssl
import time
from typing import Any

import pytest
from aiomqtt import MqttError
from aiomqtt.exceptions import MqttConnectError
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode
from typer.testing import CliRunner

from broker.cli import edge_app
from broker.edge import EdgeClient
from broker.transport import LoginRefused, NoMqttAnswer, TlsHandshakeFailed, connect_failure


def _site(creds: dict[str, Any], password: str, protocol: int, timeout_s: float = 5.0) -> EdgeClient:
    return EdgeClient(
        site="edge-a", host=creds["host"], port=creds["port"], username="edge-a", password=password,
        root=creds["root"], protocol=protocol, persistent=False, announce=False,
        connect_timeout_s=timeout_s, reconnect_min_s=0.05, reconnect_max_s=0.1,
    )  # fmt: skip


@pytest.mark.parametrize("protocol", [5, 4])
async def test_a_refused_login_fails_at_once_and_names_the_user(
    mosquitto: dict[str, Any], protocol: int
) -> None:
    t0 = time.monotonic()
    with pytest.raises(LoginRefused) as refused:
        async with _site(mosquitto, "not-the-password", protocol, timeout_s=5.0):
            pass
    # not retried until the 5 s connect timeout: the first CONNACK ends it
    assert time.monotonic() - t0 < 2.0
    assert str(refused.value) == "MQTT server refused the login of edge-a: not authorized"
    assert refused.value.code == 0x87 and refused.value.username == "edge-a"
    # the right password still connects
    async with _site(mosquitto, mosquitto["users"]["edge-a"], protocol) as site:
        assert site.connected


def test_edge_cli_exits_1_on_a_refused_login(mosquitto: dict[str, Any]) -> None:
    res = CliRunner().invoke(
        edge_app,
        ["offers", "--site", "edge-a", "--mqtt", f"{mosquitto['host']}:{mosquitto['port']}", "--root",
         mosquitto["root"], "--timeout", "5"],
        env={"GPUPOOL_MQTT_PASSWORD": "nope"},
    )  # fmt: skip
    assert res.exit_code == 1, res.output
    assert "MQTT server refused the login of edge-a: not authorized" in res.stderr
    assert "not reachable" not in res.stderr


def test_connect_failure_classifies_connack_codes_and_transport_errors() -> None:
    def rc(code: int) -> ReasonCode:
        return ReasonCode(PacketTypes.CONNACK, identifier=code)

    for code, reason in ((0x86, "bad user name or password"), (0x87, "not authorized"),
                         (0x8C, "bad authentication method")):  # fmt: skip
        found = connect_failure(MqttConnectError(rc(code)), username="edge-b", tls=False)
        assert isinstance(found, LoginRefused) and found.code == code
        assert str(found) == f"MQTT server refused the login of edge-b: {reason}"
    # MQTT 3.1.1 return codes 4 and 5
    v311 = connect_failure(MqttConnectError(4), username="edge-b", tls=False)
    assert isinstance(v311, LoginRefused) and v311.code == 0x86
    v311 = connect_failure(MqttConnectError(5), username=None, tls=False)
    assert isinstance(v311, LoginRefused) and str(v311).endswith("(anonymous): not authorized")
    # server busy / unavailable: worth retrying
    assert connect_failure(MqttConnectError(rc(0x89)), username="edge-b", tls=False) is None
    assert connect_failure(MqttConnectError(3), username="edge-b", tls=False) is None

    def chained(cause: OSError) -> MqttError:
        try:
            try:
                raise cause
            except OSError as e:
                raise MqttError(str(e)) from None
        except MqttError as err:
            return err

    tls = connect_failure(
        chained(ssl.SSLCertVerificationError(1, "CERTIFICATE_VERIFY_FAILED")), username="x", tls=True
    )
    assert isinstance(tls, TlsHandshakeFailed) and str(tls).startswith("TLS handshake failed: ")
    reset = connect_failure(chained(ConnectionResetError(104, "reset")), username="x", tls=True)
    assert isinstance(reset, TlsHandshakeFailed)
    assert connect_failure(chained(ConnectionResetError(104, "reset")), username="x", tls=False) is None
    silent = connect_failure(chained(TimeoutError()), username="x", tls=False)
    assert isinstance(silent, NoMqttAnswer)
    assert str(silent) == "no MQTT answer: is this a TLS port? give --mqtt-cafile"
    assert connect_failure(chained(TimeoutError()), username="x", tls=True) is None
    assert connect_failure(chained(ConnectionRefusedError(111, "refused")), username="x", tls=False) is None
