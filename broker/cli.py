"""Command line of the broker stage and of the edge-site client (typer).

* ``broker_app`` — mounted as ``gpupool broker``: ``run`` (the stage), ``demand`` (training wants
  GPUs back: a :class:`contracts.PoolDemand` on the ``pool.demand`` topic), ``acl`` (Mosquitto
  password file and ACL, one credential per site: :mod:`broker.acl`);
* ``edge_app`` — mounted as ``gpupool edge``: ``offers``, ``claim``, ``renew``, ``release``,
  ``watch``; each prints JSON on stdout (models as in :mod:`contracts.mqtt`).

Passwords come from ``--password`` or the environment (``GPUPOOL_MQTT_PASSWORD``), never a prompt.
Exit status: 0 done; 1 the broker refused (the reply is printed); 2 cannot connect or bad input.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
import uuid
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from broker.edge import BrokerRejected, EdgeClient, OfferWithdrawn
from contracts import KafkaTopics, LeaseMessage, Offer, PoolDemand, Record, Reply, encode
from contracts.bus import Bus

if TYPE_CHECKING:
    from broker.fabric_opensm import OpenSmFabric

broker_app = typer.Typer(
    no_args_is_help=True, help="Broker: capacity → MQTT offers → leases; training demand."
)
edge_app = typer.Typer(no_args_is_help=True, help="Edge-site client: offers, claim, renew, release, watch.")

_Mqtt = Annotated[str, typer.Option("--mqtt", envvar="GPUPOOL_MQTT", help="MQTT server host:port.")]
_Protocol = Annotated[int, typer.Option(help="MQTT protocol: 5, or 4 for MQTT 3.1.1.")]
_Root = Annotated[str, typer.Option(help="MQTT topic root.")]
_Password = Annotated[
    str | None,
    typer.Option(envvar="GPUPOOL_MQTT_PASSWORD", help="MQTT password (env GPUPOOL_MQTT_PASSWORD)."),
]
_Site = Annotated[str, typer.Option(envvar="GPUPOOL_SITE", help="Edge site name (env GPUPOOL_SITE).")]
_SiteUser = Annotated[str | None, typer.Option(help="MQTT user name; default: the site name.")]
_Timeout = Annotated[float, typer.Option(help="How long to wait for the broker, seconds.")]
_Kafka = Annotated[
    str, typer.Option(envvar="GPUPOOL_KAFKA", help="Kafka bootstrap host:port (env GPUPOOL_KAFKA).")
]
_Prefix = Annotated[str, typer.Option(help="Kafka topic prefix.")]


def _host_port(value: str) -> tuple[str, int]:
    """Split ``host:port``. Raises ``typer.BadParameter``."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise typer.BadParameter(f"expected host:port, got {value!r}")
    return host, int(port)


def _print(obj: Record | dict[str, object] | list[object]) -> None:
    if isinstance(obj, Record):
        typer.echo(obj.model_dump_json())
    else:
        typer.echo(json.dumps(obj, default=str))


