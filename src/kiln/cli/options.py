"""Options shared by several commands, so they read and behave the same everywhere."""

from __future__ import annotations

from enum import Enum

import typer

from kiln.grid import Order

JSON = typer.Option(False, "--json", help="Print only machine-readable JSON on stdout.")
QUIET = typer.Option(False, "--quiet", "-q", help="No progress on stderr.")
# A choice, so `--order random` is exit 2 before anything runs.
ORDER = typer.Option(Order.SHUFFLE, "--order", help="Request order (shuffle: as traffic arrives).")
DEVICE_INDEX = typer.Option(
    None,
    "--device-index",
    help="CUDA index this process serves on (torch keys include it; bakes use 0).",
    envvar="KILN_DEVICE_INDEX",
)


class Device(str, Enum):
    """The devices a spec's ``model.device`` names (tests hold the two lists together)."""

    CPU = "cpu"
    CUDA = "cuda"


class OnMissChoice(str, Enum):
    """``--on-miss``: kiln.serving.ON_MISS as a choice (tests hold the two lists together)."""

    ERROR = "error"
    EAGER = "eager"
    COMPILE = "compile"
