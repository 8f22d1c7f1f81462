"""Property test (issue 10): random and mutated site requests over a real Mosquitto (the
generated config: ACL, client ids bound to user names) against the real broker service.

Hypothesis draws sequences of steps for two sites — good claims (of an offer or by
requirements), renewals and releases of their leases, and mutated requests: invalid UTF-8, escaped
lone surrogates, huge fields, deep nesting, non-finite numbers, type confusions, unknown versions,
another site's name or lease ids, random bytes, retained and stale requests. edge-a speaks MQTT
3.1.1 (replies matched by ``request_id``), edge-b MQTT 5. After every step:

* the request was answered, or dropped with a counted reason (retained, stale);
* a mutated request changed nothing;
* the book's invariants hold (no GPU in two live leases among them);
* for every lease, the lease log (the newest record), the broker's memory and the retained MQTT
  lease message (as a read-only observer sees it) agree.

Good claims' request → reply latency is measured and printed (``-s`` shows it); the assertion on
it is loose (a shared 2-core machine), the number is for the report.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import statistics
import time
import uuid
from abc import ABC, abstractmethod
from typing import Any

import aiomqtt
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from broker.acl import OBSERVER_USER
from broker.config import BrokerConfig
from broker.credentials import broker_service, mqtt_client
from broker.leases import lease_message
from broker.service import BrokerService
from contracts import (
    CapacityUpdate,
    GpuState,
    KafkaTopics,
    LeaseLogRecord,
    LeaseMessage,
    MqttTopics,
    ReasonCode,
    Reply,
    decode,
    encode,
)
from contracts.bus import MemoryBus
from tests.mqtt_support import running

pytestmark = pytest.mark.integration

CFG = BrokerConfig(capacity_max_age_s=3600, offer_ttl_s=600, lease_ttl_s=60, default_site_quota=6, tick_s=0.2)
SITES = ("edge-a", "edge-b")
TOPICS = KafkaTopics(prefix="fuzz.")
REPLY_TIMEOUT_S = 5.0

MUTATIONS = (
    "invalid_utf8", "lone_surrogate", "huge_field", "deep_nesting", "nan", "overflow_number",
    "bool_count", "string_duration", "negative_count", "version_zero", "not_object", "site_field",
    "other_sites_lease", "missing_id", "long_id", "random_bytes", "retained", "stale",
)  # fmt: skip
IGNORED = {"retained", "stale"}

steps = st.one_of(
    st.tuples(st.just("claim"), st.sampled_from(SITES), st.sampled_from(["offer", "match"]), st.integers(1, 3)),
    st.tuples(st.just("renew"), st.sampled_from(SITES), st.integers(0, 5)),
    st.tuples(st.just("release"), st.sampled_from(SITES), st.integers(0, 5)),
    st.tuples(st.just("mutated"), st.sampled_from(SITES), st.sampled_from(["claims", "renewals", "releases"]),
              st.sampled_from(MUTATIONS), st.binary(max_size=48)),
)  # fmt: skip


def _counter(svc: BrokerService, name: str, **labels: str) -> float:
    return svc.registry.get_sample_value(name, labels) or 0.0


class _Subscriber(ABC):
    """A raw MQTT client that reads its subscriptions in a task of its own (``_on``)."""

    client: aiomqtt.Client
    filters: tuple[str, ...] = ()

    async def __aenter__(self) -> Any:
        await self.client.__aenter__()
        for f in self.filters:
            await self.client.subscribe(f, qos=1)
        self._task = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self.client.__aexit__(None, None, None)

    async def _read(self) -> None:
        async for msg in self.client.messages:
            self._on(msg)

    @abstractmethod
    def _on(self, msg: aiomqtt.Message) -> None:
        """Handle one message of the subscriptions."""


class _Site(_Subscriber):
    """A site that sends raw requests and waits for the reply to each."""

    def __init__(self, creds: dict[str, Any], name: str, protocol: int) -> None:
        self.name, self.t = name, MqttTopics(creds["root"])
        self.client = aiomqtt.Client(
            creds["host"], creds["port"], username=name, password=creds["users"][name],
            identifier=f"fuzz-{name}", protocol=aiomqtt.ProtocolVersion.V5 if protocol == 5 else aiomqtt.ProtocolVersion.V311,
            # as the edge SDK does (broker/transport.py): no Nagle, or a request waits ~40 ms
            # for the delayed ACK of the previous one
            socket_options=((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),),
        )  # fmt: skip
        self.filters = (self.t.replies(name),)
        self.replies: asyncio.Queue[Reply] = asyncio.Queue()
        self.leases: list[str] = []

    def _on(self, msg: aiomqtt.Message) -> None:
        self.replies.put_nowait(decode(Reply, bytes(msg.payload)))  # type: ignore[arg-type]

    async def send(self, kind: str, payload: bytes, retain: bool = False) -> None:
        topic = {"claims": self.t.claims, "renewals": self.t.renewals, "releases": self.t.releases}[kind](self.name)
        await self.client.publish(topic, payload, qos=1, retain=retain)

    async def reply_to(self, request_id: str | None) -> Reply:
        """The next reply (with ``request_id``, when given: over 3.1.1 that is how it is matched)."""
        async with asyncio.timeout(REPLY_TIMEOUT_S):
            while True:
                reply = await self.replies.get()
                if request_id is None or reply.request_id == request_id:
                    return reply


class _Observer(_Subscriber):
    """The read-only observer user's view of every retained lease message."""

    def __init__(self, creds: dict[str, Any]) -> None:
        self.t = MqttTopics(creds["root"])
        self.client = mqtt_client(creds, OBSERVER_USER, identifier="fuzz-observer")
        self.filters = (f"{self.t.root}/sites/+/leases/+",)
        self.leases: dict[str, LeaseMessage] = {}

    def _on(self, msg: aiomqtt.Message) -> None:
        lease_id = msg.topic.value.rsplit("/", 1)[1]
        if msg.payload:
            self.leases[lease_id] = decode(LeaseMessage, bytes(msg.payload))  # type: ignore[arg-type]
        else:
            self.leases.pop(lease_id, None)


