"""Replay: serve a traffic log's shapes through the padding path, in a fresh process.

``kiln verify SPEC --cache DIR --traffic LOG`` proves what a server on the restored folder will
do with the sizes its users send. As verify does, it serves a private copy of DIR with an empty
``HOME`` and ``TMPDIR`` (DIR stays as found, and every file the process writes in any of the
three is compile work): a new interpreter calls ``kiln.activate(DIR).compile(model)`` exactly
as a server would, then sends every logged request (random data at the logged sizes, in log
order, each line ``count`` times), and measures per request what compiled (torch's counters),
the latency, and the host time the padding path added. With ``eager``, a second pass after the
last request calls the unpadded eager model on each request's inputs (and the served model
again, for how far apart their outputs are): a server never makes those calls, and on a GPU the
eager kernels at unpadded sizes wrote to the CUDA driver's JIT cache (3 files for the reference
LLM on an H100), so what that pass writes is reported apart (``eager_new_files``)
and fails nothing. Files written are judged by walking the watched
folders around each off-grid request (whose writes are its own) and once at the end, not around
every request: a restored LLM folder holds thousands of files, and two walks per request made a
1,000-request replay on the H200 run for over 6 minutes. Every in-grid request must compile
nothing (exit 6 otherwise); requests off the grid follow ``on_miss`` and are reported, not
failed.
``kiln bench SPEC --traffic LOG`` bakes, restores and replays with the eager comparison.
"""

from __future__ import annotations

import math
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kiln.artifact.archive import read_manifest
from kiln.compiler.counters import CompileCounters
from kiln.compiler.padded import miss_policy
from kiln.compiler.process import WorkerError, failure_error, heartbeat_interval, log_tail, spawn
from kiln.compiler.protocol import WorkerFailure
from kiln.compiler.verify import (
    changed_line,
    check_spec_fits,
    folder_drift,
    private_copy,
    source_changed,
)
from kiln.compiler.writes import Snapshot, Watch
from kiln.errors import (
    NotFoundError,
    Param,
    ParameterError,
    UsageError,
    Worded,
)
from kiln.events import EventSink
from kiln.layout import INDUCTOR_DIR, CacheLayout
from kiln.padding import OffGridError, shape_key
from kiln.serving import ON_MISS, OnMiss, cache_env, worker_env
from kiln.spec import Spec, load_spec
from kiln.traffic import read_traffic
from kiln.workdir import served_in

MAX_REPLAY = 100_000  # requests one replay serves (counts expanded)
NEW_FILES_SHOWN = 100  # files written while serving, listed in the JSON report


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ReplayRequest(_Message):
    spec: dict[str, Any] = Field(description="the spec by value (Spec.canonical())")
    spec_base: str = Field(description="the folder the spec's relative paths start from")
    cache: str = Field(description="the private copy of the restored folder this process serves")
    watch: dict[str, str] = Field(
        default_factory=dict,
        description="label -> folder it must not write to (kiln.compiler.writes)",
    )
    requests: list[list[int]] = Field(description="axis sizes per request, in spec axis order")
    on_miss: OnMiss | None = None
    eager: bool = False
    seed: int = Field(0, ge=0, le=2**40)
    device_index: int = Field(0, ge=0)


class RequestRecord(_Message):
    """One served request."""

    key: str
    bucket: str | None = Field(description="the bucket it was served at; None: off the grid")
    compiles: int = Field(
        ge=0,
        description="compile work torch's counters saw; an off-grid request's files count too "
        "(files in-grid requests write are the result's new_files, which fail the replay)",
    )
    latency_s: float | None = Field(description="the served call (None: refused, on_miss error)")
    overhead_s: float = Field(0.0, description="host time the padding path added")
    eager_s: float | None = None
    max_abs_diff: float | None = Field(None, description="served vs unpadded eager, real slice")
    why: str | None = Field(
        None,
        description="a precompiled miss's failing guard (torch's words), or why an off-grid "
        "request was refused (on_miss error: the OffGridError's line)",
    )


class ReplayResult(_Message):
    records: list[RequestRecord]
    startup_s: float = Field(description="process start to the model served (activate, build)")
    new_files: list[str] = Field(
        default_factory=list,
        description="files written at start-up or by in-grid requests where a served process "
        "must not write (the folder, HOME, TMPDIR): each is compile work",
    )
    padding: dict[str, Any] = Field(default_factory=dict)
    eager_new_files: list[str] = Field(
        default_factory=list,
        description="files the eager comparison pass wrote (its eager calls, and the served "
        "model called again for the output difference; a server makes no such calls): "
        "reported, never failing",
    )


