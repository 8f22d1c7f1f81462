"""Scrape records (:class:`contracts.GpuScrape`) in analytics: the columnar path
(:mod:`analytics.scrapes`, :func:`analytics.rows.gpu_scrapes_table`) gives the rows the per-sample
path gives for the same samples; records the fast path refuses get the reference's verdict; a bad
GPU inside a scrape record is rejected alone; mixed batches keep their order; and through the
service, scrape records are stored exactly once with their offsets."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from analytics.decode import GpuRecord, decode_batch, decode_telemetry, salvage_scrape
from analytics.rows import gpu_samples_table, gpu_scrapes_table
from analytics.service import AnalyticsService
from contracts import GpuSample, GpuScrape, encode, gpu_scrapes
from contracts.bus import MemoryBus, TopicPartition
from tests.test_analytics_ingest_batch import T0, TOPICS, _as_stored, metric, msg, real_samples, values


def _scrape_msgs(samples: list[GpuSample], first_offset: int = 0) -> list:
    return [msg(encode(r), first_offset + i) for i, r in enumerate(gpu_scrapes(samples))]


def _mixed_samples() -> list[GpuSample]:
    """Real samples, plus GPUs without a UUID, MIG instances, invalid fields and attributes
    that need escaping, in runs of one host."""
    out = list(real_samples())
    n = len(out)
    for i in range(6):
        out.append(
            GpuSample(
                ts=T0 + 500 + (i // 3),
                host="edge-h",
                gpu_uuid=None if i % 2 else f"GPU-{i}",
                gpu_index=i,
                gpu_instance_id=i if i == 4 else None,
                gpu_instance_profile="1g.10gb" if i == 4 else None,
                fields={
                    "DCGM_FI_DEV_GPU_UTIL": i * 10,
                    "DCGM_FI_DEV_FB_USED": 2**70 if i == 5 else 100 + i,
                    "DCGM_FI_DEV_POWER_USAGE": 1e21,
                },
                invalid={"DCGM_FI_DEV_GPU_TEMP": "sentinel"} if i == 2 else {},
                attributes={"pod": 'a\u00e9\n"},{b'} if i == 1 else {},
                seq=n + i,
                target="t",
            )  # fmt: skip
        )
    return out


def _rows(table: object) -> list[dict[str, object]]:
    return table.to_pylist()  # type: ignore[attr-defined, no-any-return]


def _outcome(build: Callable[..., object], *args: object) -> object:
    """The rows ``build(*args)`` makes (JSON columns parsed), or the type of its error."""
    try:
        return _parsed(_rows(build(*args)))
    except Exception as exc:  # noqa: BLE001 — the error is the result compared
        return type(exc).__name__


def _parsed(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """``rows`` with their JSON columns parsed (a record's maps are stored as it spelled them)."""
    return [
        {k: json.loads(v) if k in ("fields", "invalid", "attributes") else v for k, v in r.items()}
        for r in rows
    ]


def test_scrape_rows_equal_the_per_sample_rows_of_the_same_samples() -> None:
    samples = _mixed_samples()
    msgs = _scrape_msgs(samples)
    assert len(msgs) < len(samples)  # GPUs of one read share a record
    got = decode_batch(msgs, TOPICS)
    assert not got.rejected and not got.gpu and got.fallbacks == 0
    scrapes = got.scrapes
    assert len(scrapes) == len(samples) and scrapes.msgs == msgs
    table = gpu_scrapes_table(scrapes, [m.partition for m in msgs], [m.offset for m in msgs])
    per_gpu = [m.offset for m, n in zip(msgs, scrapes.counts, strict=True) for _ in range(n)]
    assert _rows(table) == _rows(gpu_samples_table(samples, [0] * len(samples), per_gpu))
    assert [values(s) for s in scrapes.samples(GpuRecord)] == [values(s) for s in samples]


def test_resolved_uuids_replace_the_records_own() -> None:
    samples = [GpuSample(ts=T0, host="h", gpu_index=i, seq=i) for i in range(2)]
    got = decode_batch(_scrape_msgs(samples), TOPICS).scrapes
    table = gpu_scrapes_table(got, [0], [0], gpu_uuid=["GPU-learned", "gpu1"])
    assert table.column("gpu_uuid").to_pylist() == ["GPU-learned", "gpu1"]
    assert table.column("gpu_key").to_pylist() == ["h/GPU-learned", "h/gpu1"]
    with pytest.raises(ValueError, match="gpu_uuid"):
        gpu_scrapes_table(got, [0], [0], gpu_uuid=["only-one"])
    with pytest.raises(ValueError, match="differ in length"):
        gpu_scrapes_table(got, [0, 0], [0, 1])


def _record(**changes: object) -> dict[str, object]:
    base = json.loads(encode(gpu_scrapes([GpuSample(ts=T0 + i, host="h", gpu_uuid=f"GPU-{i}", gpu_index=i,
                                                     fields={"DCGM_FI_DEV_GPU_UTIL": i}, seq=7 + i)
                                           for i in range(3)])[0]))  # fmt: skip
    gpus = dict(base["gpus"])
    for k, v in changes.items():
        if k.startswith("gpus."):
            gpus[k[5:]] = v
        else:
            base[k] = v
    return {**base, "gpus": changes.get("gpus", gpus)}


@pytest.mark.parametrize(
    "record",
    [
        _record(**{"gpus.gpu_index": ["0", 1, 2]}),  # a lax spelling pydantic accepts
        _record(**{"gpus.fields": [{"DCGM_FI_DEV_GPU_UTIL": "1"}, {}, {}]}),
        _record(seq="7"),
    ],
)
def test_a_record_the_fast_path_refuses_gets_the_references_samples(record: dict[str, object]) -> None:
    value = json.dumps(record).encode()
    ref = decode_telemetry(msg(value), TOPICS)
    assert isinstance(ref, GpuScrape)
    got = decode_batch([msg(value)], TOPICS)
    assert got.fallbacks == 1 and not got.rejected and not got.scrapes.msgs
    assert [values(s) for s in got.gpu] == [values(s) for s in ref.samples()]
    assert [s.seq for s in got.gpu] == [7, 8, 9]


@pytest.mark.parametrize(
    ("record", "kept"),
    [
        (_record(**{"gpus.fields": [{"DCGM_FI_DEV_GPU_UTIL": 1}, {"x": "bad"}, {}]}), [0, 2]),
        (_record(**{"gpus.gpu_uuid": ["GPU-0", None, "GPU-2"], "gpus.gpu_index": [0, None, 2]}), [0, 2]),
        (_record(**{"gpus.ts": [T0, "never", float("inf")]}), [0]),
        (_record(**{"gpus.ts": [T0, 1e300, T0]}), [0, 2]),  # finite, but past the years 1-9999
        (_record(**{"gpus.attributes": [{}, {}, {"pod": 1}]}), [0, 1]),
    ],
)
def test_a_bad_gpu_inside_a_scrape_record_is_rejected_alone(
    record: dict[str, object], kept: list[int]
) -> None:
    value = json.dumps(record).encode()
    good = json.dumps(_record()).encode()
    got = decode_batch([msg(good, 0), msg(value, 1), msg(good, 2)], TOPICS)
    assert [m.offset for m in got.scrapes.msgs] == [0, 2]  # the good records stay in columns
    assert [(m.offset, e.reason) for m, e in got.rejected] == [(1, "invalid_sample")] * (3 - len(kept))
    assert all(e.detail.startswith("GPU ") for _, e in got.rejected)
    assert [(m.offset, s.seq) for s, m in zip(got.gpu, got.gpu_msgs, strict=True)] == [
        (1, 7 + i) for i in kept
    ]


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        (_record(host=5), "invalid_record"),  # the envelope: the whole record
        (_record(extra=1), "invalid_record"),
        (_record(**{"gpus.extra": [1, 2, 3]}), "invalid_record"),
        (_record(**{"gpus.gpu_index": [0, 1]}), "invalid_record"),  # a column of another length
        (_record(**{"gpus.ts": []}), "invalid_record"),
        (_record(**{"gpus.fields": {"x": [1]}}), "invalid_record"),
        (_record(gpus=[1]), "invalid_record"),
        (_record(schema_version=2), "unsupported_version"),
    ],
)
def test_a_scrape_record_that_cannot_be_split_is_rejected_whole(
    record: dict[str, object], reason: str
) -> None:
    value = json.dumps(record).encode()
    if reason == "invalid_record":
        assert salvage_scrape(msg(value)) is None
    got = decode_batch([msg(value)], TOPICS)
    assert [e.reason for _, e in got.rejected] == [reason] and not got.gpu and not got.scrapes.msgs


