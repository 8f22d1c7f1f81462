"""Command line of the broker stage and of the edge-site client (typer).

* ``broker_app`` — mounted as ``gpupool broker``: ``run`` (the stage), ``demand`` (training wants
  GPUs back: a :class:`contracts.PoolDemand` on the ``pool.demand`` topic), ``acl`` (Mosquitto
  password file and ACL, one credential per site: :mod:`broker.acl`);
* ``edge_app`` — mounted as ``gpupool edge``: ``offers``, ``claim``, ``renew``, ``release``,
  ``watch``; each prints JSON on stdout (models as in :mod:`contracts.mqtt`).

Passwords come from ``--password`` or the environment (``GPUPOOL_MQTT_PASSWORD``), never a prompt.
Exit status: 0 done; 1 the broker refused (the reply is printed) or the MQTT server refused the
login (not retried); 2 cannot connect (server down, TLS mismatch: the message says which) or bad
input.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import sys
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Protocol, TypeVar

import typer

from broker.edge import BrokerRejected, EdgeClient, OfferWithdrawn
from broker.transport import LoginRefused, TlsOptions
from contracts import (
    KafkaTopics,
    LeaseKind,
    LeaseLogRecord,
    LeaseMessage,
    LeaseState,
    Offer,
    PoolDemand,
    Record,
    Reply,
    encode,
)
from contracts.base import decode_compatible
from contracts.bus import Bus, Consumer, MissingTopicsError, TopicPartition, require_topics
from contracts.mqtt import Requirements
from runtime.run_options import derived_command, settings_command
from runtime.settings import DeploymentSettings, RunFlags
from runtime.stage import run_stage

if TYPE_CHECKING:
    from broker.fabric_opensm import OpenSmFabric
    from broker.metrics import FabricMetrics

broker_app = typer.Typer(
    no_args_is_help=True, help="Broker: capacity → MQTT offers → leases; training demand."
)
edge_app = typer.Typer(no_args_is_help=True, help="Edge-site client: offers, claim, renew, release, watch.")

F = TypeVar("F", bound=Callable[..., Any])

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
_CaFile = Annotated[
    Path | None,
    typer.Option(
        envvar="GPUPOOL_MQTT_CAFILE",
        help="Connect over TLS, trusting this CA (PEM) for the server's certificate; --mqtt is then "
        "the TLS listener (env GPUPOOL_MQTT_CAFILE).",
    ),
]
_CertFile = Annotated[
    Path | None,
    typer.Option(
        envvar="GPUPOOL_MQTT_CERTFILE",
        help="TLS client certificate (PEM), for a listener that requires one (env GPUPOOL_MQTT_CERTFILE).",
    ),
]
_KeyFile = Annotated[
    Path | None,
    typer.Option(
        envvar="GPUPOOL_MQTT_KEYFILE",
        help="Private key (PEM) of --mqtt-certfile, if not in it (env GPUPOOL_MQTT_KEYFILE).",
    ),
]


def _host_port(value: str) -> tuple[str, int]:
    """Split ``host:port``. Raises ``typer.BadParameter``."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise typer.BadParameter(f"expected host:port, got {value!r}")
    return host, int(port)


def tls_options(cafile: Path | None, certfile: Path | None, keyfile: Path | None) -> TlsOptions | None:
    """The MQTT TLS options of ``--mqtt-cafile/--mqtt-certfile/--mqtt-keyfile``: ``None`` (plain
    TCP) when none is given; with only a client certificate, the system's CAs verify the server.
    Raises ``typer.BadParameter`` when a file cannot be read or used."""
    if cafile is None and certfile is None and keyfile is None:
        return None
    try:
        return TlsOptions(cafile=cafile, certfile=certfile, keyfile=keyfile)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--mqtt-cafile/--mqtt-certfile/--mqtt-keyfile") from None


def _print(obj: Record | dict[str, object] | list[object]) -> None:
    if isinstance(obj, Record):
        typer.echo(obj.model_dump_json())
    else:
        typer.echo(json.dumps(obj, default=str))


# broker ----------------------------------------------------------------------------------------------
RUN_FLAGS = RunFlags(
    "gpupool broker run", "kafka", "mqtt*", "topic_prefix", "metrics.broker", "metrics.addr", "broker.*"
)
"""The settings fields that are options of ``gpupool broker run`` (each field's :class:`runtime.settings.Flag`
names its option; :func:`runtime.run_options.settings_command` derives the options)."""