class ReplayOutcome(_Message):
    result: ReplayResult | None = None
    failure: WorkerFailure | None = None

    @model_validator(mode="after")
    def _one_of(self) -> ReplayOutcome:
        if (self.result is None) == (self.failure is None):
            raise ValueError("an outcome holds a result or a failure")
        return self


# --- the report ------------------------------------------------------------------------------
def _quantile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank quantile (q=0.5: the median; 0.99: p99); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass
class ReplayReport:
    name: str
    traffic: str
    on_miss: str
    result: ReplayResult
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)
    # How the restored folder differs from what restore installed (as verify reports it): a
    # folder a server compiled into would pass the replay with graphs the bake never made.
    folder_changes: list[str] = field(default_factory=list)
    env_names: str | None = None  # the folder a changed kiln.env names, when not this one
    source_changed: str | None = None  # the model's source differs from the bake's (a line)

    @property
    def in_grid(self) -> list[RequestRecord]:
        return [r for r in self.result.records if r.bucket is not None]

    @property
    def off_grid(self) -> list[RequestRecord]:
        return [r for r in self.result.records if r.bucket is None]

    @property
    def failing(self) -> list[RequestRecord]:
        """In-grid requests that compiled, and off-grid ones that did under ``on_miss: error``,
        which promises that a server compiles nothing (the served callable did not hold them
        to the grid)."""
        refused = self.on_miss == "error"
        return [r for r in self.result.records if r.compiles and (r.bucket or refused)]

    @property
    def ok(self) -> bool:
        return not self.failing and not self.result.new_files and not self.folder_changes

    def summary(self) -> dict[str, Any]:
        grid = self.in_grid
        overhead = [r.overhead_s for r in grid]
        latency = [r.latency_s for r in grid if r.latency_s is not None]
        eager = [r.eager_s for r in grid if r.eager_s is not None]
        ratio = [r.latency_s / r.eager_s for r in grid if r.latency_s is not None and r.eager_s]
        diffs = [r.max_abs_diff for r in grid if r.max_abs_diff is not None]

        def q(values: list[float]) -> dict[str, float | None]:
            return {"median": _quantile(values, 0.5), "p99": _quantile(values, 0.99)}

        return {
            "requests": len(self.result.records),
            "in_grid": len(grid),
            "off_grid": len(self.off_grid),
            "compiles_in_grid": sum(r.compiles for r in grid),
            "compiles_off_grid": sum(r.compiles for r in self.off_grid),
            "new_files": len(self.result.new_files),
            "eager_new_files": len(self.result.eager_new_files),
            "waste": self.result.padding.get("waste"),
            "overhead_s": q(overhead),
            "latency_s": q(latency),
            "eager_s": q(eager),
            "latency_over_eager": q(ratio),
            "max_abs_diff": max(diffs) if diffs else None,
        }

    def reasons(self) -> list[str]:
        out = [changed_line(self.folder_changes, self.env_names)] if self.folder_changes else []
        if self.failing and self.source_changed:  # the likeliest cause of an in-grid compile
            out.append(self.source_changed)
        out += [
            f"{r.key} ({f'bucket {r.bucket}' if r.bucket else 'off the grid, on_miss: error'}): "
            f"{r.compiles} compile(s)" + (f": {r.why}" if r.why else "")
            for r in self.failing[:10]
        ]
        if self.result.new_files:
            shown = ", ".join(self.result.new_files[:3])
            out.append(f"{len(self.result.new_files)} file(s) written while serving: {shown}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "traffic": self.traffic,
            "on_miss": self.on_miss,
            "wall_s": round(self.wall_s, 3),
            "startup_s": round(self.result.startup_s, 3),
            "summary": self.summary(),
            "failing": self.reasons(),
            "folder_changes": self.folder_changes,
            "model_source_changed": self.source_changed,
            "padding": self.result.padding,
            "new_files": self.result.new_files[:NEW_FILES_SHOWN],
            "eager_new_files": self.result.eager_new_files[:NEW_FILES_SHOWN],
            "requests": [r.model_dump(mode="json") for r in self.result.records],
            **self.extra,
        }


