"""Batch decode (:func:`analytics.decode.decode_batch`) against the per-record reference
(:func:`analytics.decode.decode_telemetry`): the same records accepted with the same values and
rows, the same records rejected with the same reasons, on real dcgm-exporter records and on
mutations of them; the garbage collector paused during a batch and restored after; and in the
service, a bad record inside a batch is rejected alone, counted, and nothing else is lost."""

from __future__ import annotations

import gc
import json
import math
import random
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from analytics.classify import FB_USED, GR_ENGINE_ACTIVE
from analytics.decode import RejectedRecord, decode_batch, decode_telemetry, paused_gc
from analytics.rows import gpu_samples_table
from analytics.timestamps import TS_MAX_S, TS_MIN_S, storable_ts
from analytics.service import AnalyticsService
from contracts import GpuSample, IbPortSample, KafkaTopics, encode
from contracts.bus import BusMessage, MemoryBus, TopicPartition

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
DCGM_SAMPLES = DATA / "cases" / "dcgm_exporter_samples"
TOPICS = KafkaTopics()
T0 = 1_700_000_000.0

_LINE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)\{(?P<labels>.*)\}\s+(?P<value>\S+)$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
_IDENTITY = {"gpu", "UUID", "device", "modelName", "Hostname", "hostname", "GPU_I_ID", "GPU_I_PROFILE"}


def real_samples() -> list[GpuSample]:
    """One GpuSample per GPU (or MIG instance) of every real dcgm-exporter body in
    ``cases/dcgm_exporter_samples``: values as written (integers stay ints, sentinels past 2**53
    included), label values with commas, spaces and quotes as attributes."""
    out: list[GpuSample] = []
    for path in sorted(DCGM_SAMPLES.glob("*.prom")):
        by_gpu: dict[tuple[str, str, str], tuple[dict[str, str], dict[str, float | int], dict[str, str]]] = {}
        for line in path.read_text().splitlines():
            m = _LINE.match(line.strip())
            if not m:
                continue
            labels = {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(m["labels"])}
            if "UUID" not in labels:
                continue
            host = labels.get("Hostname") or labels.get("hostname") or path.stem
            ident = (host, labels["UUID"], labels.get("GPU_I_ID", ""))
            lab, fields, invalid = by_gpu.setdefault(ident, ({}, {}, {}))
            lab.update({k: v for k, v in labels.items() if v})
            text = m["value"]
            if re.fullmatch(r"-?[0-9]+", text):
                fields[m["name"]] = int(text)
            else:
                try:
                    fields[m["name"]] = float(text)
                except ValueError:
                    invalid[m["name"]] = "not_a_number"
        for n, ((host, uuid, gi), (lab, fields, invalid)) in enumerate(sorted(by_gpu.items())):
            out.append(
                GpuSample(
                    ts=T0 + n + 0.125,
                    host=host,
                    gpu_uuid=uuid,
                    gpu_index=int(lab["gpu"]) if "gpu" in lab else None,
                    gpu_instance_id=int(gi) if gi else None,
                    gpu_instance_profile=lab.get("GPU_I_PROFILE"),
                    model_name=lab.get("modelName"),
                    fields=fields,
                    invalid=invalid,
                    attributes={k: v for k, v in lab.items() if k not in _IDENTITY},
                    target=f"file://{path.name}",
                    seq=n,
                )
            )
    return out


def msg(value: bytes | None, offset: int = 0, topic: str = TOPICS.telemetry_gpu) -> BusMessage:
    return BusMessage(topic, 0, offset, "k", value)


def gpu(m: BusMessage) -> GpuSample:
    """The per-record reference's GpuSample for ``m`` (which must be a valid GPU record)."""
    s = decode_telemetry(m, TOPICS)
    assert isinstance(s, GpuSample)
    return s


def outcome(m: BusMessage) -> str:
    """The per-record reference's verdict on ``m``: its reason and detail, or every value of the
    decoded record with its type."""
    try:
        s = decode_telemetry(m, TOPICS)
    except RejectedRecord as exc:
        return f"rejected {exc.reason} {exc.detail}"
    assert isinstance(s, GpuSample)
    return values(s)


def values(s: GpuSample) -> str:
    members = (
        s.ts, s.host, s.gpu_uuid, s.gpu_index, s.gpu_instance_id, s.gpu_instance_profile, s.model_name,
        list(s.fields.items()), list(s.invalid.items()), list(s.attributes.items()),
        s.source, s.target, s.seq, s.key,
    )  # fmt: skip
    return repr([(type(v).__name__, v) for v in members]) + repr(
        [type(v).__name__ for v in s.fields.values()]
    )


