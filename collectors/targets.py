"""Scrape targets: a static list of URLs and Prometheus ``file_sd`` files, reloaded when they change.

file_sd format (Prometheus configuration docs, ``<file_sd_config>``; Prometheus
``discovery/file``): a JSON file holding a list of target groups::

    [{"targets": ["gpu-node-1:9400", "10.0.0.7:9400"],
      "labels": {"cluster": "a", "__scrape_interval__": "10s"}}]

Each entry of ``targets`` is an address ``host[:port]`` (``[v6]:port`` for IPv6). Labels that start
with ``__`` are Prometheus' internal labels; these are honoured per target:

* ``__scheme__`` (``http`` or ``https``; default ``http``) and ``__metrics_path__`` (default
  ``/metrics``) build the URL ``<scheme>://<address><path>``; ``__param_<name>`` adds the URL
  parameter ``<name>``;
* ``__scrape_interval__`` and ``__scrape_timeout__`` are Prometheus durations (``500ms``, ``15s``,
  ``1m30s``; units ``ms s m h d w y``): the target's own scrape interval and deadline. Without
  them a file_sd target gets the collector's interval and ``min(collector timeout, its
  interval)``; a timeout longer than the interval is refused, as Prometheus refuses it.

The other internal labels (``__meta_*``, ``__address__`` ...) are not carried. Every other label is
carried into each :class:`contracts.GpuSample` scraped from the target as the attribute
``target_<name>`` (prefixed so that a target label never collides with the workload labels
dcgm-exporter itself attaches — ``pod``, ``namespace``, ``container``); see
:attr:`Target.attributes`.

Reload (Prometheus' semantics): each file path may end in a glob pattern (``targets/*.json``).
:meth:`TargetSet.refresh` stats every file and re-reads the ones whose ``(mtime, size, inode)``
changed. A file that cannot be used as a whole — unreadable, not JSON, not a list of groups, an
invalid label name or value, a ``.yml``/``.yaml`` file (YAML is not read) — keeps its previous
targets and is counted (``gpupool_collector_file_sd_errors_total{reason}``); one bad target (an
address with a path, an unknown scheme, a bad duration, a timeout over the interval) is dropped
and counted alone. A file that disappears takes its targets with it. A URL listed twice is
scraped once (the first listing wins: static targets, then files in order).
"""

from __future__ import annotations

import glob
import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlencode, urlsplit

from collectors.metrics import CollectorMetrics

log = logging.getLogger(__name__)

ATTRIBUTE_PREFIX = "target_"
"""Prefix of a target label's name in :attr:`contracts.GpuSample.attributes`."""
DEFAULT_METRICS_PATH = "/metrics"
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_DURATION = re.compile(r"^(?:(\d+)y)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?(?:(\d+)ms)?$")
_DURATION_UNITS = (365 * 86400.0, 7 * 86400.0, 86400.0, 3600.0, 60.0, 1.0, 0.001)
_GLOB_CHARS = re.compile(r"[*?\[]")


class FileSdError(ValueError):
    """A file_sd file or one of its targets cannot be used.

    Attributes:
        reason: the ``reason`` label it is counted under (see the module docstring).
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Target:
    """One dcgm-exporter endpoint to scrape.

    Attributes:
        url: the ``/metrics`` URL.
        labels: the target's own labels (internal ``__`` labels removed), sorted by name.
        interval_s: seconds between two scrapes of it.
        timeout_s: deadline of one scrape of it, seconds.
        source: ``static``, or the path of the file_sd file it came from.
    """

    url: str
    labels: tuple[tuple[str, str], ...] = ()
    interval_s: float = 5.0
    timeout_s: float = 2.0
    source: str = "static"
    attributes: dict[str, str] = field(init=False, compare=False, repr=False)
    """The labels as :attr:`contracts.GpuSample.attributes`: ``target_<name>`` → value."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "attributes", {ATTRIBUTE_PREFIX + k: v for k, v in self.labels})


def parse_duration(text: str) -> float:
    """Seconds of a Prometheus duration (``model.ParseDuration``: ``1h30m``, ``15s``, ``250ms``;
    units ``y`` = 365 d, ``w``, ``d``, ``h``, ``m``, ``s``, ``ms``, largest first, each once).

    Raises:
        ValueError: empty, malformed, or not a string.
    """
    if not isinstance(text, str) or not text:
        raise ValueError(f"not a duration: {text!r}")
    if text == "0":
        return 0.0
    m = _DURATION.match(text)
    if m is None or not any(m.groups()):
        raise ValueError(f"not a duration: {text!r}")
    return sum(int(g) * unit for g, unit in zip(m.groups(), _DURATION_UNITS, strict=True) if g)


