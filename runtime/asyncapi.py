"""The protocol v1 documents, generated from the models: an AsyncAPI 3.0.0 document of the MQTT
protocol and one JSON Schema (draft 2020-12) per Kafka topic.

Sources of the formats: AsyncAPI 3.0.0 (asyncapi.com/docs/reference/specification/v3.0.0), its MQTT
bindings 0.2.0 (github.com/asyncapi/bindings, ``mqtt/``), JSON Schema 2020-12 as written by pydantic's
``model_json_schema()``. Topic names come from :class:`contracts.topics.MqttTopics` and
:class:`contracts.topics.KafkaTopics`, payloads from :mod:`contracts.mqtt` and the Kafka records, so
the documents cannot drift from the code: ``tests/test_asyncapi.py`` regenerates them and compares.

``python -m runtime.asyncapi --out docs/`` writes ``docs/asyncapi.yaml`` and
``docs/schemas/<kafka topic>.schema.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Union

import yaml
from pydantic import TypeAdapter
from pydantic.json_schema import models_json_schema

from contracts.base import SCHEMA_VERSION, Record
from contracts.capacity import CapacityUpdate, PoolDemand
from contracts.fabric import TOPOLOGY_KEY, FabricTopology
from contracts.leases import LeaseLogRecord, LeaseReason
from contracts.mqtt import (
    LIMITS,
    REASON_ANSWERS,
    Claim,
    LeaseMessage,
    Offer,
    PeerState,
    ReasonCode,
    Release,
    Renewal,
    Reply,
)
from contracts.scheduler import SchedulerNode
from contracts.telemetry import GpuSample, GpuScrape, IbPortSample, NvSwitchSample
from contracts.topics import KafkaTopics, MqttTopics
from runtime.settings import BrokerSettings

ASYNCAPI_FILE = "asyncapi.yaml"
"""File name of the AsyncAPI document in the output directory."""

SCHEMAS_DIR = "schemas"
"""Sub-directory of the output directory holding the Kafka record schemas."""

_JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
_MQTT_BINDING = "0.2.0"
_TRACEPARENT = r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"

_MQTT_MODELS: tuple[type[Record], ...] = (Offer, Claim, LeaseMessage, Renewal, Release, Reply, PeerState)


def kafka_records(prefix: str = "") -> dict[str, tuple[type[Record] | tuple[type[Record], ...], str]]:
    """Kafka topic name → (record model, or the models a topic carries side by side, what the
    record key is), per DESIGN.md "The bus" and :mod:`contracts.topics`. ``prefix`` is
    :attr:`KafkaTopics.prefix`."""
    t = KafkaTopics(prefix=prefix)
    return {
        t.telemetry_gpu: (
            (GpuScrape, GpuSample),
            "telemetry_partition_key(host): the host, as on telemetry.ib_port (a host's GPUs and ports "
            "share a partition number); a GpuScrape (a JSON object with a top-level gpus member: "
            "one read of a host's GPUs, written by this release's collectors) or a GpuSample (one "
            "GPU: older producers); each GPU's identity is "
            "gpu_key(host, gpu_uuid or gpu<gpu_index>[, gpu_instance_id])",
        ),
        t.telemetry_ib_port: (
            IbPortSample,
            "telemetry_partition_key(host): the host, as on telemetry.gpu (a switch port: the switch's "
            "description); the port's identity is ib_port_key(node_guid, port) of the payload",
        ),
        t.telemetry_nvswitch: (
            NvSwitchSample,
            "telemetry_partition_key(host): the host; the switch's identity is host/nvswitch<N>",
        ),
        t.telemetry_scheduler: (
            SchedulerNode,
            "telemetry_partition_key(host): the node's host, as on telemetry.gpu (a host's GPUs and its "
            "scheduler state share a partition number); GPUs are named by GRES index = the GPU index "
            "of telemetry.gpu",
        ),
        t.fabric_topology: (FabricTopology, f"always {TOPOLOGY_KEY!r} (compacted: newest snapshot wins)"),
        t.capacity: (CapacityUpdate, "gpu_key(host, gpu_uuid[, gpu_instance_id])"),
        t.pool_demand: (PoolDemand, "demand_id"),
        t.leases_log: (LeaseLogRecord, "lease_id (compacted: newest transition per lease wins)"),
    }


def kafka_json_schemas(prefix: str = "") -> dict[str, dict[str, Any]]:
    """File name (``<topic>.schema.json``) → JSON Schema (draft 2020-12) of that Kafka topic's
    records: pydantic's ``model_json_schema()`` plus ``$schema``, ``$id`` and the
    ``x-kafka-topic`` / ``x-kafka-key`` annotations (unknown keywords, ignored by validators)."""
    out: dict[str, dict[str, Any]] = {}
    for topic, (model, key) in kafka_records(prefix).items():
        if isinstance(model, tuple):  # several records side by side: any one of them
            union: TypeAdapter[Any] = TypeAdapter(Union[model])  # type: ignore[arg-type]  # noqa: UP007 (built from a tuple)
            body = {"title": " | ".join(m.__name__ for m in model), **union.json_schema()}
        else:
            body = model.model_json_schema()
        schema: dict[str, Any] = {
            "$schema": _JSON_SCHEMA_DIALECT,
            "$id": f"{topic}.schema.json",
            **body,
            "x-kafka-topic": topic,
            "x-kafka-key": key,
            "x-schema-version": SCHEMA_VERSION,
        }
        out[f"{topic}.schema.json"] = schema
    return out


def _component_schemas() -> dict[str, Any]:
    """Every MQTT payload model and the models it uses, keyed by model name, with ``$ref``s
    pointing into ``#/components/schemas``."""
    _, top = models_json_schema(
        [(model, "validation") for model in _MQTT_MODELS],
        ref_template="#/components/schemas/{model}",
    )
    return dict(sorted(top.get("$defs", {}).items()))


