"""The msgspec twins of the telemetry models (:mod:`analytics.structs`) and the batch decoder built
on them (:func:`analytics.decode.decode_batch`): the twins follow the models (fields, defaults,
constraints, behaviour, a field added later); good records decode to the right values through the
twin; every kind of bad record gets the pydantic reference's reason; records the twin refuses are
decided by the reference (lax spellings accepted, unknown fields as the model says); the batch
keeps its order; and the JSON columns built a column at a time are the reference text byte for
byte."""

from __future__ import annotations

import json
import random
from typing import Any, Literal

import msgspec
import pytest
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from analytics.decode import GpuRecord, IbPortRecord, RejectedRecord, decode_batch, decode_telemetry
from analytics.rows import _json, _json_array, gpu_samples_table, ib_port_samples_table
from analytics.structs import struct_for
from contracts import GpuColumns, GpuSample, IbPortSample, KafkaTopics, encode
from contracts.base import Record
from contracts.bus import BusMessage

TOPICS = KafkaTopics()
T0 = 1_700_000_000.0


def gpu_msg(value: bytes | None, offset: int = 0, partition: int = 0) -> BusMessage:
    return BusMessage(TOPICS.telemetry_gpu, partition, offset, "h", value)


def ib_msg(value: bytes | None, offset: int = 0, partition: int = 0) -> BusMessage:
    return BusMessage(TOPICS.telemetry_ib_port, partition, offset, "h", value)


def members(record: object, model: type[Record]) -> list[tuple[str, str, Any]]:
    """Every field and property of ``record`` by ``model``'s names, with the value's type."""
    names = [*model.model_fields, *(n for n, v in vars(model).items() if isinstance(v, property))]
    return [(n, type(getattr(record, n)).__name__, getattr(record, n)) for n in names]


def verdict(m: BusMessage) -> object:
    """The pydantic reference's verdict on ``m``: reason and detail, or every member."""
    try:
        rec = decode_telemetry(m, TOPICS)
    except RejectedRecord as exc:
        return ("rejected", exc.reason, exc.detail)
    return members(rec, type(rec))


def batch_verdicts(msgs: list[BusMessage]) -> list[object]:
    """The batch decoder's verdict on every message, in input order."""
    got = decode_batch(msgs, TOPICS)
    out: dict[int, object] = {}
    for m, exc in got.rejected:
        out[id(m)] = ("rejected", exc.reason, exc.detail)
    for rec, m in [*zip(got.gpu, got.gpu_msgs, strict=True), *zip(got.ib, got.ib_msgs, strict=True)]:
        out[id(m)] = members(rec, GpuSample if m.topic == TOPICS.telemetry_gpu else IbPortSample)
    return [out[id(m)] for m in msgs]


# the twins follow the models -------------------------------------------------------------------
@pytest.mark.parametrize("model", [GpuSample, IbPortSample])
def test_each_telemetry_model_has_a_twin_with_its_fields_defaults_and_behaviour(model: type[Record]) -> None:
    twin = struct_for(model)
    assert twin is not None, "a field of the model has no msgspec translation: extend analytics.structs"
    assert twin.__struct_fields__ == tuple(model.model_fields)
    assert twin.__struct_config__.forbid_unknown_fields and twin.__struct_config__.frozen
    required = {n for n, f in model.model_fields.items() if f.is_required()}
    assert {n for n, d in zip(twin.__struct_fields__, twin.__struct_defaults__, strict=True)
            if d is msgspec.NODEFAULT} == required  # fmt: skip
    ib_like = {"ts": 1.0, "host": "h", "device": "mlx5_0", "port": 1, "gpu_uuid": "GPU-1"}
    made = model.model_validate({k: v for k, v in ib_like.items() if k in model.model_fields})
    twin_made = msgspec.json.decode(encode(made), type=twin)
    assert members(twin_made, model) == members(made, model)  # defaults and properties alike
    assert twin is (GpuRecord if model is GpuSample else IbPortRecord)


