"""Mosquitto 2 access control for gpupool: users, passwords, ACL and config of a local broker.

Who may do what (DESIGN.md "Broker protocol"), under the MQTT root (default ``gpupool/v1``):

* the broker user (``gpupool-broker``): read and write ``{root}/#``;
* the observer user (``gpupool-observer``): read ``{root}/#`` only (health checks, audits);
* each edge site, logged in with its site name as user name: write only its request topics
  ``{root}/sites/{site}/claims``, ``…/renewals``, ``…/releases`` and ``…/state`` (never its
  ``leases/…`` or ``replies``: only the broker speaks there, so no site can forge a lease or a
  reply, retained or not), read ``{root}/sites/{site}/#``, ``{root}/offers/#`` and
  ``{root}/broker/state``; nothing else.

Identity: the config sets ``use_username_as_clientid true``: Mosquitto replaces whatever client id
a client sends by its user name, so no site can connect under the broker's client id and take its
session over (one connection per user: a second connection of the same user takes the first one's
session over, as MQTT does for a repeated client id). Limits: ``max_packet_size`` (every packet,
both ways, bytes; a client sending a larger one is disconnected), ``max_queued_messages`` and
``max_queued_bytes`` (per client, QoS 1 messages held while it is offline or slow), and since a
site may write only its four request topics it can hold at most four retained messages, each at
most ``max_packet_size`` (the broker clears retained requests it sees).

A site's own subtree is granted by Mosquitto ``pattern`` lines with ``%u`` (the user name)
rather than one ``topic`` line per site: the rule is stated once, so it cannot differ between sites
or name the wrong site in a per-site copy. ``%u`` is safe here because only users of the password
file can log in (``allow_anonymous false``) and :func:`check_user_name` admits only plain topic
levels (no ``/``, ``+``, ``#``), so no user name can widen a pattern. Pattern lines apply to every
user, the broker user included; they give it nothing it does not already have. The two read rules
that name no user (offers, broker state) are ``topic`` lines in a ``user`` block per site:
Mosquitto warns about a pattern without ``%u``/``%c``, and this way only listed sites get them.

Formats: the ACL file and config follow mosquitto.conf(5); the password file is written by
``mosquitto_passwd -U`` (Mosquitto 2: ``user:$7$`` PBKDF2-SHA512 lines), so the hash format is
always the one the installed broker reads.

TLS: with a :class:`TlsListener` (``--tls-port`` with ``--cafile``, ``--certfile``,
``--keyfile``) the config has a second listener speaking MQTT over TLS (TLS 1.2 or later) with
the server certificate and key given, and — with ``--require-certificate`` — asks every client
for a certificate signed by that CA (mutual TLS; the password login is still required). The same
users, passwords and ACL apply on both listeners (``per_listener_settings false``).

``python -m broker.acl --dir DIR --port PORT [--root R] [--sites a,b] [--broker-user U]
[--tls-port P --cafile CA --certfile CERT --keyfile KEY [--require-certificate]]`` writes
``passwd``, ``acl``, ``mosquitto.conf`` and ``credentials.json`` into DIR (used by
deploy/local/mosquitto.sh).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_ROOT = "gpupool/v1"
"""MQTT topic root of protocol v1 (same default as :class:`contracts.topics.MqttTopics`)."""

BROKER_USER = "gpupool-broker"
"""User name of the gpupool broker process."""

OBSERVER_USER = "gpupool-observer"
"""A read-only user (offers, broker state, every site's subtree): health checks, audits and
dashboards log in as it, never as the broker or a site — with client ids bound to user names, a
second login as the broker or a site would take that one's session over."""

DEFAULT_SITES = ("edge-a", "edge-b", "edge-c")
"""Edge sites of a local deployment when ``GPUPOOL_SITES`` is not set."""

MAX_PACKET_BYTES = 65_536
"""``max_packet_size``: the largest MQTT packet either way, bytes. The same values are
``contracts.mqtt.LIMITS.mosquitto_*`` (what the AsyncAPI document states; a test keeps them equal):
this module does not import ``contracts`` so that ``python -m broker.acl``, run at every start of
deploy/local/mosquitto.sh, stays quick."""

MAX_QUEUED_MESSAGES = 1000
"""``max_queued_messages``: QoS 1 messages queued per client beyond those in flight."""

MAX_QUEUED_BYTES = 16 * 1024 * 1024
"""``max_queued_bytes``: bytes queued per client beyond those in flight."""

SITE_WRITE_TOPICS = ("claims", "renewals", "releases", "state")
"""The only topics under ``{root}/sites/{site}/`` a site may publish to."""

CREDENTIALS_FILE = "credentials.json"
"""Name of the credentials file in the Mosquitto state directory."""

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_ROOT_LEVEL = re.compile(r"^[A-Za-z0-9_.-]+$")


def check_user_name(name: str) -> str:
    """Return ``name`` if it is usable as a user name and topic level: 1 to 64 of ``[A-Za-z0-9_.-]``,
    starting with a letter or digit. Raises ``ValueError`` otherwise."""
    if not _NAME.match(name):
        raise ValueError(
            f"invalid user/site name {name!r}: use 1-64 of [A-Za-z0-9_.-], starting alphanumeric"
        )
    return name


def check_root(root: str) -> str:
    """Return ``root`` (e.g. ``gpupool/v1``) if it is one or more plain topic levels without
    wildcards or leading/trailing ``/``, and does not start with ``$``. Raises ``ValueError``."""
    if not root or not all(_ROOT_LEVEL.match(level) for level in root.split("/")):
        raise ValueError(f"invalid MQTT root {root!r}: plain levels of [A-Za-z0-9_.-] joined by '/'")
    return root


def _check_users(sites: list[str], broker_user: str) -> None:
    for name in [*sites, broker_user]:
        check_user_name(name)
    if broker_user in sites or OBSERVER_USER in sites or broker_user == OBSERVER_USER:
        raise ValueError(f"a site, the broker user {broker_user!r} and {OBSERVER_USER!r} must differ")
    if len(set(sites)) != len(sites):
        raise ValueError(f"duplicate site names in {sites}")
    if not sites:
        raise ValueError("no sites")


def render_acl(root: str, sites: list[str], broker_user: str) -> str:
    """The text of a Mosquitto ``acl_file`` granting what the module docstring says.

    ``sites`` get a ``user`` block each (offers, broker state); the ``pattern`` lines give every
    user its own ``{root}/sites/{user}/#``. Raises ``ValueError`` for a bad root, a bad or
    duplicate name, no sites, or a broker user that is also a site.
    """
    check_root(root)
    _check_users(sites, broker_user)
    lines = [
        "# Generated by broker.acl (gpupool); edits are lost at the next start.",
        "# No lines before the first 'user': anonymous clients get nothing (allow_anonymous is false too).",
        "",
        f"user {broker_user}",
        f"topic readwrite {root}/#",
        "",
        f"user {OBSERVER_USER}",
        f"topic read {root}/#",
        "",
    ]
    for site in sites:
        lines += [f"user {site}", f"topic read {root}/offers/#", f"topic read {root}/broker/state", ""]
    lines += [
        "# Every user's own site subtree (%u is the user name): it reads all of it and writes only its",
        "# requests and its state; leases and replies are the broker's.",
        *(f"pattern write {root}/sites/%u/{kind}" for kind in SITE_WRITE_TOPICS),
        f"pattern read {root}/sites/%u/#",
        "",
    ]
    return "\n".join(lines)


@dataclass(frozen=True)
class TlsListener:
    """A Mosquitto listener speaking MQTT over TLS (mosquitto.conf(5), "Certificate based SSL/TLS
    Support").

    Attributes:
        port: its port (not the plain listener's).
        cafile: PEM CA certificate(s): sent to clients to verify the server, and used to verify
            client certificates when they are required.
        certfile: PEM server certificate (its names must match the host clients connect to).
        keyfile: PEM private key of ``certfile``.
        require_certificate: clients must present a certificate signed by ``cafile`` (mutual
            TLS) on top of their password.
        address: address it binds: loopback by default; the host's address (or ``0.0.0.0``)
            for edge sites outside the host — the plain listener always stays on loopback.
    """

    port: int
    cafile: Path
    certfile: Path
    keyfile: Path
    require_certificate: bool = False
    address: str = "127.0.0.1"

    def check(self, plain_port: int) -> None:
        """Raises ``ValueError`` if the port is out of range or the plain listener's, or a file
        does not exist."""
        if not 0 < self.port < 65536:
            raise ValueError(f"TLS port out of range: {self.port}")
        if self.port == plain_port:
            raise ValueError(f"TLS port {self.port} is also the plain listener's")
        for what, path in (("cafile", self.cafile), ("certfile", self.certfile), ("keyfile", self.keyfile)):
            if not path.is_file():
                raise ValueError(f"TLS {what} {path} does not exist")

    def render(self) -> list[str]:
        """The listener's lines of mosquitto.conf."""
        return [
            f"listener {self.port} {self.address}",
            f"cafile {self.cafile.resolve()}",
            f"certfile {self.certfile.resolve()}",
            f"keyfile {self.keyfile.resolve()}",
            "tls_version tlsv1.2",
            f"require_certificate {'true' if self.require_certificate else 'false'}",
            "use_username_as_clientid true",
        ]


def _render_conf(directory: Path, port: int, tls: TlsListener | None = None) -> str:
    """mosquitto.conf for one loopback listener (plus the TLS listener of ``tls``) with the files
    of :func:`write_mosquitto_files`."""
    d = directory.resolve()
    return "\n".join(
        [
            "# Generated by broker.acl (gpupool); edits are lost at the next start.",
            "per_listener_settings false",
            # limits: a packet (both ways), and what Mosquitto queues per client
            f"max_packet_size {MAX_PACKET_BYTES}",
            f"max_queued_messages {MAX_QUEUED_MESSAGES}",
            f"max_queued_bytes {MAX_QUEUED_BYTES}",
            f"listener {port} 127.0.0.1",
            # a client's id is its user name: no site can take the broker's session
            "use_username_as_clientid true",
            "allow_anonymous false",
            f"password_file {d / 'passwd'}",
            f"acl_file {d / 'acl'}",
            "persistence true",
            f"persistence_location {d / 'data'}/",
            "autosave_interval 10",
            # TCP_NODELAY on client sockets: replies and lease messages go out at once instead of
            # waiting on the client's delayed ACK (Nagle), ~45 ms per round trip on loopback
            "set_tcp_nodelay true",
            f"log_dest file {d / 'mosquitto.log'}",
            "log_type error",
            "log_type warning",
            "log_type notice",
            "log_type information",
            "connection_messages true",
            "log_timestamp_format %Y-%m-%dT%H:%M:%S",
            # Run as whoever starts it: Mosquitto would otherwise drop root to user "mosquitto",
            # which cannot read these 0600 files.
            f"user {getpass.getuser()}",
            # listener-specific lines follow their listener: the TLS listener comes last
            *(["# MQTT over TLS (same users and ACL)", *tls.render()] if tls is not None else []),
            "",
        ]
    )


def _load_passwords(path: Path) -> dict[str, str]:
    """Passwords of an earlier credentials.json in ``path`` (empty if none or unreadable), so a
    restart keeps every client's credentials valid."""
    try:
        users = json.loads(path.read_text()).get("users", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return {u: p for u, p in users.items() if isinstance(u, str) and isinstance(p, str) and p}


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically with mode 0600."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_passwd(path: Path, users: dict[str, str]) -> None:
    """Write Mosquitto's password file for ``users`` (name → clear password) with
    ``mosquitto_passwd -U``. Raises ``FileNotFoundError`` if mosquitto_passwd is not installed,
    ``RuntimeError`` with its output if it fails."""
    tool = shutil.which("mosquitto_passwd")
    if tool is None:
        raise FileNotFoundError("mosquitto_passwd not found (Debian package mosquitto)")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".passwd.")
    try:
        with os.fdopen(fd, "w") as f:
            f.writelines(f"{u}:{p}\n" for u, p in users.items())
        done = subprocess.run([tool, "-U", tmp], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"mosquitto_passwd -U failed ({done.returncode}): {done.stderr.strip()}")
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_mosquitto_files(
    directory: Path, root: str, sites: list[str], broker_user: str, port: int, tls: TlsListener | None = None
) -> dict[str, Any]:
    """Write ``passwd``, ``acl``, ``mosquitto.conf`` and ``credentials.json`` into ``directory``
    (created, mode 0700) for a broker on ``127.0.0.1:port`` (and, with ``tls``, MQTT over TLS on
    ``127.0.0.1:tls.port``); ``data/`` is its persistence dir.

    Passwords of users already in an earlier ``credentials.json`` there are kept (clients keep
    working across restarts); new users get 24 random URL-safe characters.

    Returns the credentials, as written to ``credentials.json``::

        {"host": "127.0.0.1", "port": 1883, "root": "gpupool/v1",
         "users": {"edge-a": "...", "edge-b": "...", "gpupool-broker": "...", "gpupool-observer": "..."}}

    plus, with ``tls``, ``"tls": {"port": 8883, "cafile": "/abs/ca.pem", "require_certificate": false}``.

    Raises ``ValueError`` for a bad root, name or port, or a TLS listener whose port clashes or
    whose files do not exist; ``FileNotFoundError`` / ``RuntimeError`` from ``mosquitto_passwd``
    (see :func:`_write_passwd`).
    """
    if not 0 < port < 65536:
        raise ValueError(f"port out of range: {port}")
    if tls is not None:
        tls.check(port)
    acl = render_acl(root, sites, broker_user)
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    (directory / "data").mkdir(exist_ok=True)
    creds_path = directory / CREDENTIALS_FILE
    old = _load_passwords(creds_path)
    users = {u: old.get(u) or secrets.token_urlsafe(18) for u in [*sites, broker_user, OBSERVER_USER]}
    _write_passwd(directory / "passwd", users)
    _write_private(directory / "acl", acl)
    _write_private(directory / "mosquitto.conf", _render_conf(directory, port, tls))
    creds: dict[str, Any] = {"host": "127.0.0.1", "port": port, "users": users, "root": root}
    if tls is not None:
        creds["tls"] = {
            "port": tls.port,
            "address": tls.address,
            "cafile": str(tls.cafile.resolve()),
            "require_certificate": tls.require_certificate,
        }
    _write_private(creds_path, json.dumps(creds, indent=2) + "\n")
    return creds


def tls_listener(
    port: int | None,
    cafile: Path | None,
    certfile: Path | None,
    keyfile: Path | None,
    require_certificate: bool = False,
    address: str = "127.0.0.1",
) -> TlsListener | None:
    """The :class:`TlsListener` of the command-line options: ``None`` when none of them is given.
    Raises ``ValueError`` when some but not all of port, CA, certificate and key are given, or
    ``require_certificate`` without them."""
    given = {"--tls-port": port, "--cafile": cafile, "--certfile": certfile, "--keyfile": keyfile}
    if all(v is None for v in given.values()):
        if require_certificate:
            raise ValueError("--require-certificate needs a TLS listener (--tls-port, --cafile, ...)")
        return None
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise ValueError(f"a TLS listener needs {', '.join(missing)} too")
    assert port is not None and cafile is not None and certfile is not None and keyfile is not None
    if not address or any(c.isspace() for c in address):
        raise ValueError(f"bad TLS listener address {address!r}")
    return TlsListener(port, cafile, certfile, keyfile, require_certificate, address)


def main(argv: list[str] | None = None) -> int:
    """CLI: write the Mosquitto files (see the module docstring); prints the credentials path.

    Exit status 2 on bad arguments (argparse, or a ``ValueError`` from the checks), 1 if
    ``mosquitto_passwd`` is missing or fails.
    """
    p = argparse.ArgumentParser(prog="python -m broker.acl", description="Write gpupool's Mosquitto files.")
    p.add_argument("--dir", type=Path, required=True, help="Mosquitto state directory")
    p.add_argument("--port", type=int, required=True, help="loopback port of the listener")
    p.add_argument("--root", default=DEFAULT_ROOT, help="MQTT topic root (default %(default)s)")
    p.add_argument(
        "--sites",
        default=os.environ.get("GPUPOOL_SITES") or ",".join(DEFAULT_SITES),
        help=f"comma-separated site names (default: $GPUPOOL_SITES or {','.join(DEFAULT_SITES)})",
    )
    p.add_argument(
        "--broker-user", default=BROKER_USER, help="user of the gpupool broker (default %(default)s)"
    )
    p.add_argument("--tls-port", type=int, default=None, help="also listen with TLS on this loopback port")
    p.add_argument("--cafile", type=Path, help="TLS: PEM CA certificate (with --tls-port)")
    p.add_argument("--certfile", type=Path, help="TLS: PEM server certificate (with --tls-port)")
    p.add_argument("--keyfile", type=Path, help="TLS: PEM server key (with --tls-port)")
    p.add_argument(
        "--require-certificate", action="store_true", help="TLS: clients must present a certificate of the CA"
    )
    args = p.parse_args(argv)
    sites = [s.strip() for s in args.sites.split(",") if s.strip()]
    try:
        tls = tls_listener(args.tls_port, args.cafile, args.certfile, args.keyfile, args.require_certificate)
        write_mosquitto_files(args.dir, args.root, sites, args.broker_user, args.port, tls)
    except ValueError as e:
        print(f"broker.acl: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, RuntimeError) as e:
        print(f"broker.acl: {e}", file=sys.stderr)
        return 1
    print(args.dir / CREDENTIALS_FILE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
