"""The grid worker: one pass over a spec's buckets through torch.compile, in *this* process.

kiln never compiles in the caller's process. Torch reads its cache locations and much of its
Inductor config from the environment at import time, and keeps in-memory caches that would turn
a cold compile into a fake hit, so bake, verify and bench each start
``python -m kiln.compiler.worker`` in a fresh interpreter (:mod:`kiln.compiler.launch`) with
exactly the environment they mean and read back what it did. The same pass serves all three, so
"what bake compiled" and "what verify hit" are measured the same way: each bucket's first call
and warm calls, as :class:`~kiln.compiler.counters.CompileCounters` differences plus the files
added to the cache root.

This module is the process entry and the pass itself; each step is a module of its own: the
factory imported and the inputs made (:mod:`~kiln.compiler.model_import`), the device
(:mod:`~kiln.compiler.devices`), what is called (:mod:`~kiln.compiler.forwards`), how it is timed
and counted (:mod:`~kiln.compiler.measure`), the Mega-Cache (:mod:`~kiln.compiler.megacache`),
and what a pass fails with (:mod:`~kiln.compiler.failures`).

Protocol (:mod:`kiln.compiler.protocol`): argv is ``REQUEST.json OUTCOME.json``; progress goes
to stdout as one :mod:`kiln.events` event per JSON line; the outcome (a result or a failure) is
written to OUTCOME.json; everything torch prints goes to stderr, which the parent keeps in a log.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln import bytecode
from kiln.artifact.manifest import MAX_GRAPH_BREAKS, BucketStats, CompileCounts, GraphBreak
from kiln.compiler import frames, ignore_numpy_warning, ranks
from kiln.compiler.activate import prepare_inductor
from kiln.compiler.devices import join_group, setup_device, synchronizer
from kiln.compiler.dynamo_log import DynamoLog, merge_breaks
from kiln.compiler.forwards import make_forward
from kiln.compiler.measure import CLOCK, Forward, Meter, Phases
from kiln.compiler.megacache import both, load_megacache, save_caches
from kiln.compiler.model_import import build_model, check_eager, make_inputs
from kiln.compiler.protocol import (
    MegacacheInfo,
    WorkerOutcome,
    WorkerRequest,
    WorkerResult,
    failure_of,
)
from kiln.compiler.writes import Watch
from kiln.events import BucketDone, BucketStarted, FirstPassDone, WorkerEvent, WorkerStarted
from kiln.grid import Bucket, expand
from kiln.layout import CacheLayout
from kiln.spec import Spec
from kiln.workdir import logical_cwd

if TYPE_CHECKING:
    from kiln.compiler.activate import Activation

_START = time.time()
# Input seeds: bucket i's call c draws seed input_seed + i * _SEED_STRIDE + c, so no two calls
# of a pass (and no two buckets) share inputs; the "first real request" is a call none made.
_SEED_STRIDE = 1_000
_FIRST_REQUEST_CALL = _SEED_STRIDE - 1
_RANK = ranks.current()  # this process's rank when a launcher started it (distributed specs)


def _emit(event: WorkerEvent) -> None:
    """One progress event as a JSON line on stdout, which the parent reads as it comes."""
    if not ranks.relays_events(_RANK):
        return
    sys.stdout.write(event.model_dump_json() + "\n")
    sys.stdout.flush()


@dataclass
class _Ready:
    """What start-up made ready for the first call, and when."""

    spec: Spec
    buckets: dict[str, Bucket]  # the whole grid, in grid order (seeds follow it)
    device: Any
    joined: bool  # a process group joined (distributed specs): left at the end
    loaded: MegacacheInfo
    model: Any
    forward: Forward
    meter: Meter
    torch_import_s: float
    model_ready: float


def _start_up(request: WorkerRequest, clock: Phases) -> _Ready:
    """Everything before the first call, each step a phase of ``clock``: torch imported (or
    ``kiln.activate()``), the device and process group, a Mega-Cache loaded, Dynamo watched,
    Inductor prepared, the model built and made callable as ``request`` asks."""
    watch = _watch(request)
    with CLOCK.looking():  # before torch: its import may write too
        started = watch.snapshot() if watch else None
    activation = _activate(request)  # a server calling kiln.activate() does so first
    import torch  # noqa: F401 - timed here, as a server's own import

    torch_import_s = clock.mark("kiln.activate()" if activation else "import torch")
    spec = request.load_spec()
    device = setup_device(spec, request.device_index)
    joined = join_group(spec, device, _RANK)
    clock.mark("device init")
    loaded = load_megacache(request.megacache_load)
    clock.mark("Mega-Cache load")
    buckets = {b.key: b for b in expand(spec)}
    compiling = request.torch_kwargs is not None
    dynamo = _watch_dynamo(len(buckets), compiling=compiling)
    if compiling and request.route is None:  # a served route does what its server does
        prepare_inductor(request.torch_kwargs or {})
        clock.mark("Inductor import + worker pool start")
    model = build_model(spec, device, _RANK)
    clock.mark("model build")
    if request.check_eager:
        with CLOCK.looking():  # the spec's check: no part of the start-up a server pays
            seeds = _seeds(request, buckets)
            called = {buckets[key]: seeds[key] for key in request.order}
            check_eager(model, spec, called, device, synchronizer(device))
    forward = make_forward(request, spec, model, synchronizer(device), activation, launched=_RANK)
    clock.mark(_setup_phase(forward))
    meter = Meter(request.cache_root, dynamo, forward, watch, started)
    return _Ready(
        spec, buckets, device, joined, loaded, model, forward, meter, torch_import_s, CLOCK.now()
    )


def run(request: WorkerRequest) -> WorkerResult:
    """One grid pass as ``request`` asks: the model built, then every bucket's first call, then
    its warm calls, each bucket measured; then the caches saved and the environment recorded."""
    clock = Phases(_START)
    ready = _start_up(request, clock)
    spec, forward = ready.spec, ready.forward
    import torch

    _emit(WorkerStarted(buckets=len(request.order), torch_import_s=ready.torch_import_s))
    seeds = _seeds(request, ready.buckets)
    grid = _Grid(spec, ready.device, seeds, forward, ready.meter)
    order = [ready.buckets[k] for k in request.order]
    with torch.inference_mode():
        firsts = grid.first_pass(order)
        first_pass_done = CLOCK.now()
        _emit(FirstPassDone())
        warms = grid.warm_pass(order, request, calls=_calls(request, spec))
    warm_done = CLOCK.now()
    saved = save_caches(request, forward)
    building = request.aoti_build is not None
    ranks.leave(ready.joined)
    return WorkerResult(
        buckets=[_bucket_stats(b, firsts[b.key], warms[b.key]) for b in order],
        process_start=_START,
        torch_import_s=ready.torch_import_s,
        model_ready=ready.model_ready,
        precompile_load_s=forward.load_s,
        forward_module=frames.module_of(ready.model),
        first_pass_done=first_pass_done,
        warm_done=warm_done,
        megacache=both(ready.loaded, saved),
        fingerprint=_fingerprint(request, spec, lean=forward.aoti is not None and not building),
        graph_breaks=merge_breaks(_relative(grid.meter.breaks, spec), MAX_GRAPH_BREAKS),
        imported_sources=bytecode.imported_sources() if request.report_imports else [],
        # whichever way the prefix came: request.bytecode, activate(), or a plain server's env
        bytecode_modules=bytecode.served_modules(Path(sys.pycache_prefix))
        if sys.pycache_prefix
        else 0,
        phases=clock.phases,
        aoti=forward.aoti.info if request.aoti_build and forward.aoti else None,
        compiler_modules=[m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules],
        workdir=logical_cwd(),
    )


def _seeds(request: WorkerRequest, buckets: dict[str, Bucket]) -> dict[str, int]:
    """Each bucket's first call's seed: by its place in the whole grid, not the order."""
    return {key: request.input_seed + i * _SEED_STRIDE for i, key in enumerate(buckets)}


def _setup_phase(forward: Forward) -> str:
    """What the step between the model's build and its first call was, as bench names it."""
    if forward.aoti is not None and not forward.building:
        return "AOTInductor packages load"
    return "precompiled load" if forward.load_s is not None else "compile set-up"


