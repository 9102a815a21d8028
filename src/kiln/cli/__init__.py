"""kiln's command line: a thin Typer layer over the library API.

Each command module parses arguments, calls one library function and hands the result to
:class:`kiln.output.Output`. Errors are formatted here, once, into the documented exit codes.
Importing this package never imports torch: commands that need it import it when they run.
"""

from __future__ import annotations

import signal
import sys
import types

import typer

from kiln._version import __version__
from kiln.cli import artifacts, bench, build, serve, sign
from kiln.cli.output import report_error

app = typer.Typer(
    name="kiln",
    help="Bake torch.compile caches in CI, ship them as verified artifacts, prove they hit.",
    epilog=(
        "Exit codes: 0 ok · 1 internal error · 2 usage or spec error · 3 integrity failure · "
        "4 not found · 5 incompatible environment · 6 verification failed."
    ),
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
for module in (build, artifacts, serve, bench, sign):
    module.register(app)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"kiln {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """Bake torch.compile caches in CI, ship them as verified artifacts, prove they hit."""


def _terminated(signum: int, _frame: types.FrameType | None) -> None:
    """SIGTERM unwinds like Ctrl-C: ``finally`` blocks and context managers run, so a bake kills
    its worker and removes its temporary folders. Later SIGTERMs are ignored, so that cleanup
    is not cut short; SIGKILL still ends it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def main() -> None:
    signal.signal(signal.SIGTERM, _terminated)
    try:
        app(standalone_mode=True)
    except SystemExit:
        raise
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            sys.exit(130)
        sys.exit(report_error(exc, "--json" in sys.argv))
