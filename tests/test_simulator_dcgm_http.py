"""simulator.dcgm_http: dcgm-exporter's real text format, served over HTTP, with injected faults."""

from __future__ import annotations

import asyncio
import gzip
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator.dcgm_fields import FIELDS
from simulator.dcgm_http import FleetServer, render_metrics
from simulator.fleet import Fleet
from simulator.trace import Trace
from tests.support import T0

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


@pytest.fixture
def fleet(trace: Trace) -> Fleet:
    return Fleet(trace, nodes=2, gpus_per_node=8, seed=11, t0=T0, clock=lambda: T0 + 42.5)


def _csv_fields(name: str) -> dict[str, tuple[str, str]]:
    """``field → (type, help)`` of a dcgm-exporter counters CSV; a commented-out line counts only
    for a field that has no active line."""
    out: dict[str, tuple[str, str]] = {}
    lines = (DATA / "telemetry" / "dcgm_exporter" / name).read_text().splitlines()
    for commented in (False, True):
        for line in lines:
            if line.startswith("#") is not commented:
                continue
            parts = [p.strip() for p in line.lstrip("# ").split(",", 2)]
            if len(parts) == 3 and parts[0].startswith("DCGM_"):
                out.setdefault(parts[0], (parts[1], parts[2]))
    return out


def _label_names(line: str) -> list[str]:
    return re.findall(r'(?:\{|,)([A-Za-z_][A-Za-z0-9_]*)="', line)


def test_help_and_type_are_the_exporters_own(fleet: Fleet) -> None:
    csv_fields = _csv_fields("default-counters.csv")
    text = render_metrics(fleet, "gpu-node-001")
    helps = dict(re.findall(r"^# HELP (\S+) (.*)$", text, re.M))
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    assert list(helps) == [f.name for f in FIELDS] == list(types)
    assert [f.field_id for f in FIELDS] == sorted(f.field_id for f in FIELDS)
    for name in helps:
        assert (types[name], helps[name]) == csv_fields[name], name
    # and every non-commented field of default-counters.csv (labels aside) is served
    active = {
        parts[0].strip()
        for line in (DATA / "telemetry" / "dcgm_exporter" / "default-counters.csv").read_text().splitlines()
        if line.startswith("DCGM_") and (parts := line.split(","))[1].strip() != "label"
    }
    assert len(active) == 25
    assert active <= set(helps), active - set(helps)


def test_output_parses_and_matches_the_fleet(fleet: Fleet) -> None:
    at = T0 + 42.5
    text = render_metrics(fleet, "gpu-node-002", at)
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    assert len(fams) == len(FIELDS)
    gpus = {g.uuid: g for g in fleet.gpus("gpu-node-002")}
    for field in FIELDS:
        fam_name = field.name.removesuffix("_total") if field.prom_type == "counter" else field.name
        fam = fams[fam_name]
        assert fam.type == field.prom_type
        assert len(fam.samples) == 8
        for s in fam.samples:
            g = gpus[s.labels["UUID"]]
            assert s.labels["gpu"] == str(g.index)
            assert s.labels["Hostname"] == "gpu-node-002"
            assert s.labels["modelName"] == "NVIDIA H100 80GB HBM3"
            assert s.labels["DCGM_FI_DRIVER_VERSION"] == "570.86.15"
            want = fleet.fields("gpu-node-002", g.index, at)[field.name]
            assert s.value == pytest.approx(want, abs=5e-7)
    util = fams["DCGM_FI_DEV_GPU_UTIL"].samples
    assert {s.labels["UUID"]: s.value > 0 for s in util} == {
        u: fleet.is_busy_at(g.key, at) for u, g in gpus.items()}