def _activate(request: WorkerRequest) -> Activation | None:
    """``kiln.activate()`` on the served folder, first thing, as a server on that route does."""
    if request.route != "activate":
        return None
    assert request.cache_root is not None
    from kiln.compiler.activate import activate

    # A rank's cache root is in its own folder: activate the artifact's. With activate()'s
    # default compat, as the README's server calls it: its check (and, for a build that
    # matches, the bytecode before `import torch`) is part of the start-up a user pays; a miss
    # only warns here, and verify judges it in its own report.
    served = CacheLayout.of_dir(Path(request.cache_root).parent)
    return activate(served.root, device_index=request.device_index)


def _watch(request: WorkerRequest) -> Watch | None:
    """The folders this served process must leave as they are, with what was shipped in the
    first (the served folder: its manifest lists the sha256 of every file restore installed)."""
    if not request.watch:
        return None
    folders = {label: Path(folder) for label, folder in request.watch.items()}
    label, served = next(iter(folders.items()))
    shipped: dict[str, str] = {}
    with contextlib.suppress(OSError, ValueError):
        from kiln.artifact.archive import read_manifest

        for entry in read_manifest(served).entries():
            shipped[f"{label}/{entry.path}"] = entry.sha256
    return Watch(folders, shipped)


def _watch_dynamo(buckets: int, *, compiling: bool) -> DynamoLog:
    """Room for the whole grid under Dynamo's recompile limits (past them torch silently runs
    eager), and Dynamo's own words for recompiles, graph breaks and the frames it traced.
    An eager pass leaves Dynamo alone: importing it costs seconds an eager server never pays."""
    if not compiling:
        return DynamoLog()
    import torch

    torch._dynamo.config.recompile_limit = max(8, 2 * buckets + 2)
    torch._dynamo.config.accumulated_recompile_limit = max(256, 8 * buckets)
    return DynamoLog().install()