def test_a_field_added_to_a_model_is_in_its_twin_with_its_constraint() -> None:
    class Newer(GpuSample):
        memory_used_fraction: float | None = Field(None, ge=0.0, le=1.0)
        link_width: Literal["1x", "4x", "8x", "12x"] | None = None
        lanes: list[int] = Field(default_factory=list, max_length=4)

    twin = struct_for(Newer)
    assert twin is not None and twin.__struct_fields__[-3:] == ("memory_used_fraction", "link_width", "lanes")
    dec = msgspec.json.Decoder(twin)
    base = json.loads(encode(GpuSample(ts=T0, host="h", gpu_uuid="GPU-1")))
    for extra, ok in [
        ({"memory_used_fraction": 0.0}, True),
        ({"memory_used_fraction": 1.0}, True),  # the bounds are inclusive, as ge/le say
        ({"memory_used_fraction": 1.0000000000000002}, False),
        ({"memory_used_fraction": -0.0}, True),
        ({"memory_used_fraction": -5e-324}, False),
        ({"memory_used_fraction": None}, True),
        ({"link_width": "4x"}, True),
        ({"link_width": "2x"}, False),
        ({"lanes": [1, 2, 3, 4]}, True),
        ({"lanes": [1, 2, 3, 4, 5]}, False),
    ]:
        payload = json.dumps({**base, **extra}).encode()
        try:
            got: object = members(dec.decode(payload), Newer)
        except msgspec.ValidationError:
            got = None
        reference_ok = True
        try:
            want = members(Newer.model_validate_json(payload), Newer)
        except ValueError:
            reference_ok = False
        assert reference_ok is ok, extra
        assert got == (want if ok else None), extra


def test_models_the_translation_does_not_cover_have_no_twin() -> None:
    class WithValidator(GpuSample):
        @field_validator("host")
        @classmethod
        def lower(cls, v: str) -> str:
            return v.lower()

    class WithAny(GpuSample):
        extra_blob: Any = None

    class WithAlias(GpuSample):
        hostname: str = Field("", alias="Hostname")

    class BeforeCheck(GpuSample):
        @model_validator(mode="before")
        @classmethod
        def raw(cls, data: Any) -> Any:
            return data

    class Allowing(GpuSample):
        model_config = ConfigDict(extra="allow")

    class Stripping(GpuSample):
        model_config = ConfigDict(str_strip_whitespace=True)

    class Patterned(GpuSample):
        uuid2: str = Field("", pattern="^GPU-")

    for model in (WithValidator, WithAny, WithAlias, BeforeCheck, Allowing, Stripping, Patterned):
        assert struct_for(model) is None, model.__name__


def test_a_model_that_ignores_unknown_fields_has_a_twin_that_ignores_them() -> None:
    class Tolerant(GpuSample):
        model_config = ConfigDict(extra="ignore")

    twin = struct_for(Tolerant)
    assert twin is not None and not twin.__struct_config__.forbid_unknown_fields
    payload = encode(GpuSample(ts=T0, host="h", gpu_uuid="GPU-1"))[:-1] + b',"added_later":{"x":[1]}}'
    assert members(msgspec.json.decode(payload, type=twin), Tolerant) == members(
        Tolerant.model_validate_json(payload), Tolerant
    )


# the batch decoder -------------------------------------------------------------------------------
GOOD = (
    b'{"schema_version":1,"ts":1700000000.25,"host":"node-7","gpu_uuid":"GPU-abc","gpu_index":3,'
    b'"gpu_instance_id":2,"gpu_instance_profile":"3g.40gb","model_name":"NVIDIA H100 80GB HBM3",'
    b'"fields":{"DCGM_FI_DEV_GPU_UTIL":97,"DCGM_FI_PROF_GR_ENGINE_ACTIVE":0.5,"DCGM_FI_DEV_XID_ERRORS":'
    b'18446744073709551615},"invalid":{"DCGM_FI_DEV_MEMORY_TEMP":"sentinel"},'
    b'"attributes":{"pod":"a, b \\"c\\"","namespace":"\xc3\xa9"},"source":"nvml","target":"t","seq":9}'
)


