"""The idle classifier fed from scrape records' columns (:meth:`ScrapeColumns.observations`)
decides exactly what it decides from the whole samples: the same statuses after every batch and
the same idle runs, on random fleets (GPUs with and without profiling fields, MIG instances,
invalid and out-of-range values, extra fields, gaps). And the service, which feeds the classifier
observations, still stores a scrape record's rows GPU by GPU when they cannot be built whole."""

from __future__ import annotations

import gc

from hypothesis import given, settings
from hypothesis import strategies as st

from analytics.classify import (
    FB_FREE,
    FB_RESERVED,
    FB_TOTAL,
    FB_USED,
    GPU_UTIL,
    GR_ENGINE_ACTIVE,
    SM_ACTIVE,
    IdleClassifier,
    IdleConfig,
    READ_FIELDS,
    field_readings,
)
from analytics.identity import with_uuid
from analytics.decode import decode_batch
from analytics.service import AnalyticsService
from contracts import GpuSample, encode, gpu_scrapes
from contracts.bus import MemoryBus, TopicPartition
from tests.test_analytics_ingest_batch import T0, TOPICS, metric, msg

_VALUES = {
    GR_ENGINE_ACTIVE: st.sampled_from([0.0, 0.01, 0.05, 0.07, 0.1, 0.5, 1.0, 1.0005, 1.5, -0.1]),
    SM_ACTIVE: st.sampled_from([0.0, 0.04, 0.06, 0.2, 1.0, 2.0]),
    GPU_UTIL: st.sampled_from([0, 3, 5, 10, 49, 50, 100, 101, -1]),
    FB_USED: st.sampled_from([0, 100, 512, 513, 40_000, -5]),
    FB_FREE: st.sampled_from([0, 1000, 80_000]),
    FB_TOTAL: st.sampled_from([0, 81_559]),
    FB_RESERVED: st.sampled_from([0, 500]),
    "DCGM_FI_DEV_POWER_USAGE": st.floats(0, 700),
    "DCGM_FI_DEV_GPU_TEMP": st.integers(0, 100),
}
_REASONS = st.sampled_from(["sentinel", "out_of_range", "not_a_number", ""])

_fields = st.dictionaries(st.sampled_from(sorted(_VALUES)), st.just(0)).flatmap(
    lambda keys: st.fixed_dictionaries({k: _VALUES[k] for k in keys})
)
_invalid = st.dictionaries(st.sampled_from(sorted(_VALUES)), _REASONS, max_size=2)
# per step: for each of 4 GPUs on one host whether it is read, its maps, and the time step
_gpu_read = st.tuples(st.booleans(), _fields, _invalid)
_steps = st.lists(st.tuples(st.sampled_from([5.0, 10.0, 10.0, 45.0]), st.lists(_gpu_read, min_size=4, max_size=4)),
                  min_size=1, max_size=25)  # fmt: skip


def _fleet(steps: list[tuple[float, list[tuple[bool, dict[str, float | int], dict[str, str]]]]]) -> list[list[GpuSample]]:
    """One scrape (list of samples, one host) per step: GPU 3 is a MIG instance of GPU 2."""
    out = []
    ts, seq = 1_700_000_000.0, 0
    for dt, reads in steps:
        ts += dt
        batch = []
        for g, (read, fields, invalid) in enumerate(reads):
            if not read:
                continue
            batch.append(
                GpuSample(
                    ts=ts, host="h", gpu_uuid=f"GPU-{min(g, 2)}", gpu_index=min(g, 2),
                    gpu_instance_id=1 if g == 3 else None, model_name="NVIDIA H100 80GB HBM3",
                    fields=fields, invalid={k: v for k, v in invalid.items() if k not in fields}, seq=seq,
                )  # fmt: skip
            )
            seq += 1
        out.append(batch)
    return out


@settings(max_examples=150, deadline=None)
@given(_steps, st.sampled_from([IdleConfig(), IdleConfig(min_idle_s=0.0, stale_after_s=12.0, prof_forget_s=20.0)]))
def test_observations_classify_as_the_whole_samples(steps: list, config: IdleConfig) -> None:
    whole, columns = IdleClassifier(config), IdleClassifier(config)
    offset = 0
    for scrape in _fleet(steps):
        if not scrape:
            continue
        msgs = [msg(encode(r), offset + i) for i, r in enumerate(gpu_scrapes(scrape))]
        offset += len(msgs)
        decoded = decode_batch(msgs, TOPICS)
        assert not decoded.rejected and not decoded.gpu  # every record the columnar way
        observed = decoded.scrapes.observations()
        assert [o.key for o in observed] == [s.key for s in scrape]
        for sample, seen in zip(scrape, observed, strict=True):
            assert columns.observe(seen) == whole.observe(sample)
        assert columns.statuses() == whole.statuses()
    assert columns.drain_runs() == whole.drain_runs()
    assert columns.tick(2e9) == whole.tick(2e9)