def _target_url(address: str, labels: dict[str, str]) -> str:
    """``<scheme>://<address><path>[?params]``. Raises :class:`FileSdError`."""
    scheme = labels.get("__scheme__", "http")
    if scheme not in ("http", "https"):
        raise FileSdError("bad_scheme", f"{scheme!r} is neither http nor https")
    if not address or "/" in address or any(c.isspace() for c in address):
        raise FileSdError("bad_address", f"{address!r} is not host[:port]")
    path = labels.get("__metrics_path__", DEFAULT_METRICS_PATH)
    if not path.startswith("/"):
        path = "/" + path
    params = {k[len("__param_") :]: v for k, v in labels.items() if k.startswith("__param_")}
    url = f"{scheme}://{address}{path}" + (f"?{urlencode(params)}" if params else "")
    try:
        parts = urlsplit(url)
        _ = parts.port  # a port out of range or not a number fails here
    except ValueError as e:
        raise FileSdError("bad_address", f"{address!r}: {e}") from e
    if not parts.hostname:
        raise FileSdError("bad_address", f"{address!r} has no host")
    return url


def _timing(
    labels: dict[str, str], default_interval_s: float, default_timeout_s: float
) -> tuple[float, float]:
    """``(interval_s, timeout_s)`` of a target. Raises :class:`FileSdError`."""
    try:
        interval = parse_duration(labels["__scrape_interval__"]) if "__scrape_interval__" in labels else None
        timeout = parse_duration(labels["__scrape_timeout__"]) if "__scrape_timeout__" in labels else None
    except ValueError as e:
        raise FileSdError("bad_duration", str(e)) from e
    if (interval is not None and interval <= 0) or (timeout is not None and timeout <= 0):
        raise FileSdError("bad_duration", "scrape interval and timeout must be > 0")
    interval = default_interval_s if interval is None else interval
    timeout = min(default_timeout_s, interval) if timeout is None else timeout
    if timeout > interval:
        raise FileSdError("timeout_exceeds_interval", f"timeout {timeout} s > interval {interval} s")
    return interval, timeout


def parse_file_sd(
    text: str | bytes,
    *,
    source: str = "",
    default_interval_s: float = 5.0,
    default_timeout_s: float = 2.0,
) -> tuple[list[Target], list[FileSdError]]:
    """The targets of one file_sd JSON document (format in the module docstring).

    Returns ``(targets, dropped)``: the usable targets in file order, and one error per target
    that was dropped (``bad_address``, ``bad_scheme``, ``bad_duration``,
    ``timeout_exceeds_interval``).

    Raises:
        FileSdError: the document as a whole is unusable (``bad_json``, ``bad_shape``,
            ``bad_label_name``, ``bad_label_value``).
    """
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FileSdError("bad_json", str(e)) from e
    if not isinstance(doc, list):
        raise FileSdError("bad_shape", f"expected a list of target groups, got {type(doc).__name__}")
    groups: list[tuple[list[str], dict[str, str]]] = []
    for i, group in enumerate(doc):
        if not isinstance(group, dict):
            raise FileSdError("bad_shape", f"group {i} is a {type(group).__name__}, not an object")
        addresses = group.get("targets") or []
        labels = group.get("labels") or {}
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            raise FileSdError("bad_shape", f"group {i}: 'targets' must be a list of strings")
        if not isinstance(labels, dict):
            raise FileSdError("bad_shape", f"group {i}: 'labels' must be an object")
        for name, value in labels.items():
            if not _LABEL_NAME.match(name):
                raise FileSdError("bad_label_name", f"group {i}: {name!r} is not a valid label name")
            if not isinstance(value, str):
                raise FileSdError("bad_label_value", f"group {i}: label {name!r} is not a string")
        groups.append((addresses, labels))
    targets: list[Target] = []
    dropped: list[FileSdError] = []
    for addresses, labels in groups:
        public = tuple(sorted((k, v) for k, v in labels.items() if not k.startswith("__")))
        for address in addresses:
            try:
                url = _target_url(address, labels)
                interval, timeout = _timing(labels, default_interval_s, default_timeout_s)
            except FileSdError as e:
                dropped.append(e)
                continue
            targets.append(Target(url, public, interval, timeout, source))
    return targets, dropped


@dataclass(slots=True)
class _File:
    stamp: tuple[int, int, int] | None = None  # (mtime_ns, size, inode) of the last read
    targets: list[Target] = field(default_factory=list)