def test_a_good_record_decodes_through_the_twin_to_the_right_values() -> None:
    got = decode_batch([gpu_msg(GOOD)], TOPICS)
    assert got.fallbacks == 0 and not got.rejected
    [rec] = got.gpu
    assert type(rec) is GpuRecord and type(rec) is not GpuSample
    assert (rec.ts, rec.host, rec.gpu_uuid, rec.gpu_index, rec.gpu_instance_id) == (
        1700000000.25, "node-7", "GPU-abc", 3, 2)  # fmt: skip
    assert (rec.gpu_instance_profile, rec.model_name, rec.source, rec.target, rec.seq) == (
        "3g.40gb", "NVIDIA H100 80GB HBM3", "nvml", "t", 9)  # fmt: skip
    assert list(rec.fields.items()) == [
        ("DCGM_FI_DEV_GPU_UTIL", 97), ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", 0.5),
        ("DCGM_FI_DEV_XID_ERRORS", 2**64 - 1)]  # fmt: skip
    assert (
        type(rec.fields["DCGM_FI_DEV_GPU_UTIL"]) is int
        and type(rec.fields["DCGM_FI_PROF_GR_ENGINE_ACTIVE"]) is float
    )
    assert rec.invalid == {"DCGM_FI_DEV_MEMORY_TEMP": "sentinel"}
    assert rec.attributes == {"pod": 'a, b "c"', "namespace": "\u00e9"}
    assert rec.key == "node-7/GPU-abc/2" and rec.partition_key == "node-7"
    assert members(rec, GpuSample) == verdict(gpu_msg(GOOD))


def _with(**changes: object) -> bytes:
    d = json.loads(GOOD)
    for k, v in changes.items():
        if v is _DROP:
            del d[k]
        else:
            d[k] = v
    return json.dumps(d, allow_nan=True).encode()


_DROP = object()


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (None, "tombstone"),
        (b"", "malformed_json"),
        (b'{"ts": 1,', "malformed_json"),
        (GOOD + b"}", "malformed_json"),
        (_with(ts=_DROP), "invalid_record"),  # required field missing
        (_with(host=None), "invalid_record"),
        (_with(gpu_uuid=5), "invalid_record"),
        (_with(gpu_index="three"), "invalid_record"),
        (_with(gpu_index=1.5), "invalid_record"),
        (_with(fields={"X": "1x"}), "invalid_record"),
        (_with(invalid={"X": 1}), "invalid_record"),
        (_with(source="prometheus"), "invalid_record"),
        (_with(added_later=1), "invalid_record"),  # unknown field: the model forbids it
        (_with(schema_version=2), "unsupported_version"),
        (_with(schema_version=0), "unsupported_version"),
        (_with(ts=float("nan")), "bad_timestamp"),
        (_with(ts=float("inf")), "bad_timestamp"),
        (_with(ts=1e400), "bad_timestamp"),  # past float64: msgspec refuses, pydantic reads inf
    ],
)
def test_each_kind_of_bad_record_gets_the_reference_reason(value: bytes | None, reason: str) -> None:
    good = gpu_msg(GOOD, 0)
    bad = gpu_msg(value, 1)
    got = decode_batch([good, bad, gpu_msg(GOOD, 2)], TOPICS)
    assert [(m.offset, e.reason) for m, e in got.rejected] == [(1, reason)]
    assert [m.offset for m in got.gpu_msgs] == [0, 2]
    assert got.fallbacks == 1
    assert batch_verdicts([bad]) == [verdict(bad)]


