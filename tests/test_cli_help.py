"""Every ``gpupool`` command explains itself: ``--help`` works on each, and says something.

Walks the whole click tree that typer builds, so a command added later is covered too. Help text
is plain text: brackets such as ``host/uuid[/gi]`` must print as they are (a markup parser once
turned them into a crash).
"""

from __future__ import annotations

from typing import Any

import typer
from typer.testing import CliRunner

from gpupool.cli import app


def _walk(cmd: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    out = [(path, cmd)]
    if hasattr(cmd, "commands"):  # a group (typer vendors its click)
        for name, sub in sorted(cmd.commands.items()):
            out.extend(_walk(sub, (*path, name)))
    return out


def test_every_command_has_working_help() -> None:
    root = typer.main.get_command(app)
    commands = _walk(root)
    assert len(commands) > 15
    runner = CliRunner()
    failures = []
    for path, cmd in commands:
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        if result.exit_code != 0 or "Usage" not in result.output:
            failures.append(f"gpupool {' '.join(path)} --help: exit {result.exit_code}: {result.output[-300:]}")
        elif not (cmd.help or "").strip():
            failures.append(f"gpupool {' '.join(path)} has no help text")
    assert not failures, "\n".join(failures)


def test_brackets_in_help_print_verbatim() -> None:
    result = CliRunner().invoke(app, ["broker", "demand", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "[/gi]" in result.output
