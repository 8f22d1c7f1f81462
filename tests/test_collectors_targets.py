"""Targets from a static list and Prometheus file_sd JSON: parsing (internal labels honoured, bad
targets dropped by reason), hot reload (a bad file keeps its previous targets), and the collector
service scraping each target at its own interval and deadline with its labels carried through."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from collectors.service import CollectorService
from collectors.targets import FileSdError, Target, TargetSet, parse_duration, parse_file_sd
from contracts import KafkaTopics, decode_gpu_samples
from contracts.bus import MemoryBus
from tests.fake_exporters import FakeExporters

TOPICS = KafkaTopics(prefix="sd.")


def _metric(ts: TargetSet, name: str, **labels: str) -> float:
    """A sample of the registry ``ts`` counts on (0 if absent)."""
    return ts.metrics.registry.get_sample_value(name, labels) or 0.0


def _write(path: Path, doc: object) -> None:
    """Replace ``path`` atomically (as a discovery agent should) with a new mtime."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    os.replace(tmp, path)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # never the same mtime twice


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("15s", 15.0),
        ("500ms", 0.5),
        ("1m30s", 90.0),
        ("2h", 7200.0),
        ("1d", 86400.0),
        ("1w", 604800.0),
        ("1y", 365 * 86400.0),
        ("0", 0.0),
        ("1h1m1s1ms", 3661.001),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "15", "1.5s", "s", "1s1m", "-1s", "10 s", "1S"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_file_sd_groups_labels_and_internal_labels() -> None:
    doc = [
        {"targets": ["gpu-node-1:9400", "10.0.0.7:9400"], "labels": {"cluster": "a", "rack": "r1"}},
        {
            "targets": ["[fd00::1]:9400"],
            "labels": {
                "__scheme__": "https",
                "__metrics_path__": "dcgm/metrics",
                "__param_format": "text",
                "__scrape_interval__": "10s",
                "__scrape_timeout__": "3s",
                "__meta_datacenter": "dc1",
                "pool": "train",
            },
        },
        {"targets": ["gpu-node-2:9400"], "labels": {"__scrape_interval__": "1s"}},
        {"labels": {"orphan": "group"}},  # no targets: nothing
    ]
    targets, dropped = parse_file_sd(
        json.dumps(doc), source="sd.json", default_interval_s=5, default_timeout_s=2
    )
    assert dropped == []
    assert targets == [
        Target("http://gpu-node-1:9400/metrics", (("cluster", "a"), ("rack", "r1")), 5.0, 2.0, "sd.json"),
        Target("http://10.0.0.7:9400/metrics", (("cluster", "a"), ("rack", "r1")), 5.0, 2.0, "sd.json"),
        Target("https://[fd00::1]:9400/dcgm/metrics?format=text", (("pool", "train"),), 10.0, 3.0, "sd.json"),
        Target("http://gpu-node-2:9400/metrics", (), 1.0, 1.0, "sd.json"),  # timeout capped at interval
    ]
    assert targets[0].attributes == {"target_cluster": "a", "target_rack": "r1"}


def test_file_sd_drops_bad_targets_alone() -> None:
    doc = [
        {"targets": ["ok:9400", "bad/path:9400", "", "host:99999", "sp ace:1"]},
        {"targets": ["ftp-target:21"], "labels": {"__scheme__": "ftp"}},
        {"targets": ["slow:9400"], "labels": {"__scrape_interval__": "5x"}},
        {"targets": ["zero:9400"], "labels": {"__scrape_interval__": "0"}},
        {"targets": ["late:9400"], "labels": {"__scrape_interval__": "1s", "__scrape_timeout__": "2s"}},
    ]
    targets, dropped = parse_file_sd(json.dumps(doc))
    assert [t.url for t in targets] == ["http://ok:9400/metrics"]
    assert sorted(e.reason for e in dropped) == [
        "bad_address",
        "bad_address",
        "bad_address",
        "bad_address",
        "bad_duration",
        "bad_duration",
        "bad_scheme",
        "timeout_exceeds_interval",
    ]


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("{not json", "bad_json"),
        ('{"targets": ["a:1"]}', "bad_shape"),
        ('[["a:1"]]', "bad_shape"),
        ('[{"targets": "a:1"}]', "bad_shape"),
        ('[{"targets": [1]}]', "bad_shape"),
        ('[{"targets": ["a:1"], "labels": ["x"]}]', "bad_shape"),
        ('[{"targets": ["a:1"], "labels": {"1abc": "x"}}]', "bad_label_name"),
        ('[{"targets": ["a:1"], "labels": {"a-b": "x"}}]', "bad_label_name"),
        ('[{"targets": ["a:1"], "labels": {"n": 3}}]', "bad_label_value"),
    ],
)
def test_file_sd_refuses_whole_file(text: str, reason: str) -> None:
    with pytest.raises(FileSdError) as info:
        parse_file_sd(text)
    assert info.value.reason == reason