def test_a_record_on_another_topic_is_rejected_as_unknown_topic() -> None:
    m = BusMessage("somewhere.else", 0, 0, "k", GOOD)
    got = decode_batch([m], TOPICS)
    assert [e.reason for _, e in got.rejected] == ["unknown_topic"] and not got.gpu


@pytest.mark.parametrize(
    ("changes", "through_twin"),
    [
        ({"gpu_index": 2**63 - 1}, True),
        ({"gpu_index": 2**64 - 1}, True),
        ({"gpu_index": 2**64}, True),  # past uint64: an exact int too
        ({"gpu_index": -(2**63)}, True),
        ({"gpu_index": -(2**63) - 1}, True),
        ({"seq": 2**70}, True),
        ({"ts": 253402300799.99997}, True),  # the last float before the year 10000
        ({"ts": 2**32}, True),  # an integer ts is a float
        ({"ts": -0.0}, True),
        ({"ts": "1700000000.5"}, False),  # lax spelling: the reference accepts it
        ({"gpu_index": 3.0}, False),  # the reference takes an integral float as an int
        ({"gpu_index": "3"}, False),
        ({"fields": {"X": True}}, False),  # the reference reads true as 1.0
        ({"fields": {"A": 2**64, "B": -(2**64), "C": 10**30}}, True),
        ({"fields": {"A": 5e-324, "B": -0.0, "C": 1e308}}, True),
        ({"host": ""}, True),
        ({"attributes": {}}, True),
    ],
)
def test_boundaries_decode_to_the_reference_values(changes: dict[str, object], through_twin: bool) -> None:
    m = gpu_msg(_with(**changes))
    got = decode_batch([m], TOPICS)
    assert not got.rejected and got.fallbacks == (0 if through_twin else 1)
    assert batch_verdicts([m]) == [verdict(m)]
    assert isinstance(got.gpu[0], GpuRecord)


@pytest.mark.parametrize("ts", [1.7976931348623157e308, 2**64, 253402300800.0, -62135596800.00001])
def test_times_past_the_years_1_to_9999_are_rejected_by_both_paths(ts: float) -> None:
    m = gpu_msg(_with(ts=ts))
    got = decode_batch([m], TOPICS)
    assert [e.reason for _, e in got.rejected] == ["bad_timestamp"] and got.fallbacks == 1
    assert batch_verdicts([m]) == [verdict(m)]


def test_the_batch_keeps_its_order_across_topics_partitions_and_fallbacks() -> None:
    ib = IbPortSample(ts=T0, host="n1", device="mlx5_0", port=1, counters={"PortXmitData": 7})
    ib_lax = json.dumps({**json.loads(encode(ib)), "port": "1"}).encode()  # fallback, accepted
    lax = _with(ts="1700000000.5")
    msgs = [
        gpu_msg(GOOD, 10, 1), gpu_msg(lax, 0, 0), ib_msg(encode(ib), 5, 0), gpu_msg(b"{", 11, 1),
        gpu_msg(GOOD, 1, 0), ib_msg(ib_lax, 6, 0), gpu_msg(lax, 12, 1), ib_msg(encode(ib), 3, 1),
    ]  # fmt: skip
    got = decode_batch(msgs, TOPICS)
    assert [(m.partition, m.offset) for m in got.gpu_msgs] == [(1, 10), (0, 0), (0, 1), (1, 12)]
    assert [(m.partition, m.offset) for m in got.ib_msgs] == [(0, 5), (0, 6), (1, 3)]
    assert [r.ts for r in got.gpu] == [1700000000.25, 1700000000.5, 1700000000.25, 1700000000.5]
    assert all(type(r) is GpuRecord for r in got.gpu) and all(type(r) is IbPortRecord for r in got.ib)
    assert got.fallbacks == 4 and [(m.offset, e.reason) for m, e in got.rejected] == [(11, "malformed_json")]
    assert batch_verdicts(msgs) == [verdict(m) for m in msgs]