class TargetSet:
    """The current targets: static URLs plus file_sd files, re-read when they change.

    Args:
        static: ``/metrics`` URLs scraped at ``default_interval_s`` with ``default_timeout_s``
            (not validated here: a bad URL fails its scrape as ``invalid_url``).
        files: file_sd paths; the last path component may be a glob pattern.
        default_interval_s / default_timeout_s: for targets without their own.
        refresh_s: :meth:`maybe_refresh` re-checks the files at most this often.
        clock: monotonic seconds (tests inject one).
        metrics: where file_sd reads and the target counts go (the collector service's);
            ``None``: new ones on a registry of their own (:attr:`metrics`).

    The files are read once at construction. Raises ``ValueError`` if a default is not > 0.
    """

    def __init__(
        self,
        static: Sequence[str] = (),
        files: Sequence[Path | str] = (),
        *,
        default_interval_s: float = 5.0,
        default_timeout_s: float = 2.0,
        refresh_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        metrics: CollectorMetrics | None = None,
    ) -> None:
        self.metrics = metrics if metrics is not None else CollectorMetrics()
        if default_interval_s <= 0 or default_timeout_s <= 0 or refresh_s <= 0:
            raise ValueError("default_interval_s, default_timeout_s and refresh_s must be > 0")
        self.default_interval_s = default_interval_s
        self.default_timeout_s = default_timeout_s
        self.refresh_s = refresh_s
        self.specs = [str(f) for f in files]
        self._clock = clock
        self._static = [Target(u, (), default_interval_s, default_timeout_s) for u in static]
        self._files: dict[str, _File] = {}
        self._targets: list[Target] = []
        self._by_url: dict[str, Target] = {}
        self._last_check = clock()
        self.version = 0
        """Grows by one each time the target list changes."""
        self._rebuild()
        self.refresh()

    @property
    def targets(self) -> list[Target]:
        """Every target, each URL once (static first, then files in order)."""
        return self._targets

    def get(self, url: str) -> Target | None:
        """The target scraped at ``url``, if any."""
        return self._by_url.get(url)

    def maybe_refresh(self) -> bool:
        """:meth:`refresh` if ``refresh_s`` passed since the last check; whether targets changed."""
        if self._clock() - self._last_check < self.refresh_s:
            return False
        return self.refresh()

    def refresh(self) -> bool:
        """Re-read every file_sd file that changed; return whether the target list changed.
        Never raises: a bad file is logged and counted, and keeps its previous targets."""
        self._last_check = self._clock()
        if not self.specs:
            return False
        seen: dict[str, _File] = {}
        changed = False
        for path in self._expand():
            key = str(path)
            entry = self._files.get(key) or _File()
            seen[key] = entry
            try:
                st = path.stat()
            except OSError:
                continue  # vanished between the listing and now: treated as gone next time
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp == entry.stamp:
                continue
            entry.stamp = stamp
            loaded = self._load(path)
            if loaded is not None and loaded != entry.targets:
                entry.targets = loaded
                changed = True
        if set(seen) != set(self._files):
            for gone in set(self._files) - set(seen):
                log.info("file_sd_file_gone", extra={"path": gone, "targets": len(self._files[gone].targets)})
                changed = changed or bool(self._files[gone].targets)
        self._files = seen
        if changed:
            self._rebuild()
        return changed

    def _expand(self) -> list[Path]:
        """Each spec's files: the path itself if it exists, or the matches of its glob pattern."""
        out: list[Path] = []
        for spec in self.specs:
            try:
                if _GLOB_CHARS.search(Path(spec).name):
                    out.extend(Path(p) for p in sorted(glob.glob(spec)))
                elif Path(spec).exists():
                    out.append(Path(spec))
            except OSError as e:  # e.g. a folder on the path that may not be searched
                self.metrics.file_sd_errors.labels("read_error").inc()
                log.error("file_sd_unlistable", extra={"spec": spec, "error": repr(e)})
        return list(dict.fromkeys(out))

    def _load(self, path: Path) -> list[Target] | None:
        """The targets of ``path``, or ``None`` (counted, logged) if the file is unusable."""
        try:
            if path.suffix not in (".json",):
                raise FileSdError("unsupported_format", f"{path.suffix or 'no extension'}: only JSON is read")
            try:
                raw = path.read_bytes()
            except OSError as e:
                raise FileSdError("read_error", repr(e)) from e
            targets, dropped = parse_file_sd(
                raw,
                source=str(path),
                default_interval_s=self.default_interval_s,
                default_timeout_s=self.default_timeout_s,
            )
        except FileSdError as e:
            self.metrics.file_sd_reads.labels("error").inc()
            self.metrics.file_sd_errors.labels(e.reason).inc()
            log.error("file_sd_unusable", extra={"path": str(path), "reason": e.reason, "error": str(e)})
            return None
        self.metrics.file_sd_reads.labels("ok").inc()
        for err in dropped:
            self.metrics.file_sd_errors.labels(err.reason).inc()
            log.warning(
                "file_sd_target_dropped", extra={"path": str(path), "reason": err.reason, "error": str(err)}
            )
        log.info(
            "file_sd_loaded", extra={"path": str(path), "targets": len(targets), "dropped": len(dropped)}
        )
        return targets

    def _rebuild(self) -> None:
        by_url: dict[str, Target] = {}
        for t in [*self._static, *(t for f in self._files.values() for t in f.targets)]:
            if t.url in by_url:
                log.debug("target_duplicate", extra={"url": t.url, "source": t.source})
                continue
            by_url[t.url] = t
        self._by_url = by_url
        self._targets = list(by_url.values())
        self.version += 1
        n_static = sum(1 for t in self._targets if t.source == "static")
        self.metrics.targets.labels("static").set(n_static)
        self.metrics.targets.labels("file_sd").set(len(self._targets) - n_static)
