"""Human and JSON output, progress, and errors → exit codes, in one place.

Every command builds one result object and hands it here: with ``--json`` only that object goes
to stdout (as JSON), otherwise a rich rendering does. Progress, warnings and errors always go to
stderr, so ``kiln ... --json | jq`` works while a bar is drawn. Torch-free.

Text that comes from archives, specs, servers or users is never rich markup: a member named
``[/bold]x`` would crash the printer, and ``[a-z0-9._-]`` would vanish from a message. Print it
through :func:`plain` (a :class:`~rich.text.Text`) or, inside a markup string, :func:`esc`; both
also show control characters as escapes, so nothing from an archive can drive the terminal.
Consoles are made with ``emoji=False`` for the same reason (``:name:`` codes are not ours).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.text import Text

from kiln.errors import ExitCode, KilnError, as_flags
from kiln.events import (
    BucketDone,
    BucketStarted,
    DestChanged,
    Event,
    Extracting,
    Fetched,
    Heartbeat,
    ModeStarted,
    Packed,
    Packing,
    PassStarted,
    Proving,
    ServingImports,
    SpecDiffers,
    Tuning,
    Waiting,
    WorkerStarted,
)


def visible(text: str) -> str:
    """``text`` with each non-printable character (ESC, BEL, NUL, bidi overrides, ...) written as
    its Python escape, so untrusted text shows what it holds and cannot move the cursor."""
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text
    )


def esc(value: object) -> str:
    """Untrusted ``value`` for use inside a markup string: shown exactly, never interpreted."""
    return escape(visible(str(value)))


def plain(value: object, style: str = "") -> Text:
    """Untrusted ``value`` as rich Text (a table cell, a title, a line): never markup."""
    return Text(visible(str(value)), style=style)


def console(*, stderr: bool = False) -> Console:
    """A console for kiln's output: no emoji codes, since the text printed is not all ours.

    Piped (a CI log, ``| tee``) a line is never wrapped: rich would assume 80 columns and cut a
    path or a digest in two, and a grep over the log would miss it. Tables take the width they
    need there (:func:`kiln.cli.render.print_table`)."""
    out = Console(stderr=stderr, emoji=False)
    if not out.is_terminal:
        out.soft_wrap = True
    return out


# Library parameters whose flag is not their name spelled with dashes (kiln.errors.flag_of).
FLAGS = {"weights": "--weight", "verify_keys": "--verify-key"}


def flagged(text: str) -> str:
    """Library text as the CLI says it: a parameter it names (:class:`kiln.errors.Worded`) is
    the flag that sets it."""
    return as_flags(text, FLAGS)


def _flagged_all(data: Any) -> Any:
    if isinstance(data, str):
        return flagged(data)
    if isinstance(data, dict):
        return {k: _flagged_all(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_flagged_all(v) for v in data]
    return data


def json_text(data: Any) -> str:
    """A result as ``--json`` prints it (and ``--save`` writes it): one document, keys sorted,
    library text worded with flags (a bundle variant's ``reason``)."""
    return json.dumps(_flagged_all(data), indent=2, sort_keys=True, default=str) + "\n"


def save_json(path: Path, data: Any) -> None:
    """Write ``data`` to ``path`` exactly as ``--json`` prints it (``kiln bench --save``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json_text(data), encoding="utf-8")


class Output:
    def __init__(self, json_mode: bool = False, quiet: bool = False) -> None:
        self.json_mode = json_mode
        self.quiet = quiet
        self.err = console(stderr=True)
        self.out = console()

    def emit(self, data: Any, human: Callable[[Console], None]) -> None:
        if self.json_mode:
            sys.stdout.write(json_text(data))
            sys.stdout.flush()
        else:
            human(self.out)

    def note(self, message: str) -> None:
        """``message`` is plain text (it may quote a spec or an archive), never markup."""
        if not self.quiet:
            self.err.print(plain(message), highlight=False)

    def warn(self, message: str) -> None:
        """``message`` is plain text (it may quote a spec or an archive), never markup."""
        self.err.print(Text.assemble(("warning:", "yellow"), " ", visible(message)))

    @contextlib.contextmanager
    def progress(self) -> Iterator[_ProgressSink]:
        """A sink for kiln's progress events: rich bars on a terminal, plain lines otherwise."""
        enabled = not self.quiet and self.err.is_terminal
        with (
            Progress(
                TextColumn("{task.description}", markup=False),  # holds bucket keys
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=self.err,
                transient=True,
                disable=not enabled,
            ) as bars,
            Progress(
                TextColumn("{task.description}", markup=False),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                console=self.err,
                transient=True,
                disable=not enabled,
            ) as byte_bars,
        ):
            sink = _ProgressSink(bars, byte_bars, self if not enabled else None, self.warn)
            yield sink


class _ProgressSink:
    """Draws :mod:`kiln.events` as bars; without a terminal, prints one plain line per step.

    Piped (a CI log, ``make demo``), a bake says which bucket it starts before its first call,
    which can compile for minutes, and a :class:`~kiln.events.Heartbeat` line while a step stays
    silent; during ``kiln bench`` each line says which mode (and run) it belongs to.
    """

    def __init__(
        self,
        bars: Progress,
        byte_bars: Progress,
        plain: Output | None,
        warn: Callable[[str], None],
    ) -> None:
        self.bars, self.byte_bars, self.plain, self.warn = bars, byte_bars, plain, warn
        self.tasks: dict[str, TaskID] = {}
        self.buckets = 0
        self.label = ""  # the bench mode the next events belong to ("" outside bench)

    def _task(self, progress: Progress, name: str, description: str, total: float | None) -> TaskID:
        if name not in self.tasks:
            self.tasks[name] = progress.add_task(description, total=total)
        return self.tasks[name]

    def _line(self, text: str) -> None:
        if self.plain:
            self.plain.note(f"  {self.label} · {text}" if self.label else f"  {text}")

    def __call__(self, event: Event) -> None:
        match event:
            case ModeStarted() as e:
                self.label = e.label
                if self.plain:
                    self.plain.note(f"bench: {e.label}")
            case PassStarted() as e:
                self.tasks.pop("first", None)
                self.tasks.pop("warm", None)
                if self.plain and e.passes > 1:
                    where = f"{self.label}: " if self.label else ""
                    self.plain.note(f"{where}pass {e.index + 1}/{e.passes}")
            case Tuning() | ServingImports() as e:  # their buckets show as their own progress
                self.tasks.pop("first", None)
                self.tasks.pop("warm", None)
                if self.plain and isinstance(e, ServingImports):
                    self.plain.note("bytecode: serving the packages once for a server's imports")
            case Proving() as e:
                self.tasks.pop("first", None)
                self.tasks.pop("warm", None)
                again = f" (after re-bake {e.attempt})" if e.attempt else ""
                if self.plain:
                    self.plain.note(f"proof: serving the packed artifact in a fresh process{again}")
            case WorkerStarted() as e:
                self._worker_started(e)
            case BucketStarted() as e:
                self._bucket_started(e)
            case BucketDone() as e:
                self._bucket_done(e)
            case Heartbeat() as e:
                self._line(f"still running: {e.what} ({e.elapsed_s:.0f} s)")
            case Waiting() as e:
                if self.plain:
                    self.plain.note(e.message)
                else:
                    self.bars.console.print(plain(e.message), highlight=False)
            case Packing() as e:
                self._task(self.byte_bars, "pack", "pack", e.total)
            case Packed() as e:
                task = self._task(self.byte_bars, "pack", "pack", None)
                self.byte_bars.update(task, advance=e.bytes)
            case Fetched() as e:
                task = self._task(self.byte_bars, "fetch", "fetch", e.total)
                self.byte_bars.update(task, completed=e.bytes, total=e.total)
            case Extracting() as e:
                task = self._task(self.byte_bars, "extract", "unpack", e.total)
                self.byte_bars.update(task, completed=e.bytes, total=e.total)
            case DestChanged() | SpecDiffers() as e:  # with or without a terminal, or --quiet
                self.warn(e.message)
            case _:
                pass

    def _worker_started(self, event: WorkerStarted) -> None:
        self.buckets = event.buckets
        tag = f"{self.label} " if self.label else f"[{len(self.tasks)}] "
        self.tasks["first"] = self.bars.add_task(f"{tag}compile/first call", total=self.buckets)
        self.tasks["warm"] = self.bars.add_task(f"{tag}warm + time", total=self.buckets)

    def _bucket_started(self, event: BucketStarted) -> None:
        task = self.tasks.get(event.phase)
        if task is not None:
            self.bars.update(task, description=self._describe(event.phase, event.key))
        if event.phase == "first":
            self._line(f"{event.key}: start ({event.index + 1}/{self.buckets or '?'})")

    def _bucket_done(self, event: BucketDone) -> None:
        task = self.tasks.get(event.phase)
        if task is not None:
            self.bars.update(task, advance=1, description=self._describe(event.phase, event.key))
        if event.phase == "first":
            self._line(f"{event.key}: first call {event.seconds:.2f}s")

    def _describe(self, phase: str, key: str) -> str:
        return f"{self.label} {phase:5} {key}" if self.label else f"{phase:5} {key}"


def _base(name: str) -> Any:
    """click's exception class ``name`` as this typer raises it (typer >= 0.2x vendors click
    as ``typer._click``, older ones use click itself): found through typer's public export."""
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == name)