def test_a_column_of_n_or_no_elements_is_the_boundary() -> None:
    ok = json.dumps(_record(**{"gpus.gpu_instance_id": []})).encode()
    assert len(decode_batch([msg(ok)], TOPICS).scrapes) == 3
    for n in (2, 4):
        bad = json.dumps(_record(**{"gpus.gpu_instance_id": [None] * n})).encode()
        assert [e.reason for _, e in decode_batch([msg(bad)], TOPICS).rejected] == ["invalid_record"]


def test_per_sample_and_scrape_records_in_one_batch() -> None:
    samples = _mixed_samples()[:10]
    scrapes = gpu_scrapes(samples[5:])
    msgs = [msg(encode(s), i) for i, s in enumerate(samples[:3])]
    msgs += [msg(encode(r), 3 + i) for i, r in enumerate(scrapes)]
    msgs += [msg(encode(s), 3 + len(scrapes) + i) for i, s in enumerate(samples[3:5])]
    got = decode_batch(msgs, TOPICS)
    assert [values(s) for s in got.gpu] == [values(s) for s in samples[:5]]
    assert [values(s) for s in got.scrapes.samples(GpuRecord)] == [values(s) for s in samples[5:]]


async def test_scrape_records_through_the_service_exactly_once() -> None:
    bus = MemoryBus()
    svc = AnalyticsService(bus=bus, topics=TOPICS, db_path=":memory:", clock=lambda: T0 + 100)
    await svc.start()
    try:
        producer = bus.producer()
        samples = _mixed_samples()
        legacy = samples[:2]
        records = gpu_scrapes(samples[2:])
        for s in legacy:
            await producer.send(TOPICS.telemetry_gpu, encode(s), key=s.partition_key)
        bad = _record(**{"gpus.fields": [{"DCGM_FI_DEV_GPU_UTIL": 1}, {"x": "bad"}, {}]}, host="h-bad")
        await producer.send(TOPICS.telemetry_gpu, json.dumps(bad).encode(), key="h")
        for r in records:
            await producer.send(TOPICS.telemetry_gpu, encode(r), key=r.partition_key)
        total = len(legacy) + 1 + len(records)
        assert await svc.step(timeout_s=0.01) == total
        assert metric(svc, "gpupool_analytics_rejected_records_total", reason="invalid_sample") == 1
        assert svc.store.stored_offsets() == {TopicPartition(TOPICS.telemetry_gpu, 0): total}
        _, [(n, offsets)] = svc.store.sql("SELECT count(*), count(DISTINCT kafka_offset) FROM gpu_samples")
        assert (n, offsets) == (len(samples) + 2, total)  # every GPU once; the bad record's 2 good GPUs
        assert svc.rows_ingested() == n
        _, stored = svc.store.sql(
            "SELECT * EXCLUDE (kafka_partition, kafka_offset) FROM gpu_samples WHERE host <> 'h-bad'"
        )
        resolved = [
            s if s.gpu_uuid else s.model_copy(update={"gpu_uuid": f"gpu{s.gpu_index}"}) for s in samples
        ]
        ref = gpu_samples_table(resolved, [0] * len(samples), list(range(len(samples))))
        assert sorted(stored, key=str) == sorted((tuple(r.values()) for r in _as_stored(svc, ref)), key=str)
        assert set(svc.current_states()) >= {s.key for s in resolved}  # the classifier saw every GPU
        await producer.send(TOPICS.telemetry_gpu, encode(records[0]), key=records[0].partition_key)
        assert await svc.step(timeout_s=0.01) == 1  # a new offset: stored again, as any record
        _, [(n2,)] = svc.store.sql("SELECT count(*) FROM gpu_samples")
        assert n2 == n + len(records[0])
    finally:
        await svc.stop()


