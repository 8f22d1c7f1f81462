"""contracts.GpuScrape: one read of a host's GPUs in columns — grouping samples into records and
back gives the same samples, columns hold n elements or none, every GPU is identified, and a
``telemetry.gpu`` record of either kind decodes to its samples."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from contracts import GpuColumns, GpuSample, GpuScrape, decode, decode_gpu_samples, encode, gpu_scrapes


def _samples() -> list[GpuSample]:
    return [
        GpuSample(ts=10.0, host="a", gpu_uuid="GPU-0", gpu_index=0, fields={"X": 1}, seq=5),
        GpuSample(
            ts=10.5,
            host="a",
            gpu_index=1,
            gpu_instance_id=3,
            gpu_instance_profile="1g.10gb",
            invalid={"Y": "sentinel"},
            attributes={"pod": "p"},
            seq=6,
        ),  # fmt: skip
        GpuSample(ts=11.0, host="a", gpu_uuid="GPU-2", gpu_index=2, seq=8),  # a gap in seq: new record
        GpuSample(ts=11.0, host="b", gpu_uuid="GPU-3", gpu_index=0, seq=9),  # another host: new record
        GpuSample(ts=11.0, host="b", gpu_uuid="GPU-4", gpu_index=1, seq=10, target="t"),  # another target
        GpuSample(ts=11.0, host="b", gpu_uuid="GPU-5", gpu_index=2, seq=11, target="t", source="nvml"),
    ]


def test_samples_grouped_and_expanded_are_the_same_samples() -> None:
    samples = _samples()
    records = gpu_scrapes(samples)
    assert [(r.host, r.target, r.source, r.seq, len(r)) for r in records] == [
        ("a", "", "dcgm-exporter", 5, 2), ("a", "", "dcgm-exporter", 8, 1), ("b", "", "dcgm-exporter", 9, 1),
        ("b", "t", "dcgm-exporter", 10, 1), ("b", "t", "nvml", 11, 1),
    ]  # fmt: skip
    assert [s for r in records for s in r.samples()] == samples
    for r in records:
        assert decode(GpuScrape, encode(r)) == r
        assert r.partition_key == r.host
    first = records[0].gpus
    assert first.gpu_uuid == ["GPU-0", None] and first.gpu_instance_id == [None, 3]
    assert records[1].gpus.gpu_instance_id == [] and records[1].gpus.fields == []  # defaults: left empty
    assert gpu_scrapes([]) == []


def test_columns_hold_n_elements_or_none() -> None:
    GpuColumns(ts=[1.0, 2.0], gpu_index=[0, 1], model_name=[])
    for bad in ([None], [None, None, None]):
        with pytest.raises(ValidationError, match="model_name has"):
            GpuColumns(ts=[1.0, 2.0], gpu_index=[0, 1], model_name=bad)
    with pytest.raises(ValidationError, match="at least one GPU"):
        GpuColumns(ts=[])


def test_every_gpu_needs_its_uuid_or_its_index() -> None:
    GpuColumns(ts=[1.0, 1.0], gpu_uuid=["GPU-0", None], gpu_index=[None, 1])
    with pytest.raises(ValidationError, match="GPU 1 needs"):
        GpuColumns(ts=[1.0, 1.0], gpu_uuid=["GPU-0", ""], gpu_index=[None, None])
    with pytest.raises(ValidationError, match="GPU 0 needs"):
        GpuColumns(ts=[1.0])


def test_a_telemetry_gpu_record_of_either_kind_decodes_to_its_samples() -> None:
    samples = _samples()
    [record, *_] = gpu_scrapes(samples)
    assert decode_gpu_samples(encode(record)) == samples[:2]
    assert decode_gpu_samples(encode(samples[0])) == samples[:1]
    with pytest.raises(ValueError):
        decode_gpu_samples(b'{"host": "a", "gpus": {"ts": []}}')
    with pytest.raises(ValueError):
        decode_gpu_samples(json.dumps({**json.loads(encode(record)), "schema_version": 2}))
    with pytest.raises(ValueError):
        decode_gpu_samples(b"not json")