def test_label_order_and_number_format_follow_the_exporter(fleet: Fleet) -> None:
    text = render_metrics(fleet, "gpu-node-001", hostname_label="hostname")
    kinds = {f.name: f.kind for f in FIELDS}
    sample = (DATA / "cases" / "dcgm_exporter_samples" / "synthesized_current_template_4x.prom").read_text()
    ref_xid = next(ln for ln in sample.splitlines() if ln.startswith("DCGM_FI_DEV_XID_ERRORS{gpu=\"0\""))
    ref_util = next(ln for ln in sample.splitlines() if ln.startswith("DCGM_FI_DEV_GPU_UTIL{gpu=\"0\""))
    series = [ln for ln in text.splitlines() if not ln.startswith("#")]
    assert len(series) == len(FIELDS) * 8
    for line in series:
        name = line.split("{", 1)[0]
        ref = ref_xid if name == "DCGM_FI_DEV_XID_ERRORS" else ref_util
        assert _label_names(line) == _label_names(ref), line
        value = line.rsplit(" ", 1)[1]
        if kinds[name] == "float":
            assert re.fullmatch(r"\d+\.\d{6}", value), line
        else:
            assert re.fullmatch(r"\d+", value), line
    xid = next(ln for ln in series if ln.startswith("DCGM_FI_DEV_XID_ERRORS"))
    assert xid.endswith(',DCGM_FI_DRIVER_VERSION="570.86.15",err_code="0",err_msg="No Error"} 0')
    assert text.endswith("\n") and "\n\n" not in text
    default = render_metrics(fleet, "gpu-node-001")
    assert ',Hostname="gpu-node-001",' in default and "hostname=" not in default


def test_bad_render_arguments(fleet: Fleet) -> None:
    with pytest.raises(KeyError):
        render_metrics(fleet, "gpu-node-404")
    with pytest.raises(ValueError):
        render_metrics(fleet, "gpu-node-001", hostname_label="host")


async def test_server_serves_one_endpoint_per_node(fleet: Fleet) -> None:
    async with FleetServer(fleet) as server:
        urls = server.urls()
        assert set(urls) == set(fleet.hosts())
        assert len({server.port(h) for h in urls}) == 2
        async with httpx.AsyncClient(timeout=5.0) as client:
            for host, url in urls.items():
                assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics")
                r = await client.get(url)
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
                assert r.text == render_metrics(fleet, host)
                assert (await client.get(url.replace("/metrics", "/health"))).status_code == 200
    assert server.urls() == {}


async def test_fault_modes_fail_only_their_node(fleet: Fleet) -> None:
    bad, good = fleet.hosts()
    async with FleetServer(fleet) as server:
        urls = server.urls()
        async with httpx.AsyncClient(timeout=1.0) as client:
            async def good_still_ok() -> None:
                r = await client.get(urls[good])
                assert r.status_code == 200 and list(text_string_to_metric_families(r.text))

            server.fail_mode[bad] = "http500"
            assert (await client.get(urls[bad])).status_code == 500
            await good_still_ok()

            server.fail_mode[bad] = "truncate"
            r = await client.get(urls[bad])
            assert r.status_code == 200 and not r.text.endswith("\n")
            assert render_metrics(fleet, bad).startswith(r.text)
            with pytest.raises(ValueError):
                list(text_string_to_metric_families(r.text))
            await good_still_ok()

            server.fail_mode[bad] = "disconnect"
            with pytest.raises(httpx.RemoteProtocolError):
                await client.get(urls[bad])
            await good_still_ok()

            server.fail_mode[bad] = "garbage"
            r = await client.get(urls[bad])
            assert r.status_code == 200
            with pytest.raises(UnicodeDecodeError):
                r.content.decode("utf-8")
            assert gzip.decompress(r.content).decode() == render_metrics(fleet, bad)
            await good_still_ok()

            server.fail_mode[bad] = "hang"
            with pytest.raises(httpx.ReadTimeout):
                await client.get(urls[bad], timeout=0.3)
            await good_still_ok()

            server.fail_mode[bad] = None
            assert (await client.get(urls[bad])).status_code == 200

            with pytest.raises(KeyError):
                server.fail_mode["gpu-node-404"] = "http500"
            with pytest.raises(ValueError):
                server.fail_mode[bad] = "explode"  # type: ignore[assignment]


async def test_stop_answers_hanging_requests(fleet: Fleet) -> None:
    server = FleetServer(fleet)
    await server.start()
    host = fleet.hosts()[0]
    server.fail_mode[host] = "hang"
    async with httpx.AsyncClient(timeout=5.0) as client:
        pending = asyncio.create_task(client.get(server.urls()[host]))
        await asyncio.sleep(0.2)
        assert not pending.done()
        await server.stop()
        r = await asyncio.wait_for(pending, 3.0)
        assert r.status_code == 503
    await server.stop()  # idempotent
