"""``gpupool broker acl`` writes the Mosquitto files of broker/acl.py: the ACL is render_acl's
text, the password file holds one mosquitto_passwd hash per site plus the broker user, and
passwords reach stdout only with --show-passwords."""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from broker.acl import render_acl
from gpupool.cli import app

pytestmark = pytest.mark.skipif(
    shutil.which("mosquitto_passwd") is None, reason="mosquitto_passwd (Debian mosquitto) not installed"
)

SITES = ["edge-a", "edge-b", "edge-c"]


def _run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["broker", "acl", *args], env={"COLUMNS": "200"})
    return result.exit_code, result.stdout, result.stderr


def test_writes_acl_and_hashed_passwords(tmp_path: Path) -> None:
    out = tmp_path / "mq"
    code, stdout, stderr = _run("--dir", str(out), "--sites", ",".join(SITES), "--port", "18883")
    assert code == 0, stderr
    assert stdout.strip() == str(out / "credentials.json")
    assert (out / "acl").read_text() == render_acl("gpupool/v1", SITES, "gpupool-broker")

    creds = json.loads((out / "credentials.json").read_text())
    assert set(creds["users"]) == {*SITES, "gpupool-broker", "gpupool-observer"}
    for password in creds["users"].values():
        assert password not in stdout

    entries = [line.split(":", 1) for line in (out / "passwd").read_text().splitlines() if line]
    assert sorted(user for user, _ in entries) == sorted([*SITES, "gpupool-broker", "gpupool-observer"])
    for user, hashed in entries:
        assert hashed.startswith("$7$") or hashed.startswith("$6$"), (user, hashed)
        assert creds["users"][user] not in hashed
    for name in ("passwd", "acl", "credentials.json"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600
    assert "listener 18883 127.0.0.1" in (out / "mosquitto.conf").read_text()


def test_show_passwords_and_rerun_keeps_them(tmp_path: Path) -> None:
    out = tmp_path / "mq"
    code, first, _ = _run("--dir", str(out), "--sites", "a,b", "--root", "lab/v1")
    assert code == 0
    before = json.loads((out / "credentials.json").read_text())["users"]
    code, stdout, _ = _run("--dir", str(out), "--sites", "a,b", "--root", "lab/v1", "--show-passwords")
    assert code == 0
    lines = stdout.splitlines()
    assert lines[0] == first.strip()
    shown = json.loads("\n".join(lines[1:]))
    assert shown["users"] == before  # kept across runs, and printed only when asked
    assert (out / "acl").read_text() == render_acl("lab/v1", ["a", "b"], "gpupool-broker")


@pytest.mark.parametrize("sites", ["edge/a", "a,a", "", "gpupool-broker"])
def test_bad_sites_are_refused_and_nothing_written(tmp_path: Path, sites: str) -> None:
    out = tmp_path / "mq"
    code, _, stderr = _run("--dir", str(out), "--sites", sites)
    assert code == 2
    assert not (out / "passwd").exists() and not (out / "acl").exists()


def _write_with_tls(tmp_path: Path, *extra: str) -> tuple[dict[str, Path], Path]:
    """``broker acl`` for edge-a with a plain listener on 18883 and TLS on 18884 (placeholder
    PEM files); returns the files and the output directory."""
    files = {n: tmp_path / f"{n}.pem" for n in ("ca", "server", "server-key")}
    for f in files.values():
        f.write_text("pem\n")
    out = tmp_path / "mq"
    code, _, stderr = _run(
        "--dir", str(out), "--sites", "edge-a", "--port", "18883", "--tls-port", "18884",
        "--cafile", str(files["ca"]), "--certfile", str(files["server"]), "--keyfile", str(files["server-key"]),
        *extra,
    )  # fmt: skip
    assert code == 0, stderr
    return files, out


def test_tls_listener_is_written_with_the_plain_one(tmp_path: Path) -> None:
    files, out = _write_with_tls(tmp_path, "--require-certificate")
    conf = (out / "mosquitto.conf").read_text()
    assert "listener 18883 127.0.0.1" in conf
    tls = conf[conf.index("listener 18884 127.0.0.1") :].splitlines()
    assert tls[:6] == [
        "listener 18884 127.0.0.1",
        f"cafile {files['ca']}",
        f"certfile {files['server']}",
        f"keyfile {files['server-key']}",
        "tls_version tlsv1.2",
        "require_certificate true",
    ]
    creds = json.loads((out / "credentials.json").read_text())
    assert creds["tls"] == {
        "port": 18884, "address": "127.0.0.1", "cafile": str(files["ca"]), "require_certificate": True,
    }  # fmt: skip
    # half a TLS listener is refused, and nothing is written
    code, _, _ = _run("--dir", str(tmp_path / "half"), "--sites", "edge-a", "--tls-port", "18884")
    assert code == 2 and not (tmp_path / "half" / "mosquitto.conf").exists()


def test_tls_listener_binds_the_given_address_for_remote_sites(tmp_path: Path) -> None:
    """Edge sites connect from outside the host: the TLS listener binds ``--tls-address`` while the
    plain listener stays on loopback; an address with blanks is refused and nothing written."""
    from broker.cli import broker_app

    files = {n: tmp_path / f"{n}.pem" for n in ("ca", "server", "server-key")}
    for f in files.values():
        f.write_text("pem\n")
    tls = ["--tls-port", "8883", "--cafile", str(files["ca"]), "--certfile", str(files["server"]),
           "--keyfile", str(files["server-key"])]  # fmt: skip
    out = tmp_path / "mq"
    res = CliRunner().invoke(
        broker_app, ["acl", "--dir", str(out), "--sites", "edge-a", "--port", "1883", *tls, "--tls-address", "0.0.0.0"]
    )
    assert res.exit_code == 0, res.output
    conf = (out / "mosquitto.conf").read_text().splitlines()
    assert "listener 1883 127.0.0.1" in conf and "listener 8883 0.0.0.0" in conf
    assert json.loads((out / "credentials.json").read_text())["tls"]["address"] == "0.0.0.0"
    res = CliRunner().invoke(
        broker_app, ["acl", "--dir", str(tmp_path / "bad"), "--sites", "edge-a", *tls, "--tls-address", "a b"]
    )
    assert res.exit_code == 2 and not (tmp_path / "bad" / "mosquitto.conf").exists()


def test_the_config_binds_client_ids_and_sets_limits(tmp_path: Path) -> None:
    """Client ids are user names on every listener; packet and per-client queue limits are set
    (contracts.mqtt.LIMITS); a site may write only its request topics."""
    from contracts.mqtt import LIMITS

    _, out = _write_with_tls(tmp_path)
    lines = (out / "mosquitto.conf").read_text().splitlines()
    from broker.acl import MAX_PACKET_BYTES, MAX_QUEUED_BYTES, MAX_QUEUED_MESSAGES

    assert (MAX_PACKET_BYTES, MAX_QUEUED_MESSAGES, MAX_QUEUED_BYTES) == (
        LIMITS.mosquitto_max_packet_bytes, LIMITS.mosquitto_max_queued_messages, LIMITS.mosquitto_max_queued_bytes
    )  # fmt: skip
    assert f"max_packet_size {LIMITS.mosquitto_max_packet_bytes}" in lines
    assert f"max_queued_messages {LIMITS.mosquitto_max_queued_messages}" in lines
    assert f"max_queued_bytes {LIMITS.mosquitto_max_queued_bytes}" in lines
    listeners = [i for i, line in enumerate(lines) if line.startswith("listener ")]
    assert len(listeners) == 2
    for start, end in zip(listeners, [*listeners[1:], len(lines)], strict=True):
        assert "use_username_as_clientid true" in lines[start:end], lines[start]
    acl = (out / "acl").read_text().splitlines()
    writes = sorted(line for line in acl if line.startswith("pattern write"))
    assert writes == sorted(f"pattern write gpupool/v1/sites/%u/{k}" for k in ("claims", "releases", "renewals", "state"))