def _ib_mutations() -> list[bytes | None]:
    base = IbPortSample(
        ts=T0, host="sw1", device="Quantum", node_guid="0x0002c90300a1b2c3", port=17,
        link_layer="InfiniBand", state_id=4, state="ACTIVE", phys_state_id=5, phys_state="LinkUp",
        rate_bytes_per_second=50_000_000_000,
        counters={"PortXmitData": 2**64 - 1, "PortRcvData": 2**53 + 1, "PortXmitWait": None},
        counter_bits={"PortXmitData": 64}, saturated=["SymbolErrorCounter"], hw_counters={"np_cnp_sent": 3},
        source="perfquery", seq=4,
    )  # fmt: skip
    d = json.loads(encode(base))
    out: list[bytes | None] = [encode(base), None, b"[]", encode(base)[:-2]]
    for k in d:
        e = dict(d)
        del e[k]
        out.append(json.dumps(e).encode())
        for v in (None, True, 1, -1, 1.0, 1.5, "1", "", [], {}, [1], ["x"], 2**64, 2**64 - 1, -(2**63) - 1,
                  float("nan"), {"PortXmitData": 2**64}, {"PortXmitData": -1}, {"x": "1"}, {"x": None}):  # fmt: skip
            out.append(json.dumps({**d, k: v}, allow_nan=True).encode())
    return out


def test_ib_records_and_their_mutations_get_the_reference_verdict() -> None:
    msgs = [ib_msg(p, i) for i, p in enumerate(_ib_mutations())]
    got, want = batch_verdicts(msgs), [verdict(m) for m in msgs]
    assert got == want
    assert 50 < sum(w[0] == "rejected" for w in want if isinstance(w, tuple)) < len(want) - 50
    accepted = decode_batch(msgs, TOPICS)
    ref = [decode_telemetry(m, TOPICS) for m in accepted.ib_msgs]
    assert len(ref) > 50
    for twin, model in zip(accepted.ib, ref, strict=True):  # rows alike, or the same error
        assert row_or_error(ib_port_samples_table, twin) == row_or_error(ib_port_samples_table, model)


def row_or_error(build: Any, record: object) -> object:
    try:
        return build([record], [0], [0]).to_pylist()
    except Exception as exc:  # noqa: BLE001 — the error's kind is the value compared
        return type(exc).__name__


def test_random_records_decode_like_the_reference_and_build_the_same_rows() -> None:
    rng = random.Random(15)
    keys = ["DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_DEV_FB_USED", "x},{y", "temp e"]
    values: list[object] = [0, 1, -1, 0.5, 1e21, 1.5e-7, 2**53 + 1, 2**64, -0.0, 1e300, 123.456, 7.0]
    msgs = []
    for i in range(400):
        fields = {rng.choice(keys): rng.choice(values) for _ in range(rng.randint(0, 4))}
        s = GpuSample(
            ts=T0 + rng.random() * 1e6, host=f"n{rng.randint(0, 9)}", gpu_uuid=f"GPU-{rng.randint(0, 99)}",
            gpu_index=rng.choice([None, 0, 7]), gpu_instance_id=rng.choice([None, 1]), fields=fields,
            invalid=rng.choice([{}, {"X": "sentinel"}]), attributes=rng.choice([{}, {"pod": "p},{q"}, {"é": "\n"}]),
            seq=i,
        )  # fmt: skip
        msgs.append(gpu_msg(encode(s), i))
    got = decode_batch(msgs, TOPICS)
    assert got.fallbacks == 0
    ref = [decode_telemetry(m, TOPICS) for m in msgs]
    assert [members(r, GpuSample) for r in got.gpu] == [members(r, GpuSample) for r in ref]
    n = len(ref)
    assert gpu_samples_table(got.gpu, [0] * n, list(range(n))).equals(  # type: ignore[arg-type]
        gpu_samples_table(ref, [0] * n, list(range(n)))  # type: ignore[arg-type]
    )