run_settings = RUN_FLAGS.load
"""The settings ``gpupool broker run`` runs with (:meth:`runtime.settings.RunFlags.load`)."""


@settings_command(broker_app, "run", RUN_FLAGS)
def run(settings: DeploymentSettings) -> None:
    """Run the broker stage until SIGINT/SIGTERM.

    Reads capacity and pool demand from Kafka, offers idle GPUs over MQTT, turns claims into leases
    (each transition logged to the leases.log topic), reclaims on demand. With --fabric-state, each
    lease gets an OpenSM partition verified on the fabric before it is granted; without it, fabric
    isolation is disabled and leases carry "partition": null.

    Every option can also come from the deployment's settings (runtime/settings.py): a flag
    wins over its GPUPOOL_* variable (GPUPOOL_KAFKA, GPUPOOL_MQTT, GPUPOOL_MQTT_PASSWORD,
    GPUPOOL_BROKER__NOTICE_S...), which wins over the --config TOML file (kafka, mqtt*, the broker
    and metrics tables), which wins over the defaults. Exit status 2 on invalid settings or no Kafka
    configured; 1 when Kafka cannot be reached, a topic is missing or the /metrics port cannot be
    bound.
    """
    from pydantic import ValidationError

    from broker.config import broker_config_from
    from broker.lending import lending_from
    from broker.metrics import BrokerMetrics
    from broker.service import BrokerService, tune_gc
    from runtime.bus import make_bus

    assert settings.kafka is not None  # settings_command guarantees it
    bootstrap, sb = settings.kafka, settings.broker
    host, port = _host_port(settings.mqtt)
    try:
        config = broker_config_from(sb)
    except ValidationError as e:
        raise typer.BadParameter(str(e), param_hint="[broker] settings") from None
    broker_metrics = BrokerMetrics()  # the service's registry, the fabric manager's metrics on it
    fabric = None
    if sb.fabric_state is not None:
        fabric = opensm_fabric(
            sb.fabric_state,
            sb.fabric_gateway,
            sb.fabric_hosts,
            sb.fabric_sl,
            sb.fabric_timeout_s,
            sb.fabric_dry_run,
            qos_share_percent=sb.lent_share_percent if sb.fabric_qos else None,
            qos_vl=sb.fabric_lent_vl,
            audit_interval_s=sb.fabric_qos_audit_s,
            metrics=broker_metrics.fabric,
        )
    try:
        lending = lending_from(sb, config, settings.state_dir)
    except (OSError, ValueError) as e:
        hint = "[broker] kubeconfig" if sb.scheduler == "kubernetes" else "[broker] slurm_gpu_map"
        raise typer.BadParameter(str(e), param_hint=hint) from None
    secret = settings.mqtt_password.get_secret_value() if settings.mqtt_password is not None else None
    tls = tls_options(settings.mqtt_cafile, settings.mqtt_certfile, settings.mqtt_keyfile)

    def build() -> tuple[BrokerService, Bus]:
        bus = make_bus(bootstrap, client_id=sb.client_id)
        service = BrokerService(
            bus=bus,
            topics=KafkaTopics(prefix=settings.topic_prefix),
            mqtt_host=host,
            mqtt_port=port,
            mqtt_username=settings.mqtt_username,
            mqtt_password=secret,
            root=settings.mqtt_root,
            protocol=settings.mqtt_protocol,
            config=config,
            fabric=fabric,
            client_id=sb.client_id,
            tls=tls,
            lease_log_linger_ms=sb.lease_log_linger_ms,
            lending=lending,
            metrics=broker_metrics,
        )
        return service, bus

    metrics = settings.metrics
    run_stage(
        "gpupool broker run",
        build,
        metrics_port=metrics.broker,
        metrics_addr=metrics.addr,
        started=tune_gc if sb.tune_gc else None,
    )