def _scrape_mutations() -> list[bytes]:
    base = _record()
    out = []
    for col in ("ts", "gpu_uuid", "gpu_index", "gpu_instance_id", "gpu_instance_profile", "model_name",
                "fields", "field_series", "invalid", "attributes"):  # fmt: skip
        for v in (None, True, 1, 1.5, "1", "", {}, {"a": 1}, {"a": "b"}, {"a": [{"labels": {}, "value": 1}]},
                  {"a": None}, 2**64, float("nan"), [], [1]):  # fmt: skip
            for where in (0, 2):
                column = list(base["gpus"][col]) or [None] * 3  # type: ignore[index]
                column[where] = v
                out.append(json.dumps(_record(**{f"gpus.{col}": column}), allow_nan=True).encode())
    for k in ("host", "source", "target", "seq", "schema_version"):
        for v in (None, 1, "x", "nvml", 2**64, -1, 1.0):
            out.append(json.dumps(_record(**{k: v})).encode())
    return out


def test_what_the_fast_path_accepts_the_reference_accepts_with_the_same_samples() -> None:
    accepted = 0
    for value in _scrape_mutations():
        got = decode_batch([msg(value)], TOPICS)
        if not got.scrapes.msgs:
            continue
        accepted += 1
        ref = decode_telemetry(msg(value), TOPICS)
        assert isinstance(ref, GpuScrape), value
        assert [values(s) for s in got.scrapes.samples(GpuRecord)] == [values(s) for s in ref.samples()], (
            value
        )
        n = len(ref)
        rows = _outcome(gpu_scrapes_table, got.scrapes, [0], [0])
        ref_rows = _outcome(gpu_samples_table, ref.samples(), [0] * n, [0] * n)
        assert rows == ref_rows, value  # the JSON columns as sent, with the same values
    assert accepted > 20  # the mutations that stay valid went the fast way