def _mutate(site: str, kind: str, mutation: str, noise: bytes, other_lease: str | None) -> bytes:
    """A request of ``kind`` broken by ``mutation`` (see MUTATIONS)."""
    now = time.time()
    rid = f"m-{uuid.uuid4().hex[:8]}"
    if kind == "claims":
        base: dict[str, Any] = {"claim_id": f"bad-{uuid.uuid4().hex[:8]}", "site": site, "count": 1, "ts": now}
    else:
        base = {"lease_id": other_lease or "lease-none", "site": site, "ts": now}
    base["request_id"] = rid
    if mutation == "invalid_utf8":
        return json.dumps(base).encode()[:-1] + b'\xff\xfe"}'
    if mutation == "lone_surrogate":
        return json.dumps(base).replace(f'"{site}"', '"\\ud83d"').encode()
    if mutation == "huge_field":
        return json.dumps({**base, "pad": "x" * 20_000}).encode()
    if mutation == "deep_nesting":
        return json.dumps(base)[:-1].encode() + b', "x": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    if mutation == "nan":
        return json.dumps(base).replace(f'"ts": {now}', '"ts": NaN').encode()
    if mutation == "overflow_number":
        return json.dumps(base).replace(f'"ts": {now}', '"ts": 1e999').encode()
    if mutation == "bool_count":
        return json.dumps({**base, "count": True} if kind == "claims" else {**base, "ts": True}).encode()
    if mutation == "string_duration":
        key = "duration_seconds" if kind == "claims" else "ts"
        return json.dumps({**base, key: "600"}).encode()
    if mutation == "negative_count":
        return json.dumps({**base, "count": -3} if kind == "claims" else {**base, "ts": -1}).encode()
    if mutation == "version_zero":
        return json.dumps({**base, "schema_version": 0}).encode()
    if mutation == "not_object":
        return json.dumps([base]).encode()
    if mutation == "site_field":
        return json.dumps({**base, "site": next(s for s in SITES if s != site)}).encode()
    if mutation == "other_sites_lease":  # another site's lease id (or none) where this site's belongs
        if kind == "claims":
            base["offer_id"] = other_lease or "lease-none"
        return json.dumps(base).encode()
    if mutation == "missing_id":
        base.pop("claim_id" if kind == "claims" else "lease_id")
        return json.dumps(base).encode()
    if mutation == "long_id":
        base["claim_id" if kind == "claims" else "lease_id"] = "x" * 129
        return json.dumps(base).encode()
    if mutation == "random_bytes":
        return noise
    if mutation == "retained":
        return json.dumps(base).encode()
    if mutation == "stale":
        return json.dumps({**base, "ts": now - CFG.request_max_age_s - 60}).encode()
    raise AssertionError(mutation)