@dataclass
class _Grid:
    """The two phases of a pass over the grid, each bucket measured by ``meter``."""

    spec: Spec
    device: Any
    seeds: dict[str, int]  # a bucket's inputs are seeded by its place in the grid, not the order
    forward: Forward
    meter: Meter

    def first_pass(self, order: list[Bucket]) -> dict[str, tuple[float, CompileCounts]]:
        """Phase 1: every bucket once, in request order. "Ready" in bench terms ends here."""
        out: dict[str, tuple[float, CompileCounts]] = {}
        for i, bucket in enumerate(order):
            inputs = self._inputs(bucket, call=0)
            _emit(BucketStarted(phase="first", index=i, key=bucket.key))
            step = functools.partial(self.forward.first, inputs)
            seconds, compiles = self.meter.measure(bucket.key, step)
            out[bucket.key] = (seconds, compiles)
            _emit(BucketDone(phase="first", index=i, key=bucket.key, seconds=seconds))
        return out

    def warm_pass(
        self, order: list[Bucket], request: WorkerRequest, *, calls: int
    ) -> dict[str, tuple[float | None, float, CompileCounts]]:
        """Phase 2: the remaining warmup calls (CUDA graphs record here), then a fresh "first
        real request" and the steady-state latency. Compiles here count too: a bucket that
        recompiles on its second call is not warm."""
        out: dict[str, tuple[float | None, float, CompileCounts]] = {}
        for i, bucket in enumerate(order):
            warmups = [self._inputs(bucket, call) for call in range(1, calls)]
            fresh = self._inputs(bucket, _FIRST_REQUEST_CALL) if request.first_request else None
            steady = self._inputs(bucket, call=0)
            _emit(BucketStarted(phase="warm", index=i, key=bucket.key))
            warm = functools.partial(self._warm_calls, warmups, fresh, steady, request.steady_calls)
            (first_request, steady_s), compiles = self.meter.measure(bucket.key, warm)
            out[bucket.key] = (first_request, steady_s, compiles)
            _emit(BucketDone(phase="warm", index=i, key=bucket.key, seconds=steady_s))
        return out

    def _inputs(self, bucket: Bucket, call: int) -> dict[str, Any]:
        """Fresh inputs for each warmup call: a model that branches on its data compiles the
        frames after that branch only for the data that reaches them, so calls that all see
        the same tensors cover one side of every such branch."""
        return make_inputs(self.spec, bucket, self.device, self.seeds[bucket.key] + call)

    def _warm_calls(
        self,
        warmups: list[dict[str, Any]],
        fresh: dict[str, Any] | None,
        steady: dict[str, Any],
        steady_calls: int,
    ) -> tuple[float | None, float]:
        for inputs in warmups:
            self.forward.timed(inputs)
        first_request = self.forward.timed(fresh) if fresh is not None else None
        steady_s = statistics.median(self.forward.timed(steady) for _ in range(steady_calls))
        return first_request, steady_s