def _ref(*parts: str) -> dict[str, str]:
    return {"$ref": "#/" + "/".join(p.replace("~", "~0").replace("/", "~1") for p in parts)}


def _param(description: str) -> dict[str, Any]:
    return {"description": description}


def _traced_headers() -> dict[str, Any]:
    return _ref("components", "schemas", "Mqtt5UserProperties")


def _message(model: str, summary: str, *, binding: dict[str, Any] | None = None) -> dict[str, Any]:
    """A message whose payload is the JSON of ``model``."""
    msg: dict[str, Any] = {
        "name": model,
        "title": model,
        "summary": summary,
        "contentType": "application/json",
        "payload": _ref("components", "schemas", model),
        "headers": _traced_headers(),
        "bindings": {
            "mqtt": {"payloadFormatIndicator": 1, "contentType": "application/json", **(binding or {}),
                     "bindingVersion": _MQTT_BINDING}
        },
    }
    return msg


def _messages() -> dict[str, Any]:
    request = {
        "responseTopic": {
            "type": "string",
            "description": "MQTT 5 response topic: the site's own sites/{site}/replies (or another "
            "topic under its own sites/{site}/); MQTT 3.1.1 has none and the reply goes to "
            "sites/{site}/replies, matched by claim_id / lease_id in the payload.",
        },
        "correlationData": {
            "type": "string",
            "description": "MQTT 5 correlation data: the claim_id / lease_id as UTF-8, echoed in the reply.",
        },
    }
    return {
        "Offer": _message("Offer", "Idle GPUs of one node offered to every site."),
        "Withdrawal": {
            "name": "Withdrawal",
            "title": "Withdrawal",
            "summary": "Zero-length retained payload: clears a withdrawn offer or a finished lease "
            "from the server's retained store.",
            "payload": {"type": "string", "maxLength": 0},
            "bindings": {"mqtt": {"bindingVersion": _MQTT_BINDING}},
        },
        "Claim": _message("Claim", "A site claims (part of) a named offer, or asks by requirements (model, count, memory, zone, minimum duration, preference) and the broker matches offers.", binding=request),
        "LeaseMessage": _message("LeaseMessage", "Current state of one lease (retained)."),
        "Renewal": _message("Renewal", "Heartbeat keeping a lease alive.", binding=request),
        "Release": _message("Release", "A site gives a lease back early.", binding=request),
        "Reply": _message(
            "Reply",
            "The broker's answer to a claim, renewal or release, with a reason code.",
            binding={"correlationData": request["correlationData"]},
        ),
        "PeerState": _message("PeerState", "Retained birth/death of a site or the broker; its Last Will."),
    }