def opensm_fabric(
    state: Path,
    gateway: str,
    hosts: Path | None,
    sl: int,
    timeout_s: float,
    dry_run: bool,
    *,
    qos_share_percent: float | None = None,
    qos_vl: int = 1,
    audit_interval_s: float = 300.0,
    metrics: FabricMetrics | None = None,
) -> OpenSmFabric:
    """The OpenSM fabric manager for ``gpupool broker run`` (dry-run diffs go to stderr); the
    ``qos_*``, ``audit_interval_s`` and ``metrics`` arguments are :class:`OpenSmFabric`'s.

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
            qos_share_percent=qos_share_percent,
            qos_vl=qos_vl,
            audit_interval_s=audit_interval_s,
            metrics=metrics,
        )
    except (OSError, ValueError) as e:
        raise typer.BadParameter(f"--fabric-state {state}: {e}") from None


DEMAND_FLAGS = RunFlags("gpupool broker demand", "kafka", "topic_prefix")
"""The settings fields that are options of ``gpupool broker demand``."""


@settings_command(broker_app, "demand", DEMAND_FLAGS)
def demand(
    settings: DeploymentSettings,
    count: Annotated[int, typer.Option(help="Take back this many leased GPUs (0 with no --gpu: all).")] = 0,
    gpu: Annotated[
        list[str] | None, typer.Option(help="GPU key host/uuid[/gi] to take back; repeatable.")
    ] = None,
    reason: Annotated[str, typer.Option(help="Why (the training job), for the log.")] = "cli",
    force: Annotated[bool, typer.Option(help="Cut a lease's minimum guaranteed duration short.")] = False,
    wait: Annotated[
        float,
        typer.Option(
            help="Then follow the lease log this long, seconds, printing each lease that turns "
            "reclaiming for this demand (0: do not wait)."
        ),
    ] = 0.0,
) -> None:
    """Ask for GPUs back: publish a PoolDemand on the pool.demand topic, print it as JSON.

    The broker moves the matching leases to reclaiming, each with its notice. Kafka and the topic
    prefix come from the flags, else GPUPOOL_KAFKA / GPUPOOL_TOPIC_PREFIX, else the --config TOML
    (GPUPOOL_CONFIG), as for `gpupool broker run`. With --wait S, the lease log (leases.log topic,
    read from its end as it was when the demand was sent) is followed for up to S seconds: each
    lease the broker turned reclaiming for this demand (record reason demand:<demand_id>...) is
    printed as one JSON line (LeaseLogRecord, contracts/leases.py), and a count goes to stderr;
    it stops early once --count GPUs (or every --gpu) are reclaiming. Exit 1 when a topic is
    missing (create them first: gpupool topics create); 2 for bad options or settings, or when
    Kafka cannot be reached.
    """
    from runtime.bus import make_bus

    if count < 0:
        raise typer.BadParameter("--count must be >= 0")
    if wait < 0:
        raise typer.BadParameter("--wait must be >= 0")
    assert settings.kafka is not None  # settings_command guarantees it
    topics = KafkaTopics(prefix=settings.topic_prefix)
    record = PoolDemand(
        demand_id=f"cli-{uuid.uuid4().hex[:12]}",
        ts=time.time(),
        gpus=list(gpu or []),
        count=count,
        reason=reason,
        force=force,
    )
    found: list[LeaseLogRecord] = []

    async def _main() -> None:
        bus = make_bus(settings.kafka, client_id="gpupool-cli")
        try:
            if wait <= 0:
                await require_topics(bus, [topics.pool_demand])
                await publish_demand(bus, topics, record)
                return
            async with contextlib.aclosing(demand_and_follow(bus, topics, record, wait)) as events:
                async for event in events:
                    _print(event)
                    sys.stdout.flush()
                    if isinstance(event, LeaseLogRecord):
                        found.append(event)
        finally:
            await bus.close()

    from aiokafka.errors import KafkaError

    try:
        asyncio.run(_main())
    except MissingTopicsError as e:
        typer.echo(f"gpupool broker demand: {e}", err=True)
        raise typer.Exit(1) from None
    except (OSError, KafkaError) as e:
        typer.echo(f"gpupool broker demand: Kafka {settings.kafka}: {e!r}", err=True)
        raise typer.Exit(2) from None
    if wait <= 0:
        _print(record)
    else:
        typer.echo(
            f"{len(found)} leases turned reclaiming for demand {record.demand_id} within {wait:g} s",
            err=True,
        )


async def demand_and_follow(
    bus: Bus, topics: KafkaTopics, record: PoolDemand, wait_s: float
) -> AsyncGenerator[PoolDemand | LeaseLogRecord, None]:
    """Publish ``record`` (:func:`publish_demand`) and yield it once sent, then follow the lease
    log (``topics.leases_log``, from its end offsets as they were just before the send) for up to
    ``wait_s`` seconds and yield each :class:`contracts.LeaseLogRecord` that turned
    ``reclaiming`` for this demand (``reason`` ``demand:<demand_id>``, possibly followed by
    ``;deferred_to_guarantee_end`` or ``;guarantee_broken``: :meth:`broker.leases.LeaseBook.apply_demand`),
    once per lease. Stops early when the demand is met: ``record.count`` GPUs, or every one of
    ``record.gpus``, reclaiming (a demand for all leased GPUs waits the whole ``wait_s``).

    Reads the lease log in a consumer group of its own (``gpupool-demand-<demand_id>``, nothing
    committed); undecodable records are skipped. Raises :class:`contracts.bus.MissingTopicsError`
    if ``pool.demand`` or ``leases.log`` is missing (never creates them), and the bus's connection
    and delivery errors."""
    await require_topics(bus, [topics.pool_demand, topics.leases_log])
    consumer: Consumer

    async def _at_end(assigned: set[TopicPartition]) -> dict[TopicPartition, int]:
        ends = await consumer.end_offsets()
        return {tp: off for tp, off in ends.items() if tp in assigned}

    consumer = bus.consumer(
        [topics.leases_log], f"gpupool-demand-{record.demand_id}", client_id="gpupool-cli", on_assign=_at_end
    )
    await consumer.start()
    try:
        await consumer.getmany(timeout_s=0)  # positions taken at the end now, before the send
        await publish_demand(bus, topics, record)
        yield record
        tag = f"demand:{record.demand_id}"
        seen: set[str] = set()
        gpus: set[str] = set()
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            for msg in await consumer.getmany(timeout_s=min(left, 0.5)):
                try:
                    lease = decode_compatible(LeaseLogRecord, msg.value or b"")
                except ValueError:
                    continue
                mine = lease.reason == tag or lease.reason.startswith(tag + ";")
                if mine and lease.state is LeaseState.RECLAIMING and lease.lease_id not in seen:
                    seen.add(lease.lease_id)
                    gpus.update(lease.gpus)
                    yield lease
            if (record.count and len(gpus) >= record.count) or (record.gpus and gpus >= set(record.gpus)):
                return
    finally:
        await consumer.stop()


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
    tls_port: Annotated[
        int | None,
        typer.Option(help="Also listen with MQTT over TLS on this port (needs the three files)."),
    ] = None,
    tls_address: Annotated[
        str,
        typer.Option(help="Address the TLS listener binds (the host's address or 0.0.0.0 for edge sites)."),
    ] = "127.0.0.1",
    cafile: Annotated[Path | None, typer.Option(help="TLS: PEM CA certificate of the listener.")] = None,
    certfile: Annotated[Path | None, typer.Option(help="TLS: PEM server certificate.")] = None,
    keyfile: Annotated[
        Path | None, typer.Option(help="TLS: PEM private key of the server certificate.")
    ] = None,
    require_certificate: Annotated[
        bool, typer.Option(help="TLS: clients must also present a certificate signed by --cafile.")
    ] = False,
) -> None:
    """Write the Mosquitto password file and ACL: one credential per site, each site confined to
    its own sites/SITE/ subtree plus reading offers and broker state (broker/acl.py).

    Writes passwd (mosquitto_passwd hashes), acl, mosquitto.conf and credentials.json into --dir;
    passwords already in credentials.json are kept. Prints the credentials.json path (and, with
    --show-passwords, its content). With --tls-port, --cafile, --certfile and --keyfile, mosquitto.conf
    has a second listener speaking MQTT over TLS (same users and ACL) and credentials.json a "tls"
    entry. Exit 2 on a bad name, root or port, or incomplete TLS options; 1 if mosquitto_passwd is
    missing or fails.
    """
    from broker.acl import CREDENTIALS_FILE, tls_listener, write_mosquitto_files

    names = [s.strip() for s in sites.split(",") if s.strip()]
    try:
        tls = tls_listener(tls_port, cafile, certfile, keyfile, require_certificate, tls_address)
        creds = write_mosquitto_files(directory, root, names, broker_user, port, tls)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    except (FileNotFoundError, RuntimeError) as e:
        typer.echo(f"gpupool broker acl: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(str(directory / CREDENTIALS_FILE))
    if show_passwords:
        _print(creds)


# edge ------------------------------------------------------------------------------------------------------
_TLS_PARAMS = ("mqtt_cafile", "mqtt_certfile", "mqtt_keyfile")


@edge_app.callback()
def edge_connection(
    mqtt_cafile: _CaFile = None,
    mqtt_certfile: _CertFile = None,
    mqtt_keyfile: _KeyFile = None,
) -> None:
    """Edge-site client: offers, claim, renew, release, watch.

    TLS: --mqtt-cafile/--mqtt-certfile/--mqtt-keyfile before the command (gpupool edge
    --mqtt-cafile ca.pem claim ...), after it (gpupool edge claim --mqtt-cafile ca.pem ...), or
    from GPUPOOL_MQTT_CAFILE/_CERTFILE/_KEYFILE, with --mqtt naming the server's TLS listener.
    A flag after the command wins over one before it; a flag wins over the environment.
    """
    tls_options(mqtt_cafile, mqtt_certfile, mqtt_keyfile)  # bad files: exit 2 before connecting


class _ParameterSources(Protocol):
    """What :func:`_from_command_line` needs of a click/typer context."""

    def get_parameter_source(self, name: str) -> Any:
        """Where parameter ``name`` got its value (click's ``ParameterSource``), or ``None``."""


def _from_command_line(ctx: _ParameterSources, name: str) -> bool:
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def edge_tls(
    ctx: typer.Context, cafile: Path | None, certfile: Path | None, keyfile: Path | None
) -> TlsOptions | None:
    """The TLS options of an edge subcommand: each of its own ``--mqtt-cafile/--mqtt-certfile/
    --mqtt-keyfile`` when given on its command line, else the same flag given before the
    subcommand (``gpupool edge --mqtt-cafile ...``), else the environment value. ``None``: plain
    TCP. Raises ``typer.BadParameter`` when a file cannot be read or used."""
    own = dict(zip(_TLS_PARAMS, (cafile, certfile, keyfile), strict=True))
    group = ctx.parent
    chosen: list[Path | None] = []
    for name in _TLS_PARAMS:
        value = own[name]
        if not _from_command_line(ctx, name) and group is not None and _from_command_line(group, name):
            value = group.params[name]
        chosen.append(value)
    return tls_options(*chosen)


@dataclass(frozen=True)
class EdgeConnection:
    """How an edge command reaches the broker: the options every ``gpupool edge`` command shares
    (:func:`edge_command` adds them).

    Attributes:
        site: the edge site's name (MQTT topics ``<root>/sites/<site>/...``).
        mqtt: MQTT server ``host:port``.
        username / password: MQTT login; ``username`` ``None``: the site name.
        protocol: 5, or 4 for MQTT 3.1.1.
        root: MQTT topic root.
        timeout: how long to wait for the broker, seconds.
        tls: MQTT over TLS, ``None``: plain TCP.
    """

    site: str
    mqtt: str
    username: str | None
    password: str | None
    protocol: int
    root: str
    timeout: float
    tls: TlsOptions | None

    def client(self, *, persistent: bool = False) -> EdgeClient:
        """An :class:`broker.edge.EdgeClient` of this connection (not connected: ``async with``
        it). Raises ``typer.BadParameter`` when ``mqtt`` is not ``host:port``."""
        host, port = _host_port(self.mqtt)
        return EdgeClient(
            site=self.site,
            host=host,
            port=port,
            username=self.username or self.site,
            password=self.password,
            root=self.root,
            protocol=self.protocol,
            persistent=persistent,
            announce=False,
            connect_timeout_s=self.timeout,
            tls=self.tls,
        )


def _edge_parameters(timeout: float) -> list[inspect.Parameter]:
    """The connection options of an edge command, ``--timeout`` defaulting to ``timeout`` s."""
    kw = inspect.Parameter.KEYWORD_ONLY
    return [
        inspect.Parameter("ctx", kw, annotation=typer.Context),
        inspect.Parameter("site", kw, annotation=_Site),
        inspect.Parameter("mqtt", kw, default="127.0.0.1:1883", annotation=_Mqtt),
        inspect.Parameter("username", kw, default=None, annotation=_SiteUser),
        inspect.Parameter("password", kw, default=None, annotation=_Password),
        inspect.Parameter("protocol", kw, default=5, annotation=_Protocol),
        inspect.Parameter("root", kw, default="gpupool/v1", annotation=_Root),
        inspect.Parameter("timeout", kw, default=timeout, annotation=_Timeout),
        inspect.Parameter("mqtt_cafile", kw, default=None, annotation=_CaFile),
        inspect.Parameter("mqtt_certfile", kw, default=None, annotation=_CertFile),
        inspect.Parameter("mqtt_keyfile", kw, default=None, annotation=_KeyFile),
    ]


def _edge_connection(values: dict[str, Any]) -> EdgeConnection:
    tls = edge_tls(values.pop("ctx"), *(values.pop(name) for name in _TLS_PARAMS))
    return EdgeConnection(tls=tls, **values)


def edge_command(name: str, *, timeout: float) -> Callable[[F], F]:
    """Register ``func`` as ``gpupool edge NAME`` with the shared connection options (``--site``,
    ``--mqtt``, ``--username``, ``--password``, ``--protocol``, ``--root``, ``--timeout`` defaulting
    to ``timeout`` seconds, ``--mqtt-cafile/--mqtt-certfile/--mqtt-keyfile``: :func:`edge_tls`)
    after its own; ``func`` gets them as its ``conn`` parameter (:class:`EdgeConnection`).
    Returns ``func`` unchanged."""

    def register(func: F) -> F:
        edge_app.command(name)(derived_command(func, "conn", _edge_parameters(timeout), _edge_connection))
        return func

    return register


def _run_edge(coro_factory: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run an edge command; map a refused login and the broker's refusals to exit code 1,
    other connection failures (server down, TLS mismatch, no answer) to 2."""
    try:
        asyncio.run(coro_factory())
    except LoginRefused as e:
        typer.echo(f"gpupool edge: {e}", err=True)
        raise typer.Exit(1) from None
    except ConnectionError as e:
        typer.echo(f"gpupool edge: {e}", err=True)
        raise typer.Exit(2) from None
    except TimeoutError:
        typer.echo("gpupool edge: no answer from the broker in time", err=True)
        raise typer.Exit(2) from None
    except BrokerRejected as e:
        _print(e.reply)
        raise typer.Exit(1) from None


def _print_answer(conn: EdgeConnection, ask: Callable[[EdgeClient], Awaitable[Record]]) -> None:
    """Connect, print what ``ask(client)`` answers as JSON, disconnect; exits as :func:`_run_edge`."""

    async def _main() -> None:
        async with conn.client() as client:
            answer = await ask(client)
        _print(answer)

    _run_edge(_main)


@edge_command("offers", timeout=2.0)
def offers(conn: EdgeConnection) -> None:
    """Print the live offers as a JSON list of Offer objects (contracts/mqtt.py)."""

    async def _main() -> None:
        async with conn.client() as client:
            found: list[Offer] = await client.offers(timeout_s=conn.timeout)
        _print([o.model_dump(mode="json") for o in found])

    _run_edge(_main)


@edge_command("claim", timeout=5.0)
def claim(
    conn: EdgeConnection,
    offer_id: Annotated[
        str | None,
        typer.Argument(help="The offer to claim; omit it to let the broker match --count GPUs to offers."),
    ] = None,
    gpu: Annotated[list[str] | None, typer.Option(help="GPU key of the offer to take; repeatable.")] = None,
    count: Annotated[
        int, typer.Option(help="How many GPUs when no --gpu (0: all of the offer; >= 1 without an offer).")
    ] = 0,
    duration: Annotated[float, typer.Option(help="Lease length wanted, seconds.")] = 300.0,
    min_notice: Annotated[float, typer.Option(help="Shortest reclaim notice acceptable, seconds.")] = 0.0,
    min_duration: Annotated[
        float,
        typer.Option(
            help="Minimum guaranteed duration, seconds: offers must be promised that long, and no "
            "unforced training demand takes the lease back sooner."
        ),
    ] = 0.0,
    model: Annotated[
        list[str] | None,
        typer.Option(help="Acceptable GPU model (DCGM modelName); repeatable. Matching only."),
    ] = None,
    min_memory_mib: Annotated[
        int | None, typer.Option(help="Smallest framebuffer per GPU, MiB. Matching only.")
    ] = None,
    zone: Annotated[
        str | None, typer.Option(help="Latency zone the offers must be in. Matching only.")
    ] = None,
    prefer: Annotated[
        list[str] | None,
        typer.Option(
            help="Preference order, best first: a GPU model or a pool name; repeatable. Matching only."
        ),
    ] = None,
    cross_leaf: Annotated[
        bool, typer.Option(help="Allow GPUs under different leaf switches. Matching only.")
    ] = False,
    memory_held: Annotated[
        bool, typer.Option(help="Accept GPUs whose memory a resident model holds. Matching only.")
    ] = True,
    avoid_host: Annotated[
        list[str] | None,
        typer.Option(
            help="A node to keep the lease off when another node can hold it (anti-affinity, e.g. the "
            "nodes of the site's other leases); repeatable. Matching only."
        ),
    ] = None,
    kind: Annotated[
        LeaseKind | None,
        typer.Option(
            help="preemptible: promises only the notice; window: promised until the offer's available_until "
            "(the lease's window_until). Default: window when --min-duration > 0, else preemptible."
        ),
    ] = None,
) -> None:
    """Claim an offer (OFFER_ID), or --count GPUs that meet the requirements (no OFFER_ID: the broker
    picks one node, else several under one leaf switch): print the granted LeaseMessage as JSON
    (contracts/mqtt.py), or the Reply and exit 1 if refused; exit 2 for options that do not fit
    the kind of claim."""
    matching = bool(
        model or min_memory_mib is not None or zone or prefer or cross_leaf or not memory_held or avoid_host
    )
    if offer_id is not None and matching:
        raise typer.BadParameter("requirement options (--model, --zone, ...) only apply without OFFER_ID")
    if offer_id is None and (gpu or count < 1):
        raise typer.BadParameter("without OFFER_ID give --count >= 1 (and no --gpu)")
    if min_duration > duration:
        raise typer.BadParameter("--min-duration exceeds --duration")
    if kind is LeaseKind.PREEMPTIBLE and min_duration > 0:
        raise typer.BadParameter("a preemptible lease promises only the notice: no --min-duration")
    requirements = Requirements(
        model_names=model or [],
        min_fb_total_mib=min_memory_mib,
        zone=zone,
        prefer=prefer or [],
        allow_cross_leaf=cross_leaf,
        allow_memory_held=memory_held,
        avoid_hosts=avoid_host or [],
    )
    timeout = conn.timeout

    async def ask(client: EdgeClient) -> LeaseMessage:
        if offer_id is None:
            return await client.request(
                count,
                requirements,
                duration_seconds=duration,
                min_notice_seconds=min_notice,
                min_duration_seconds=min_duration,
                timeout_s=timeout,
                lease_kind=kind,
            )
        return await client.claim(
            offer_id,
            gpus=gpu or [],
            count=count,
            duration_seconds=duration,
            min_notice_seconds=min_notice,
            min_duration_seconds=min_duration,
            timeout_s=timeout,
            lease_kind=kind,
        )

    _print_answer(conn, ask)


@edge_command("renew", timeout=5.0)
def renew(
    conn: EdgeConnection,
    lease_id: Annotated[str, typer.Argument(help="The lease to renew.")],
    extend: Annotated[
        float | None, typer.Option(help="Extend by this long, seconds (capped by the TTL).")
    ] = None,
) -> None:
    """Renew a lease: print the broker's Reply as JSON; exit 1 if refused."""
    _print_answer(conn, lambda client: client.renew(lease_id, extend_seconds=extend, timeout_s=conn.timeout))


@edge_command("release", timeout=5.0)
def release(
    conn: EdgeConnection,
    lease_id: Annotated[str, typer.Argument(help="The lease to release.")],
) -> None:
    """Release a lease early: print the broker's Reply as JSON; exit 1 if refused."""
    _print_answer(conn, lambda client: client.release(lease_id, timeout_s=conn.timeout))


@edge_command("watch", timeout=10.0)
def watch(
    conn: EdgeConnection,
    persistent: Annotated[bool, typer.Option(help="Persistent session: notices queue while away.")] = False,
    limit: Annotated[int, typer.Option(help="Stop after this many events (0: never).")] = 0,
) -> None:
    """Follow offers, withdrawals, lease messages and replies, one JSON object per line.

    Each line has a "type": offer, offer_withdrawn, lease or reply. Runs until interrupted or --limit.
    """

    async def _main() -> None:
        async with conn.client(persistent=persistent) as client:
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
