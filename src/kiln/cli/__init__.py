"""kiln's command line: a thin Typer layer over the library API.

Each command module parses arguments, calls one library function and hands the result to
:class:`kiln.cli.output.Output`. Errors, click's usage errors included, are formatted once, by
:func:`kiln.cli.output.report_error`, into the documented exit codes.
Importing this package never imports torch: commands that need it import it when they run.
"""

from __future__ import annotations

import signal
import sys
import types

import typer

from kiln._version import __version__
from kiln.cli import artifacts, bench, build, merge, plan, serve, sign
from kiln.cli.options import KilnCommand, KilnGroup
from kiln.cli.output import report_error
from kiln.compiler import ignore_numpy_warning
from kiln.errors import ExitCode

app = typer.Typer(
    name="kiln",
    cls=KilnGroup,
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
for module in (build, artifacts, merge, serve, bench, plan, sign):
    module.register(app)
for info in app.registered_commands:
    info.cls = KilnCommand  # typer's default, TyperCommand, with help that reads like the README


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
    """Run the app; every error, click's usage errors included, leaves through report_error.

    Click runs non-standalone so that a bad flag is reported like any other error: one line,
    exit 2, and the JSON error object on stdout with ``--json``.
    """
    signal.signal(signal.SIGTERM, _terminated)
    ignore_numpy_warning()  # env, check, verify import torch in this process
    try:
        code = app(standalone_mode=False)
    except SystemExit:
        raise
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            sys.exit(130)
        if type(exc).__name__ == "NoArgsIsHelpError":  # `kiln` alone: the help is printed
            sys.exit(int(ExitCode.USAGE))
        sys.exit(report_error(exc, "--json" in sys.argv))
    sys.exit(code if isinstance(code, int) else 0)