def _channels(root: str) -> dict[str, Any]:
    t = MqttTopics(root=root)
    site = _param("Edge site name; also its MQTT user name (the ACL allows it only its own subtree).")

    def msg(name: str) -> dict[str, Any]:
        return {name: _ref("components", "messages", name)}

    def channel(address: str, description: str, messages: dict[str, Any], **params: Any) -> dict[str, Any]:
        ch: dict[str, Any] = {"address": address, "description": description, "messages": messages}
        if params:
            ch["parameters"] = params
        return ch

    return {
        "offers": channel(
            t.offer("{offer_id}"),
            "Retained offers, QoS 1; MQTT 5 message expiry = the offer's remaining lifetime "
            "(expires_at in the payload for MQTT 3.1.1). A zero-length retained payload withdraws it.",
            {**msg("Offer"), **msg("Withdrawal")},
            offer_id=_param("Offer id (Offer.offer_id)."),
        ),
        "claims": channel(t.claims("{site}"), "A site's claims, QoS 1.", msg("Claim"), site=site),
        "leases": channel(
            t.lease("{site}", "{lease_id}"),
            "Retained lease state, QoS 1: granted, active, reclaiming (with reclaim_deadline), "
            "released, expired, revoked; a zero-length retained payload clears a finished lease.",
            {**msg("LeaseMessage"), **msg("Withdrawal")},
            site=site,
            lease_id=_param("Lease id (LeaseMessage.lease_id)."),
        ),
        "renewals": channel(t.renewals("{site}"), "Lease heartbeats, QoS 1.", msg("Renewal"), site=site),
        "releases": channel(t.releases("{site}"), "Early releases, QoS 1.", msg("Release"), site=site),
        "replies": channel(
            t.replies("{site}"),
            "The broker's answers (not retained, QoS 1); MQTT 5 requests also get the answer on "
            "their response topic when it lies under the site's own subtree.",
            msg("Reply"),
            site=site,
        ),
        "siteState": channel(
            t.site_state("{site}"),
            "A site's retained birth (online, seq) and its Last Will (offline, same seq), QoS 1.",
            msg("PeerState"),
            site=site,
        ),
        "brokerState": channel(
            t.broker_state,
            "The broker's retained birth and Last Will, QoS 1.",
            msg("PeerState"),
        ),
    }


def _operation(
    action: str, channel: str, messages: list[str], summary: str, *, retain: bool,
    expiry: dict[str, Any] | None = None, reply: bool = False,
) -> dict[str, Any]:
    binding: dict[str, Any] = {"qos": 1, "retain": retain}
    if expiry is not None:
        binding["messageExpiryInterval"] = expiry
    op: dict[str, Any] = {
        "action": action,
        "channel": _ref("channels", channel),
        "summary": summary,
        "messages": [_ref("channels", channel, "messages", m) for m in messages],
        "bindings": {"mqtt": {**binding, "bindingVersion": _MQTT_BINDING}},
    }
    if reply:
        # No reply "address": the replies channel has one (sites/{site}/replies). The MQTT 5
        # response topic is a message binding property, which a runtime expression cannot name.
        op["reply"] = {
            "channel": _ref("channels", "replies"),
            "messages": [_ref("channels", "replies", "messages", "Reply")],
        }
    return op