def test_observations_are_the_gpus_of_the_records() -> None:
    sample = GpuSample(
        ts=1.0, host="h", gpu_uuid="GPU-0", gpu_index=0, fields={GPU_UTIL: 5, "DCGM_FI_DEV_GPU_TEMP": 40},
        invalid={SM_ACTIVE: "sentinel"}, attributes={"pod": "p"}, seq=3,
    )  # fmt: skip
    other = GpuSample(ts=2.0, host="h", gpu_uuid=None, gpu_index=1, gpu_instance_id=2, fields={FB_USED: 7}, seq=4)
    scrapes = decode_batch([msg(encode(r), 0) for r in gpu_scrapes([sample, other])], TOPICS).scrapes
    first, second = scrapes.observations()
    assert (first.ts, first.host, first.gpu_uuid, first.gpu_index, first.gpu_instance_id, first.key) == (
        1.0, "h", "GPU-0", 0, None, "h/GPU-0"
    )  # fmt: skip
    # the entries the classifier reads (READ_FIELDS), not the GPU temperature
    assert (first.fields, first.invalid, first.model_name) == ({GPU_UTIL: 5}, {SM_ACTIVE: "sentinel"}, None)
    assert (second.fields, second.invalid, second.key) == ({FB_USED: 7}, {}, "h/gpu1/2")
    # one tuple per GPU: the READ_FIELDS values, then their reasons (classify.FieldReadings)
    n = len(READ_FIELDS)
    assert first.readings[READ_FIELDS.index(GPU_UTIL)] == 5 and first.readings[n + READ_FIELDS.index(SM_ACTIVE)] == "sentinel"
    assert sum(v is not None for v in first.readings) == 2 and len(first.readings) == 2 * n
    assert first.readings == field_readings(sample) and second.readings == field_readings(other)
    assert field_readings(first) is first  # read in place: the readings come first
    assert not gc.is_tracked(first)  # numbers and strings only: no work for the collector
    assert with_uuid(second, "GPU-x").key == "h/GPU-x/2" and with_uuid(second, "GPU-x")[:14] == second[:14]


async def test_scrape_rows_with_a_seq_past_int64_are_stored_as_samples_are() -> None:
    """A record whose GPU ``i`` has ``seq + i`` past int64 is stored as its per-sample records
    would be: the value that does not fit is NULL, a GPU without a UUID is stored under the id the
    stage resolved for it, and the classifier saw every GPU."""
    bus = MemoryBus()
    svc = AnalyticsService(bus=bus, topics=TOPICS, db_path=":memory:", clock=lambda: T0 + 100)
    await svc.start()
    try:
        first = 2**63 - 2
        samples = [
            GpuSample(ts=T0, host="h", gpu_uuid="GPU-0", gpu_index=0, fields={GPU_UTIL: 5}, seq=first),
            GpuSample(ts=T0, host="h", gpu_index=1, fields={GPU_UTIL: 7}, seq=first + 1),
            GpuSample(ts=T0, host="h", gpu_uuid="GPU-2", gpu_index=2, seq=first + 2),
        ]
        [record] = gpu_scrapes(samples)
        await bus.producer().send(TOPICS.telemetry_gpu, encode(record), key=record.partition_key)
        assert await svc.step(timeout_s=0.01) == 1
        _, rows = svc.store.sql("SELECT gpu_key, gpu_uuid, gpu_util, seq FROM gpu_samples ORDER BY gpu_index")
        assert rows == [
            ("h/GPU-0", "GPU-0", 5.0, first), ("h/gpu1", "gpu1", 7.0, first + 1), ("h/GPU-2", "GPU-2", None, None),
        ]  # fmt: skip
        assert metric(svc, "gpupool_analytics_rejected_records_total", reason="unstorable") == 0
        assert svc.store.stored_offsets() == {TopicPartition(TOPICS.telemetry_gpu, 0): 1}
        assert set(svc.current_states()) == {"h/GPU-0", "h/gpu1", "h/GPU-2"}
    finally:
        await svc.stop()