# --- the parent side ----------------------------------------------------------------------
def replay(
    spec: Spec | str | Path,
    cache: str | Path,
    traffic: str | Path,
    *,
    on_miss: OnMiss | None = None,
    eager: bool = False,
    seed: int = 0,
    device_index: int = 0,
    on_event: EventSink | None = None,
) -> ReplayReport:
    """Serve ``traffic``'s requests from the restored folder ``cache`` in a fresh process."""
    spec = spec if isinstance(spec, Spec) else load_spec(spec)
    cache = Path(cache).absolute()
    if not CacheLayout(cache).inductor.is_dir():
        raise NotFoundError(f"{cache}: no {INDUCTOR_DIR}/ folder (restore an artifact there first)")
    if on_miss is not None and on_miss not in ON_MISS:
        raise ParameterError("on_miss", on_miss, f"one of {', '.join(ON_MISS)}", shown=str(on_miss))
    manifest = read_manifest(cache)
    check_spec_fits(spec, manifest)
    if spec.distributed:
        raise UsageError(
            Worded(
                f"{spec.name}: ", Param("traffic"), " replays one process; multi-rank specs not yet"
            )
        )
    log = read_traffic(traffic, tuple(spec.buckets))
    if log.requests > MAX_REPLAY:
        raise UsageError(
            f"{traffic}: {log.requests} requests; a replay serves at most {MAX_REPLAY} "
            "(lower the counts)"
        )
    requests = [list(sizes) for sizes, count in log.lines for _ in range(count)]
    request = ReplayRequest(
        spec=spec.canonical(),
        spec_base=str(spec.base_dir.absolute()),
        cache=str(cache),
        requests=requests,
        on_miss=on_miss,
        eager=eager,
        seed=seed,
        device_index=device_index,
    )
    policy = miss_policy(manifest, on_miss)  # what the served callable does with them
    changes, elsewhere = folder_drift(cache, manifest)
    t0 = time.time()
    # As verify serves (kiln.compiler.verify.serve_copy): a private copy of the folder, an
    # empty HOME and TMPDIR, all watched, so the restored folder stays as found.
    with tempfile.TemporaryDirectory(prefix="kiln-replay-") as tmp:
        served, home, temp = private_copy(cache, manifest, Path(tmp))
        watch = {"DIR": str(served), "HOME": str(home), "TMPDIR": str(temp)}
        env = cache_env(served, manifest.env) | {"HOME": str(home), "TMPDIR": str(temp)}
        request = request.model_copy(update={"cache": str(served), "watch": watch})
        result = _run(spec, request, env, on_event)
    return ReplayReport(
        manifest.name,
        str(traffic),
        policy,
        result,
        time.time() - t0,
        folder_changes=changes,
        env_names=elsewhere,
        source_changed=source_changed(spec, manifest),
    )


def _run(
    spec: Spec, request: ReplayRequest, env: dict[str, str], on_event: EventSink | None
) -> ReplayResult:
    with tempfile.TemporaryDirectory(prefix="kiln-replay-") as tmp:
        folder = Path(tmp)
        (folder / "request.json").write_text(request.model_dump_json())
        command = [
            sys.executable,
            "-m",
            "kiln.compiler.replay",
            str(folder / "request.json"),
            str(folder / "outcome.json"),
        ]
        cwd = served_in(spec.serve.workdir)  # where the server runs (kiln.workdir)
        _, code = spawn(
            folder, command, worker_env(env), on_event, heartbeat_interval(), None, cwd=cwd
        )
        log = (folder / "stderr.log").read_text(errors="replace")
        path = folder / "outcome.json"
        if not path.exists():
            raise WorkerError(f"replay process died with exit code {code}:\n{log_tail(log)}")
        outcome = ReplayOutcome.model_validate_json(path.read_bytes())
    if outcome.failure is not None:
        raise failure_error(spec, outcome.failure, log)
    assert outcome.result is not None
    return outcome.result