async def _consistent(svc: BrokerService, bus: MemoryBus, observer: _Observer) -> None:
    """Wait (at most 3 s) until lease log, memory and retained MQTT state agree; assert it."""
    deadline = time.monotonic() + 3.0
    while True:
        logged: dict[str, LeaseLogRecord] = {}
        for m in bus.records(TOPICS.leases_log):
            if m.value:
                r = decode(LeaseLogRecord, m.value)
                if r.lease_id not in logged or r.seq >= logged[r.lease_id].seq:
                    logged[r.lease_id] = r
        book = dict(svc.book.leases)
        problems = [f"log {i}: {logged.get(i)} != book {r}" for i, r in book.items() if logged.get(i) != r]
        problems += [f"live in the log, unknown to the book: {i}" for i, r in logged.items()
                     if r.state.live and i not in book]  # fmt: skip
        problems += [f"retained {i}: {observer.leases.get(i)} != {lease_message(r)}" for i, r in book.items()
                     if observer.leases.get(i) != lease_message(r)]  # fmt: skip
        problems += [f"retained but unknown: {i}" for i in observer.leases if i not in book]
        if not problems:
            return
        if time.monotonic() > deadline:
            raise AssertionError("\n".join(problems[:5]))
        await asyncio.sleep(0.02)


async def _scenario(
    creds: dict[str, Any], plan: list[tuple[Any, ...]], latencies: list[float] | None = None
) -> None:
    """Run ``plan`` against a started broker, checking the invariants after every step; the
    request → reply seconds of each good claim are appended to ``latencies`` when given."""
    bus = MemoryBus()
    svc = broker_service(creds, bus=bus, topics=TOPICS, config=CFG, client_id="gpupool-broker")
    async with running(svc), _Observer(creds) as observer, _Site(creds, "edge-a", 4) as a, _Site(creds, "edge-b", 5) as b:
        sites = {"edge-a": a, "edge-b": b}
        producer = bus.producer()
        now = time.time()
        for n in range(3):
            for g in range(4):
                cap = CapacityUpdate(ts=now, host=f"fz{n}", gpu_uuid=f"GPU-fz{n}-{g}", state=GpuState.IDLE,
                                     since=now - 60, predicted_idle_until=now + 3600, leaf="leaf-fz")  # fmt: skip
                await producer.send(TOPICS.capacity, encode(cap), key=cap.key)
        async with asyncio.timeout(10):
            while sum(len(o.gpus) for o in svc.book.offers.values()) < 12:
                await asyncio.sleep(0.02)
        for step in plan:
            site = sites[step[1]]
            before = dict(svc.book.leases)
            rid = f"r-{uuid.uuid4().hex[:10]}"
            if step[0] == "claim":
                _, _, how, count = step
                body: dict[str, Any] = {"claim_id": f"c-{uuid.uuid4().hex[:10]}", "site": site.name, "ts": time.time(),
                                        "request_id": rid, "unknown_future_field": {"x": 1}}  # fmt: skip
                offers = sorted(svc.book.offers.values(), key=lambda o: o.offer_id)
                if how == "offer" and offers:
                    body["offer_id"] = offers[0].offer_id
                    body["count"] = min(count, len(offers[0].gpus))
                else:
                    body["count"] = count
                t0 = time.perf_counter()
                await site.send("claims", json.dumps(body).encode())
                reply = await site.reply_to(rid)
                if latencies is not None:
                    latencies.append(time.perf_counter() - t0)
                assert reply.request == "claim" and reply.in_reply_to == body["claim_id"]
                assert reply.code in {ReasonCode.OK, ReasonCode.NO_MATCH, ReasonCode.GPU_UNAVAILABLE,
                                      ReasonCode.QUOTA_EXCEEDED, ReasonCode.UNKNOWN_OFFER}, reply  # fmt: skip
                if reply.code is ReasonCode.OK:
                    assert reply.lease_id is not None and reply.expires_at is not None
                    site.leases.append(reply.lease_id)
            elif step[0] in ("renew", "release"):
                if not site.leases:
                    continue
                lease_id = site.leases[step[2] % len(site.leases)]
                kind = "renewals" if step[0] == "renew" else "releases"
                await site.send(kind, json.dumps({"lease_id": lease_id, "site": site.name, "ts": time.time(),
                                                  "request_id": rid}).encode())  # fmt: skip
                reply = await site.reply_to(rid)
                assert reply.in_reply_to == lease_id and reply.code in {
                    ReasonCode.OK, ReasonCode.LEASE_NOT_LIVE}, reply  # fmt: skip
                if step[0] == "renew" and reply.code is ReasonCode.OK:
                    assert reply.expires_at == svc.book.leases[lease_id].expires_at
                    assert reply.ttl_seconds == CFG.lease_ttl_s
            else:
                _, _, kind, mutation, noise = step
                other = sites["edge-b" if site.name == "edge-a" else "edge-a"]
                other_lease = other.leases[0] if other.leases else None
                payload = _mutate(site.name, kind, mutation, noise, other_lease)
                if mutation in IGNORED:
                    reason = "retained" if mutation == "retained" else "stale"
                    ignored = _counter(svc, "gpupool_broker_ignored_requests_total", reason=reason)
                    await site.send(kind, payload, retain=mutation == "retained")
                    async with asyncio.timeout(REPLY_TIMEOUT_S):
                        while _counter(svc, "gpupool_broker_ignored_requests_total", reason=reason) < ignored + 1:
                            await asyncio.sleep(0.01)
                    await asyncio.sleep(0.05)
                    assert site.replies.empty(), "an ignored request was answered"
                else:
                    await site.send(kind, payload)
                    reply = await site.reply_to(None)
                    assert reply.code is not ReasonCode.OK, (mutation, kind, reply)
                    assert reply.code in {ReasonCode.MALFORMED, ReasonCode.UNSUPPORTED_VERSION,
                                          ReasonCode.SITE_MISMATCH, ReasonCode.UNKNOWN_LEASE,
                                          ReasonCode.UNKNOWN_OFFER}, (mutation, reply)  # fmt: skip
                assert dict(svc.book.leases) == before, f"{mutation} changed the book"
            assert svc.book.violations() == []
            await _consistent(svc, bus, observer)
    # the retained requests were cleared by the broker: nothing is left to replay at a restart
    # (read once every client of this scenario is gone: a second login as a user takes the
    # first one's session over)
    t = MqttTopics(creds["root"])
    for name in SITES:
        for topic in (t.claims(name), t.renewals(name), t.releases(name)):
            assert not await _retained_payload(creds, topic), topic


