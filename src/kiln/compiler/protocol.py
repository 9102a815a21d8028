"""The worker protocol: what a parent asks of ``python -m kiln.compiler.worker`` and what it gets.

Bake, verify and bench all run a spec's grid in a fresh interpreter (see
:mod:`kiln.compiler.worker` for why). The request and the outcome cross that process boundary as
JSON files, and the progress events (:mod:`kiln.events`) as JSON lines on the worker's stdout, so
each is a typed model shared by both sides: a field added or renamed is a validation error in the
process that got it wrong, not a dict key silently read with a default. The parent gets the
per-bucket measurements already parsed into :class:`~kiln.artifact.manifest.BucketStats`.
Torch-free.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kiln.artifact.manifest import Aoti, BucketStats, GraphBreak
from kiln.compiler.failures import Incompatible, SpecProblem
from kiln.errors import IncompatibleError, PackageLoadError, UsageError
from kiln.spec import Spec

_STREAM_STRIDE = 1 << 24  # seeds per stream: 16,384 buckets of 1,000 calls


def input_stream(stream: int) -> int:
    """The ``input_seed`` of input stream ``stream``: each bake pass, the bake's proof and each
    verify draw data no other of them drew, as serving traffic would."""
    return (stream % (1 << 16)) * _STREAM_STRIDE


class _Message(BaseModel):
    # Both ends are the same kiln: an unknown field is a bug on one side, not a newer version.
    model_config = ConfigDict(extra="forbid", frozen=True)


class AotiBuild(_Message):
    """Build ``compile.route: aoti``'s packages in this pass (kiln.compiler.aoti_bake)."""

    folder: str = Field(description="the work folder's aoti/: one package folder per program")
    options: dict[str, Any] = Field(default_factory=dict, description="the spec's Inductor options")
    weights: Literal["external", "embed"] = "external"
    ranged: bool = Field(False, description="one program over each axis's range (dynamic: true)")


class WorkerRequest(_Message):
    """One grid pass: which buckets in which order, compiled how, reading and writing what.

    ``torch_kwargs`` is always the caller's decision (a bake pass's, or what an artifact
    recorded): the worker never derives compile arguments from the spec itself.
    """

    spec: dict[str, Any] = Field(
        default_factory=dict,
        description="the spec by value (Spec.canonical()), set by kiln.compiler.launch.run_worker:"
        " the worker compiles what the parent validated and hashed, never a re-read file",
    )
    spec_base: str = Field("", description="the folder the spec's relative paths start from")
    order: list[str] = Field(description="bucket keys, in the order to call them")
    torch_kwargs: dict[str, Any] | None = Field(
        description="torch.compile(model, **torch_kwargs); None runs the model eagerly"
    )
    calls: int = Field(2, ge=1, description="calls per bucket (CUDA-graphed specs get >= 3)")
    steady_calls: int = Field(5, ge=1, description="calls timed for the steady latency")
    first_request: bool = Field(False, description="time one call with fresh inputs when warm")
    cache_root: str | None = Field(None, description="watched for the files each bucket writes")
    megacache_save: str | None = Field(None, description="write the Mega-Cache blob here")
    megacache_load: str | None = Field(None, description="hot-load this Mega-Cache blob first")
    precompile_save: str | None = Field(None, description="build precompiled forwards, save here")
    precompile_load: str | None = Field(None, description="serve from these precompiled forwards")
    frames: Literal["record", "serve"] | None = Field(
        None, description="Dynamo's saved frames: record them (bake) or serve from them"
    )
    aoti_build: AotiBuild | None = Field(None, description="build AOTInductor packages (bake)")
    aoti_load: str | None = Field(
        None, description="serve the AOTInductor packages of the artifact restored here"
    )
    aoti_packages: list[Aoti] | None = Field(
        None,
        description="what aoti_load's folder holds, by rank, when it has no manifest yet: a "
        "bake's work folder, served once to list a server's imports (kiln.compiler.bake)",
    )
    fingerprint: bool = Field(False, description="record this process's environment fingerprint")
    check_eager: bool = Field(
        False,
        description="call the model eagerly on each bucket's inputs before compiling: a spec "
        "it refuses is exit 2 at the spec (the bake's first process only; never a served one)",
    )
    report_imports: bool = Field(False, description="list the library sources imported (bake)")
    bytecode: str | None = Field(
        None, description="a restored bytecode tree to import from (kiln.bytecode.use)"
    )
    route: Literal["plain", "activate"] | None = Field(
        None,
        description="serve a restored folder (cache_root's parent) as a user does: plain "
        "torch.compile on kiln.env's environment, or kiln.activate(); None: a bake or bench pass",
    )
    watch: dict[str, str] = Field(
        default_factory=dict,
        description="label -> folder a served process must not write to (kiln.compiler.writes)",
    )
    device_index: int = Field(0, ge=0)
    input_seed: int = Field(
        0, ge=0, le=2**40, description="offset of every input seed (verify serves unseen data)"
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="set before torch is imported: a rank's cache folders (kiln.compiler.ranks)",
    )

    @model_validator(mode="after")
    def _precompile_compiles(self) -> WorkerRequest:
        if (self.precompile_save or self.precompile_load) and self.torch_kwargs is None:
            raise ValueError("precompiled forwards need torch_kwargs (they are compiled)")
        if self.precompile_save and self.precompile_load:
            raise ValueError("a pass either builds precompiled forwards or loads them")
        aot = self.precompile_save or self.precompile_load
        if self.frames and (self.torch_kwargs is None or aot):
            raise ValueError("saved frames need torch_kwargs and exclude precompiled forwards")
        if self.aoti_build and (self.torch_kwargs is None or aot or self.frames):
            raise ValueError("an AOTInductor build compiles, and only that")
        if self.aoti_load and (self.torch_kwargs is not None or aot or self.frames):
            raise ValueError("serving AOTInductor packages compiles nothing (torch_kwargs None)")
        if self.aoti_packages is not None and not self.aoti_load:
            raise ValueError("aoti_packages describes aoti_load's folder")
        return self

    def replace(self, **changes: Any) -> WorkerRequest:
        """A copy with ``changes``, validated again (``model_copy`` would not validate)."""
        return WorkerRequest.model_validate({**self.model_dump(), **changes})

    def load_spec(self) -> Spec:
        """The spec this pass runs, validated again on this side of the process boundary (as
        merge validates a shard's), its relative paths resolved from :attr:`spec_base`."""
        if not self.spec:
            raise ValueError("a WorkerRequest without a spec (run_worker sets it)")
        return Spec.model_validate(self.spec).with_base(Path(self.spec_base))