def bench_traffic(
    spec: Spec | str | Path,
    traffic: str | Path,
    *,
    workdir: str | Path | None = None,
    on_miss: OnMiss | None = None,
    on_event: EventSink | None = None,
) -> ReplayReport:
    """Bake ``spec``, restore it at a new path, and replay ``traffic`` against the unpadded
    eager call (``kiln bench --traffic``)."""
    from kiln.artifact.restore import restore
    from kiln.compiler.bake import FollowerResult, bake
    from kiln.compiler.bench import bench_folder

    spec = spec if isinstance(spec, Spec) else load_spec(spec)
    read_traffic(traffic, tuple(spec.buckets))  # a bad log is exit 2 before a bake
    work = bench_folder(spec, workdir)
    try:
        baked = bake(spec, work / "bench.kiln.tar.zst", on_event=on_event)
        if isinstance(baked, FollowerResult):
            raise UsageError(f"{spec.name}: run kiln bench once, outside torchrun")
        restore(baked.artifact, work / "restored")
        report = replay(
            spec, work / "restored", traffic, on_miss=on_miss, eager=True, on_event=on_event
        )
        report.extra["bake_wall_s"] = round(baked.wall_s, 3)
        return report
    finally:
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)


# --- the replay process -------------------------------------------------------------------
def run(request: ReplayRequest) -> ReplayResult:
    """Serve every request as a server on the restored folder would (see the module docstring)."""
    started = time.time()
    watch = _watch(request)
    at_start = watch.snapshot()  # before torch: its import may write too
    import kiln

    activation = kiln.activate(request.cache, compat="warn", device_index=request.device_index)
    import torch

    from kiln.compiler import ranks
    from kiln.compiler.devices import setup_device, synchronizer
    from kiln.compiler.dynamo_log import DynamoLog
    from kiln.compiler.model_import import build_model
    from kiln.compiler.padded import PaddedModel
    from kiln.padding import PadGrid

    spec = Spec.model_validate(request.spec).with_base(Path(request.spec_base))
    device = setup_device(spec, request.device_index)
    model = build_model(spec, device, ranks.current())
    served = activation.compile(model, on_miss=request.on_miss)
    replayer = _Replayer(
        spec=spec,
        device=device,
        sync=synchronizer(device),
        model=model,
        served=served,
        grid=PadGrid.from_manifest(activation.manifest),
        dynamo=DynamoLog().install(),
        frames=activation.manifest.precompiled_frames is not None,
        watch=watch,
    )
    replayer.sync()
    startup = time.time() - started
    replayer.last = watch.snapshot()
    at_start_written = watch.written(at_start, replayer.last)
    with torch.inference_mode():
        records = [
            replayer.serve(sizes, request.seed + i) for i, sizes in enumerate(request.requests)
        ]
    served_last = replayer.settle()
    new = sorted({*at_start_written, *replayer.in_grid_written})
    pads = isinstance(served, PaddedModel) and served.grid.pads  # not a grid served exactly
    padding = served.stats.to_dict() if pads else {}
    eager_written: list[str] = []
    if request.eager:
        with torch.inference_mode():
            records = [
                replayer.compare(record, sizes, request.seed + i)
                for i, (record, sizes) in enumerate(zip(records, request.requests, strict=True))
            ]
        eager_written = watch.written(served_last, watch.snapshot())
    return ReplayResult(
        records=records,
        startup_s=startup,
        new_files=new,
        padding=padding,
        eager_new_files=eager_written,
    )


