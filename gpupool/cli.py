"""``gpupool`` command line: one sub-command group per stage, plus ``demo``."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="gpupool",
    help="Lend idle GPUs of an InfiniBand training pool to edge inference sites, and take them back.",
    no_args_is_help=True,
)