def _operations() -> dict[str, Any]:
    offer_expiry = {
        "type": "integer",
        "minimum": 1,
        "description": "Seconds: the offer's remaining lifetime, ceil(expires_at - now), at least 1.",
    }
    return {
        "publishOffer": _operation(
            "send", "offers", ["Offer", "Withdrawal"], "Offer idle GPUs; withdraw them.",
            retain=True, expiry=offer_expiry,
        ),
        "receiveClaim": _operation(
            "receive", "claims", ["Claim"], "Claims of every site (subscription sites/+/claims).",
            retain=False, reply=True,
        ),
        "publishLease": _operation(
            "send", "leases", ["LeaseMessage", "Withdrawal"], "Lease transitions, reclaim notices.",
            retain=True,
        ),
        "receiveRenewal": _operation(
            "receive", "renewals", ["Renewal"], "Heartbeats of every site.", retain=False, reply=True
        ),
        "receiveRelease": _operation(
            "receive", "releases", ["Release"], "Early releases of every site.", retain=False, reply=True
        ),
        "sendReply": _operation(
            "send", "replies", ["Reply"], "Answer a claim, renewal or release.", retain=False
        ),
        "receiveSiteState": _operation(
            "receive", "siteState", ["PeerState"], "Sites' birth/death.", retain=True
        ),
        "publishBrokerState": _operation(
            "send", "brokerState", ["PeerState"], "The broker's birth/death.", retain=True
        ),
    }


def _user_properties_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "description": "MQTT 5 user properties (none over MQTT 3.1.1, where the payload carries "
        "everything essential). Not part of the MQTT binding 0.2.0, hence described as headers.",
        "properties": {
            "traceparent": {
                "type": "string",
                "pattern": _TRACEPARENT,
                "description": "W3C Trace Context traceparent of the span that sent the message.",
            },
            "tracestate": {"type": "string", "description": "W3C Trace Context tracestate."},
        },
    }


def _member_docs(enum: type[Any]) -> dict[str, str]:
    """Member value → the docstring under it in the enum's source (``""`` if none)."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(enum)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:] + [None], strict=True):
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
            name = stmt.targets[0].id
            doc = ""
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                doc = " ".join(nxt.value.value.split())
            docs[getattr(enum, name).value] = doc
    return docs


def _reason_codes() -> dict[str, Any]:
    """``x-reason-codes``: every :class:`ReasonCode` with its meaning and the requests it answers."""
    docs = _member_docs(ReasonCode)
    return {
        code.value: {"description": docs[code.value], "answers": list(REASON_ANSWERS[code])}
        for code in ReasonCode
    }


def _lease_reasons() -> dict[str, str]:
    """``x-lease-reasons``: every :class:`LeaseReason` value (``reason`` of lease messages)."""
    return _member_docs(LeaseReason)


def _limits() -> dict[str, Any]:
    """``x-limits``: the protocol's bounds (:data:`contracts.mqtt.LIMITS`) and the broker's
    defaults a site meets (rate limit, quota, TTLs)."""
    out: dict[str, Any] = {
        name: getattr(LIMITS, name) for name in sorted(vars(type(LIMITS))) if not name.startswith("_")
    }
    defaults = BrokerSettings()
    out.update(
        {
            "default_site_quota_gpus": defaults.default_site_quota,
            "lease_ttl_seconds": defaults.lease_ttl_s,
            "offer_ttl_seconds": defaults.offer_ttl_s,
            "retain_terminal_seconds": 900.0,
        }
    )
    return out


_GUIDE = """
## Lease state machine

```
granted ─► active ─► reclaiming(reclaim_deadline) ─► released | revoked | expired
   │          │
   │          └─► released (site) | expired (TTL or ends_at)
   └─► active (first renewal) | reclaiming | released | expired
```

`granted` and `active` hold the GPUs; `reclaiming` still holds them until `reclaim_deadline`
(= transition time + `notice_seconds`, or the end of the minimum guarantee); `released`, `expired`,
`revoked` are terminal. No GPU is ever in two live leases. Each transition is written to the
broker's lease log (Kafka) before anything about it is published; a transition the log refuses is
undone and the request answered `internal`. `seq` grows by one per transition.

