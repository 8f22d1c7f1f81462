"""OpenTelemetry tracing shared by every stage: one trace from a scrape to a lease.

The trace context crosses each hop in the W3C Trace Context format (``traceparent`` and
``tracestate``, https://www.w3.org/TR/trace-context/):

* Kafka: record headers ``(name, bytes)`` (:func:`inject_headers` / :func:`extract_context`);
* MQTT 5: user properties ``(name, str)`` (:func:`mqtt_user_properties` /
  :func:`extract_mqtt_context`); MQTT 3.1.1 has no properties, so the trace ends there.

Off by default: until :func:`setup_tracing` (or :func:`use_provider`) installs an SDK
``TracerProvider``, every span of a :func:`tracer` is the API's invalid (non-recording) span, made
without touching the context, the inject helpers return nothing (no header or property is added)
and the extract helpers return ``None`` without parsing — the stages' hot loops pay one boolean
test (about 3 µs per scraped target in all). gpupool keeps its own provider slot
instead of the API's process-global one (which can be set only once), so a test can swap
providers.

Span attributes follow the OpenTelemetry semantic conventions (messaging spans, semconv 1.3x:
``messaging.system``, ``messaging.operation.type`` = ``send``/``receive``/``process``,
``messaging.operation.name``, ``messaging.destination.name``, ``messaging.destination.template``,
``messaging.kafka.message.key``...; hardware: ``hw.id``, ``hw.type``, ``hw.model``). Span names are
``{messaging.operation.name} {destination or its template}``, e.g. ``send telemetry.gpu``,
``process capacity``, ``publish gpupool/v1/offers/{offer_id}``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

__all__ = [
    "KAFKA",
    "MQTT",
    "SpanKind",
    "TRACEPARENT",
    "TRACESTATE",
    "enabled",
    "extract_context",
    "extract_mqtt_context",
    "inject_headers",
    "link",
    "mark_error",
    "messaging_attributes",
    "mqtt_user_properties",
    "setup_tracing",
    "shutdown_tracing",
    "tracer",
    "use_provider",
]

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
"""W3C Trace Context header carrying version, trace id, parent span id and flags."""
TRACESTATE = "tracestate"
"""W3C Trace Context header carrying vendor-specific trace state."""
KAFKA = "kafka"
"""``messaging.system`` of Kafka hops (semconv well-known value)."""
MQTT = "mqtt"
"""``messaging.system`` of MQTT hops (no well-known value in semconv: the protocol's name)."""

_PROPAGATOR = TraceContextTextMapPropagator()
_FIELDS = (TRACEPARENT, TRACESTATE)


@dataclass(slots=True)
class _Slot:
    """The installed provider; ``generation`` grows at each swap so cached tracers refresh."""

    provider: trace.TracerProvider
    enabled: bool = False
    generation: int = 0


_SLOT = _Slot(trace.NoOpTracerProvider())


_OFF = contextlib.nullcontext(trace.INVALID_SPAN)
"""What a span context manager is while tracing is off: no span, no context switch."""


class _Tracer(trace.Tracer):
    """A tracer that follows :func:`use_provider`: each call goes to the current provider's tracer
    of the same instrumentation scope (cached until the provider changes). While tracing is off
    it returns the invalid span without touching the context (the API's no-op tracer would still
    attach and detach a context per span)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._generation = -1
        self._delegate: trace.Tracer = trace.NoOpTracer()

    def _current(self) -> trace.Tracer:
        if self._generation != _SLOT.generation:
            self._delegate = _SLOT.provider.get_tracer(self._name)
            self._generation = _SLOT.generation
        return self._delegate

    def start_span(self, *args: Any, **kwargs: Any) -> trace.Span:
        """Start a span on the current provider (same arguments as ``Tracer.start_span``)."""
        if not _SLOT.enabled:
            return trace.INVALID_SPAN
        return self._current().start_span(*args, **kwargs)

    def start_as_current_span(self, *args: Any, **kwargs: Any) -> Any:
        """Context manager of a span made current (same arguments as
        ``Tracer.start_as_current_span``; use it in a ``with`` statement, not as a decorator)."""
        if not _SLOT.enabled:
            return _OFF
        return self._current().start_as_current_span(*args, **kwargs)


def tracer(name: str) -> trace.Tracer:
    """The tracer of instrumentation scope ``name`` (a module's ``__name__``). Safe to create at
    import time: it follows whatever provider :func:`setup_tracing` installs later (no-op
    until then)."""
    return _Tracer(name)


def enabled() -> bool:
    """True when an SDK provider is installed (spans are recorded and context is propagated)."""
    return _SLOT.enabled


def use_provider(provider: trace.TracerProvider | None) -> None:
    """Install ``provider`` for every :func:`tracer` (``None``: back to the no-op tracer). The
    provider that was installed is not shut down (see :func:`shutdown_tracing`). Tests install
    a provider with an in-memory exporter this way."""
    _SLOT.provider = provider if provider is not None else trace.NoOpTracerProvider()
    _SLOT.enabled = provider is not None and not isinstance(provider, trace.NoOpTracerProvider)
    _SLOT.generation += 1


def _current_context_carrier(ctx: Context | trace.Span | None) -> dict[str, str]:
    if isinstance(ctx, trace.Span):
        ctx = trace.set_span_in_context(ctx)
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


def inject_headers(ctx: Context | trace.Span | None = None) -> list[tuple[str, bytes]]:
    """Kafka record headers carrying ``ctx`` (a span, or a context; default: the current span):
    ``[("traceparent", b"00-<trace id>-<span id>-<flags>")]`` plus ``tracestate`` if any.
    Empty when tracing is off or there is no valid span."""
    if not _SLOT.enabled:
        return []
    return [(k, v.encode("ascii")) for k, v in _current_context_carrier(ctx).items()]


def mqtt_user_properties(ctx: Context | trace.Span | None = None) -> list[tuple[str, str]]:
    """MQTT 5 user properties carrying ``ctx`` (a span, or a context; default: the current span):
    ``[("traceparent", "00-...")]`` plus ``tracestate`` if any. Empty when tracing is off or
    there is no valid span."""
    if not _SLOT.enabled:
        return []
    return list(_current_context_carrier(ctx).items())


def _extract(carrier: Mapping[str, str]) -> Context | None:
    if TRACEPARENT not in carrier:
        return None
    ctx = _PROPAGATOR.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def extract_context(headers: Iterable[tuple[str, bytes]] | None) -> Context | None:
    """The remote parent carried by Kafka ``headers`` (``(name, bytes)`` pairs, e.g.
    :attr:`contracts.bus.BusMessage.headers`), or ``None`` when tracing is off or no valid
    ``traceparent`` is there (missing, malformed, not ASCII, all-zero ids: never raises)."""
    if not _SLOT.enabled or not headers:
        return None
    carrier: dict[str, str] = {}
    for name, value in headers:
        if name in _FIELDS:
            try:
                carrier[name] = bytes(value).decode("ascii")
            except (UnicodeDecodeError, TypeError):
                return None
    return _extract(carrier)


def extract_mqtt_context(user_properties: Iterable[tuple[str, str]] | None) -> Context | None:
    """The remote parent carried by MQTT 5 ``user_properties`` (``(name, value)`` pairs, e.g.
    paho's ``Properties.UserProperty``), or ``None`` when tracing is off or there is no valid
    ``traceparent`` (never raises)."""
    if not _SLOT.enabled or not user_properties:
        return None
    carrier: dict[str, str] = {}
    for prop in user_properties:
        if isinstance(prop, tuple | list) and len(prop) == 2 and prop[0] in _FIELDS:
            carrier[str(prop[0])] = str(prop[1])
    return _extract(carrier)


def link(ctx: Context | None) -> list[trace.Link]:
    """A one-element list of a span link to the span of ``ctx``, or ``[]`` if ``ctx`` is
    ``None`` or holds no valid span (for ``start_span(links=...)``)."""
    if ctx is None:
        return []
    sc = trace.get_current_span(ctx).get_span_context()
    return [trace.Link(sc)] if sc.is_valid else []


def mark_error(span: trace.Span, error_type: str, description: str = "") -> None:
    """Mark ``span`` failed: semconv ``error.type`` = ``error_type`` (a low-cardinality reason such
    as ``timeout`` or ``http_500``) and status ``ERROR`` with ``description``. No-op on a
    non-recording span."""
    if span.is_recording():
        span.set_attribute("error.type", error_type)
        span.set_status(Status(StatusCode.ERROR, description or error_type))


def messaging_attributes(
    system: str,
    operation_type: str,
    destination: str,
    *,
    operation_name: str | None = None,
    template: str | None = None,
    key: str | None = None,
    message_id: str | None = None,
    client_id: str | None = None,
    consumer_group: str | None = None,
    partition: int | None = None,
    offset: int | None = None,
    batch_count: int | None = None,
) -> dict[str, AttributeValue]:
    """Semantic-convention attributes of a messaging span (semconv "messaging spans" and its
    Kafka page): ``messaging.system`` (:data:`KAFKA`, :data:`MQTT`), ``messaging.operation.type``
    (``send``, ``receive``, ``process``), ``messaging.operation.name`` (default: the type),
    ``messaging.destination.name`` and, where given, ``messaging.destination.template``,
    ``messaging.kafka.message.key`` (Kafka only), ``messaging.message.id``,
    ``messaging.client.id``, ``messaging.consumer.group.name``,
    ``messaging.destination.partition.id``, ``messaging.kafka.offset``,
    ``messaging.batch.message_count``."""
    attrs: dict[str, AttributeValue] = {
        "messaging.system": system,
        "messaging.operation.type": operation_type,
        "messaging.operation.name": operation_name or operation_type,
        "messaging.destination.name": destination,
    }
    optional: dict[str, AttributeValue | None] = {
        "messaging.destination.template": template,
        "messaging.kafka.message.key": key if system == KAFKA else None,
        "messaging.message.id": message_id,
        "messaging.client.id": client_id,
        "messaging.consumer.group.name": consumer_group,
        "messaging.destination.partition.id": str(partition) if partition is not None else None,
        "messaging.kafka.offset": offset if system == KAFKA else None,
        "messaging.batch.message_count": batch_count,
    }
    attrs.update({k: v for k, v in optional.items() if v is not None})
    return attrs


def mqtt_publish_attributes(
    topic: str, *, template: str, message_id: str, client_id: str
) -> dict[str, AttributeValue]:
    """Attributes of the span of one MQTT publish (:func:`messaging_attributes` with ``send`` /
    ``publish``): ``topic`` the MQTT topic, ``template`` it with its variable level in braces
    (``gpupool/v1/sites/{site}/claims``), ``message_id`` the record's id (offer or claim id),
    ``client_id`` the MQTT client id."""
    return messaging_attributes(
        MQTT,
        "send",
        topic,
        operation_name="publish",
        template=template,
        message_id=message_id,
        client_id=client_id,
    )


def _traces_url(endpoint: str) -> str:
    """``endpoint`` as an OTLP/HTTP traces URL: a base URL (``http://collector:4318``, as in
    ``OTEL_EXPORTER_OTLP_ENDPOINT``) gets ``/v1/traces`` appended; a URL already ending in
    ``/v1/traces`` is kept. Raises ``ValueError`` for anything but an http(s) URL."""
    url = endpoint.strip()
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1].strip("/")) == 0:
        raise ValueError(f"OTLP endpoint must be an http:// or https:// URL, not {endpoint!r}")
    url = url.rstrip("/")
    return url if url.endswith("/v1/traces") else f"{url}/v1/traces"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gpupool")
    except PackageNotFoundError:
        return "unknown"


def setup_tracing(
    service_name: str,
    otlp_endpoint: str | None = None,
    *,
    console: bool = False,
    otlp_headers: Mapping[str, str] | None = None,
    exporters: Sequence[Any] = (),
) -> TracerProvider | None:
    """Install an SDK tracer provider when tracing is configured; otherwise leave it off.

    Args:
        service_name: ``service.name`` of the resource (e.g. ``gpupool-collector``);
            ``service.namespace`` is ``gpupool``.
        otlp_endpoint: OTLP/HTTP (protobuf) collector URL, base (``http://host:4318``) or full
            (``.../v1/traces``); spans are batched and exported off the event loop.
        console: also write each span as JSON to stderr (``ConsoleSpanExporter``).
        otlp_headers: extra HTTP headers for the OTLP exporter (e.g. an auth token).
        exporters: more span exporters (tests pass an ``InMemorySpanExporter``), each behind a
            ``SimpleSpanProcessor``.

    Returns the installed provider, or ``None`` when nothing is configured or
    ``OTEL_SDK_DISABLED=true``. Sampling follows the SDK's ``OTEL_TRACES_SAMPLER`` /
    ``OTEL_TRACES_SAMPLER_ARG`` (default: parent-based, always on). Raises ``ValueError`` for a
    malformed endpoint. The provider is flushed and shut down at interpreter exit.
    """
    if not otlp_endpoint and not console and not exporters:
        return None
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        log.info("tracing_disabled", extra={"reason": "OTEL_SDK_DISABLED"})
        return None
    url = _traces_url(otlp_endpoint) if otlp_endpoint else None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    provider = TracerProvider(
        resource=Resource.create(
            {"service.name": service_name, "service.namespace": "gpupool", "service.version": _version()}
        )
    )
    if url is not None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url, headers=otlp_headers)))
    if console:
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
    for exporter in exporters:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    use_provider(provider)  # the SDK provider flushes and shuts down at exit by itself
    log.info("tracing_enabled", extra={"service": service_name, "otlp_endpoint": url, "console": console})
    return provider


def shutdown_tracing() -> None:
    """Flush and shut down the installed SDK provider (if any) and go back to the no-op tracer.
    Idempotent; an exporter that fails while flushing is logged by the SDK, never raised."""
    provider = _SLOT.provider
    use_provider(None)
    shutdown = getattr(provider, "shutdown", None)
    if callable(shutdown):
        shutdown()