async def _retained_payload(creds: dict[str, Any], topic: str) -> bytes:
    async with aiomqtt.Client(creds["host"], creds["port"], username="gpupool-observer",
                              password=creds["users"]["gpupool-observer"], identifier="fuzz-probe") as c:  # fmt: skip
        await c.subscribe(topic, qos=1)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.3):
                async for msg in c.messages:
                    return bytes(msg.payload)  # type: ignore[arg-type]
    return b""


# no shrinking: each example runs real services, and the failing plan is printed whole
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck),
          phases=(Phase.explicit, Phase.reuse, Phase.generate), print_blob=True)
@given(plan=st.lists(steps, min_size=6, max_size=16))
def test_random_and_mutated_requests_never_break_the_broker(mosquitto: dict[str, Any], plan: list[tuple[Any, ...]]) -> None:
    asyncio.run(_scenario(mosquitto, plan))


# good claims of both sites, each after a mutated request of the other kinds (a fixed plan: the
# property test may draw few good claims)
_LOAD_PLAN: list[tuple[Any, ...]] = [
    step
    for n, mutation in enumerate(("deep_nesting", "huge_field", "invalid_utf8", "nan", "random_bytes",
                                  "bool_count", "other_sites_lease", "long_id", "site_field", "not_object"))
    for step in (("mutated", SITES[n % 2], "claims", mutation, b"\x00\xff" * 8),
                 ("claim", SITES[n % 2], "match", 1))
]  # fmt: skip


def test_good_claims_stay_fast_under_the_fuzz_load(mosquitto: dict[str, Any]) -> None:
    """A good claim's request → reply latency, interleaved with mutated requests (printed with
    ``-s``)."""
    latencies: list[float] = []
    asyncio.run(_scenario(mosquitto, _LOAD_PLAN, latencies))
    assert len(latencies) == 10
    ms = sorted(x * 1000 for x in latencies)
    p50, p95 = statistics.median(ms), ms[int(0.95 * (len(ms) - 1))]
    print(f"\ngood claims under fuzz: n={len(ms)} p50={p50:.1f} ms p95={p95:.1f} ms max={ms[-1]:.1f} ms")
    assert p50 < 50.0  # the target; measured p50 about 10 ms, p95 15 ms on 2 shared cores (README)