class MegacacheInfo(_Message):
    """What happened to torch's Mega-Cache blob in this pass (None: not asked)."""

    loaded: bool | None = None
    saved: bool | None = None
    entries: dict[str, int] = Field(default_factory=dict, description="artifacts per cache kind")


class WorkerResult(_Message):
    """What one pass measured.

    Times are wall-clock epochs, so the parent can subtract its own spawn time: time to ready
    then includes the interpreter start and ``import torch``, as a pod's would.
    """

    buckets: list[BucketStats] = Field(description="in request order")
    process_start: float
    torch_import_s: float
    model_ready: float = Field(description="model built and compiled or loaded, before any call")
    precompile_load_s: float | None = None
    forward_module: str | None = Field(None, description="module of the model's forward")
    first_pass_done: float = Field(description="every bucket has run once")
    warm_done: float
    megacache: MegacacheInfo = Field(default_factory=MegacacheInfo)
    fingerprint: dict[str, Any] | None = None
    graph_breaks: list[GraphBreak] = Field(default_factory=list, description="merged, all buckets")
    imported_sources: list[str] = Field(
        default_factory=list, description="library sources imported (report_imports)"
    )
    bytecode_modules: int = Field(0, ge=0, description="modules imported from request.bytecode")
    phases: dict[str, float] = Field(
        default_factory=dict, description="start-up in order: seconds per phase, before a call"
    )
    aoti: Aoti | None = Field(None, description="the AOTInductor packages this pass built")
    compiler_modules: list[str] = Field(
        default_factory=list, description="torch._dynamo / torch._inductor, if imported by the end"
    )
    workdir: str | None = Field(None, description="the working directory, as NVRTC names it")

    @property
    def compiles(self) -> int:
        return sum(b.compiles for b in self.buckets)


class WorkerFailure(_Message):
    """An expected failure, mapped by the parent to kiln's exit codes.

    ``spec``: the spec is at fault, at ``key`` (exit 2); ``usage``: kiln refused what it was
    given (a :class:`~kiln.errors.UsageError`, e.g. the padding path's ``ShapeError``: exit 2,
    its one line); ``incompatible``: this process cannot use what was baked (exit 5);
    ``unservable``: what was restored cannot serve (:class:`~kiln.errors.PackageLoadError`,
    exit 6); ``internal``: anything else (exit 1, with the log's tail).
    """

    kind: Literal["spec", "usage", "incompatible", "unservable", "internal"]
    message: str
    key: str | None = Field(None, description="the spec key at fault (kind spec)")


def failure_of(exc: Exception) -> tuple[WorkerFailure, int]:
    """How a worker (or replay's) process reports ``exc`` to its parent, with its exit code: the
    spec's problem at a key or what kiln refused (2), what was baked unusable here (5), what was
    restored unable to serve (6), else a bug (1). Called in the ``except`` block: a failure that
    is not the spec's leaves its traceback in the log."""
    if isinstance(exc, SpecProblem):
        return WorkerFailure(kind="spec", key=exc.key, message=str(exc)), 2
    traceback.print_exc()
    if isinstance(exc, UsageError):
        return WorkerFailure(kind="usage", message=str(exc)), 2
    if isinstance(exc, (Incompatible, IncompatibleError)):
        return WorkerFailure(kind="incompatible", message=str(exc)), 5
    if isinstance(exc, PackageLoadError):
        return WorkerFailure(kind="unservable", message=exc.problem), 6
    return WorkerFailure(kind="internal", message=f"{type(exc).__name__}: {exc}"), 1


class WorkerOutcome(_Message):
    """The file a worker leaves: exactly one of a result or a failure."""

    result: WorkerResult | None = None
    failure: WorkerFailure | None = None

    @model_validator(mode="after")
    def _one_of(self) -> WorkerOutcome:
        if (self.result is None) == (self.failure is None):
            raise ValueError("an outcome holds a result or a failure")
        return self
