"""collectors.kube_watch.Informer against a fake API (responses as urllib3 gives them to the
official client): list, watch from the list's resourceVersion, resume from the last event's or
bookmark's version, relist after 410 Gone, skip and count an object that does not parse; a failed list leaves the cache unsynced until one succeeds."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from urllib3.exceptions import MaxRetryError

from collectors.kube_parse import KubeParseError
from collectors.kube_watch import Informer


class _Resp:
    """A urllib3 response of the fake API: ``data`` for a list, ``stream()`` lines for a watch."""

    def __init__(self, body: Any = None, lines: list[dict[str, Any]] | None = None) -> None:
        self.data = json.dumps(body).encode() if body is not None else b""
        self._lines = lines or []
        self.status = 200

    def stream(self, amt: Any = None, decode_content: bool = False) -> Iterator[bytes]:
        for line in self._lines:
            yield (json.dumps(line) + "\n").encode()

    def close(self) -> None:
        pass

    def release_conn(self) -> None:
        pass


def _obj(name: str, version: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": name, "resourceVersion": version}}


def test_the_informer_resumes_from_the_versions_it_saw_and_relists_when_the_version_expired() -> None:
    calls: list[dict[str, Any]] = []
    lists = iter([{"metadata": {"resourceVersion": "10"}, "items": [_obj("a", "9")]},
                  {"metadata": {"resourceVersion": "20"}, "items": [_obj("b", "19")]}])  # fmt: skip
    watches = iter([
        [{"type": "ADDED", "object": _obj("c", "11")},
         {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}}],
        [{"type": "ADDED", "object": _obj("d", "21")}, {"type": "BOOKMARK", "object": _obj("", "25")},
         {"type": "DELETED", "object": _obj("b", "26")}, {"type": "MODIFIED", "object": {"metadata": {}}}],
    ])  # fmt: skip
    errors: list[tuple[str, str]] = []

    def list_call(**kwargs: Any) -> _Resp:
        calls.append(kwargs)
        if kwargs.get("watch"):
            try:
                return _Resp(lines=next(watches))
            except StopIteration:
                informer._stop.set()
                return _Resp(lines=[])
        return _Resp(body=next(lists))

    def parse(obj: dict[str, Any]) -> str:
        if not obj["metadata"].get("name"):
            raise KubeParseError("no_metadata")
        return str(obj["metadata"]["name"])

    informer: Informer[str] = Informer("things", list_call, parse, lambda r, why: errors.append((r, why)))
    informer._run()
    assert sorted(informer.snapshot()) == ["d"]  # b deleted, the relist dropped a and c
    watched = [c.get("resource_version") for c in calls if c.get("watch")]
    assert watched == ["10", "20", "26"]  # the list's version, the relist's, the last event's
    assert errors == [("things", "expired"), ("things", "no_metadata")]
    assert informer.synced and informer.version == "26"


def test_a_failed_list_leaves_the_cache_unsynced_counted_until_a_list_succeeds() -> None:
    answers: list[Any] = [
        MaxRetryError(None, "/api/v1/pods", "connection refused"),  # type: ignore[arg-type]
        {"metadata": {"resourceVersion": "5"}, "items": [_obj("a", "4")]},
    ]
    seen: list[tuple[str, str, bool, str | None]] = []

    def list_call(**kwargs: Any) -> _Resp:
        if kwargs.get("watch"):
            informer._stop.set()
            return _Resp(lines=[])
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return _Resp(body=answer)

    def on_error(resource: str, reason: str) -> None:
        seen.append((resource, reason, informer.synced, informer.failure))

    informer: Informer[str] = Informer("things", list_call, lambda o: str(o["metadata"]["name"]), on_error)
    assert (informer.synced, informer.failure) == (False, "not_listed")
    informer._run()
    assert seen == [("things", "unreachable", False, "unreachable")]
    assert informer.synced and informer.failure is None and informer.snapshot() == ["a"]
