"""One worker process, started and followed: the part of launching that :mod:`kiln.compiler.launch`
(this process starts the worker, or torchrun starting K) and :mod:`kiln.compiler.user_launch`
(rank 0 of a user's launch, and its followers) share.

:func:`spawn` runs a command in its own process group and relays the worker's progress events
(:func:`relay_events`), with a :class:`~kiln.events.Heartbeat` while a step stays silent; it
kills the whole group when interrupted, so nothing keeps writing into a folder about to be
removed. :func:`read_outcome` reads what the worker left. Neither knows about specs or ranks;
:func:`failure_error` then turns a reported failure into kiln's error for it (the spec's, at its
key), which replay's process shares with the grid worker's.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from pydantic import ValidationError

from kiln.compiler.protocol import WorkerFailure, WorkerOutcome
from kiln.errors import IncompatibleError, KilnError, PackageLoadError, UsageError
from kiln.events import (
    WORKER_EVENTS,
    BucketDone,
    BucketStarted,
    EventSink,
    FirstPassDone,
    Heartbeat,
    WorkerEvent,
    WorkerStarted,
    ignore,
)
from kiln.spec import Spec, error_at
from kiln.workdir import process_env

HEARTBEAT_ENV = "KILN_HEARTBEAT_S"
HEARTBEAT_S = 15.0  # default: often enough for a CI log, rare enough not to drown it
LOG_TAIL = 15  # lines of the worker's stderr shown with an error


def heartbeat_interval() -> float | None:
    """Seconds of worker silence between heartbeats: ``KILN_HEARTBEAT_S``, default 15; 0 = off."""
    text = os.environ.get(HEARTBEAT_ENV, "").strip()
    if not text:
        return HEARTBEAT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise UsageError(f"{HEARTBEAT_ENV}={text!r}: give a number of seconds (0 turns it off)")
    return seconds or None


def worker_command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "kiln.compiler.worker", *args]


def read_outcome(path: Path) -> WorkerOutcome | None:
    """What the worker left; None when it died before writing it."""
    return WorkerOutcome.model_validate_json(path.read_bytes()) if path.exists() else None


class WorkerError(KilnError):
    """The worker failed in a way that is not the spec's or the environment's (exit 1)."""


def failure_error(spec: Spec, failure: WorkerFailure, log: str) -> KilnError:
    """kiln's error for what the worker reported: the spec's (exit 2, at its key), kiln's
    refusal of what it was given (exit 2), an incompatibility (exit 5), a restored folder that
    cannot serve (exit 6), or a :class:`WorkerError` with the tail of its log."""
    if failure.kind == "spec":
        return error_at(spec, failure.key or "", failure.message)
    if failure.kind == "usage":
        return UsageError(failure.message)
    if failure.kind == "incompatible":
        return IncompatibleError(failure.message)
    if failure.kind == "unservable":
        return PackageLoadError(failure.message)
    return WorkerError(f"{failure.message}\n{log_tail(log)}".strip())


def log_tail(log: str) -> str:
    """The last :data:`LOG_TAIL` lines of a worker's stderr: what an error shows of it."""
    return "\n".join(log.strip().splitlines()[-LOG_TAIL:])


def spawn(
    folder: Path,
    command: list[str],
    env: dict[str, str],
    on_event: EventSink | None,
    heartbeat_s: float | None,
    timeout: float | None,
    *,
    graceful: bool = False,
    cwd: Path | None = None,
) -> tuple[float, int]:
    """Run ``command`` (a worker, or torchrun starting K), relaying its events; (start epoch,
    exit code). ``graceful``: on interruption, SIGTERM first (torchrun forwards it to the ranks,
    which it starts in sessions of their own), SIGKILL after :data:`STOP_GRACE_S`. ``cwd``:
    the folder it runs in, named as a shell started there names it (kiln.workdir); None: this
    process's."""
    with open(folder / "stderr.log", "wb") as err:
        spawned = time.time()
        proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            env=(env | process_env(cwd)) if cwd else env,
            cwd=cwd,
            start_new_session=True,
        )
        try:
            assert proc.stdout is not None
            relay_events(proc.stdout, on_event or ignore, heartbeat_s)
            return spawned, proc.wait(timeout=timeout)
        except BaseException:
            # The leader is not reaped yet, so its group id cannot have been reused.
            if graceful:
                _stop(proc)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            proc.stdout.close()


STOP_GRACE_S = 20.0  # torchrun's own wait for its ranks is 30 s; SIGKILL follows, ranks orphaned


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Ask torchrun to stop its ranks (each in its own session: a group kill misses them)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_GRACE_S)


def relay_events(stream: IO[bytes], on_event: EventSink, heartbeat_s: float | None) -> None:
    """Pass the worker's events from ``stream`` to ``on_event`` until the worker closes it.

    Lines that are not events (a model that prints) are skipped. While nothing arrives for
    ``heartbeat_s`` seconds (None: never), send a :class:`Heartbeat` naming the step the worker
    is in and how long it has been in it.
    """
    fd, pending = stream.fileno(), b""
    activity = _Activity()
    last = time.monotonic()
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while True:
            wait = None if heartbeat_s is None else max(0.0, last + heartbeat_s - time.monotonic())
            if not selector.select(wait):
                on_event(activity.heartbeat())
                last = time.monotonic()
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                event = _parse(line)
                if event is not None:
                    activity.saw(event)
                    last = time.monotonic()
                    on_event(event)


def _parse(line: bytes) -> WorkerEvent | None:
    if not line.startswith(b"{"):
        return None
    try:
        return WORKER_EVENTS.validate_json(line)
    except ValidationError:
        return None


class _Activity:
    """What the worker is doing, as far as its last event says: a heartbeat's words."""

    def __init__(self) -> None:
        self.what, self.since = "start-up (import torch, build the model)", time.monotonic()
        self.buckets = 0

    def saw(self, event: WorkerEvent) -> None:
        if isinstance(event, WorkerStarted):
            self.buckets = event.buckets
            self._now("first pass")
        elif isinstance(event, BucketStarted):
            self._now(f"{event.key}: {'first call' if event.phase == 'first' else 'warm calls'}")
        elif isinstance(event, FirstPassDone):
            self._now("warm pass")
        elif isinstance(event, BucketDone) and event.phase == "warm":
            last = event.index + 1 == self.buckets
            self._now("saving caches" if last else f"after {event.key}")

    def _now(self, what: str) -> None:
        self.what, self.since = what, time.monotonic()

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(what=self.what, elapsed_s=time.monotonic() - self.since)
