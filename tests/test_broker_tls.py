"""MQTT over TLS on a real Mosquitto: ``deploy/local/mosquitto.sh`` with ``GPUPOOL_MQTT_TLS=1``
(a throwaway CA and server certificate made with openssl, a TLS listener written by
``broker.acl``), the broker service and an edge site connecting with the CA, and clients without
it refused.

Each Mosquitto here is private to this module (its own ``GPUPOOL_STATE``), started and stopped
by the script, by pid.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from broker.acl import TlsListener, tls_listener, write_mosquitto_files
from broker.cli import broker_app, edge_app, tls_options
from broker.edge import EdgeClient
from broker.service import BrokerService
from broker.transport import LoginRefused, NoMqttAnswer, TlsHandshakeFailed, TlsOptions, make_client
from contracts import KafkaTopics, LeaseState
from contracts.bus import MemoryBus
from tests.mqtt_support import MOSQUITTO_SH, running
from tests.test_broker_service import CFG, _idle, _offer_on

pytestmark = pytest.mark.integration


def _script(state: Path, action: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(MOSQUITTO_SH), action],
        env={**os.environ, "GPUPOOL_STATE": str(state), **env},
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


def _start(state: Path, **env: str) -> dict[str, Any]:
    done = _script(state, "start", GPUPOOL_MQTT_TLS="1", **env)
    if done.returncode != 0:
        pytest.fail(f"mosquitto.sh start (TLS) failed:\n{done.stdout}\n{done.stderr}", pytrace=False)
    creds: dict[str, Any] = json.loads((state / "mosquitto" / "credentials.json").read_text())
    creds["state"] = state
    return creds


@pytest.fixture(scope="module")
def tls_mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A private Mosquitto with a plain and a TLS listener: its credentials.json (with ``tls``)."""
    state = tmp_path_factory.mktemp("tls-mosquitto")
    creds = _start(state)
    yield creds
    _script(state, "stop")


def _ca(creds: dict[str, Any]) -> TlsOptions:
    return TlsOptions(cafile=Path(creds["tls"]["cafile"]))


def _site(creds: dict[str, Any], tls: TlsOptions | None, **kw: Any) -> EdgeClient:
    return EdgeClient(
        site="edge-a",
        host=creds["host"],
        port=creds["tls"]["port"],
        username="edge-a",
        password=creds["users"]["edge-a"],
        root=creds["root"],
        protocol=5,
        tls=tls,
        reconnect_min_s=0.05,
        reconnect_max_s=0.2,
        **kw,
    )


