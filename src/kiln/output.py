"""Human and JSON output, progress, and errors → exit codes, in one place.

Every command builds one result object and hands it here: with ``--json`` only that object goes
to stdout (as JSON), otherwise a rich rendering does. Progress, warnings and errors always go to
stderr, so ``kiln ... --json | jq`` works while a bar is drawn. Torch-free.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
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

from kiln.errors import ExitCode, KilnError


class Output:
    def __init__(self, json_mode: bool = False, quiet: bool = False) -> None:
        self.json_mode = json_mode
        self.quiet = quiet
        self.err = Console(stderr=True)
        self.out = Console()

    def emit(self, data: Any, human: Callable[[Console], None]) -> None:
        if self.json_mode:
            sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
            sys.stdout.flush()
        else:
            human(self.out)

    def note(self, message: str) -> None:
        if not self.quiet:
            self.err.print(message, highlight=False)

    def warn(self, message: str) -> None:
        self.err.print(f"[yellow]warning:[/] {message}", highlight=False)

    @contextlib.contextmanager
    def progress(self) -> Iterator[Callable[[dict[str, Any]], None]]:
        """An event sink that draws kiln's progress events as rich bars on stderr."""
        enabled = not self.quiet and self.err.is_terminal
        with (
            Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=self.err,
                transient=True,
                disable=not enabled,
            ) as bars,
            Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                console=self.err,
                transient=True,
                disable=not enabled,
            ) as byte_bars,
        ):
            sink = _ProgressSink(bars, byte_bars, self if not enabled else None)
            yield sink


class _ProgressSink:
    """Maps worker/restore events to bars; without a terminal, prints one line per step."""

    def __init__(self, bars: Progress, byte_bars: Progress, plain: Output | None) -> None:
        self.bars, self.byte_bars, self.plain = bars, byte_bars, plain
        self.tasks: dict[str, TaskID] = {}
        self.buckets = 0

    def _task(self, progress: Progress, name: str, description: str, total: float | None) -> TaskID:
        if name not in self.tasks:
            self.tasks[name] = progress.add_task(description, total=total)
        return self.tasks[name]

    def __call__(self, event: dict[str, Any]) -> None:
        kind = event.get("event")
        if kind == "pass":
            self.tasks.pop("first", None)
            self.tasks.pop("warm", None)
            if self.plain and event["passes"] > 1:
                self.plain.note(f"pass {event['index'] + 1}/{event['passes']}")
        elif kind == "start":
            self.buckets = int(event["buckets"])
            tag = len(self.tasks)
            self.tasks["first"] = self.bars.add_task(
                f"compile/first call [{tag}]", total=self.buckets
            )
            self.tasks["warm"] = self.bars.add_task(f"warm + time      [{tag}]", total=self.buckets)
        elif kind == "bucket":
            task = self.tasks.get(event["phase"])
            if task is not None:
                self.bars.update(task, advance=1, description=f"{event['phase']:5} {event['key']}")
            if self.plain and event["phase"] == "first":
                self.plain.note(f"  {event['key']}: first call {event['first_call_s']:.2f}s")
        elif kind == "pack":
            self._task(self.byte_bars, "pack", "pack", event["bytes"])
        elif kind == "packed":
            self.byte_bars.update(
                self._task(self.byte_bars, "pack", "pack", None), advance=event["bytes"]
            )
        elif kind == "fetched":
            t = self._task(self.byte_bars, "fetch", "fetch", event.get("total"))
            self.byte_bars.update(t, completed=event["bytes"], total=event.get("total"))
        elif kind == "extract":
            t = self._task(self.byte_bars, "extract", "unpack", event.get("total"))
            self.byte_bars.update(t, completed=event["bytes"], total=event.get("total"))


def report_error(exc: BaseException, json_mode: bool) -> int:
    """Print one line for ``exc`` (and JSON on stdout in --json mode); return the exit code."""
    err = Console(stderr=True)
    if isinstance(exc, KilnError):
        code, message, detail = int(exc.exit_code), exc.message, exc.detail
    else:
        code, message, detail = (
            int(ExitCode.INTERNAL),
            f"internal error: {type(exc).__name__}: {exc}",
            None,
        )
    first, _, rest = message.partition("\n")
    err.print(f"[bold red]kiln: error:[/] {first}", highlight=False, soft_wrap=True)
    if rest:
        err.print(rest, style="dim", highlight=False, soft_wrap=True)
    if json_mode and not getattr(exc, "reported", False):
        payload = {"error": message, "exit_code": code, "detail": detail}
        sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
    return code
