"""The one runner of every stage's ``run`` command (:func:`runtime.stage.run_stage`): metrics from
the stage's own registry, SIGTERM, start → run → stop, and the same exit for each kind of start
failure. The stages themselves are run against real Kafka by tests/test_stage_topics.py and the CLI
tests; here a small in-process stage on the memory bus checks the runner's logic."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import urllib.request
from typing import Any

import pytest
import typer
from prometheus_client import CollectorRegistry, Gauge

from contracts.bus import MemoryBus, MissingTopicsError
from runtime.stage import run_stage


class _Bus(MemoryBus):
    def __init__(self) -> None:
        super().__init__()
        self.closed = 0

    async def close(self) -> None:
        self.closed += 1
        await super().close()


class _Stage:
    """Records what the runner did; ``fail`` is raised by :meth:`start`; :meth:`run` runs ``body``
    then waits for ``stop``."""

    def __init__(self, fail: BaseException | None = None, body: Any = None) -> None:
        self.fail, self.body = fail, body
        self.calls: list[str] = []
        self.registry = CollectorRegistry()
        Gauge("gpupool_test_stage_up", "The test stage is up.", registry=self.registry).set(1)

    async def start(self) -> None:
        self.calls.append("start")
        if self.fail is not None:
            raise self.fail

    async def run(self, stop: asyncio.Event) -> None:
        self.calls.append("run")
        if self.body is not None:
            await self.body(self)
        await stop.wait()

    async def stop(self) -> None:
        self.calls.append("stop")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(stage: _Stage, bus: _Bus, port: int = 0, **kw: Any) -> None:
    run_stage("gpupool test run", lambda: (stage, bus), metrics_port=port, metrics_addr="127.0.0.1", **kw)


def test_serves_the_stage_registry_and_stops_on_sigterm() -> None:
    port = _free_port()
    scraped: list[str] = []
    started: list[bool] = []

    async def body(stage: _Stage) -> None:
        url = f"http://127.0.0.1:{port}/metrics"
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        scraped.append(text)
        os.kill(os.getpid(), signal.SIGTERM)  # the runner's handler sets stop, the process lives

    stage, bus = _Stage(body=body), _Bus()
    _run(stage, bus, port, started=lambda: started.append(True))
    assert "gpupool_test_stage_up 1.0" in scraped[0]
    assert "python_gc_objects_collected_total" not in scraped[0]  # its own registry, not the default
    assert stage.calls == ["start", "run", "stop"] and bus.closed == 1 and started == [True]


def test_missing_topics_exit_1_naming_topics_create(capsys: pytest.CaptureFixture[str]) -> None:
    stage, bus = _Stage(fail=MissingTopicsError(["p.capacity"])), _Bus()
    with pytest.raises(typer.Exit) as caught:
        _run(stage, bus)
    assert caught.value.exit_code == 1
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if x.startswith("gpupool test run: ")]
    assert len(line) == 1 and "gpupool topics create" in line[0] and "p.capacity" in line[0]
    assert stage.calls == ["start"] and bus.closed == 1  # never run, bus closed


class _NamedError(Exception):
    def __str__(self) -> str:
        return "_NamedError: Unable to bootstrap from [('127.0.0.1', 1)]"  # as aiokafka's errors say


@pytest.mark.parametrize(
    ("error", "line"),
    [
        (ConnectionRefusedError("[Errno 111] Connect call failed"), "ConnectionRefusedError: [Errno 111] Connect call failed"),
        (RuntimeError(), "RuntimeError()"),  # no message: its repr
        (_NamedError(), "_NamedError: Unable to bootstrap from [('127.0.0.1', 1)]"),  # its name once
    ],
)
def test_any_other_start_failure_is_one_line_and_exit_1(
    error: Exception, line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    stage, bus = _Stage(fail=error), _Bus()
    with pytest.raises(typer.Exit) as caught:
        _run(stage, bus)
    assert caught.value.exit_code == 1
    err = capsys.readouterr().err  # (and the JSON log line, where a test before set logging up)
    assert f"gpupool test run: cannot start: {line}" in err.splitlines()
    assert "Traceback" not in err
    assert stage.calls == ["start"] and bus.closed == 1


def test_a_usage_error_while_starting_stays_a_usage_error() -> None:
    stage, bus = _Stage(fail=typer.BadParameter("--fabric-state: no such file")), _Bus()
    with pytest.raises(typer.BadParameter):
        _run(stage, bus)
    assert bus.closed == 1


def test_a_value_the_stage_refuses_while_built_is_a_usage_error() -> None:
    def build() -> tuple[_Stage, _Bus]:
        raise ValueError("memory_limit: not a size")

    with pytest.raises(typer.BadParameter, match="memory_limit"):
        run_stage("gpupool test run", build, metrics_port=0, metrics_addr="127.0.0.1")


def test_a_metrics_port_in_use_exits_1_before_starting(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        stage, bus = _Stage(), _Bus()
        with pytest.raises(typer.Exit) as caught:
            _run(stage, bus, port)
    assert caught.value.exit_code == 1
    assert f"gpupool test run: cannot serve /metrics on 127.0.0.1:{port}" in capsys.readouterr().err
    assert stage.calls == [] and bus.closed == 1