def test_the_script_writes_a_tls_listener_with_a_ca_signed_certificate(tls_mosquitto: dict[str, Any]) -> None:
    creds = tls_mosquitto
    conf = (creds["state"] / "mosquitto" / "mosquitto.conf").read_text()
    tls_dir = creds["state"] / "mosquitto" / "tls"
    assert f"listener {creds['port']} 127.0.0.1" in conf
    assert f"listener {creds['tls']['port']} 127.0.0.1\ncafile {tls_dir / 'ca.pem'}\n" in conf
    assert "require_certificate false" in conf and creds["tls"]["require_certificate"] is False
    verify = subprocess.run(
        ["openssl", "verify", "-CAfile", str(tls_dir / "ca.pem"), str(tls_dir / "server.pem")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr
    san = subprocess.run(
        ["openssl", "x509", "-noout", "-ext", "subjectAltName", "-in", str(tls_dir / "server.pem")],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "IP Address:127.0.0.1" in san and "DNS:localhost" in san


async def test_a_site_claims_over_tls_and_clients_without_the_ca_are_refused(
    tls_mosquitto: dict[str, Any],
) -> None:
    creds = tls_mosquitto
    bus = MemoryBus()
    svc = BrokerService(
        bus=bus, topics=KafkaTopics(), mqtt_host=creds["host"], mqtt_port=creds["tls"]["port"],
        mqtt_username="gpupool-broker", mqtt_password=creds["users"]["gpupool-broker"], root=creds["root"],
        protocol=5, config=CFG, client_id=f"gpupool-broker-tls-{time.time_ns()}", tls=_ca(creds),
    )  # fmt: skip
    async with running(svc):
        async with _site(creds, _ca(creds), persistent=False) as site:
            await _idle(bus, "tls-n1", 2)
            offer = await _offer_on(site, "tls-n1")
            lease = await site.claim(offer.offer_id, count=1)
            assert lease.state is LeaseState.GRANTED and lease.site == "edge-a"
            await site.release(lease.lease_id)
            final = await site.wait_lease(lease.lease_id, lambda m: not m.state.live, 5)
            assert final.state is LeaseState.RELEASED

        # the system's trust store does not know the throwaway CA: the handshake fails
        with pytest.raises(TlsHandshakeFailed, match="TLS handshake failed: .*CERTIFICATE_VERIFY_FAILED"):
            async with _site(creds, TlsOptions(), persistent=False, connect_timeout_s=2):
                pass
        # plain MQTT on the TLS port is not MQTT to it: no CONNACK, and the error says why
        with pytest.raises(NoMqttAnswer, match="no MQTT answer: is this a TLS port. give --mqtt-cafile"):
            async with _site(creds, None, persistent=False, connect_timeout_s=2):
                pass
        # TLS to the plain port: the handshake fails at once
        t0 = time.monotonic()
        with pytest.raises(TlsHandshakeFailed, match="TLS handshake failed"):
            async with EdgeClient(
                site="edge-a", host=creds["host"], port=creds["port"], username="edge-a",
                password=creds["users"]["edge-a"], root=creds["root"], tls=_ca(creds), persistent=False,
                connect_timeout_s=5,
            ):  # fmt: skip
                pass
        assert time.monotonic() - t0 < 2.0
        # the CA is not a password: a wrong one is still refused over TLS
        wrong = EdgeClient(
            site="edge-a", host=creds["host"], port=creds["tls"]["port"], username="edge-a",
            password="not-the-password", root=creds["root"], tls=_ca(creds), persistent=False,
            connect_timeout_s=2,
        )  # fmt: skip
        with pytest.raises(LoginRefused, match="refused the login of edge-a: not authorized"):
            async with wrong:
                pass


def test_edge_cli_connects_over_tls_with_the_ca_only(tls_mosquitto: dict[str, Any]) -> None:
    creds = tls_mosquitto
    runner = CliRunner()
    common = ["offers", "--site", "edge-a", "--mqtt", f"{creds['host']}:{creds['tls']['port']}",
              "--root", creds["root"], "--timeout", "1"]  # fmt: skip
    env = {"GPUPOOL_MQTT_PASSWORD": creds["users"]["edge-a"]}
    ok = runner.invoke(edge_app, ["--mqtt-cafile", creds["tls"]["cafile"], *common], env=env)
    assert ok.exit_code == 0, ok.output
    assert isinstance(json.loads(ok.stdout), list)
    # the TLS flags also work after the subcommand, and there win over the ones before it
    after = runner.invoke(edge_app, [*common, "--mqtt-cafile", creds["tls"]["cafile"]], env=env)
    assert after.exit_code == 0, after.output
    both = runner.invoke(
        edge_app, ["--mqtt-cafile", "/etc/ssl/certs/ca-certificates.crt", *common, "--mqtt-cafile", creds["tls"]["cafile"]],
        env=env,
    )  # fmt: skip
    assert both.exit_code == 0, both.output
    # a flag wins over the environment, before or after the subcommand
    env_ca = {**env, "GPUPOOL_MQTT_CAFILE": "/etc/ssl/certs/ca-certificates.crt"}
    for args in (
        ["--mqtt-cafile", creds["tls"]["cafile"], *common],
        [*common, "--mqtt-cafile", creds["tls"]["cafile"]],
    ):
        assert runner.invoke(edge_app, args, env=env_ca).exit_code == 0
    untrusted = runner.invoke(edge_app, common, env=env_ca)
    assert untrusted.exit_code == 2 and "TLS handshake failed" in untrusted.stderr
    refused = runner.invoke(edge_app, common, env=env)
    assert refused.exit_code == 2 and "not reachable" in refused.stderr
    assert "no MQTT answer: is this a TLS port? give --mqtt-cafile" in refused.stderr
    # every edge subcommand has the three flags, each reading (and naming) its variable
    group = typer.main.get_command(edge_app)
    for name in ("offers", "claim", "renew", "release", "watch"):
        params = {p.name: p for p in group.commands[name].params}  # type: ignore[attr-defined]
        for flag, var in (("mqtt_cafile", "GPUPOOL_MQTT_CAFILE"), ("mqtt_certfile", "GPUPOOL_MQTT_CERTFILE"),
                          ("mqtt_keyfile", "GPUPOOL_MQTT_KEYFILE")):  # fmt: skip
            assert params[flag].envvar == var and f"env {var}" in (params[flag].help or ""), (name, flag)
    missing = runner.invoke(edge_app, ["--mqtt-cafile", "/nonexistent/ca.pem", *common], env=env)
    assert missing.exit_code == 2 and "/nonexistent/ca.pem" in missing.output


async def test_mutual_tls_requires_a_client_certificate_of_the_ca(tmp_path: Path) -> None:
    creds = _start(tmp_path / "state", GPUPOOL_MQTT_TLS_REQUIRE_CERT="1")
    try:
        tls_dir = tmp_path / "state" / "mosquitto" / "tls"
        key, csr, cert = tmp_path / "client.key", tmp_path / "client.csr", tmp_path / "client.pem"
        for args in (
            ["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=edge-a", "-keyout", key, "-out", csr],
            ["x509", "-req", "-in", csr, "-CA", tls_dir / "ca.pem", "-CAkey", tls_dir / "ca.key",
             "-CAcreateserial", "-days", "2", "-out", cert],
        ):  # fmt: skip
            subprocess.run(["openssl", *map(str, args)], capture_output=True, check=True)
        assert creds["tls"]["require_certificate"] is True
        with_cert = TlsOptions(cafile=Path(creds["tls"]["cafile"]), certfile=cert, keyfile=key)
        async with _site(creds, with_cert, persistent=False, announce=False) as site:
            assert site.connected
        with pytest.raises(ConnectionError):
            async with _site(creds, _ca(creds), persistent=False, announce=False, connect_timeout_s=2):
                pass
        # the plain listener (loopback, for the local tools) is unchanged
        client = make_client(
            creds["host"], creds["port"], username="edge-a", password=creds["users"]["edge-a"],
            identifier="tls-test-plain", protocol=5, state_topic=None, peer="edge-a", seq=1, persistent=False,
        )  # fmt: skip
        async with client:
            pass
    finally:
        _script(tmp_path / "state", "stop")


def test_tls_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs its certificate"):
        TlsOptions(keyfile=tmp_path / "k.pem")
    with pytest.raises(ValueError, match="TLS CA file"):
        TlsOptions(cafile=tmp_path / "missing.pem")
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    with pytest.raises(ValueError, match="junk.pem"):
        TlsOptions(cafile=tmp_path / "junk.pem")
    assert tls_options(None, None, None) is None
    with pytest.raises(Exception, match="missing.pem"):
        tls_options(tmp_path / "missing.pem", None, None)
    res = CliRunner().invoke(
        broker_app, ["run", "--kafka", "127.0.0.1:9", "--mqtt-cafile", str(tmp_path / "missing.pem")]
    )
    assert res.exit_code == 2 and "missing.pem" in res.output


def test_acl_tls_listener_options_are_all_or_nothing(tmp_path: Path) -> None:
    assert tls_listener(None, None, None, None) is None
    with pytest.raises(ValueError, match="--certfile, --keyfile"):
        tls_listener(8883, tmp_path / "ca.pem", None, None)
    with pytest.raises(ValueError, match="--require-certificate needs"):
        tls_listener(None, None, None, None, require_certificate=True)
    files = {n: tmp_path / f"{n}.pem" for n in ("ca", "cert", "key")}
    for f in files.values():
        f.write_text("x\n")
    listener = TlsListener(18884, files["ca"], files["cert"], files["key"])
    with pytest.raises(ValueError, match="also the plain listener's"):
        write_mosquitto_files(tmp_path / "mq", "gpupool/v1", ["edge-a"], "gpupool-broker", 18884, listener)
    with pytest.raises(ValueError, match="does not exist"):
        TlsListener(18884, tmp_path / "nope.pem", files["cert"], files["key"]).check(1883)
