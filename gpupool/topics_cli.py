"""``gpupool topics create|list``: the Kafka topics every gpupool stage uses, made up front.

A stage never creates topics itself (in production that is the operator's job, or the cluster's
``auto.create.topics.enable``, which KRaft clusters usually turn off): without them the collectors
and analytics log ``Topic ... not found in cluster metadata``. ``topics create`` creates every name
of :meth:`contracts.topics.KafkaTopics.all` under the deployment's ``topic_prefix``:

* every topic with the same partition count (``--partitions``): the two telemetry topics *must*
  share it, since analytics gives partition *p* of both to one instance (:mod:`contracts.topics`);
* ``leases.log`` and ``fabric.topology`` with ``cleanup.policy=compact`` (the broker rebuilds its
  state from the lease log, the last record per key);
* ``--replication-factor`` replicas each (1 on a single-node cluster, 3 on a production one).

It is idempotent: an existing topic is left as it is, and then checked. A check that fails (the
telemetry topics' partition counts differ, a compacted topic is not compacted, a topic is missing)
is printed and makes the command exit 1; Kafka cannot shrink partitions nor should a tool silently
change a topic's retention, so fixing it is left to the operator (``kafka-configs.sh``,
``kafka-topics.sh --alter``).

Output: one JSON document on stdout, ``{"bootstrap", "topic_prefix", "topics": [{"name",
"exists", "created", "partitions", "replication_factor", "cleanup_policy"}], "problems": [str]}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass
from typing import Annotated, Any

import typer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError

from contracts.topics import KafkaTopics
from runtime.kafka import KafkaBus
from runtime.run_options import settings_command
from runtime.settings import DeploymentSettings, RunFlags

log = logging.getLogger(__name__)

topics_app = typer.Typer(
    no_args_is_help=True,
    help="Kafka topics: create every gpupool topic (idempotent) and list them with their settings.",
)

DEFAULT_PARTITIONS = 6
"""Partitions per topic of ``topics create`` when not given: room for six analytics instances."""
METADATA_WAIT_S = 15.0
"""How long ``create`` waits for the topics it created to show in the cluster metadata, seconds."""
TOPICS_FLAGS = RunFlags("gpupool topics", "kafka", "topic_prefix")
"""The options of ``gpupool topics create|list`` → the settings they set (kafka, topic_prefix)."""


def compacted_topics(topics: KafkaTopics) -> list[str]:
    """The topics that must have ``cleanup.policy=compact``: ``leases.log`` and ``fabric.topology``."""
    return [topics.leases_log, topics.fabric_topology]


@dataclass(frozen=True)
class TopicState:
    """One gpupool topic as the cluster describes it.

    Attributes:
        name: the full name (with the prefix).
        exists: whether the cluster has it.
        created: whether this command created it (``False`` for ``topics list``).
        partitions: partition count; ``None`` when it does not exist.
        replication_factor: replicas of partition 0; ``None`` when it does not exist.
        cleanup_policy: the topic's ``cleanup.policy`` (``delete``, ``compact`` or both); ``None``
            when it does not exist.
    """

    name: str
    exists: bool
    created: bool
    partitions: int | None
    replication_factor: int | None
    cleanup_policy: str | None


def check_topics(topics: KafkaTopics, states: list[TopicState]) -> list[str]:
    """What is wrong with ``states`` (one per name of ``topics.all()``), as messages; ``[]`` if
    nothing: a missing topic, telemetry topics with different partition counts, a compacted topic
    without ``compact`` in its ``cleanup.policy``."""
    by_name = {s.name: s for s in states}
    problems = [f"topic {s.name} does not exist" for s in states if not s.exists]
    gpu = by_name.get(topics.telemetry_gpu)
    for other in (topics.telemetry_ib_port, topics.telemetry_scheduler):
        ib = by_name.get(other)
        if gpu and ib and gpu.exists and ib.exists and gpu.partitions != ib.partitions:
            problems.append(
                f"{gpu.name} has {gpu.partitions} partitions but {ib.name} has {ib.partitions}: "
                "the telemetry topics need the same count (analytics co-partitions them by host)"
            )
    for name in compacted_topics(topics):
        s = by_name.get(name)
        if s and s.exists and "compact" not in (s.cleanup_policy or "").split(","):
            problems.append(f"topic {name} has cleanup.policy={s.cleanup_policy}, needs compact")
    return problems


async def describe_topics(bootstrap: str, names: list[str]) -> list[TopicState]:
    """Describe ``names`` on the cluster at ``bootstrap`` (``host:port[,...]``), in that order.

    Raises:
        aiokafka.errors.KafkaError: the cluster cannot be reached or refuses the request.
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, client_id="gpupool-topics")
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        present = [n for n in names if n in existing]
        meta: dict[str, dict[str, Any]] = {}
        policies: dict[str, str] = {}
        if present:
            meta = {t["topic"]: t for t in await admin.describe_topics(present)}
            resources = [ConfigResource(ConfigResourceType.TOPIC, n, configs={"cleanup.policy": None}) for n in present]
            for response in await admin.describe_configs(resources):
                for _code, _msg, _rtype, rname, entries, *_ in response.resources:
                    for entry in entries:
                        if entry[0] == "cleanup.policy":
                            policies[rname] = entry[1]
    finally:
        await admin.close()
    out = []
    for n in names:
        parts = meta.get(n, {}).get("partitions") or []
        replicas = next((len(p["replicas"]) for p in parts if p["partition"] == 0), None)
        out.append(TopicState(n, n in existing, False, len(parts) if n in existing else None,
                              replicas if n in existing else None, policies.get(n)))
    return out