def test_target_set_hot_reload_keeps_previous_on_a_bad_file(tmp_path: Path) -> None:
    now = [0.0]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    _write(a, [{"targets": ["n1:9400"], "labels": {"cluster": "x"}}])
    ts = TargetSet(["http://static:9400/metrics"], [tmp_path / "*.json"], refresh_s=10, clock=lambda: now[0])
    assert [t.url for t in ts.targets] == ["http://static:9400/metrics", "http://n1:9400/metrics"]
    assert ts.get("http://n1:9400/metrics") is not None

    _write(b, [{"targets": ["n2:9400", "static:9400"]}])  # a new file matching the glob
    assert ts.maybe_refresh() is False  # refresh_s not elapsed yet
    now[0] = 10.0
    assert ts.maybe_refresh() is True
    # static:9400 is listed twice: scraped once, the static listing wins
    assert [(t.url, t.source) for t in ts.targets] == [
        ("http://static:9400/metrics", "static"),
        ("http://n1:9400/metrics", str(a)),
        ("http://n2:9400/metrics", str(b)),
    ]

    errors = _metric(ts, "gpupool_collector_file_sd_errors_total", reason="bad_json")
    _write(a, '[{"targets": ["n1:9400"], ')  # a half-written file
    assert ts.refresh() is False
    assert "http://n1:9400/metrics" in [t.url for t in ts.targets]  # previous targets kept
    assert _metric(ts, "gpupool_collector_file_sd_errors_total", reason="bad_json") == errors + 1
    assert ts.refresh() is False  # unchanged since: not read (nor counted) again
    assert _metric(ts, "gpupool_collector_file_sd_errors_total", reason="bad_json") == errors + 1

    version = ts.version
    _write(a, [{"targets": ["n3:9400"], "labels": {"__scrape_interval__": "30s"}}])
    assert ts.refresh() is True and ts.version == version + 1
    assert ts.get("http://n3:9400/metrics") == Target("http://n3:9400/metrics", (), 30.0, 2.0, str(a))
    assert ts.get("http://n1:9400/metrics") is None

    b.unlink()  # a file that disappears takes its targets with it
    assert ts.refresh() is True
    assert [t.url for t in ts.targets] == ["http://static:9400/metrics", "http://n3:9400/metrics"]
    assert _metric(ts, "gpupool_collector_targets", source="file_sd") == 1


def test_target_set_refuses_yaml_and_ignores_missing(tmp_path: Path) -> None:
    y = tmp_path / "t.yml"
    y.write_text("- targets: ['n1:9400']\n")
    ts = TargetSet([], [y, tmp_path / "missing.json"])
    assert ts.targets == []
    assert _metric(ts, "gpupool_collector_file_sd_errors_total", reason="unsupported_format") == 1




async def test_service_carries_labels_and_uses_each_target_deadline(
    exporters: FakeExporters, tmp_path: Path
) -> None:
    host = exporters.base.removeprefix("http://")
    sd = tmp_path / "dcgm.json"
    _write(
        sd,
        [
            {
                "targets": [host],
                "labels": {"__metrics_path__": "/ok/5", "cluster": "a", "pod": "from-target"},
            },
            {"targets": [host], "labels": {"__metrics_path__": "/slow", "__scrape_timeout__": "200ms"}},
        ],
    )
    bus = MemoryBus()
    svc = CollectorService(
        bus=bus,
        topics=TOPICS,
        dcgm_targets=[exporters.url("/ok/6")],
        sysfs_roots=[],
        interval_s=5.0,
        timeout_s=3.0,
        file_sd=[sd],
    )
    await svc.start()
    try:
        t0 = time.monotonic()
        stats = await svc.collect_once()
        elapsed = time.monotonic() - t0
    finally:
        await svc.stop()
    assert stats.targets == 3 and stats.failures == {"timeout": 1}
    assert elapsed < 2.0  # /slow hit its own 200 ms deadline, not the service's 3 s
    samples = [s for m in bus.records(TOPICS.telemetry_gpu) if m.value for s in decode_gpu_samples(m.value)]
    by_host = {s.host: s for s in samples}
    labelled = by_host["gpu-node-5"]
    assert labelled.attributes["target_cluster"] == "a" and labelled.attributes["target_pod"] == "from-target"
    assert "target_cluster" not in by_host["gpu-node-6"].attributes  # a static target has no labels
    workload = {k: v for k, v in labelled.attributes.items() if not k.startswith("target_")}
    assert workload == {k: v for k, v in by_host["gpu-node-6"].attributes.items()}  # exporter labels kept


