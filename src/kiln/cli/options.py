"""Options shared by several commands, so they read and behave the same everywhere."""

from __future__ import annotations

import typer

JSON = typer.Option(False, "--json", help="Print only machine-readable JSON on stdout.")
QUIET = typer.Option(False, "--quiet", "-q", help="No progress on stderr.")
DEVICE_INDEX = typer.Option(
    None,
    "--device-index",
    help="CUDA index this process serves on (torch keys include it; bakes use 0).",
    envvar="KILN_DEVICE_INDEX",
)
