"""One OpenTelemetry trace from a scrape to a lease (:mod:`runtime.tracing`).

* unit: W3C ``traceparent`` round trips through Kafka headers and MQTT 5 user properties; with
  tracing off nothing is added and nothing is parsed; a broken ``traceparent`` is tolerated;
  OTLP/HTTP export reaches a collector (a loopback HTTP server decoding the protobuf request);
* pipeline (no external service): a dcgm-exporter page from ../shared/data → collectors →
  MemoryBus → analytics → MemoryBus → broker over in-process amqtt (MQTT 3.1.1): the scrape, the
  analytics process span, the broker's capacity process span and the offer's publish span form
  one parent chain in one trace;
* integration (real Mosquitto, MQTT 5): the same pipeline, then an edge site claims the offer;
  the ``traceparent`` user properties carry the trace on to the site's claim and the broker's
  lease grant.

Spans are read from an ``InMemorySpanExporter`` installed with :func:`runtime.tracing.use_provider`.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from analytics.classify import IdleConfig
from analytics.predict import PredictorConfig
from analytics.service import AnalyticsService
from broker.config import BrokerConfig
from broker.edge import EdgeClient
from broker.service import BrokerService
from collectors.service import CollectorService
from contracts import KafkaTopics, MqttTopics
from contracts.bus import MemoryBus
from runtime import tracing
from tests.mqtt_support import until
from tests.test_broker_service import _Amqtt, _free_port

SAMPLE = (
    Path(__file__).resolve().parents[1]
    / ".."
    / "shared"
    / "data"
    / "cases"
    / "dcgm_exporter_samples"
    / "synthesized_current_template_4x.prom"
)
SAMPLE_HOST = "gpu-node-001"  # GPU 0 of that page is idle (GR engine 0, FB 0), GPU 1 busy
TOPICS = KafkaTopics(prefix="trace.")
T = TypeVar("T")


# --- fixtures -----------------------------------------------------------------------------------
@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on for this test: an SDK provider whose spans end up in the returned exporter."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    try:
        yield exporter
    finally:
        tracing.use_provider(None)
        provider.shutdown()


@pytest.fixture
def no_tracing() -> Iterator[None]:
    """Tracing off (the default), whatever an earlier test left."""
    tracing.use_provider(None)
    yield


@contextlib.asynccontextmanager
async def _exporter_page(host: str) -> AsyncIterator[str]:
    """A loopback HTTP server serving the real dcgm-exporter page with its host renamed to
    ``host``; yields its /metrics URL."""
    body = SAMPLE.read_text().replace(SAMPLE_HOST, host)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=body, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    port = _free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}/metrics"
    finally:
        await runner.cleanup()


@pytest.fixture
async def amqtt_port() -> AsyncIterator[int]:
    """An in-process amqtt server (MQTT 3.1.1) on a free loopback port."""
    server = _Amqtt(_free_port())
    await server.start()
    try:
        yield server.port
    finally:
        await server.stop()


# --- unit ---------------------------------------------------------------------------------------
def test_kafka_headers_and_mqtt_properties_round_trip(spans: InMemorySpanExporter) -> None:
    tr = tracing.tracer("test")
    with tr.start_as_current_span("producer") as span:
        headers = tracing.inject_headers()
        props = tracing.mqtt_user_properties()
    sc = span.get_span_context()
    assert [name for name, _ in headers] == ["traceparent"]
    assert headers[0][1] == f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}".encode()
    assert props == [(name, value.decode()) for name, value in headers]
    for ctx in (tracing.extract_context(headers), tracing.extract_mqtt_context(props)):
        with tr.start_as_current_span("consumer", context=ctx) as child:
            pass
        assert child.get_span_context().trace_id == sc.trace_id
        assert child.parent is not None and child.parent.span_id == sc.span_id  # type: ignore[attr-defined]
    # a span passed explicitly wins over the current one; tracestate travels along
    with tr.start_as_current_span("other"):
        assert tracing.inject_headers(span) == headers
    carried = [*headers, ("tracestate", b"vendor=abc"), ("gpupool-redelivery", b"1")]
    ctx = tracing.extract_context(carried)
    assert ctx is not None
    remote = tracing.link(ctx)[0].context
    assert remote.trace_id == sc.trace_id and remote.trace_state.get("vendor") == "abc"


@pytest.mark.parametrize(
    "value",
    [
        b"",
        b"garbage",
        b"00-00000000000000000000000000000000-b7ad6b7169203331-01",  # all-zero trace id
        b"00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # all-zero span id
        b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",  # no flags
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\u00e9".encode(),  # not ASCII
        b"\xff\xfe",
    ],
)
def test_a_broken_traceparent_is_ignored(spans: InMemorySpanExporter, value: bytes) -> None:
    assert tracing.extract_context([("traceparent", value)]) is None
    assert tracing.extract_mqtt_context([("traceparent", value.decode(errors="replace"))]) is None
    # a consumer span then simply starts a trace of its own
    with tracing.tracer("test").start_as_current_span("consumer", context=None) as span:
        assert span.get_span_context().is_valid


def test_off_by_default_adds_and_parses_nothing(no_tracing: None) -> None:
    valid = [("traceparent", b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")]
    assert not tracing.enabled()
    with tracing.tracer("test").start_as_current_span("noop") as span:
        assert not span.is_recording()
        assert tracing.inject_headers() == [] and tracing.mqtt_user_properties() == []
    assert tracing.extract_context(valid) is None
    assert tracing.extract_mqtt_context([("traceparent", valid[0][1].decode())]) is None
    assert tracing.setup_tracing("gpupool-test", None) is None and not tracing.enabled()


def test_setup_tracing_rejects_a_bad_endpoint_and_honours_sdk_disabled(
    no_tracing: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for bad in ("collector:4318", "ftp://x", "http://"):
        with pytest.raises(ValueError, match="OTLP endpoint"):
            tracing.setup_tracing("gpupool-test", bad)
    assert not tracing.enabled()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.setup_tracing("gpupool-test", "http://127.0.0.1:4318") is None
    assert not tracing.enabled()


async def test_otlp_http_export_reaches_a_collector(no_tracing: None) -> None:
    """A loopback OTLP/HTTP receiver gets the span, protobuf-encoded, with the resource."""
    received: list[ExportTraceServiceRequest] = []
    paths: list[str] = []

    async def traces(request: web.Request) -> web.Response:
        paths.append(request.path)
        assert request.content_type == "application/x-protobuf"
        received.append(ExportTraceServiceRequest.FromString(await request.read()))
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        provider = tracing.setup_tracing("gpupool-test", f"http://127.0.0.1:{port}")
        assert provider is not None and tracing.enabled()
        with tracing.tracer("test").start_as_current_span(
            "send telemetry.gpu",
            kind=SpanKind.PRODUCER,
            attributes=tracing.messaging_attributes(tracing.KAFKA, "send", "telemetry.gpu", batch_count=3),
        ):
            pass
        # the batch processor exports from its own thread (blocking HTTP): not on this loop
        assert await asyncio.to_thread(provider.force_flush, 10_000)
        tracing.shutdown_tracing()
    finally:
        tracing.use_provider(None)
        await runner.cleanup()
    assert paths == ["/v1/traces"]
    (rs,) = [rs for req in received for rs in req.resource_spans]
    resource = {a.key: a.value.string_value for a in rs.resource.attributes}
    assert resource["service.name"] == "gpupool-test" and resource["service.namespace"] == "gpupool"
    (span,) = [s for ss in rs.scope_spans for s in ss.spans]
    attrs = {a.key: a.value for a in span.attributes}
    assert span.name == "send telemetry.gpu"
    assert attrs["messaging.system"].string_value == "kafka"
    assert attrs["messaging.batch.message_count"].int_value == 3


async def test_tracing_off_pipeline_records_carry_no_headers(no_tracing: None) -> None:
    bus = MemoryBus()
    async with _exporter_page(f"off-{uuid.uuid4().hex[:6]}") as url:
        collector = _collector(bus, url)
        analytics = _analytics(bus)
        await collector.start()
        await analytics.start()
        try:
            for _ in range(2):
                await collector.collect_once()
                await analytics.step(timeout_s=0.05)
        finally:
            await collector.stop()
            await analytics.stop()
    gpu, caps = bus.records(TOPICS.telemetry_gpu), bus.records(TOPICS.capacity)
    assert gpu and caps
    assert all(m.headers == () for m in [*gpu, *caps])


# --- pipeline ------------------------------------------------------------------------------------
def _collector(bus: MemoryBus, url: str) -> CollectorService:
    return CollectorService(bus=bus, topics=TOPICS, dcgm_targets=[url], sysfs_roots=[], timeout_s=2.0)


def _analytics(bus: MemoryBus) -> AnalyticsService:
    return AnalyticsService(
        bus=bus,
        topics=TOPICS,
        db_path=":memory:",
        idle=IdleConfig(min_idle_s=0.0),
        predictor=PredictorConfig(default_remaining_s=600.0),
        publish_interval_s=0.05,
    )


def _attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def _by_name(spans: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in spans.get_finished_spans() if s.name == name]


def _parent_of(child: ReadableSpan, spans: InMemorySpanExporter) -> ReadableSpan:
    assert child.parent is not None, f"{child.name} has no parent"
    found = [s for s in spans.get_finished_spans() if s.context.span_id == child.parent.span_id]
    assert len(found) == 1, f"parent of {child.name} not exported"
    assert found[0].context.trace_id == child.context.trace_id
    return found[0]


def _chain(leaf: ReadableSpan, spans: InMemorySpanExporter) -> list[ReadableSpan]:
    """``leaf`` and its ancestors, root first."""
    out = [leaf]
    while out[-1].parent is not None:
        out.append(_parent_of(out[-1], spans))
    return out[::-1]


@contextlib.asynccontextmanager
async def _pipeline(
    bus: MemoryBus, url: str, broker: BrokerService, spans: InMemorySpanExporter, offers_template: str
) -> AsyncIterator[ReadableSpan]:
    """Run collectors → analytics → the started ``broker`` until the broker published an offer
    span; yield that span (stages keep running until exit)."""
    collector, analytics = _collector(bus, url), _analytics(bus)
    await collector.start()
    await analytics.start()
    stop = asyncio.Event()
    run = asyncio.create_task(broker.run(stop))

    async def feed() -> None:
        while True:
            await collector.collect_once()
            await analytics.step(timeout_s=0.05)
            await asyncio.sleep(0.05)

    feeder = asyncio.create_task(feed())
    try:
        yield await until(lambda: next(iter(_by_name(spans, f"publish {offers_template}")), None), 10)
    finally:
        feeder.cancel()
        await asyncio.gather(feeder, return_exceptions=True)
        stop.set()
        await run
        await broker.stop()
        await collector.stop()
        await analytics.stop()


def _assert_kafka_chain(offer_span: ReadableSpan, spans: InMemorySpanExporter, host: str) -> None:
    chain = _chain(offer_span, spans)
    assert [(s.name, s.kind) for s in chain] == [
        ("scrape dcgm-exporter", SpanKind.CLIENT),
        (f"send {TOPICS.telemetry_gpu}", SpanKind.PRODUCER),
        (f"process {TOPICS.telemetry_gpu}", SpanKind.CONSUMER),
        (f"send {TOPICS.capacity}", SpanKind.PRODUCER),
        (f"process {TOPICS.capacity}", SpanKind.CONSUMER),
        (offer_span.name, SpanKind.PRODUCER),
    ]
    assert len({s.context.trace_id for s in chain}) == 1
    scrape, send_gpu, process_gpu, send_cap, process_cap, offer = chain
    a = _attrs
    assert a(scrape)["url.full"].endswith("/metrics") and a(scrape)["http.response.status_code"] == 200
    assert a(send_gpu)["messaging.system"] == "kafka" and a(send_gpu)["messaging.operation.type"] == "send"
    assert a(send_gpu)["messaging.destination.name"] == TOPICS.telemetry_gpu
    assert a(send_gpu)["messaging.batch.message_count"] == 1  # the page's GPUs in one GpuScrape record
    gpu = a(process_gpu)
    assert gpu["messaging.operation.type"] == "process" and gpu["messaging.consumer.group.name"]
    assert gpu["hw.type"] == "gpu" and gpu["hw.id"].startswith("GPU-") and gpu["host.name"] == host
    assert gpu["hw.model"] == "NVIDIA H100 80GB HBM3" and gpu["gpupool.gpu.state"] == "idle"
    assert gpu["messaging.kafka.message.key"] == a(send_cap)["messaging.kafka.message.key"]
    assert a(send_cap)["messaging.destination.name"] == TOPICS.capacity
    cap = a(process_cap)
    assert cap["messaging.kafka.message.key"] == gpu["messaging.kafka.message.key"]
    assert cap["messaging.destination.name"] == TOPICS.capacity and "messaging.kafka.offset" in cap
    o = a(offer)
    assert o["messaging.system"] == "mqtt" and o["messaging.operation.name"] == "publish"
    assert o["messaging.destination.name"].endswith(f"/offers/{o['messaging.message.id']}")
    assert o["host.name"] == host and gpu["messaging.kafka.message.key"] in o["gpupool.offer.gpus"]


async def test_one_trace_from_scrape_to_offer_over_kafka_headers(
    spans: InMemorySpanExporter, amqtt_port: int
) -> None:
    bus, host = MemoryBus(), f"trace-{uuid.uuid4().hex[:6]}"
    broker = BrokerService(
        bus=bus, topics=TOPICS, mqtt_host="127.0.0.1", mqtt_port=amqtt_port, protocol=4,
        config=BrokerConfig(tick_s=0.05, reconnect_min_s=0.05),
    )
    await broker.start()
    async with (
        _exporter_page(host) as url,
        _pipeline(bus, url, broker, spans, MqttTopics().offer("{offer_id}")) as offer,
    ):
        _assert_kafka_chain(offer, spans, host)
    # the context crossed the bus in the record headers
    traced = [m for m in bus.records(TOPICS.telemetry_gpu) if m.headers]
    assert traced and all(dict(m.headers)["traceparent"].startswith(b"00-") for m in traced)
    assert any(m.headers for m in bus.records(TOPICS.capacity))


async def test_one_trace_from_scrape_to_lease_over_mqtt5_user_properties(
    spans: InMemorySpanExporter, mosquitto: dict[str, Any]
) -> None:
    bus, run_id = MemoryBus(), uuid.uuid4().hex[:6]
    host = f"trace-{run_id}"
    root = mosquitto.get("root", "gpupool/v1")
    mt = MqttTopics(root)
    broker = BrokerService(
        bus=bus, topics=TOPICS, mqtt_host=mosquitto["host"], mqtt_port=mosquitto["port"],
        mqtt_username="gpupool-broker", mqtt_password=mosquitto["users"]["gpupool-broker"], root=root,
        protocol=5, config=BrokerConfig(tick_s=0.05, reconnect_min_s=0.05),
        client_id=f"gpupool-broker-trace-{run_id}",
    )
    await broker.start()
    site = EdgeClient(
        site="edge-a", host=mosquitto["host"], port=mosquitto["port"], username="edge-a",
        password=mosquitto["users"]["edge-a"], root=root, protocol=5, persistent=False, announce=False,
    )
    async with (
        _exporter_page(host) as url,
        _pipeline(bus, url, broker, spans, mt.offer("{offer_id}")) as offer,
        site,
    ):
        _assert_kafka_chain(offer, spans, host)
        offer_id = str(_attrs(offer)["messaging.message.id"])
        await until(lambda: offer_id in site.known_offers, 10)
        lease = await site.claim(offer_id, count=1, duration_seconds=60)
        grant = await until(lambda: next(iter(_by_name(spans, "grant lease")), None), 10)

    chain = _chain(grant, spans)
    names = [s.name for s in chain]
    assert names[: len(_chain(offer, spans))] == [s.name for s in _chain(offer, spans)]
    claim, process_claim, granted = chain[-3:]
    assert chain[-4].context.span_id == offer.context.span_id
    assert (claim.name, claim.kind) == ("claim", SpanKind.CLIENT)
    assert (process_claim.name, process_claim.kind) == (f"process {mt.claims('{site}')}", SpanKind.CONSUMER)
    assert granted.name == "grant lease" and len({s.context.trace_id for s in chain}) == 1
    c, p, g = (_attrs(s) for s in (claim, process_claim, granted))
    assert c["gpupool.offer.id"] == offer_id and c["gpupool.lease.id"] == lease.lease_id
    assert c["messaging.destination.name"] == mt.claims("edge-a")
    assert p["messaging.message.id"] == c["messaging.message.id"]
    assert p["messaging.destination.template"] == mt.claims("{site}")
    assert g["gpupool.lease.id"] == lease.lease_id and list(g["gpupool.lease.gpus"]) == lease.gpus
    # the lease-log record of the grant carries the grant's context on Kafka
    logged = [m for m in bus.records(TOPICS.leases_log) if m.key == lease.lease_id and m.headers]
    assert logged and tracing.link(tracing.extract_context(logged[0].headers))[0].context.trace_id == (
        granted.context.trace_id
    )
