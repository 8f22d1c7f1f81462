"""List and watch one kind of Kubernetes object into a cache, in a thread of its own.

:class:`Informer` does what client-go's reflector does, with the official ``kubernetes`` client:
``list`` (raw JSON, the list's ``metadata.resourceVersion``), then ``watch`` from that version
(``resourceVersion``, ``allowWatchBookmarks``; each request ends server-side after
:data:`WATCH_TIMEOUT_S` and is resumed from the last version seen, bookmarks included). A watch
whose version expired (HTTP 410 ``Gone``, or an ``ERROR`` event with code 410) lists again
(counted, ``expired``); any other failure (unreachable, refused, 403, a broken stream) marks the
cache not :attr:`Informer.synced` until a new list succeeds, after a backoff of 0.1 s doubling to
5 s. Each object is parsed as it arrives; one that does not parse is dropped from the cache and
counted with the parser's reason.

Reference: Kubernetes API concepts, "Efficient detection of changes" and "Watch bookmarks".
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from kubernetes import watch
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from collectors.kube_parse import KubeParseError

__all__ = ["WATCH_TIMEOUT_S", "Informer"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")

WATCH_TIMEOUT_S = 30
"""Server-side timeout of one watch request (s): the thread notices a stop at least this often."""
LIST_TIMEOUT_S = 30
"""Client-side deadline of one list request (s)."""


def _reason(exc: BaseException) -> str:
    """Metric label of a failed request: ``http_<status>`` for an API answer, ``unreachable``
    for a connection that failed, else ``stream_error``."""
    if isinstance(exc, ApiException):
        return f"http_{exc.status}" if exc.status else "unreachable"
    if isinstance(exc, (HTTPError, OSError)):
        return "unreachable"
    return "stream_error"


class Informer(Generic[_T]):
    """A cache of one kind of object, kept by list + watch in a daemon thread (module docstring).

    Args:
        resource: name for logs and metrics (``pods``, ``nodes``, ``workloads``...).
        list_call: the client method that lists them across namespaces
            (``CoreV1Api.list_pod_for_all_namespaces``, or a ``functools.partial`` of
            ``CustomObjectsApi.list_cluster_custom_object`` with group, version and plural).
        parse: object JSON (dict) → value; raises :class:`KubeParseError` for a bad object.
        on_error: called with ``(resource, reason)`` for every failure and rejected object.

    The cache is read with :meth:`snapshot`; :attr:`synced` is False before the first list and
    after a failure until the next list.
    """

    def __init__(
        self,
        resource: str,
        list_call: Callable[..., Any],
        parse: Callable[[Mapping[str, Any]], _T],
        on_error: Callable[[str, str], None],
    ) -> None:
        self.resource = resource
        self._list_call = list_call
        self._parse = parse
        self._on_error = on_error
        self._lock = threading.Lock()
        self._items: dict[str, _T] = {}
        self._synced = False
        self._failure: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.version: str | None = None
        """The resourceVersion the cache is at (a list's, then each event's)."""

    @property
    def synced(self) -> bool:
        """The cache holds a full list and the watch since then has not failed."""
        with self._lock:
            return self._synced

    @property
    def failure(self) -> str | None:
        """Reason of the failure that made the cache not synced (``http_403``, ``unreachable``...),
        ``"not_listed"`` before the first list, ``None`` while synced."""
        with self._lock:
            return None if self._synced else self._failure or "not_listed"

    def snapshot(self) -> list[_T]:
        """The cached values (a copy), in no particular order."""
        with self._lock:
            return list(self._items.values())

    def start(self) -> None:
        """Start the thread (idempotent)."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=f"kube-{self.resource}", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 1.0) -> None:
        """Ask the thread to end and wait up to ``timeout_s`` for it (a watch request in flight
        ends by its server-side timeout at the latest; the thread is a daemon)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)

    def _key(self, obj: Mapping[str, Any]) -> str | None:
        meta = obj.get("metadata")
        if not isinstance(meta, Mapping):
            return None
        return str(meta.get("uid") or f"{meta.get('namespace') or ''}/{meta.get('name') or ''}")

    def _parsed(self, obj: Mapping[str, Any]) -> tuple[str | None, _T | None]:
        key = self._key(obj)
        try:
            return key, self._parse(obj)
        except KubeParseError as exc:
            self._on_error(self.resource, exc.reason)
            log.warning(
                "kube_object_rejected", extra={"resource": self.resource, "key": key, "reason": str(exc)}
            )
            return key, None

    def list_once(self) -> None:
        """List every object and replace the cache (marks it synced). Raises what the client
        raises (``ApiException``, urllib3 ``HTTPError``, ``OSError``) or ``ValueError`` for an
        answer that is not a list with a resourceVersion."""
        resp = self._list_call(_preload_content=False, _request_timeout=LIST_TIMEOUT_S)
        body = json.loads(resp.data)
        version = (body.get("metadata") or {}).get("resourceVersion") if isinstance(body, dict) else None
        if not version or not isinstance(body.get("items"), list):
            raise ValueError(f"list {self.resource}: not a list with a resourceVersion")
        items: dict[str, _T] = {}
        for obj in body["items"]:
            key, value = self._parsed(obj)
            if key is not None and value is not None:
                items[key] = value
        with self._lock:
            self._items, self._synced, self._failure = items, True, None
            self.version = str(version)

    def _apply(self, kind: str, obj: Mapping[str, Any]) -> None:
        key, value = self._parsed(obj) if kind != "DELETED" else (self._key(obj), None)
        version = (obj.get("metadata") or {}).get("resourceVersion")
        with self._lock:
            if key is not None:
                if value is None:
                    self._items.pop(key, None)
                else:
                    self._items[key] = value
            if version:
                self.version = str(version)

    def _fail(self, reason: str, exc: BaseException | str) -> None:
        with self._lock:
            was, self._synced, self._failure = self._synced, False, reason
        self._on_error(self.resource, reason)
        if was:
            log.warning(
                "kube_watch_failed",
                extra={"resource": self.resource, "reason": reason, "error": str(exc)[:300]},
            )

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            if not self.synced:
                try:
                    self.list_once()
                except Exception as exc:  # noqa: BLE001 — any failure: counted, retried after a backoff
                    self._fail(_reason(exc) if not isinstance(exc, ValueError) else "bad_list", exc)
                    self._stop.wait(backoff)
                    backoff = min(5.0, backoff * 2)
                    continue
                backoff = 0.1
            w = watch.Watch(return_type="object")  # events as the API's JSON (dicts), not models
            try:
                for event in w.stream(
                    self._list_call,
                    resource_version=self.version,
                    allow_watch_bookmarks=True,
                    timeout_seconds=WATCH_TIMEOUT_S,
                    _request_timeout=WATCH_TIMEOUT_S + 10,
                ):
                    kind, obj = event.get("type"), event.get("object")
                    if kind == "ERROR":
                        code = obj.get("code") if isinstance(obj, Mapping) else None
                        raise ApiException(status=code or 0, reason=str(obj)[:200])
                    if kind == "BOOKMARK" and isinstance(obj, Mapping):
                        version = (obj.get("metadata") or {}).get("resourceVersion")
                        if version:
                            with self._lock:
                                self.version = str(version)
                    elif kind in ("ADDED", "MODIFIED", "DELETED") and isinstance(obj, Mapping):
                        self._apply(kind, obj)
                    if self._stop.is_set():
                        w.stop()
            except Exception as exc:  # noqa: BLE001 — whatever broke the stream, list again
                if self._stop.is_set():
                    return
                if isinstance(exc, ApiException) and exc.status == 410:
                    self._on_error(self.resource, "expired")  # the cache stays as it is until relisted
                    try:
                        self.list_once()
                        continue
                    except Exception as exc2:  # noqa: BLE001 — counted, retried after a backoff
                        exc = exc2
                self._fail(_reason(exc) if not isinstance(exc, ValueError) else "bad_list", exc)
                self._stop.wait(backoff)
                backoff = min(5.0, backoff * 2)