## Requests and replies

Every claim, renewal and release gets exactly one `Reply` on `sites/{site}/replies` (and, over
MQTT 5, on the request's response topic with its correlation data), except requests ignored
without an answer: retained requests (never acted on; the broker clears them) and requests whose
`ts` is older than 300 s on arrival (`request_max_age_s`); both are counted in
`gpupool_broker_ignored_requests_total{reason}`. Match a reply by `request` (`claim`, `renewal`,
`release`) and `in_reply_to` (the `claim_id` or `lease_id`); to tell two renewals of one lease apart
over MQTT 3.1.1, put a `request_id` in the request: the reply echoes it, and only a request with
a `request_id` gets the reply fields added after the first release (`request`, `request_id`,
`expires_at`, `ttl_seconds`: sites of the first release refuse unknown fields). `x-reason-codes` lists
every `code` with its meaning and the requests it answers.

## Renewal and TTL

A lease expires at `expires_at` unless renewed. A renewal moves `expires_at` to
`now + min(extend_seconds, TTL)` (TTL: the broker's `lease_ttl_s`, 60 s by default; `extend_seconds`
absent: the full TTL), never past `ends_at` (grant + the claim's `duration_seconds`) and never
backwards; the first renewal makes a `granted` lease `active`. The `ok` reply carries the new
`expires_at` and `ttl_seconds` (machine-readable, for a request with a `request_id`; the `text`
repeats them for people), and the
retained lease message is republished with the same `expires_at`. Renew well before it, e.g.
every TTL/3.

## Offers

An offer is retained on `offers/{offer_id}` until withdrawn (zero-length retained payload): when
claimed, when its GPUs or its promise change (a GPU turns busy or is leased, or analytics predicts
a shorter idle window — then a new offer under a new `offer_id` replaces it, which on a busy pool
happens every few seconds), and at `expires_at` (`ts` + 60 s by default), when still-idle GPUs are
offered again under a new id. `available_until` (the predicted idle end) is never before `ts`;
equal to `ts` means the prediction has passed and nothing is promised beyond now. Claim by
`requirements` instead of `offer_id` to be independent of re-issues.

## Identity and limits

Each site logs in with its own user name (= `{site}`) and password. Mosquitto replaces the
client id by the user name (`use_username_as_clientid`), so a site's client id is always its site
name, no site can take the broker's session, and a second connection of the same site takes over
the first. A site may publish only to its own `claims`, `renewals`, `releases` and `state`
topics; it reads `offers/#`, `broker/state` and its own `sites/{site}/#`. `x-limits` lists the
bounds: a request over `max_payload_bytes`, nested deeper than `max_depth`, not valid UTF-8
(including escaped lone surrogates), with a non-finite number, a wrong JSON type (no coercion:
`true` is not a count, `"600"` is not a number) or a value out of bounds is answered `malformed`
and changes nothing. A site sending more than `site_request_rate_per_s` requests per second (burst
`site_request_burst`) is answered `rate_limited`; it holds at most `default_site_quota_gpus` GPUs
unless configured otherwise (`quota_exceeded`). Mosquitto disconnects a client sending a packet
larger than `mosquitto_max_packet_bytes`.

## Retained state

Offers are retained until withdrawn (above). Lease messages stay retained while the lease is
remembered: live leases always, terminal ones for `retain_terminal_seconds` (15 min) after their
last transition; then the broker clears them. At every (re)connection the broker republishes every
offer and lease it holds and clears retained offers and lease messages it does not know.

## Versioning

Readers are tolerant, writers strict: a reader ignores fields it does not know and accepts any
`schema_version` >= 1 on these topics; within `gpupool/v1` every change is additive (new
optional fields, new reason codes or reason values). A breaking change moves to a new root,
`gpupool/v2`, and the broker then serves both roots for a transition, so sites of the previous
release keep working. Samples of every message of each release are kept in the repository
(`tests/fixtures/wire/v1/`) and decoded by every later release.
"""


def build_asyncapi(root: str = "gpupool/v1") -> dict[str, Any]:
    """The AsyncAPI 3.0.0 document of protocol v1 under MQTT topic ``root``, as a JSON-able dict.

    Channels are :class:`contracts.topics.MqttTopics` addresses with ``{site}``, ``{offer_id}``,
    ``{lease_id}`` parameters; operations are seen from the gpupool broker (``send`` = it publishes,
    ``receive`` = it subscribes); payload schemas are the pydantic models' JSON Schemas under
    ``components/schemas``; MQTT bindings 0.2.0 give QoS, retain, message expiry, response topic
    and correlation data.
    """
    schemas = _component_schemas()
    schemas["Mqtt5UserProperties"] = _user_properties_schema()
    broker_will = {
        "topic": MqttTopics(root=root).broker_state,
        "qos": 1,
        "retain": True,
        "message": "PeerState JSON with online=false and the session's seq",
    }
    servers = {
        f"mosquitto-{name}": {
            "host": "127.0.0.1:1883",
            "protocol": "mqtt",
            "protocolVersion": version,
            "description": f"Mosquitto 2, MQTT {version}; user/password per site (see "
            "`gpupool broker acl`), TLS listener optional.",
            "bindings": {"mqtt": {"lastWill": broker_will, "bindingVersion": _MQTT_BINDING}},
        }
        for name, version in (("mqtt5", "5"), ("mqtt311", "3.1.1"))
    }
    return {
        "asyncapi": "3.0.0",
        "id": "urn:gpupool:protocol:v1",
        "info": {
            "title": "gpupool broker protocol",
            "version": f"1.{SCHEMA_VERSION - 1}.0",
            "description": "Idle GPUs of an InfiniBand training pool offered to edge sites over "
            "MQTT, claimed, leased with renewals, reclaimed with notice. Every essential field "
            "is in the JSON payload (MQTT 3.1.1 works); MQTT 5 adds message expiry, response "
            "topic, correlation data and a traceparent user property. Every payload carries "
            f"schema_version ({SCHEMA_VERSION}). Generated from contracts/ by "
            "`python -m runtime.asyncapi`; do not edit by hand.\n" + _GUIDE,
        },
        "x-reason-codes": _reason_codes(),
        "x-lease-reasons": _lease_reasons(),
        "x-limits": _limits(),
        "defaultContentType": "application/json",
        "servers": servers,
        "channels": _channels(root),
        "operations": _operations(),
        "components": {"schemas": schemas, "messages": _messages()},
    }


class _NoAliasDumper(yaml.SafeDumper):
    """Writes shared sub-objects out in full instead of as ``&id001`` anchors and aliases."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render(root: str = "gpupool/v1") -> dict[str, str]:
    """Relative path → file text of every generated document (what :func:`write` writes)."""
    files = {
        ASYNCAPI_FILE: yaml.dump(
            build_asyncapi(root), Dumper=_NoAliasDumper, sort_keys=False, allow_unicode=True, width=100
        )
    }
    for name, schema in kafka_json_schemas().items():
        files[f"{SCHEMAS_DIR}/{name}"] = json.dumps(schema, indent=2, ensure_ascii=False) + "\n"
    return files


def write(out: Path, root: str = "gpupool/v1") -> list[Path]:
    """Write :func:`render`'s files under ``out`` (created); return their paths. Raises ``OSError``."""
    written = []
    for rel, text in render(root).items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m runtime.asyncapi --out DIR [--root R]``; prints the written paths.
    Exit status 1 if a file cannot be written."""
    p = argparse.ArgumentParser(prog="python -m runtime.asyncapi", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="output directory (e.g. docs/)")
    p.add_argument("--root", default="gpupool/v1", help="MQTT topic root (default %(default)s)")
    args = p.parse_args(argv)
    try:
        paths = write(args.out, args.root)
    except OSError as e:
        print(f"runtime.asyncapi: {e}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