def ib_values(s: IbPortSample) -> str:
    names = [*IbPortSample.model_fields, "key", "partition_key"]
    return repr([(n, type(getattr(s, n)).__name__, getattr(s, n)) for n in names])


def batch_outcomes(msgs: list[BusMessage]) -> list[str]:
    """The batch path's verdict on every message, in input order."""
    got = decode_batch(msgs, TOPICS)
    by_offset: dict[int, str] = {}
    for m, exc in got.rejected:
        by_offset[m.offset] = f"rejected {exc.reason} {exc.detail}"
    for rec, m in zip(got.gpu, got.gpu_msgs, strict=True):
        by_offset[m.offset] = values(rec)
    assert not got.ib
    return [by_offset[m.offset] for m in msgs]


def rows_or_error(records: list[GpuSample]) -> str:
    """The rows built for ``records`` (repr, so NaN equals NaN), or the error's type."""
    try:
        return repr(gpu_samples_table(records, [0] * len(records), list(range(len(records)))).to_pylist())
    except Exception as exc:  # noqa: BLE001 — the error is the result compared
        return type(exc).__name__


def test_real_records_decode_in_a_batch_with_identical_values_and_rows() -> None:
    samples = real_samples()
    assert len(samples) >= 20  # every GPU and MIG instance of the handed bodies
    assert any(isinstance(v, int) and v > 2**53 for s in samples for v in s.fields.values())  # sentinels
    assert any("," in v or " " in v for s in samples for v in s.attributes.values())
    msgs = [msg(encode(s), i) for i, s in enumerate(samples)]
    got = decode_batch(msgs, TOPICS)
    assert not got.rejected and got.gpu_msgs == msgs
    ref = [gpu(m) for m in msgs]
    assert [values(r) for r in got.gpu] == [values(s) for s in ref] == [values(s) for s in samples]
    assert got.fallbacks == 0  # every real record decoded by the twin
    assert rows_or_error(got.gpu) == rows_or_error(ref)


def _mutations(base: bytes) -> list[bytes | None]:
    d = json.loads(base)
    payloads: list[bytes | None] = [None, b"", b"   ", b"[]", b"null", b"{}", b"\x00not json", base[:-1]]
    payloads += [base + b"x", base.replace(b"}", b",}", 1), base[:-1] + b",}"]
    payloads += [b"\xff" + base, base.replace(b'"ts"', b'"ts\\u0000"')]
    payloads += [base.replace(b'"host":"', b'"host":"\\ud800'), base.replace(b'"host":"', b'"host":"\\u00e9')]
    payloads += [json.dumps(d).encode(), json.dumps(d, indent=2).encode()]  # whitespace: still valid

    def variant(**changes: object) -> bytes:
        e = dict(d)
        for k, v in changes.items():
            if v is _DROP:
                e.pop(k, None)
            else:
                e[k] = v
        return json.dumps(e, separators=(",", ":"), allow_nan=True).encode()

    for k in d:
        payloads.append(variant(**{k: _DROP}))
        for v in (None, True, 1, -1, 0, 1.0, 1.5, "1", "1.5", "", [], {}, 2**64, -(2**63), 2**53 + 1, 1e300,
                  float("nan"), float("inf"), "dcgm-exporter", "nvml", {"a": 1}):  # fmt: skip
            payloads.append(variant(**{k: v}))
    payloads.append(variant(extra=1))
    payloads.append(variant(schema_version=2))
    payloads.append(variant(ts=2**53))
    payloads.append(variant(ts=2**53 + 2))
    payloads.append(variant(ts=-1e13))
    payloads.append(variant(ts=1700000000.0000005))
    for fv in (None, True, "1", 2**64, 2**63, 2**53 + 1, 1e308, 1.5, 2.5, -0.0, 0, -1,
               float("nan"), float("-inf"), [1], {"x": 1}):  # fmt: skip
        payloads.append(variant(fields={**d["fields"], FB_USED: fv, GR_ENGINE_ACTIVE: fv}))
    payloads.append(variant(invalid={"x": 1}))
    payloads.append(variant(invalid={"x": None}))
    payloads.append(variant(attributes={"pod": "a\u00e9\n\"b"}))
    payloads.append(variant(attributes={"pod": 5}))
    payloads.append(base.replace(b'"host":', b'"host":"dup","host":', 1))  # duplicate member: last wins
    payloads.append(base.replace(b'"fields":{', b'"fields":{"DCGM_FI_DEV_FB_USED":1.5,', 1))
    payloads.append(base.replace(b'"fields":{', b'"fields":{"x":NaN,', 1))
    payloads.append(base.replace(b'"fields":{', b'"fields":{"x":1e400,', 1))
    payloads.append(base.replace(b'"ts":', b'"ts":Infinity,"x":', 1))
    return payloads


