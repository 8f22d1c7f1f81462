"""Strict decoding of site messages (broker/wire.py), tolerant reading of every message
(contracts.base.decode_compatible), and the committed wire samples of protocol v1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from broker.wire import CHECKS, Malformed, parse_site_message, peek_id
from contracts import (
    Claim,
    LeaseLogRecord,
    LeaseMessage,
    Offer,
    PeerState,
    ReasonCode,
    Release,
    Renewal,
    Reply,
)
from contracts.base import decode_compatible
from contracts.mqtt import CLAIM_COMMAND_FIELDS, LIMITS

SAMPLES = Path(__file__).resolve().parent / "fixtures" / "wire" / "v1"
GOOD: dict[str, Any] = {"claim_id": "c-1", "site": "edge-a", "count": 1, "ts": 1796100000.0}


def _claim(obj: Any) -> Claim | Malformed:
    return parse_site_message(Claim, json.dumps(obj).encode() if not isinstance(obj, bytes) else obj, "claim_id")


def _refused(obj: Any, check: str) -> Malformed:
    got = _claim(obj)
    assert isinstance(got, Malformed), got
    assert got.check == check, got
    assert got.code is (ReasonCode.UNSUPPORTED_VERSION if check == "version" else ReasonCode.MALFORMED)
    assert got.text
    return got


def test_a_good_claim_decodes() -> None:
    got = _claim(GOOD)
    assert isinstance(got, Claim) and got.count == 1


def test_size_limit_is_exact() -> None:
    pad = LIMITS.max_payload_bytes - len(json.dumps({**GOOD, "claim_id": ""}).encode())
    at_limit = json.dumps({**GOOD, "x": "", "claim_id": "c"}).encode()
    at_limit = at_limit.replace(b'"x": ""', b'"x": "' + b"a" * (pad - len(b'"x": ""') - 3) + b'"')
    at_limit = at_limit + b" " * (LIMITS.max_payload_bytes - len(at_limit))
    assert len(at_limit) == LIMITS.max_payload_bytes
    assert isinstance(_claim(at_limit), Claim)
    _refused(at_limit + b" ", "size")


def test_nesting_limit_is_exact_and_deep_nesting_never_recurses() -> None:
    def nested(depth: int) -> dict[str, Any]:
        inner: Any = 1
        for _ in range(depth - 1):
            inner = [inner]
        return {**GOOD, "unknown": inner}

    assert isinstance(_claim(nested(LIMITS.max_depth)), Claim)  # the object is level 1, each list one more
    _refused(nested(LIMITS.max_depth + 1), "depth")
    _refused(b"[" * 8_000 + b"]" * 8_000, "depth")  # within the size limit, far past the parser's recursion
    # brackets inside strings do not count
    assert isinstance(_claim({**GOOD, "request_id": "[[[[[[[[[[[[[["}), Claim)


@pytest.mark.parametrize(
    ("payload", "check"),
    [
        (b"\xff\xfe{}", "utf8"),
        (b'{"claim_id": "\\ud800", "site": "edge-a", "count": 1, "ts": 1}', "utf8"),
        (b'{"claim_id": "c", "site": "\\udfff", "count": 1, "ts": 1}', "utf8"),
        (b"{not json", "json"),
        (b'{"claim_id": "c", "site": "edge-a", "count": 1, "ts": NaN}', "json"),
        (b'{"claim_id": "c", "site": "edge-a", "count": 1, "ts": Infinity}', "json"),
        (b'{"claim_id": "c", "site": "edge-a", "count": 1, "ts": 1e999}', "non_finite"),
        (b'{"claim_id": "c", "site": "edge-a", "count": 1, "ts": 1, "duration_seconds": -1e400}', "non_finite"),
        (b"[1, 2]", "object"),
        (b'"claim"', "object"),
    ],
)
def test_broken_payloads_are_refused_by_kind(payload: bytes, check: str) -> None:
    _refused(payload, check)


@pytest.mark.parametrize(
    "change",
    [
        {"count": True},  # a bool is not a count
        {"count": "1"},
        {"count": 1.0},
        {"duration_seconds": "600"},
        {"duration_seconds": True},
        {"ts": "1796100000"},
        {"claim_id": 7},
        {"claim_id": ""},
        {"claim_id": "has space"},
        {"claim_id": "x" * (LIMITS.max_id_chars + 1)},
        {"site": "edge/a"},
        {"count": LIMITS.max_count + 1},
        {"count": -1},
        {"duration_seconds": LIMITS.max_duration_seconds + 1},
        {"duration_seconds": 0},
        {"min_notice_seconds": LIMITS.max_notice_seconds + 1},
        {"ts": -1},
        {"requirements": {"model_names": ["x"] * (LIMITS.max_list_items + 1)}},
        {"requirements": {"avoid_hosts": ["n"] * (LIMITS.max_list_items + 1)}},
        {"requirements": {"avoid_hosts": "gpu-node-001"}},
        {"requirements": {"avoid_hosts": [""]}},
        {"requirements": {"avoid_hosts": ["n" * (LIMITS.max_name_chars + 1)]}},
        {"requirements": {"avoid_hosts": [7]}},
        {"requirements": {"avoid_hosts": None}},
        {"requirements": {"allow_cross_leaf": "yes"}},
        {"requirements": [1]},
    ],
)
def test_type_confusion_and_bounds_are_malformed(change: dict[str, Any]) -> None:
    got = _claim({**GOOD, **change})
    assert isinstance(got, Malformed) and got.code is ReasonCode.MALFORMED, (change, got)


def test_a_huge_integer_is_malformed() -> None:
    got = _claim(json.dumps(GOOD).replace('"count": 1', '"count": ' + "9" * 5000).encode())
    assert isinstance(got, Malformed) and got.check == "json"


def test_bounds_are_inclusive() -> None:
    ok = {**GOOD, "claim_id": "x" * LIMITS.max_id_chars, "count": LIMITS.max_count,
          "duration_seconds": LIMITS.max_duration_seconds, "min_notice_seconds": LIMITS.max_notice_seconds}
    assert isinstance(_claim(ok), Claim)
    hosts = [f"n{i}" for i in range(LIMITS.max_list_items)]
    assert len(json.dumps({**GOOD, "requirements": {"avoid_hosts": hosts}})) <= LIMITS.max_payload_bytes
    got = _claim({**GOOD, "requirements": {"avoid_hosts": hosts}})
    assert isinstance(got, Claim) and got.requirements is not None and got.requirements.avoid_hosts == hosts
    renewal = parse_site_message(
        Renewal, json.dumps({"lease_id": "l", "site": "edge-a", "ts": 1, "extend_seconds": LIMITS.max_extend_seconds}).encode(), "lease_id"
    )
    assert isinstance(renewal, Renewal)
    too_long = parse_site_message(
        Renewal, json.dumps({"lease_id": "l", "site": "edge-a", "ts": 1, "extend_seconds": LIMITS.max_extend_seconds + 1}).encode(), "lease_id"
    )
    assert isinstance(too_long, Malformed)


def test_unknown_fields_and_newer_versions_are_read() -> None:
    newer = {**GOOD, "schema_version": 7, "lent_share": 0.5, "requirements": {"zone": "z", "future": [1]}}
    got = _claim(newer)
    assert isinstance(got, Claim) and got.requirements is not None and got.requirements.zone == "z"
    for bad in (0, -1, "1", 1.0, True, None):
        _refused({**GOOD, "schema_version": bad}, "version")


def test_in_reply_to_and_request_id_are_read_only_when_safe() -> None:
    got = _refused({**GOOD, "count": True, "request_id": "r-9"}, "schema")
    assert (got.in_reply_to, got.request_id) == ("c-1", "r-9")
    assert _refused({**GOOD, "claim_id": "x" * 500, "count": True}, "schema").in_reply_to == ""
    assert peek_id(json.dumps(GOOD).encode(), "claim_id") == "c-1"
    assert peek_id(b"[" * 100, "claim_id") == ""
    assert peek_id(b'{"claim_id": "\\ud800"}', "claim_id") == ""


def test_every_check_is_named() -> None:
    assert set(CHECKS) == {"size", "utf8", "json", "depth", "non_finite", "object", "version", "command", "schema"}


def _with(obj: dict[str, Any], refused: frozenset[str] = CLAIM_COMMAND_FIELDS) -> Claim | Malformed:
    return parse_site_message(Claim, json.dumps(obj).encode(), "claim_id", refused)


def test_a_claim_never_passes_a_command() -> None:
    for field in sorted(CLAIM_COMMAND_FIELDS):
        got = _with({**GOOD, field: ["rm", "-rf", "/"], "request_id": "r-1"})
        assert isinstance(got, Malformed) and field in got.text
        assert (got.code, got.check, got.in_reply_to, got.request_id) == (
            ReasonCode.COMMAND_NOT_ALLOWED, "command", "c-1", "r-1"
        )  # fmt: skip
    # a profile name is what a site sends; without a refused set an unknown field is dropped
    named = _with({**GOOD, "workload": "vllm-small"})
    assert isinstance(named, Claim) and named.workload == "vllm-small"
    assert isinstance(_with({**GOOD, "command": "x"}, frozenset()), Claim)
    old = _with(GOOD)  # an old claim (no workload) stays valid, with no workload
    assert isinstance(old, Claim) and old.workload is None


_MODELS = {
    "offer": Offer,
    "claim_offer": Claim,
    "claim_match": Claim,
    "lease_message": LeaseMessage,
    "renewal": Renewal,
    "release": Release,
    "reply": Reply,
    "peer_state": PeerState,
    "lease_log_record": LeaseLogRecord,
}


def test_every_message_has_a_committed_sample() -> None:
    assert {p.stem for p in SAMPLES.glob("*.json")} == set(_MODELS)


def _kept(sample: Any, read: Any) -> bool:
    """Every value of ``sample`` is in ``read`` (recursively; ``read`` may have fields a later
    release added, at their defaults)."""
    if isinstance(sample, dict):
        return isinstance(read, dict) and all(k in read and _kept(v, read[k]) for k, v in sample.items())
    return bool(sample == read)


@pytest.mark.parametrize("name", sorted(_MODELS))
def test_committed_samples_decode(name: str) -> None:
    """The samples of the current release decode with this release's readers, also with a field
    a later release might add (tolerant readers)."""
    raw = (SAMPLES / f"{name}.json").read_bytes()
    model = _MODELS[name]
    rec = decode_compatible(model, raw)
    assert _kept(json.loads(raw), json.loads(rec.model_dump_json()))  # nothing lost (fields added since default)
    obj = json.loads(raw)
    obj["added_in_a_later_release"] = {"x": 1}
    obj["schema_version"] = 2
    assert decode_compatible(model, json.dumps(obj)) == rec
    if model in (Claim, Renewal, Release):
        strict = parse_site_message(model, json.dumps(obj).encode(), "claim_id" if model is Claim else "lease_id")
        assert strict == rec


def test_writers_stay_strict() -> None:
    with pytest.raises(ValueError):
        Claim(**GOOD, lent_share=1)  # type: ignore[call-arg]


def test_a_claim_s_lease_kind_is_read_from_its_json_string() -> None:
    import json as _json

    from contracts import Claim as _Claim
    from contracts import LeaseKind

    base = {"claim_id": "c", "site": "edge-a", "offer_id": "o", "ts": 1.0}
    for text, kind in (("window", LeaseKind.WINDOW), ("preemptible", LeaseKind.PREEMPTIBLE)):
        claim = parse_site_message(_Claim, _json.dumps({**base, "lease_kind": text}).encode(), "claim_id")
        assert isinstance(claim, _Claim) and claim.kind is kind
    bad = parse_site_message(_Claim, _json.dumps({**base, "lease_kind": "spot"}).encode(), "claim_id")
    assert bad.code.value == "malformed" and "lease_kind" in bad.text