async def test_run_scrapes_each_target_at_its_interval_and_reloads(
    exporters: FakeExporters, tmp_path: Path
) -> None:
    host = exporters.base.removeprefix("http://")
    sd = tmp_path / "dcgm.json"
    _write(sd, [{"targets": [host], "labels": {"__metrics_path__": "/ok/1", "__scrape_interval__": "100ms"}}])
    svc = CollectorService(
        bus=MemoryBus(),
        topics=TOPICS,
        dcgm_targets=[exporters.url("/ok/2")],
        sysfs_roots=[],
        interval_s=0.6,
        timeout_s=0.5,
        file_sd=[sd],
        file_sd_refresh_s=0.1,
    )
    stop = asyncio.Event()
    await svc.start()
    task = asyncio.create_task(svc.run(stop))
    try:
        await asyncio.sleep(1.0)
        fast, slow = exporters.hits.get("/ok/1", 0), exporters.hits.get("/ok/2", 0)
        assert 5 <= fast <= 12 and 1 <= slow <= 2 and fast >= 3 * slow  # 100 ms vs 600 ms
        # hot reload: the file now lists another target at the service's interval
        _write(sd, [{"targets": [host], "labels": {"__metrics_path__": "/ok/3"}}])
        await asyncio.sleep(1.0)
        assert exporters.hits.get("/ok/3", 0) >= 1
        after = exporters.hits.get("/ok/1", 0)
        await asyncio.sleep(0.4)
        assert exporters.hits.get("/ok/1", 0) == after  # its loop ended with it
    finally:
        stop.set()
        await asyncio.wait_for(task, 3)
        await svc.stop()


def test_cli_counts_file_sd_as_a_source(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from collectors.cli import app

    sd = tmp_path / "dcgm.json"
    _write(sd, [{"targets": ["127.0.0.1:9"]}])
    runner = CliRunner()
    # A file_sd file alone is something to collect: the command gets as far as Kafka (unreachable).
    res = runner.invoke(app, ["run", "--kafka", "127.0.0.1:1", "--metrics-port", "0", "--file-sd", str(sd)])
    assert res.exit_code == 1, res.output
    res = runner.invoke(app, ["run", "--kafka", "127.0.0.1:1", "--metrics-port", "0"])
    assert res.exit_code == 2 and "--file-sd" in res.output


FORGET_S = 60.0


def _series(svc: CollectorService, target: str) -> dict[str, float | None]:
    reg = svc.registry
    return {
        "success": reg.get_sample_value("gpupool_collector_scrapes_total", {"target": target, "result": "success"}),
        "failure": reg.get_sample_value("gpupool_collector_scrapes_total", {"target": target, "result": "failure"}),
        "http_500": reg.get_sample_value(
            "gpupool_collector_scrape_errors_total", {"target": target, "reason": "http_500"}
        ),
    }


def _sd_service(exporters: FakeExporters, tmp_path: Path, paths: list[str]) -> tuple[CollectorService, Path, str]:
    """A collector whose only targets are ``paths`` of ``exporters``, from one file_sd file."""
    host = exporters.base.removeprefix("http://")
    sd = tmp_path / "dcgm.json"
    _write(sd, [{"targets": [host], "labels": {"__metrics_path__": p}} for p in paths])
    svc = CollectorService(bus=MemoryBus(), topics=TOPICS, dcgm_targets=[], sysfs_roots=[], file_sd=[sd],
                           forget_after_s=FORGET_S)  # fmt: skip
    return svc, sd, host


@pytest.mark.parametrize("gone_for", [FORGET_S - 0.5, FORGET_S])
async def test_a_target_removed_for_forget_after_s_loses_its_series(
    exporters: FakeExporters, tmp_path: Path, gone_for: float
) -> None:
    """A file_sd target that left the file ``forget_after_s`` ago (or more) has no series any more;
    one that left just under that ago keeps them, and a target still configured is never touched."""
    svc, sd, host = _sd_service(exporters, tmp_path, ["/500", "/ok/7"])
    bad, good = exporters.url("/500"), exporters.url("/ok/7")
    await svc.start()
    try:
        await svc.collect_once()
        await svc.collect_once()
        assert _series(svc, bad)["failure"] == 2 and _series(svc, bad)["http_500"] == 2
        assert _series(svc, good)["success"] == 2
        assert svc.forget_removed_targets(1000.0) == []  # every target still configured
        _write(sd, [{"targets": [host], "labels": {"__metrics_path__": "/ok/7"}}])
        assert svc.targets.refresh()
        assert svc.forget_removed_targets(1000.0) == []  # gone from now on
        forgotten = svc.forget_removed_targets(1000.0 + gone_for)
        if gone_for < FORGET_S:
            assert forgotten == [] and _series(svc, bad)["http_500"] == 2
        else:
            assert forgotten == [bad]
            assert _series(svc, bad) == {"success": None, "failure": None, "http_500": None}
        assert _series(svc, good)["success"] == 2  # the configured target keeps its series
        assert svc.forget_removed_targets(1e9) == ([bad] if gone_for < FORGET_S else [])
    finally:
        await svc.stop()


async def test_a_target_back_before_forget_after_s_keeps_counting(
    exporters: FakeExporters, tmp_path: Path
) -> None:
    svc, sd, host = _sd_service(exporters, tmp_path, ["/ok/8"])
    doc = [{"targets": [host], "labels": {"__metrics_path__": "/ok/8"}}]
    url = exporters.url("/ok/8")
    await svc.start()
    try:
        await svc.collect_once()
        _write(sd, [])
        svc.targets.refresh()
        svc.forget_removed_targets(0.0)
        _write(sd, doc)  # back (a rolling rewrite of the file) before it was forgotten
        svc.targets.refresh()
        assert svc.forget_removed_targets(FORGET_S * 10) == []
        await svc.collect_once()
        assert _series(svc, url)["success"] == 2
    finally:
        await svc.stop()
