"""``gpupool config ...``: show the effective settings (:mod:`gpupool.settings`)."""

from __future__ import annotations

import json
import tomllib
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console

from gpupool.settings import CONFIG_ENV, effective_config, load_settings, to_toml

config_app = typer.Typer(
    no_args_is_help=True,
    help="Settings: GPUPOOL_* environment variables and a TOML file (GPUPOOL_CONFIG or --config).",
)


class OutputFormat(StrEnum):
    """How ``config show`` prints."""

    TOML = "toml"
    JSON = "json"


@config_app.command("show")
def show(
    config: Annotated[
        Path | None,
        typer.Option("--config", help=f"TOML settings file; default: ${CONFIG_ENV} if set, else none."),
    ] = None,
    output: Annotated[
        OutputFormat, typer.Option("--format", help="Print as TOML or JSON.")
    ] = OutputFormat.TOML,
) -> None:
    """Print the effective settings, secrets masked as **********.

    Precedence: GPUPOOL_* environment variables (nested groups with __, e.g.
    GPUPOOL_IDLE__MIN_IDLE_S=120) over the TOML file over the defaults. The TOML output is itself a
    valid settings file (unset values are listed in a comment). Exit code 1 if the file is
    missing or does not parse, or a value is invalid (the message names it).
    """
    err = Console(stderr=True)
    try:
        settings = load_settings(config)
    except FileNotFoundError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from exc
    except tomllib.TOMLDecodeError as exc:
        err.print(f"[red]the settings file does not parse:[/red] {exc}")
        raise typer.Exit(1) from exc
    except ValidationError as exc:
        err.print(f"[red]invalid settings:[/red]\n{exc}")
        raise typer.Exit(1) from exc
    data = effective_config(settings)
    if output is OutputFormat.JSON:
        typer.echo(json.dumps(data, indent=2))
    else:
        typer.echo(to_toml(data), nl=False)