async def create_all(
    bootstrap: str, topics: KafkaTopics, partitions: int, replication_factor: int
) -> list[TopicState]:
    """Create the topics of ``topics.all()`` that do not exist (``partitions`` each, the compacted
    ones of :func:`compacted_topics` with ``cleanup.policy=compact``, ``replication_factor``
    replicas) and describe all of them afterwards (``created`` set on the new ones), waiting up to
    :data:`METADATA_WAIT_S` for new topics to show in the metadata.

    Raises:
        ValueError: ``partitions`` or ``replication_factor`` < 1.
        aiokafka.errors.KafkaError: the cluster cannot be reached, or refuses a topic (e.g. a
            replication factor above its broker count: ``InvalidReplicationFactorError``).
    """
    if replication_factor < 1:
        raise ValueError(f"replication factor must be >= 1, got {replication_factor}")
    names = topics.all()
    before = {s.name for s in await describe_topics(bootstrap, names) if s.exists}
    bus = KafkaBus(bootstrap, client_id="gpupool-topics", replication_factor=replication_factor)
    try:
        await bus.create_topics(names, partitions=partitions, compacted=compacted_topics(topics))
    finally:
        await bus.close()
    after = await describe_topics(bootstrap, names)
    deadline = time.monotonic() + METADATA_WAIT_S
    while not all(s.exists for s in after) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)  # a new topic reaches the brokers' metadata a moment after creation
        after = await describe_topics(bootstrap, names)
    created = [s.name for s in after if s.exists and s.name not in before]
    log.info("kafka_topics_created", extra={"topics_created": created, "partitions": partitions,
                                             "replication_factor": replication_factor})
    return [TopicState(**{**asdict(s), "created": s.name in created}) for s in after]


def _report(bootstrap: str, topics: KafkaTopics, states: list[TopicState]) -> None:
    """Print the JSON document of the module docstring; exit 1 when a check fails."""
    problems = check_topics(topics, states)
    typer.echo(json.dumps({"bootstrap": bootstrap, "topic_prefix": topics.prefix,
                           "topics": [asdict(s) for s in states], "problems": problems}, indent=2))
    for p in problems:
        log.error("kafka_topic_problem", extra={"problem": p})
    if problems:
        raise typer.Exit(1)


def _run(coro: Any) -> Any:
    """Run ``coro``; a Kafka error becomes a one-line message on stderr and exit status 1."""
    try:
        return asyncio.run(coro)
    except KafkaError as e:
        typer.echo(f"error: Kafka: {type(e).__name__}: {e}", err=True)
        raise typer.Exit(1) from None


@settings_command(topics_app, "create", TOPICS_FLAGS)
def create(
    settings: DeploymentSettings,
    partitions: Annotated[
        int, typer.Option(min=1, help="Partitions of each topic (both telemetry topics need the same "
                          "count; it bounds the number of analytics instances).")
    ] = DEFAULT_PARTITIONS,
    replication_factor: Annotated[
        int, typer.Option(min=1, help="Replicas of each topic (1 on a single-node cluster).")
    ] = 1,
) -> None:
    """Create every gpupool Kafka topic that does not exist yet, then check them all.

    Topics (under the prefix): telemetry.gpu, telemetry.ib_port, telemetry.nvswitch,
    telemetry.scheduler, fabric.topology (compacted), capacity, pool.demand, leases.log (compacted); each with --partitions partitions and
    --replication-factor replicas. Existing topics are left as they are. Prints JSON (name, exists,
    created, partitions, replication_factor, cleanup_policy; problems). Exit 1 when a topic is
    wrong (telemetry partition counts differ, a compacted topic is not compacted) or Kafka
    refuses; exit 2 without Kafka bootstrap servers (--kafka, GPUPOOL_KAFKA or the settings file).
    """
    assert settings.kafka is not None  # settings_command guarantees it
    topics = KafkaTopics(prefix=settings.topic_prefix)
    states = _run(create_all(settings.kafka, topics, partitions, replication_factor))
    _report(settings.kafka, topics, states)


@settings_command(topics_app, "list", TOPICS_FLAGS)
def list_(settings: DeploymentSettings) -> None:
    """List every gpupool Kafka topic of the prefix with its partitions, replication factor and
    cleanup.policy (JSON, as `topics create` prints it; created is always false). Exit 1 when one
    is missing or wrong, or Kafka cannot be reached; exit 2 without Kafka bootstrap servers."""
    assert settings.kafka is not None  # settings_command guarantees it
    topics = KafkaTopics(prefix=settings.topic_prefix)
    states = _run(describe_topics(settings.kafka, topics.all()))
    _report(settings.kafka, topics, states)