@dataclass
class _Replayer:
    """Serves one request at a time and measures it (the replay process's state)."""

    spec: Spec
    device: Any
    sync: Any
    model: Any
    served: Any
    grid: Any  # kiln.padding.PadGrid
    dynamo: Any  # kiln.compiler.dynamo_log.DynamoLog
    frames: bool  # saved Dynamo frames served: a traced frame is a miss
    watch: Watch
    last: Snapshot | None = None  # the watched folders after start-up or the last off-grid request
    in_grid_written: set[str] = field(default_factory=set)  # an off-grid request's are its own

    def settle(self) -> Snapshot:
        """Walk the watched folders: what changed since ``last`` was written by in-grid
        requests (start-up's writes were taken before the first). Returns the new snapshot."""
        now = self.watch.snapshot()
        assert self.last is not None, "start-up's snapshot is taken before the first request"
        self.in_grid_written.update(self.watch.written(self.last, now))
        self.last = now
        return now

    def _inputs(self, sizes: list[int], seed: int) -> tuple[Any, dict[str, Any]]:
        """The request's bucket and call arguments (the same for a seed in both passes)."""
        from kiln.compiler.model_import import make_inputs
        from kiln.grid import Bucket

        bucket = Bucket(tuple(zip(self.spec.buckets, sizes, strict=True)))
        inputs = make_inputs(self.spec, bucket, self.device, seed)
        return bucket, {**inputs, **self.spec.model.call_kwargs}

    def _timed(self, fn: Any, kwargs: dict[str, Any]) -> tuple[Any, float]:
        self.sync()
        t0 = time.perf_counter()
        out = fn(**kwargs)
        self.sync()
        return out, time.perf_counter() - t0

    def _refusable(self, kwargs: dict[str, Any]) -> tuple[float | None, str | None]:
        """The served call's latency, or (on_miss error) None and the refusal's one line, which
        the record carries: the report then says why, as the server's caller would read it."""
        try:
            return self._timed(self.served, kwargs)[1], None
        except OffGridError as exc:
            return None, str(exc)

    def serve(self, sizes: list[int], seed: int) -> RequestRecord:
        from kiln.compiler.counters import compile_counts

        bucket, kwargs = self._inputs(sizes, seed)
        at = self.grid.lookup(bucket.as_dict())
        before, mark = CompileCounters.read(), self.dynamo.mark()
        missed = getattr(self.served, "misses", 0)
        pre = self.settle() if at is None else None
        latency, refused = self._refusable(kwargs)
        traced = len(self.dynamo.frames_since(mark)) if self.frames else 0
        misses = getattr(self.served, "misses", 0) - missed
        why = (getattr(self.served, "miss_reason", None) if misses else None) or refused
        written: list[str] = []
        if pre is not None:  # off the grid: what it wrote is its own, not the grid's
            self.last = self.watch.snapshot()
            written = self.watch.written(pre, self.last)
        counts = compile_counts(
            CompileCounters.read() - before,
            written,
            served=True,
            precompile_misses=misses + traced,
        )
        stats = getattr(self.served, "stats", None)
        return RequestRecord(
            key=bucket.key,
            bucket=shape_key(at) if at is not None else None,
            compiles=counts.compiles,
            latency_s=latency,
            overhead_s=stats.last_overhead_s if stats is not None else 0.0,
            why=why,
        )

    def compare(self, record: RequestRecord, sizes: list[int], seed: int) -> RequestRecord:
        """The eager pass for one served request: the unpadded eager call's latency, and how
        far the served output (called again on the same inputs) is from it."""
        from kiln.compiler.padded import tensor_leaves

        _, kwargs = self._inputs(sizes, seed)
        ref, eager_s = self._timed(self.model, kwargs)
        diff = None
        if record.latency_s is not None:
            out = self.served(**kwargs)
            diff = _max_abs_diff(dict(tensor_leaves(out)), dict(tensor_leaves(ref)))
        return record.model_copy(update={"eager_s": eager_s, "max_abs_diff": diff})


def _watch(request: ReplayRequest) -> Watch:
    """The folders this process must leave as they are, with the sha256 of every file restore
    installed in the served one (a rewrite with the same bytes is no change)."""
    folders = {label: Path(folder) for label, folder in request.watch.items()}
    shipped = {f"DIR/{e.path}": e.sha256 for e in read_manifest(request.cache).entries()}
    return Watch(folders, shipped)


def _max_abs_diff(served: dict[Any, Any], eager: dict[Any, Any]) -> float:
    """The largest difference between served and eager outputs, leaf by leaf (inf where a
    shape differs: the slice was not the real one)."""
    worst = 0.0
    for path, ref in eager.items():
        got = served.get(path)
        if got is None or tuple(got.shape) != tuple(ref.shape):
            return math.inf
        if ref.numel():
            d = (got.float() - ref.float()).abs().max().item()
            worst = max(worst, d if d == d else math.inf)
    return worst


def main(argv: list[str] | None = None) -> int:
    """``python -m kiln.compiler.replay REQUEST.json OUTCOME.json``; exit codes as kiln's."""
    from kiln.compiler import ignore_numpy_warning
    from kiln.compiler.protocol import failure_of

    args = sys.argv[1:] if argv is None else argv
    ignore_numpy_warning()
    request = ReplayRequest.model_validate_json(Path(args[0]).read_text())
    code = 0
    try:
        outcome = ReplayOutcome(result=run(request))
    except Exception as exc:
        failure, code = failure_of(exc)
        outcome = ReplayOutcome(failure=failure)
    Path(args[1]).write_text(outcome.model_dump_json())
    return code


if __name__ == "__main__":
    sys.exit(main())