# broker ----------------------------------------------------------------------------------------------
@broker_app.command("run")
def run(
    kafka: _Kafka,
    mqtt: _Mqtt = "127.0.0.1:1883",
    username: Annotated[
        str | None, typer.Option(envvar="GPUPOOL_MQTT_USERNAME", help="MQTT user.")
    ] = "gpupool-broker",
    password: _Password = None,
    protocol: _Protocol = 5,
    root: _Root = "gpupool/v1",
    topic_prefix: _Prefix = "",
    group_id: Annotated[
        str, typer.Option(help="Kafka consumer group of capacity and demand (one per deployment).")
    ] = "gpupool-broker",
    client_id: Annotated[
        str, typer.Option(help="MQTT client id; the broker's persistent session is kept under it.")
    ] = "gpupool-broker",
    metrics_port: Annotated[
        int, typer.Option(help="Serve Prometheus /metrics on this port (0: off).")
    ] = 9403,
    metrics_addr: Annotated[str, typer.Option(help="Address of the /metrics listener.")] = "127.0.0.1",
    offer_ttl: Annotated[float, typer.Option(help="Offer lifetime, seconds.")] = 60.0,
    notice: Annotated[float, typer.Option(help="Reclaim notice of each lease, seconds.")] = 30.0,
    lease_ttl: Annotated[float, typer.Option(help="Lease TTL between renewals, seconds.")] = 60.0,
    fabric_state: Annotated[
        Path | None,
        typer.Option(
            envvar="GPUPOOL_FABRIC_STATE",
            help="fabric.json of an OpenSM fabric (deploy/local/fabric.sh): isolate every lease in a "
            "partition verified on the fabric. Without it, fabric isolation is disabled.",
        ),
    ] = None,
    fabric_gateway: Annotated[
        str, typer.Option(help="Node id or port GUID of the edge gateway's HCA (full member).")
    ] = "edge-gw",
    fabric_hosts: Annotated[
        Path | None,
        typer.Option(
            help='JSON file {"<gpu host>": ["<HCA node id or port GUID>", ...]}; default: hosts '
            "ending in N map to the Nth compute HCA."
        ),
    ] = None,
    fabric_sl: Annotated[int, typer.Option(help="Service level of inference traffic (0..15).")] = 1,
    fabric_timeout: Annotated[
        float, typer.Option(help="Seconds to wait for the fabric to show a partition change.")
    ] = 20.0,
    fabric_dry_run: Annotated[
        bool,
        typer.Option(
            help="Print the partitions.conf/qos-policy.conf diff of each lease on stderr and change "
            "nothing (leases are then refused: isolation_failed)."
        ),
    ] = False,
) -> None:
    """Run the broker stage until SIGINT/SIGTERM.

    Reads capacity and pool demand from Kafka, offers idle GPUs over MQTT, turns claims into leases
    (each transition logged to the leases.log topic), reclaims on demand. With --fabric-state, each
    lease gets an OpenSM partition verified on the fabric before it is granted; without it, fabric
    isolation is disabled and leases carry "partition": null.
    """
    from prometheus_client import start_http_server

    from broker.config import BrokerConfig
    from broker.service import BrokerService
    from contracts.bus import make_bus

    host, port = _host_port(mqtt)
    config = BrokerConfig(offer_ttl_s=offer_ttl, notice_s=notice, lease_ttl_s=lease_ttl, group_id=group_id)
    fabric = None
    if fabric_state is not None:
        fabric = opensm_fabric(
            fabric_state, fabric_gateway, fabric_hosts, fabric_sl, fabric_timeout, fabric_dry_run
        )
    if metrics_port:
        start_http_server(metrics_port, addr=metrics_addr)

    async def _main() -> None:
        bus = make_bus(kafka, client_id=client_id)
        service = BrokerService(
            bus=bus,
            topics=KafkaTopics(prefix=topic_prefix),
            mqtt_host=host,
            mqtt_port=port,
            mqtt_username=username,
            mqtt_password=password,
            root=root,
            protocol=protocol,
            config=config,
            fabric=fabric,
            client_id=client_id,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await service.start()
        try:
            await service.run(stop)
        finally:
            await service.stop()
            await bus.close()

    asyncio.run(_main())


def opensm_fabric(
    state: Path, gateway: str, hosts: Path | None, sl: int, timeout_s: float, dry_run: bool
) -> OpenSmFabric:
    """The OpenSM fabric manager for ``gpupool broker run`` (dry-run diffs go to stderr).

    ``hosts`` is a JSON object host → list of HCA node ids / port GUIDs. Raises
    ``typer.BadParameter`` when ``state`` or ``hosts`` cannot be read or the gateway is not an HCA.
    """
    from broker.fabric_opensm import OpenSmFabric

    host_ports: dict[str, list[str]] | None = None
    if hosts is not None:
        try:
            data = json.loads(hosts.read_text())
        except (OSError, ValueError) as e:
            raise typer.BadParameter(f"--fabric-hosts {hosts}: {e}") from None
        if not isinstance(data, dict) or not all(
            isinstance(v, list) and all(isinstance(x, str) for x in v) for v in data.values()
        ):
            raise typer.BadParameter(f"--fabric-hosts {hosts}: expected {{host: [port, ...]}}")
        host_ports = {str(k): list(v) for k, v in data.items()}
    try:
        return OpenSmFabric(
            state,
            gateway=gateway,
            host_ports=host_ports,
            sl=sl,
            verify_timeout_s=timeout_s,
            dry_run=dry_run,
            on_diff=lambda diff: typer.echo(diff, err=True),
        )
    except (OSError, ValueError) as e:
        raise typer.BadParameter(f"--fabric-state {state}: {e}") from None


@broker_app.command("demand")
def demand(
    kafka: _Kafka,
    count: Annotated[int, typer.Option(help="Take back this many leased GPUs (0 with no --gpu: all).")] = 0,
    gpu: Annotated[
        list[str] | None, typer.Option(help="GPU key host/uuid[/gi] to take back; repeatable.")
    ] = None,
    reason: Annotated[str, typer.Option(help="Why (the training job), for the log.")] = "cli",
    force: Annotated[bool, typer.Option(help="Cut a lease's minimum guaranteed duration short.")] = False,
    topic_prefix: _Prefix = "",
) -> None:
    """Ask for GPUs back: publish a PoolDemand on the pool.demand topic, print it as JSON.

    The broker moves the matching leases to reclaiming, each with its notice.
    """
    from contracts.bus import make_bus

    if count < 0:
        raise typer.BadParameter("--count must be >= 0")
    record = PoolDemand(
        demand_id=f"cli-{uuid.uuid4().hex[:12]}",
        ts=time.time(),
        gpus=list(gpu or []),
        count=count,
        reason=reason,
        force=force,
    )

    async def _main() -> None:
        bus = make_bus(kafka, client_id="gpupool-cli")
        try:
            await publish_demand(bus, KafkaTopics(prefix=topic_prefix), record)
        finally:
            await bus.close()

    asyncio.run(_main())
    _print(record)


async def publish_demand(bus: Bus, topics: KafkaTopics, record: PoolDemand) -> None:
    """Send ``record`` to ``topics.pool_demand`` keyed by ``demand_id`` and wait until the bus
    acknowledged it. Raises the bus's connection and delivery errors."""
    producer = bus.producer(client_id="gpupool-cli")
    await producer.start()
    try:
        await producer.send(topics.pool_demand, encode(record), key=record.demand_id)
        await producer.flush()
    finally:
        await producer.stop()


@broker_app.command("acl")
def acl(
    directory: Annotated[
        Path, typer.Option("--dir", help="Mosquitto state directory to write (created, mode 0700).")
    ],
    sites: Annotated[str, typer.Option(envvar="GPUPOOL_SITES", help="Comma-separated site names.")],
    root: _Root = "gpupool/v1",
    broker_user: Annotated[str, typer.Option(help="MQTT user of the gpupool broker.")] = "gpupool-broker",
    port: Annotated[int, typer.Option(help="Loopback port of the listener in mosquitto.conf.")] = 1883,
    show_passwords: Annotated[
        bool, typer.Option(help="Also print the credentials JSON (with passwords) on stdout.")
    ] = False,
) -> None:
    """Write the Mosquitto password file and ACL: one credential per site, each site confined to
    its own sites/SITE/ subtree plus reading offers and broker state (broker/acl.py).

    Writes passwd (mosquitto_passwd hashes), acl, mosquitto.conf and credentials.json into --dir;
    passwords already in credentials.json are kept. Prints the credentials.json path (and, with
    --show-passwords, its content). Exit 2 on a bad name, root or port; 1 if mosquitto_passwd is
    missing or fails.
    """
    from broker.acl import CREDENTIALS_FILE, write_mosquitto_files

    names = [s.strip() for s in sites.split(",") if s.strip()]
    try:
        creds = write_mosquitto_files(directory, root, names, broker_user, port)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    except (FileNotFoundError, RuntimeError) as e:
        typer.echo(f"gpupool broker acl: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(str(directory / CREDENTIALS_FILE))
    if show_passwords:
        _print(creds)


# edge ------------------------------------------------------------------------------------------------------
def _edge(
    mqtt: str,
    site: str,
    username: str | None,
    password: str | None,
    protocol: int,
    root: str,
    timeout: float,
    persistent: bool = False,
) -> EdgeClient:
    host, port = _host_port(mqtt)
    return EdgeClient(
        site=site,
        host=host,
        port=port,
        username=username or site,
        password=password,
        root=root,
        protocol=protocol,
        persistent=persistent,
        announce=False,
        connect_timeout_s=timeout,
    )


def _run_edge(coro_factory: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run an edge command; map connection failures and refusals to exit codes 2 and 1."""
    try:
        asyncio.run(coro_factory())
    except ConnectionError as e:
        typer.echo(f"gpupool edge: {e}", err=True)
        raise typer.Exit(2) from None
    except TimeoutError:
        typer.echo("gpupool edge: no answer from the broker in time", err=True)
        raise typer.Exit(2) from None
    except BrokerRejected as e:
        _print(e.reply)
        raise typer.Exit(1) from None


@edge_app.command("offers")
def offers(
    site: _Site,
    mqtt: _Mqtt = "127.0.0.1:1883",
    username: _SiteUser = None,
    password: _Password = None,
    protocol: _Protocol = 5,
    root: _Root = "gpupool/v1",
    timeout: _Timeout = 2.0,
) -> None:
    """Print the live offers as a JSON list of Offer objects (contracts/mqtt.py)."""

    async def _main() -> None:
        async with _edge(mqtt, site, username, password, protocol, root, timeout) as client:
            found: list[Offer] = await client.offers(timeout_s=timeout)
        _print([o.model_dump(mode="json") for o in found])

    _run_edge(_main)


@edge_app.command("claim")
def claim(
    offer_id: Annotated[str, typer.Argument(help="The offer to claim.")],
    site: _Site,
    mqtt: _Mqtt = "127.0.0.1:1883",
    username: _SiteUser = None,
    password: _Password = None,
    protocol: _Protocol = 5,
    root: _Root = "gpupool/v1",
    timeout: _Timeout = 5.0,
    gpu: Annotated[list[str] | None, typer.Option(help="GPU key of the offer to take; repeatable.")] = None,
    count: Annotated[int, typer.Option(help="How many GPUs when no --gpu (0: all).")] = 0,
    duration: Annotated[float, typer.Option(help="Lease length wanted, seconds.")] = 300.0,
    min_notice: Annotated[float, typer.Option(help="Shortest reclaim notice acceptable, seconds.")] = 0.0,
) -> None:
    """Claim an offer: print the granted LeaseMessage as JSON, or the Reply and exit 1 if refused."""

    async def _main() -> None:
        async with _edge(mqtt, site, username, password, protocol, root, timeout) as client:
            lease: LeaseMessage = await client.claim(
                offer_id,
                gpus=gpu or [],
                count=count,
                duration_seconds=duration,
                min_notice_seconds=min_notice,
                timeout_s=timeout,
            )
        _print(lease)

    _run_edge(_main)


@edge_app.command("renew")
def renew(
    lease_id: Annotated[str, typer.Argument(help="The lease to renew.")],
    site: _Site,
    mqtt: _Mqtt = "127.0.0.1:1883",
    username: _SiteUser = None,
    password: _Password = None,
    protocol: _Protocol = 5,
    root: _Root = "gpupool/v1",
    timeout: _Timeout = 5.0,
    extend: Annotated[
        float | None, typer.Option(help="Extend by this long, seconds (capped by the TTL).")
    ] = None,
) -> None:
    """Renew a lease: print the broker's Reply as JSON; exit 1 if refused."""

    async def _main() -> None:
        async with _edge(mqtt, site, username, password, protocol, root, timeout) as client:
            reply: Reply = await client.renew(lease_id, extend_seconds=extend, timeout_s=timeout)
        _print(reply)

    _run_edge(_main)


@edge_app.command("release")
def release(
    lease_id: Annotated[str, typer.Argument(help="The lease to release.")],
    site: _Site,
    mqtt: _Mqtt = "127.0.0.1:1883",
    username: _SiteUser = None,
    password: _Password = None,
    protocol: _Protocol = 5,
    root: _Root = "gpupool/v1",
    timeout: _Timeout = 5.0,
) -> None:
    """Release a lease early: print the broker's Reply as JSON; exit 1 if refused."""

    async def _main() -> None:
        async with _edge(mqtt, site, username, password, protocol, root, timeout) as client:
            reply: Reply = await client.release(lease_id, timeout_s=timeout)
        _print(reply)

    _run_edge(_main)


@edge_app.command("watch")
def watch(
    site: _Site,
    mqtt: _Mqtt = "127.0.0.1:1883",
    username: _SiteUser = None,
    password: _Password = None,
    protocol: _Protocol = 5,
    root: _Root = "gpupool/v1",
    timeout: _Timeout = 10.0,
    persistent: Annotated[bool, typer.Option(help="Persistent session: notices queue while away.")] = False,
    limit: Annotated[int, typer.Option(help="Stop after this many events (0: never).")] = 0,
) -> None:
    """Follow offers, withdrawals, lease messages and replies, one JSON object per line.

    Each line has a "type": offer, offer_withdrawn, lease or reply. Runs until interrupted or --limit.
    """

    async def _main() -> None:
        async with _edge(mqtt, site, username, password, protocol, root, timeout, persistent) as client:
            seen = 0
            async with contextlib.aclosing(client.watch()) as events:
                async for event in events:
                    if isinstance(event, OfferWithdrawn):
                        line: dict[str, object] = {"type": "offer_withdrawn", "offer_id": event.offer_id}
                    else:
                        kind = {Offer: "offer", LeaseMessage: "lease", Reply: "reply"}[type(event)]
                        line = {"type": kind, **event.model_dump(mode="json")}
                    _print(line)
                    sys.stdout.flush()
                    seen += 1
                    if limit and seen >= limit:
                        return

    with contextlib.suppress(KeyboardInterrupt):
        _run_edge(_main)