_DROP = object()


def test_mutated_records_get_the_reference_verdict_and_rows() -> None:
    samples = real_samples()
    for s in samples[:6]:
        payloads = _mutations(encode(s))
        msgs = [msg(p, i) for i, p in enumerate(payloads)]
        assert batch_outcomes(msgs) == [outcome(m) for m in msgs]
        got = decode_batch(msgs, TOPICS)
        ref = [gpu(m) for m in got.gpu_msgs]
        for rec, s_ref in zip(got.gpu, ref, strict=True):
            assert rows_or_error([rec]) == rows_or_error([s_ref])
    reasons = {o.split()[1] for m in msgs if (o := outcome(m)).startswith("rejected")}
    assert reasons == {"tombstone", "malformed_json", "invalid_record", "unsupported_version",
                       "bad_timestamp"}  # fmt: skip
    assert len(got.gpu) > 20  # accepted variants (whitespace, ints as floats ...) are kept too


def test_random_byte_mutations_get_the_reference_verdict() -> None:
    rng = random.Random(20261130)
    alphabet = b'{}[]",:0123456789.eE-+ntrufalsNI\\ xu'
    bases = [encode(s) for s in real_samples()]
    payloads = []
    for _ in range(1000):
        b = bytearray(rng.choice(bases))
        for _ in range(rng.randint(1, 3)):
            pos = rng.randrange(len(b))
            op = rng.randrange(3)
            if op == 0:
                del b[pos]
            elif op == 1:
                b.insert(pos, rng.choice(alphabet))
            else:
                b[pos] = rng.choice(alphabet)
        payloads.append(bytes(b))
    msgs = [msg(p, i) for i, p in enumerate(payloads)]
    got, want = batch_outcomes(msgs), [outcome(m) for m in msgs]
    assert got == want
    assert 100 < sum(w.startswith("rejected") for w in want) < len(want) - 100  # both kinds exercised


def test_ib_records_and_other_topics_in_a_batch() -> None:
    ib = IbPortSample(ts=T0, host="n1", device="mlx5_0", port=1, counters={"PortXmitData": 2**64 - 1})
    msgs = [
        msg(encode(ib), 0, TOPICS.telemetry_ib_port),
        msg(b"{}", 1, "somewhere.else"),
        msg(encode(real_samples()[0]), 2),
    ]
    got = decode_batch(msgs, TOPICS)
    assert [ib_values(r) for r in got.ib] == [ib_values(ib)] and got.ib_msgs == [msgs[0]]
    assert [(m.offset, e.reason) for m, e in got.rejected] == [(1, "unknown_topic")]
    assert [m.offset for m in got.gpu_msgs] == [2]


def test_the_collector_is_paused_for_a_batch_and_restored() -> None:
    seen: list[bool] = []

    class Topics(KafkaTopics):
        @property
        def telemetry_gpu(self) -> str:  # read once per record, inside the batch
            seen.append(gc.isenabled())
            return "telemetry.gpu"

    msgs = [msg(encode(s), i) for i, s in enumerate(real_samples()[:3])] + [msg(b"{")]
    assert gc.isenabled()
    got = decode_batch(msgs, Topics())
    assert len(got.gpu) == 3 and [e.reason for _, e in got.rejected] == ["malformed_json"]
    assert seen and not any(seen) and gc.isenabled()
    with pytest.raises(RuntimeError), paused_gc():
        assert not gc.isenabled()
        raise RuntimeError("boom")
    assert gc.isenabled()  # restored on error too
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()  # left as it was found
    finally:
        gc.enable()


