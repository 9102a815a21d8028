"""Options shared by several commands, so they read and behave the same everywhere."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from kiln.grid import Order

if TYPE_CHECKING:  # typer >= 0.2x vendors click and no longer installs it
    import click

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


class KilnCommand(TyperCommand):
    """A command whose help reads like the README's: ``kiln bake [OPTIONS] SPEC`` and
    ``ARTIFACTS...`` rather than typer's ``{spec}`` and ``<list[Path]>``, and no ``<bool>``
    beside a flag, which takes no value."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        return _readable(super().get_params(ctx))  # --help included, which click adds here


class KilnGroup(TyperGroup):
    """The ``kiln`` group itself: ``--version`` and ``--help`` without ``<bool>``."""

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        return _readable(super().get_params(ctx))


def _readable(params: list[click.Parameter]) -> list[click.Parameter]:
    for param in params:
        if type(param) is TyperArgument:
            param.__class__ = _Argument
        elif type(param) is TyperOption and param.is_flag:
            param.__class__ = _Flag
    return params


class _Argument(TyperArgument):
    @property
    def display_name_raw(self) -> str:
        return self.metavar or (self.name or "").upper()

    def _usage_display_name(self) -> str:
        name = self.display_name_raw + ("..." if self.nargs != 1 else "")
        return name if self.required else f"[{name}]"

    def display_type_rich(self, ctx: click.Context) -> str | None:
        return None  # the name says what it is; the help says the rest


class _Flag(TyperOption):
    def display_type_rich(self, ctx: click.Context) -> str | None:
        return None


class OnMissChoice(str, Enum):
    """``--on-miss``: kiln.serving.ON_MISS as a choice (tests hold the two lists together)."""

    ERROR = "error"
    EAGER = "eager"
    COMPILE = "compile"