@pytest.mark.parametrize("part", [1, 3, 4, 1000])
def test_parts_of_a_batch_give_the_same_columns(part: int) -> None:
    samples = _mixed_samples()
    msgs = _scrape_msgs(samples)
    bad = json.dumps(_record(**{"gpus.fields": [{"DCGM_FI_DEV_GPU_UTIL": 1}, {"x": "bad"}, {}]})).encode()
    msgs.insert(3, msg(bad, 99))
    whole = decode_batch(msgs, TOPICS)
    assert [(m.offset, e.reason) for m, e in whole.rejected] == [(99, "invalid_sample")]
    assert whole.scrapes.msgs == [m for m in msgs if m.offset != 99]
    assert [values(s) for s in whole.scrapes.samples(GpuRecord)] == [values(s) for s in samples]
    rows = []
    for i in range(0, len(msgs), part):
        got = decode_batch(msgs[i : i + part], TOPICS)
        offsets = [m.offset for m in got.scrapes.msgs]
        if offsets:
            rows += _rows(gpu_scrapes_table(got.scrapes, [0] * len(offsets), offsets))
    offsets = [m.offset for m in whole.scrapes.msgs]
    assert rows == _rows(gpu_scrapes_table(whole.scrapes, [0] * len(offsets), offsets))
