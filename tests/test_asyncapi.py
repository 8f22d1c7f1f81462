"""The committed protocol documents (docs/asyncapi.yaml, docs/schemas/*.json) are what
``python -m contracts.asyncapi --out docs/`` generates from the models, and the AsyncAPI document
is structurally valid AsyncAPI 3.0.0.

No AsyncAPI 3 validator is a dependency of the project, so the structure is checked here: required
top-level fields, every ``$ref`` resolves, every channel parameter appears in its address (and
every ``{placeholder}`` has a parameter), operations name their channel's messages, and each
payload schema accepts a real model instance's JSON in the fields it requires.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from contracts import Claim, LeaseMessage, MqttTopics, Offer, OfferedGpu
from contracts.asyncapi import ASYNCAPI_FILE, build_asyncapi, kafka_json_schemas, main, render

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"


def _resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), f"not a local ref: {ref}"
    node: Any = doc
    for raw in ref[2:].split("/"):
        part = raw.replace("~1", "/").replace("~0", "~")
        assert isinstance(node, dict) and part in node, f"unresolved $ref {ref} (at {part!r})"
        node = node[part]
    return node


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return yaml.safe_load((DOCS / ASYNCAPI_FILE).read_text())


def test_committed_files_equal_regenerated() -> None:
    files = render()
    committed = {p.relative_to(DOCS).as_posix() for p in (DOCS / "schemas").glob("*.json")}
    assert committed == {k for k in files if k.startswith("schemas/")}, "stale or missing schema files"
    for rel, text in files.items():
        assert (DOCS / rel).read_text() == text, (
            f"docs/{rel} differs from the models: run `python -m contracts.asyncapi --out docs/`"
        )


def test_cli_writes_same_files(tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path)]) == 0
    for rel, text in render().items():
        assert (tmp_path / rel).read_text() == text
    done = subprocess.run(
        [sys.executable, "-m", "contracts.asyncapi", "--out", str(tmp_path / "m")],
        cwd=REPO, capture_output=True, text=True, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "m" / ASYNCAPI_FILE).read_text() == render()[ASYNCAPI_FILE]


def test_top_level_fields(doc: dict[str, Any]) -> None:
    assert doc["asyncapi"] == "3.0.0"
    assert doc["info"]["title"] and doc["info"]["version"]
    assert set(doc) <= {"asyncapi", "id", "info", "servers", "defaultContentType", "channels",
                        "operations", "components"}
    for server in doc["servers"].values():
        assert server["host"] and server["protocol"] == "mqtt"


def test_every_ref_resolves(doc: dict[str, Any]) -> None:
    refs = _refs(doc)
    assert len(refs) > 40
    for ref in refs:
        _resolve(doc, ref)


def test_channel_parameters_match_addresses(doc: dict[str, Any]) -> None:
    t = MqttTopics()
    expected = {
        t.offer("{offer_id}"), t.claims("{site}"), t.lease("{site}", "{lease_id}"),
        t.renewals("{site}"), t.releases("{site}"), t.replies("{site}"), t.site_state("{site}"),
        t.broker_state,
    }
    assert {ch["address"] for ch in doc["channels"].values()} == expected
    for name, ch in doc["channels"].items():
        placeholders = set(re.findall(r"\{([^}]+)\}", ch["address"]))
        assert set(ch.get("parameters", {})) == placeholders, name


def test_operations_use_their_channels_messages(doc: dict[str, Any]) -> None:
    actions = {}
    for name, op in doc["operations"].items():
        assert op["action"] in ("send", "receive"), name
        channel_ref = op["channel"]["$ref"]
        for m in op["messages"]:
            assert m["$ref"].startswith(channel_ref + "/messages/"), (name, m)
        if "reply" in op:
            assert op["reply"]["channel"]["$ref"] == "#/channels/replies"
        actions[name] = (op["action"], channel_ref.rsplit("/", 1)[1])
    # from the broker's point of view
    assert actions["publishOffer"] == ("send", "offers")
    assert actions["receiveClaim"] == ("receive", "claims")
    assert actions["publishLease"] == ("send", "leases")
    assert actions["sendReply"] == ("send", "replies")
    offer_mqtt = doc["operations"]["publishOffer"]["bindings"]["mqtt"]
    assert offer_mqtt["qos"] == 1 and offer_mqtt["retain"] is True and "messageExpiryInterval" in offer_mqtt
    assert doc["components"]["messages"]["Claim"]["bindings"]["mqtt"]["responseTopic"]


def test_payload_schemas_are_the_models(doc: dict[str, Any]) -> None:
    schemas = doc["components"]["schemas"]
    for model in (Offer, Claim, LeaseMessage):
        own = model.model_json_schema()
        assert schemas[model.__name__]["required"] == own["required"]
        assert set(schemas[model.__name__]["properties"]) == set(own["properties"])
    claim = Claim(claim_id="c1", site="edge-a", offer_id="o1", ts=1.0)
    body = json.loads(claim.model_dump_json())
    assert set(schemas["Claim"]["required"]) <= set(body) and set(body) <= set(schemas["Claim"]["properties"])
    offer = Offer(offer_id="o", ts=1.0, host="h", gpus=[OfferedGpu(gpu="h/GPU-1")], expires_at=2.0,
                  notice_seconds=30.0)
    assert set(json.loads(offer.model_dump_json())) <= set(schemas["Offer"]["properties"])


def test_root_is_applied() -> None:
    d = build_asyncapi(root="lab/x")
    assert all(ch["address"].startswith("lab/x/") for ch in d["channels"].values())


def test_kafka_schemas() -> None:
    schemas = kafka_json_schemas()
    assert set(schemas) == {
        "telemetry.gpu.schema.json", "telemetry.ib_port.schema.json", "telemetry.scheduler.schema.json",
        "fabric.topology.schema.json", "capacity.schema.json", "pool.demand.schema.json",
        "leases.log.schema.json",
    }
    for name, schema in schemas.items():
        assert schema["$schema"].endswith("2020-12/schema")
        assert schema["x-kafka-topic"] + ".schema.json" == name
        for ref in _refs(schema):
            _resolve(schema, ref)
    assert schemas["leases.log.schema.json"]["title"] == "LeaseLogRecord"