_ClickUsageError = _base("UsageError")
_ClickException = _base("ClickException")


def classify(exc: BaseException) -> tuple[int, str, object | None]:
    """``exc`` as (exit code, message, machine-readable detail): kiln's one error table.

    A :class:`KilnError` carries its code; a flag or argument that click refuses (a bad
    ``--order``, a missing SPEC) is a usage error, exit 2; anything else is a bug, exit 1.
    """
    if isinstance(exc, KilnError):  # the library names its parameters; here they are flags
        return int(exc.exit_code), flagged(exc.message), exc.detail
    if isinstance(exc, _ClickUsageError):
        ctx = exc.ctx
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        # typer words a refused choice "Value error, 'x' is not one of ...": say it plainly
        message = exc.format_message().replace(": Value error, ", ": ")
        return int(ExitCode.USAGE), message + hint, None
    if isinstance(exc, _ClickException):
        return exc.exit_code, exc.format_message(), None
    if isinstance(exc, ModuleNotFoundError) and exc.name in ("torch", "triton"):
        # A path that needs torch and missed require_torch: still the one line, not a crash.
        return int(ExitCode.USAGE), f"this needs {exc.name}, which this install lacks", None
    return int(ExitCode.INTERNAL), f"internal error: {type(exc).__name__}: {exc}", None


def report_error(exc: BaseException, json_mode: bool) -> int:
    """Print ``exc`` on stderr (and JSON on stdout in --json mode); return the exit code.

    The first line is the error; a message of several lines (a failed verify: one per bucket)
    goes on below it, indented. The message is plain text: it quotes member names, manifest
    fields and spec values.
    """
    err = console(stderr=True)
    code, message, detail = classify(exc)
    first, _, rest = message.partition("\n")
    err.print(Text.assemble(("kiln: error:", "bold red"), " ", visible(first)), soft_wrap=True)
    for line in rest.split("\n") if rest else ():
        err.print(plain("  " + line), soft_wrap=True)
    if json_mode and not getattr(exc, "reported", False):
        payload = {"error": message, "exit_code": code, "detail": detail}
        sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
    return code