def _calls(request: WorkerRequest, spec: Spec) -> int:
    """Calls per bucket: a CUDA-graphed bucket needs a warm-up, a recording and a replay."""
    return max(request.calls, 3 if spec.compile.cudagraphs else 1)


def _bucket_stats(
    bucket: Bucket,
    first: tuple[float, CompileCounts],
    warm: tuple[float | None, float, CompileCounts],
) -> BucketStats:
    first_call_s, first_compiles = first
    first_request_s, steady_s, warm_compiles = warm
    return BucketStats(
        key=bucket.key,
        sizes=bucket.as_dict(),
        first_call_s=first_call_s,
        steady_s=steady_s,
        first_request_s=first_request_s,
        **(first_compiles + warm_compiles).counts(),
    )


def _relative(breaks: list[GraphBreak], spec: Spec) -> list[GraphBreak]:
    """Places in the model's own files relative to the spec's folder: the bake machine's
    checkout path means nothing to whoever reads the manifest."""
    base = f"{spec.base_dir.resolve()}/"
    return [
        b.model_copy(update={"where": b.where.removeprefix(base)})
        if b.where.startswith(base)
        else b
        for b in breaks
    ]


def _fingerprint(request: WorkerRequest, spec: Spec, *, lean: bool) -> dict[str, Any] | None:
    """This process's environment fingerprint, when asked (it is what a manifest records)."""
    if not request.fingerprint:
        return None
    from kiln.compiler.fingerprint import fingerprint

    # lean: serving AOTInductor packages, only what such a server can know without Inductor.
    return fingerprint(spec.model.device, device_index=request.device_index, lean=lean)


def main(argv: list[str] | None = None) -> int:
    """``python -m kiln.compiler.worker REQUEST.json OUTCOME.json``; exit codes as kiln's."""
    args = ranks.worker_args(sys.argv[1:] if argv is None else argv, _RANK)
    ignore_numpy_warning()
    request_path, outcome_path = Path(args[0]), Path(args[1])
    request = WorkerRequest.model_validate_json(request_path.read_text())
    os.environ.update(request.env)  # a rank's own cache folders, before torch reads them
    if request.bytecode:  # before torch is imported, as a server calling kiln.activate() first
        note = bytecode.use(Path(request.bytecode))
        if note:
            print(f"kiln: {note}", file=sys.stderr)
    try:
        outcome = WorkerOutcome(result=run(request))
        code = 0
    except Exception as exc:
        failure, code = failure_of(exc)
        outcome = WorkerOutcome(failure=failure)
    outcome_path.write_text(outcome.model_dump_json())
    return code


if __name__ == "__main__":
    sys.exit(main())
