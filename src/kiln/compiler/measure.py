"""Measuring a worker pass: timed calls (:class:`Forward`), what each step compiled
(:class:`Meter`: torch's counters, Dynamo's log, precompiled misses, files written) and where
start-up went (:class:`Phases`). The same measures serve bake, verify and bench, so "what bake
compiled" and "what verify hit" are counted the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kiln.artifact.manifest import CompileCounts, GraphBreak
from kiln.compiler.capture import snapshot
from kiln.compiler.counters import CompileCounters, compile_counts
from kiln.compiler.dynamo_log import DynamoLog
from kiln.compiler.writes import Snapshot, Watch

if TYPE_CHECKING:
    from kiln.compiler.precompile import PrecompiledForward

_T = TypeVar("_T")


class Clock:
    """Wall time less kiln's own looking: a served process's timestamps (start-up phases, time
    to ready) are what a server that watches nothing would have seen. On the H100 (2026-12-06)
    an LLM's 9-bucket first pass took ~3 s longer than its start-up and first calls on the
    kiln and aoti routes, and no longer on eager, which watches no folder: that gap held the
    snapshots of the restored folder (its torch bytecode alone is thousands of files) before
    and after each bucket, which bench had charged to the route it measured."""

    def __init__(self) -> None:
        self.looking_s = 0.0

    def now(self) -> float:
        return time.time() - self.looking_s

    @contextlib.contextmanager
    def looking(self) -> Iterator[None]:
        """Time spent in here is not the served process's."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.looking_s += time.perf_counter() - t0


CLOCK = Clock()  # one per process: every timestamp a worker reports reads it


class Phases:
    """Start-up, phase by phase: where a restored process spends the time before its first
    call (bench shows it; the first one, since process start, includes kiln's own imports)."""

    def __init__(self, start: float) -> None:
        self.last = start  # the process's start: the first phase includes kiln's own imports
        self.phases: dict[str, float] = {}

    def mark(self, name: str) -> float:
        now = CLOCK.now()
        self.phases[name] = round(now - self.last, 4)
        self.last = now
        return self.phases[name]


@dataclass
class Forward:
    """The callable a pass times: the compiled model, precompiled forwards, or the eager model."""

    fn: Callable[..., Any]
    call_kwargs: dict[str, Any]
    sync: Callable[[], None]
    precompiled: PrecompiledForward | None = None
    building: bool = False  # a precompile bake: each bucket compiles ahead of its first call
    load_s: float | None = None  # time to load precompiled forwards
    serves_frames: bool = False  # Dynamo's saved frames loaded: a traced frame is a miss
    aoti: Any = None  # route: aoti: the AotiBuilder (bake) or AotiModel (serve) behind fn

    def timed(self, inputs: dict[str, Any]) -> float:
        self.sync()
        t0 = time.perf_counter()
        self.fn(**inputs, **self.call_kwargs)
        self.sync()
        return time.perf_counter() - t0

    def first(self, inputs: dict[str, Any]) -> float:
        """A bucket's first call; a precompile bake counts the ahead-of-time compile in it."""
        if not self.building:
            return self.timed(inputs)
        builder = self.precompiled or self.aoti
        assert builder is not None
        t0 = time.perf_counter()
        builder.add(**inputs, **self.call_kwargs)
        self.timed(inputs)
        return time.perf_counter() - t0

    @property
    def build_s(self) -> float:
        """Seconds the AOT route's builder spent building packages so far (0 elsewhere: Dynamo
        times its own compiles)."""
        return self.aoti.build_s if self.building and self.aoti is not None else 0.0

    @property
    def misses(self) -> int:
        """Calls no precompiled forward (or AOTInductor package) accepted so far."""
        served = self.precompiled or self.aoti
        return served.misses if served is not None else 0

    @property
    def miss_reason(self) -> str | None:
        """Why the last precompiled miss missed (the failing guard), where known."""
        return self.precompiled.miss_reason if self.precompiled is not None else None


class Meter:
    """Measures what one step compiled: the difference in torch's counters, what Dynamo logged
    (recompiles, graph breaks, frames), the precompiled-forward misses, and the files the step
    added to the cache root."""

    def __init__(
        self,
        cache_root: str | None,
        dynamo: DynamoLog,
        forward: Forward,
        watch: Watch | None = None,
        started: Snapshot | None = None,
    ) -> None:
        self.root = Path(cache_root) if cache_root else None
        self.dynamo, self.forward = dynamo, forward
        self.watch, self.started = watch, started
        self.breaks: list[GraphBreak] = []  # every bucket's, merged into the result

    def _files(self) -> set[str]:
        with CLOCK.looking():
            return snapshot(self.root) if self.root else set()

    def _written(self, step: Callable[[], _T]) -> tuple[_T, list[str]]:
        """``step``'s value and what it wrote where a served process must not (the first
        step also owns what start-up wrote: the import, the model build, the compile call).
        A step's closing snapshot opens the next step's: one walk of the folders per step."""
        assert self.watch is not None
        with CLOCK.looking():
            before = self.started or self.watch.snapshot()
        value = step()
        with CLOCK.looking():
            self.started = self.watch.snapshot()
            return value, self.watch.written(before, self.started)

    def measure(self, key: str, step: Callable[[], _T]) -> tuple[_T, CompileCounts]:
        before = CompileCounters.read()
        files = self._files() if self.watch is None else set()
        mark, missed, built = self.dynamo.mark(), self.forward.misses, self.forward.build_s
        if self.watch is not None:
            value, new_files = self._written(step)
        else:
            value = step()
            new_files = sorted(self._files() - files)
        self.breaks += [
            b.model_copy(update={"buckets": [key]}) for b in self.dynamo.breaks_since(mark)
        ]
        traced = self.dynamo.frames_since(mark)
        misses = self.forward.misses - missed
        reasons = self.dynamo.recompiles_since(mark)
        if misses and self.forward.miss_reason:
            reasons = [f"precompiled: {self.forward.miss_reason}", *reasons]
        if self.forward.serves_frames:  # the saved frames did not cover these
            misses += len(traced)
        diff = CompileCounters.read() - before
        # The AOT route's export and package build, which no Dynamo timer sees, is compile time.
        diff = dataclasses.replace(diff, compile_s=diff.compile_s + self.forward.build_s - built)
        compiles = compile_counts(
            diff,
            new_files,
            served=self.watch is not None,
            recompile_reasons=reasons,
            precompile_misses=misses,
            frames=traced,
            benchmarked=self.dynamo.benchmarked_since(mark),
        )
        return value, compiles
