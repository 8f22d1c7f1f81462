"""The committed protocol documents (docs/asyncapi.yaml, docs/schemas/*.json) are what
``python -m runtime.asyncapi --out docs/`` generates from the models, and the AsyncAPI document
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
from runtime.asyncapi import ASYNCAPI_FILE, build_asyncapi, kafka_json_schemas, main, render

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
            f"docs/{rel} differs from the models: run `python -m runtime.asyncapi --out docs/`"
        )


def test_cli_writes_same_files(tmp_path: Path) -> None:
    assert main(["--out", str(tmp_path)]) == 0
    for rel, text in render().items():
        assert (tmp_path / rel).read_text() == text
    done = subprocess.run(
        [sys.executable, "-m", "runtime.asyncapi", "--out", str(tmp_path / "m")],
        cwd=REPO, capture_output=True, text=True, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "m" / ASYNCAPI_FILE).read_text() == render()[ASYNCAPI_FILE]


def test_top_level_fields(doc: dict[str, Any]) -> None:
    assert doc["asyncapi"] == "3.0.0"
    assert doc["info"]["title"] and doc["info"]["version"]
    # besides the fixed fields only specification extensions (x-...), which AsyncAPI allows here
    assert {k for k in doc if not k.startswith("x-")} <= {"asyncapi", "id", "info", "servers",
                                                          "defaultContentType", "channels", "operations",
                                                          "components"}
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
        "telemetry.gpu.schema.json", "telemetry.ib_port.schema.json", "telemetry.nvswitch.schema.json",
        "telemetry.scheduler.schema.json",
        "fabric.topology.schema.json", "capacity.schema.json", "pool.demand.schema.json", "leases.log.schema.json",
    }
    for name, schema in schemas.items():
        assert schema["$schema"].endswith("2020-12/schema")
        assert schema["x-kafka-topic"] + ".schema.json" == name
        for ref in _refs(schema):
            _resolve(schema, ref)
    assert schemas["leases.log.schema.json"]["title"] == "LeaseLogRecord"


# --- a protocol a stranger can implement from (issue 10) -------------------------------------------

def test_every_reason_code_is_documented_with_the_requests_it_answers(doc: dict[str, Any]) -> None:
    from contracts import ReasonCode
    from contracts.mqtt import REASON_ANSWERS

    documented = doc["x-reason-codes"]
    assert set(documented) == {c.value for c in ReasonCode}
    assert set(REASON_ANSWERS) == set(ReasonCode)
    for code, entry in documented.items():
        assert len(entry["description"]) > 20, code
        assert entry["answers"] and set(entry["answers"]) <= {"claim", "renewal", "release"}, code
    # the Reply schema's code enum is the same set
    assert set(doc["components"]["schemas"]["ReasonCode"]["enum"]) == set(documented)


def test_every_lease_reason_is_documented(doc: dict[str, Any]) -> None:
    from contracts.leases import LeaseReason

    documented = doc["x-lease-reasons"]
    assert set(documented) == {r.value for r in LeaseReason}
    assert all(len(text) > 10 for text in documented.values())


_REASON_CALLS = {"_transition": 3, "_end": 3, "_start_reclaim": 2, "reclaim": 3}
"""Book methods that set a lease's ``reason``, and the position of that argument (after self)."""


def _reason_ok(node: Any) -> bool:
    """A ``reason`` argument may be a LeaseReason member (``LeaseReason.X`` or ``.value``), a name
    passed through (a parameter), a conditional of those, or an f-string that starts with one of
    those and adds only ``:<detail>`` or further LeaseReason members (suffixes)."""
    import ast

    if isinstance(node, ast.Attribute):
        base = node.value.value if isinstance(node.value, ast.Attribute) and node.attr == "value" else node.value
        return isinstance(base, ast.Name) and base.id == "LeaseReason"
    if isinstance(node, ast.Name):
        return True
    if isinstance(node, ast.IfExp):
        return _reason_ok(node.body) and _reason_ok(node.orelse)
    if isinstance(node, ast.JoinedStr):
        first, *rest = node.values
        return (
            isinstance(first, ast.FormattedValue)
            and _reason_ok(first.value)
            and all(
                str(v.value).startswith(":") and ";" not in str(v.value)
                for v in rest
                if isinstance(v, ast.Constant)
            )
        )
    return False


def test_the_code_produces_only_documented_reasons() -> None:
    """Every ``reason`` the lease book can write comes from LeaseReason (which the document lists):
    a string literal passed as a reason anywhere in broker/ fails this test."""
    import ast

    offenders = []
    for path in sorted((REPO / "broker").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            pos = _REASON_CALLS.get(node.func.attr)
            if pos is None:
                continue
            arg = next((k.value for k in node.keywords if k.arg == "reason"), None)
            if arg is None and len(node.args) > pos:
                arg = node.args[pos]
            if arg is None:
                continue
            if not _reason_ok(arg):
                offenders.append(f"{path.name}:{node.lineno}: {ast.unparse(arg)}")
            # a record built directly: LeaseLogRecord(..., reason=...)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "LeaseLogRecord":
                for k in node.keywords:
                    if k.arg == "reason" and not _reason_ok(k.value):
                        offenders.append(f"{path.name}:{node.lineno}: reason={ast.unparse(k.value)}")
    assert offenders == []


def test_the_guide_covers_what_a_client_needs(doc: dict[str, Any]) -> None:
    text = doc["info"]["description"]
    for needle in (
        "## Lease state machine", "## Renewal and TTL", "ttl_seconds", "## Offers", "available_until",
        "request_id", "use_username_as_clientid", "## Retained state", "## Versioning", "gpupool/v2",
        "rate_limited",
    ):
        assert needle in text, needle
    limits = doc["x-limits"]
    for key in ("max_payload_bytes", "max_depth", "max_id_chars", "site_request_rate_per_s",
                "default_site_quota_gpus", "lease_ttl_seconds", "mosquitto_max_packet_bytes"):
        assert key in limits, key
    # every field of every site-facing message is described
    for name in ("Offer", "OfferedGpu", "Claim", "Requirements", "LeaseMessage", "Renewal", "Release", "Reply", "PeerState"):
        schema = doc["components"]["schemas"][name]
        undocumented = [f for f, s in schema["properties"].items() if f != "schema_version" and not s.get("description")]
        assert undocumented == [], (name, undocumented)