def metric(svc: AnalyticsService, name: str, **labels: str) -> float:
    """A sample of ``svc``'s Prometheus registry (0 if absent)."""
    return svc.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (None, "tombstone"),
        (b'{"ts": 1, "host": "h"', "malformed_json"),
        (b'{"ts": 1, "host": "h", "gpu_uuid": 5}', "invalid_record"),
        (b'{"schema_version": 2, "ts": 1, "host": "h", "gpu_uuid": "u"}', "unsupported_version"),
        (b'{"ts": NaN, "host": "h", "gpu_uuid": "u"}', "bad_timestamp"),
        # finite, but past what DuckDB's TIMESTAMP and datetime hold: it used to fail every step
        (b'{"ts": 1e300, "host": "h", "gpu_uuid": "u"}', "bad_timestamp"),
        (b'{"ts": 253402300800.0, "host": "h", "gpu_uuid": "u"}', "bad_timestamp"),
    ],
)
async def test_a_bad_record_inside_a_batch_is_rejected_alone(bad: bytes | None, reason: str) -> None:
    bus = MemoryBus()
    svc = AnalyticsService(bus=bus, topics=TOPICS, db_path=":memory:", clock=lambda: T0 + 100)
    await svc.start()
    before = metric(svc, "gpupool_analytics_rejected_records_total", reason=reason)
    consumed = metric(svc, "gpupool_analytics_records_consumed_total", topic=TOPICS.telemetry_gpu)
    try:
        producer = bus.producer()
        good = real_samples()[:8]
        for s in good[:4]:
            await producer.send(TOPICS.telemetry_gpu, encode(s), key=s.key)
        await producer.send(TOPICS.telemetry_gpu, bad, key="bad")
        # after the bad one: valid records spelled otherwise (spaces, ts as a JSON string)
        respelled = [json.dumps({**json.loads(encode(s)), "ts": str(s.ts)}).encode() for s in good[4:]]
        assert [values(r) for r in decode_batch([msg(v) for v in respelled], TOPICS).gpu] == [
            values(s) for s in good[4:]
        ]
        for s, value in zip(good[4:], respelled, strict=True):
            await producer.send(TOPICS.telemetry_gpu, value, key=s.key)
        assert await svc.step(timeout_s=0.01) == 9
        assert metric(svc, "gpupool_analytics_rejected_records_total", reason=reason) == before + 1
        assert metric(svc, "gpupool_analytics_records_consumed_total", topic=TOPICS.telemetry_gpu) == consumed + 9
        _, rows = svc.store.sql("SELECT gpu_key, kafka_offset FROM gpu_samples ORDER BY kafka_offset")
        assert rows == [(s.key, i if i < 4 else i + 1) for i, s in enumerate(good)]
        assert svc.store.stored_offsets() == {TopicPartition(TOPICS.telemetry_gpu, 0): 9}
        assert set(svc.current_states()) == {s.key for s in good}  # the classifier saw every good one
        _, stored = svc.store.sql("SELECT * EXCLUDE (kafka_partition, kafka_offset) FROM gpu_samples")
        ref = gpu_samples_table(good, [0] * 8, list(range(8)))
        assert sorted(stored, key=str) == sorted((tuple(r.values()) for r in _as_stored(svc, ref)), key=str)
    finally:
        await svc.stop()


def _as_stored(svc: AnalyticsService, table: object) -> list[dict[str, object]]:
    """``table``'s rows as DuckDB returns them from ``gpu_samples`` (through a scratch table)."""
    con = svc.store.cursor()
    con.register("_ref", table)
    con.execute("CREATE TEMP TABLE _ref_rows AS SELECT * FROM gpu_samples LIMIT 0")
    con.execute("INSERT INTO _ref_rows BY NAME SELECT * FROM _ref")
    rel = con.execute("SELECT * EXCLUDE (kafka_partition, kafka_offset) FROM _ref_rows")
    names = [d[0] for d in rel.description or []]
    return [dict(zip(names, row, strict=True)) for row in rel.fetchall()]


def test_storable_times_are_the_years_1_to_9999() -> None:
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    assert epoch + timedelta(seconds=TS_MIN_S) == datetime(1, 1, 1, tzinfo=UTC)
    assert epoch + timedelta(seconds=TS_MAX_S - 1) == datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)
    assert storable_ts(TS_MIN_S) and storable_ts(math.nextafter(TS_MAX_S, 0)) and storable_ts(0.0)
    for ts in (math.nextafter(TS_MIN_S, -math.inf), TS_MAX_S, 1e300, math.inf, -math.inf, math.nan):
        assert not storable_ts(ts)
