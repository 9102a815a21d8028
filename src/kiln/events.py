"""Progress events: what a long step reports while it runs, as typed values.

Bake, restore, verify and bench report progress through one sink (:data:`EventSink`) that the
CLI draws as rich bars on stderr, or as one plain line per step when stderr is not a terminal
(CI logs, ``make demo``). Each event is a small pydantic model with an ``event`` tag: the
worker's cross a process boundary as JSON lines (:data:`WORKER_EVENTS` parses them back), and a
sink dispatches on the type, not on dictionary keys. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

Phase = Literal["first", "warm"]


class _Event(BaseModel):
    # Progress is best effort: a field a newer sender adds must not stop a bake.
    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)


# --- from the worker process (one grid pass, kiln.compiler.worker) ----------------------------
class WorkerStarted(_Event):
    """The model is built and compiled or loaded; the grid starts."""

    event: Literal["start"] = "start"
    buckets: int
    torch_import_s: float = 0.0


class BucketStarted(_Event):
    """Sent before a bucket's first call (phase ``first``: where compiling happens) or its warm
    calls: a piped log shows what is running *now*, not only what finished."""

    event: Literal["bucket_start"] = "bucket_start"
    phase: Phase
    index: int
    key: str


class BucketDone(_Event):
    event: Literal["bucket"] = "bucket"
    phase: Phase
    index: int
    key: str
    seconds: float = Field(description="the first call (phase first), the steady latency (warm)")


class FirstPassDone(_Event):
    """Every bucket ran once: "ready" in bench's terms."""

    event: Literal["first_pass_done"] = "first_pass_done"


# --- from the parent (kiln.compiler.launch, bake, bench) ---------------------------------------
class Heartbeat(_Event):
    """A worker step is still running (a big graph compiling) and has said nothing for a while:
    keeps a piped log from looking hung. ``what`` is the step, ``elapsed_s`` its time so far."""

    event: Literal["heartbeat"] = "heartbeat"
    what: str
    elapsed_s: float


class Waiting(_Event):
    """The step waits for something another process holds (a bake of the same name holds its
    work folder's lock): said once when the wait starts and once when it ends, so a silent
    minute never looks like a hang."""

    event: Literal["wait"] = "wait"
    message: str


class PassStarted(_Event):
    """A bake pass starts a fresh worker (``index`` counts from 0)."""

    event: Literal["pass"] = "pass"
    index: int
    passes: int
    order: list[str]


class Proving(_Event):
    """The bake serves its packed artifact from a fresh process (``attempt`` 0, then after
    each re-bake)."""

    event: Literal["prove"] = "prove"
    attempt: int


class ModeStarted(_Event):
    """A bench mode starts one of its runs (``run`` counts from 1; ``bake`` is a mode here)."""

    event: Literal["mode"] = "mode"
    mode: str
    run: int = 1
    runs: int = 1

    @property
    def label(self) -> str:
        """``kiln`` or ``kiln 2/3``: what bench progress lines are prefixed with."""
        return self.mode if self.runs == 1 else f"{self.mode} {self.run}/{self.runs}"


class Capturing(_Event):
    event: Literal["capture"] = "capture"


class Tuning(_Event):
    """The bake's tuning pre-pass (a GPU spec): kernels benchmark their launch configs before
    the graphs that ship are compiled (kiln.compiler.bake explains why)."""

    event: Literal["tune"] = "tune"


class ServingImports(_Event):
    """The AOT route's bake serves its packages once, in a fresh process, to learn which
    modules a server imports: only their bytecode ships (kiln.compiler.bake explains why)."""

    event: Literal["serving-imports"] = "serving-imports"


class Packing(_Event):
    event: Literal["pack"] = "pack"
    total: int = Field(description="bytes of the files going into the artifact")


class Packed(_Event):
    event: Literal["packed"] = "packed"
    bytes: int = Field(description="bytes packed since the last event")


# --- from restore (sent as dicts of these shapes) ---------------------------------------------
class Fetching(_Event):
    event: Literal["fetch"] = "fetch"
    source: str


class Fetched(_Event):
    event: Literal["fetched"] = "fetched"
    bytes: int = Field(description="so far")
    total: int | None = None


class Extracting(_Event):
    event: Literal["extract"] = "extract"
    bytes: int = Field(description="so far")
    total: int | None = None


class Recovered(_Event):
    event: Literal["recovered"] = "recovered"
    dest: str
    source: str = Field(alias="from")


class DestChanged(_Event):
    """Restore found DEST changed since it was installed (:mod:`kiln.artifact.drift`): it
    installs the artifact again instead of calling it a no-op."""

    event: Literal["dest_changed"] = "dest_changed"
    dest: str
    added: int
    changed: int
    removed: int

    @property
    def message(self) -> str:
        files = "file" if self.added == 1 else "files"
        return (
            f"{self.dest} changed since it was installed ({self.added} {files} added, "
            f"{self.changed} changed, {self.removed} removed): re-installing"
        )


class SpecDiffers(_Event):
    """verify's spec is not the one baked into the artifact: said before it serves (a bucket
    the bake never compiled takes its whole compile before the report could say why)."""

    event: Literal["spec_differs"] = "spec_differs"
    spec: str
    keys: list[str] = Field(description="dotted spec keys that differ (empty: only the digest)")
    unbaked: list[str] = Field(description="why each served bucket outside the baked grid is")

    @property
    def message(self) -> str:
        where = ", ".join(self.keys) or "its digest"
        text = f"{self.spec} differs from the spec baked into this artifact at: {where}"
        if self.unbaked:
            shown = "; ".join(self.unbaked[:3]) + ("; ..." if len(self.unbaked) > 3 else "")
            text += f"; {len(self.unbaked)} bucket(s) will compile: {shown}"
        return text


WorkerEvent = Annotated[
    WorkerStarted | BucketStarted | BucketDone | FirstPassDone, Field(discriminator="event")
]
Event = (
    WorkerStarted
    | BucketStarted
    | BucketDone
    | FirstPassDone
    | Heartbeat
    | Waiting
    | PassStarted
    | Proving
    | ModeStarted
    | Capturing
    | Tuning
    | ServingImports
    | Packing
    | Packed
    | Fetching
    | Fetched
    | Extracting
    | Recovered
    | DestChanged
    | SpecDiffers
)
EventSink = Callable[[Event], None]

WORKER_EVENTS: TypeAdapter[WorkerEvent] = TypeAdapter(WorkerEvent)


def ignore(_event: Event) -> None:
    """The sink for callers that do not watch progress."""