# JSON columns ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dicts",
    [
        [],
        [{}],
        [{}, {}, {}],
        [{"a": 1}, {}, {"b": 2.5}],
        [{"A": 1e21}, {"A": 1e-7}],  # positive exponent: pydantic writes 1e+21
        [{"A": 1.7976931348623157e308, "B": 5e-324, "C": -0.0}],
        [{"A": float("nan"), "B": float("inf"), "C": float("-inf")}],  # null, as JSON has no NaN
        [{"A": 2**64, "B": -(2**70), "C": 2**53 + 1}],
        [{"x},{y": 1}, {"z": 2}],  # the separator inside a key
        [{"k": "v},{w"}, {}],  # ... and inside a value
        [{'\u00e9\n"\\\u2028\x7f\x00': "\U0001f600</"}],
        [{"A": None, "B": 3}],
        [{"a": "1e5"}, {"temp e": 2}],
    ],
)
def test_json_columns_are_the_reference_text(dicts: list[dict[str, Any]]) -> None:
    for floats in (True, False):
        if not floats and any(isinstance(v, float) and "e" in repr(v) for d in dicts for v in d.values()):
            continue  # floats=False promises no floats with an exponent
        got = _json_array(dicts, floats=floats)
        assert got.type == "string" and got.to_pylist() == [_json(d) for d in dicts]
    assert all(json.loads(t) is not None for t in _json_array(dicts, floats=True).to_pylist())


def test_without_a_twin_every_record_is_decided_by_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    import analytics.decode as decode_module

    monkeypatch.setattr(decode_module, "_GPU_DECODER", None)
    msgs = [gpu_msg(GOOD, 0), gpu_msg(b"{", 1), gpu_msg(_with(ts="1700000000.5"), 2)]
    got = decode_batch(msgs, TOPICS)
    assert got.fallbacks == 3 and [m.offset for m in got.gpu_msgs] == [0, 2]
    assert batch_verdicts(msgs) == [verdict(m) for m in msgs]


def test_nested_models_get_twins_and_after_validators_run_on_the_twin() -> None:
    class Inner(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        value: int = Field(ge=0)

    class Outer(BaseModel):
        model_config = ConfigDict(extra="forbid")
        items: list[Inner] = Field(default_factory=list)
        a: int | None = None
        b: int | None = None

        @model_validator(mode="after")
        def _one_of(self) -> Outer:
            if self.a is None and self.b is None:
                raise ValueError("a or b")
            return self

    twin = struct_for(Outer)
    assert twin is not None
    dec = msgspec.json.Decoder(twin)
    got = dec.decode(b'{"items": [{"value": 0}, {"value": 3}], "a": 1}')
    assert [i.value for i in got.items] == [0, 3] and got.a == 1
    for bad in (b'{"items": [{"value": -1}], "a": 1}', b'{"items": [{"value": 1, "x": 2}], "a": 1}', b'{"items": []}'):
        with pytest.raises(msgspec.ValidationError):
            dec.decode(bad)
        with pytest.raises(ValueError):
            Outer.model_validate_json(bad)  # the model refuses each too
    assert struct_for(GpuSample) is not None  # a sample known by index alone is checked on the twin


def test_a_twin_with_replaced_field_types_keeps_those_elements_raw() -> None:
    raw = struct_for(GpuColumns, (("fields", list[msgspec.Raw]),))
    assert raw is not None and raw is not struct_for(GpuColumns)
    got = msgspec.json.decode(b'{"ts":[1.0],"gpu_index":[0],"fields":[{"A": 1}]}', type=raw)
    assert [bytes(f) for f in got.fields] == [b'{"A": 1}']
    # the model's validator runs on the twin
    with pytest.raises(msgspec.ValidationError, match="needs gpu_uuid or gpu_index"):
        msgspec.json.decode(b'{"ts":[1.0],"fields":[{}]}', type=raw)
    with pytest.raises(KeyError, match="no field"):
        struct_for(GpuColumns, (("nope", int),))
