"""The grid worker: one pass over a spec's buckets through torch.compile, in *this* process.

kiln never compiles in the caller's process. Torch reads its cache locations and much of its
Inductor config from the environment at import time, and keeps in-memory caches that would turn
a cold compile into a fake hit, so bake, verify and bench each start
``python -m kiln.compiler.worker`` in a fresh interpreter (:mod:`kiln.compiler.launch`) with
exactly the environment they mean and read back what it did. The same pass serves all three, so
"what bake compiled" and "what verify hit" are measured the same way: each bucket's first call
and warm calls, as :class:`~kiln.compiler.counters.CompileCounters` differences plus the files
added to the cache root.

Protocol (:mod:`kiln.compiler.protocol`): argv is ``REQUEST.json OUTCOME.json``; progress goes
to stdout as one :mod:`kiln.events` event per JSON line; the outcome (a result or a failure) is
written to OUTCOME.json; everything torch prints goes to stderr, which the parent keeps in a log.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import math
import os
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kiln import bytecode
from kiln.artifact.manifest import MAX_GRAPH_BREAKS, BucketStats, CompileCounts, GraphBreak
from kiln.compiler import frames, ranks
from kiln.compiler.activate import prepare_inductor
from kiln.compiler.aoti_bake import AotiBuildError
from kiln.compiler.capture import snapshot
from kiln.compiler.counters import CompileCounters, compile_counts
from kiln.compiler.dynamo_log import DynamoLog, merge_breaks
from kiln.compiler.launch import ignore_numpy_warning
from kiln.compiler.protocol import (
    MegacacheInfo,
    WorkerFailure,
    WorkerOutcome,
    WorkerRequest,
    WorkerResult,
)
from kiln.compiler.writes import Snapshot, Watch
from kiln.events import BucketDone, BucketStarted, FirstPassDone, WorkerEvent, WorkerStarted
from kiln.grid import Bucket, expand
from kiln.serving import RANKS_DIR, rank_dir
from kiln.spec import Spec

if TYPE_CHECKING:
    from kiln.compiler.activate import Activation
    from kiln.compiler.precompile import PrecompiledForward

_START = time.time()
_T = TypeVar("_T")
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


def resolve_factory(spec: Spec) -> Any:
    """Import the spec's factory, looking next to the spec file first."""
    target, _, attr = spec.model.factory.partition(":")
    if target.endswith(".py"):
        origin = spec.factory_origin()
        assert origin is not None
        base, module_name = str(origin.parent), origin.stem
    else:
        base, module_name = str(spec.base_dir), target
    sys.path.insert(0, base)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise _SpecProblem("model.factory", f"cannot import {target!r}: {exc}") from exc
    except Exception as exc:  # the module's own code failed (a SyntaxError, a raise at import)
        raise _SpecProblem(
            "model.factory", f"importing {target!r} raised {type(exc).__name__}: {_one_line(exc)}"
        ) from exc
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(base)
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise _SpecProblem("model.factory", f"{target!r} has no attribute {attr!r}")
    if not callable(obj):
        raise _SpecProblem("model.factory", f"{spec.model.factory!r} is not callable")
    return obj


class _Incompatible(Exception):
    """This process cannot use what was baked (exit 5, as ``kiln check`` would say)."""


class _SpecProblem(Exception):
    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def make_inputs(spec: Spec, bucket: Bucket, device: Any, seed: int) -> dict[str, Any]:
    """A bucket's inputs; torch refusing one (allocation, range) is a spec problem at that input."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    out: dict[str, Any] = {}
    for i, inp in enumerate(spec.inputs):
        shape = bucket.shape_of(inp.shape)
        dtype = getattr(torch, inp.dtype)
        try:
            if inp.fill == "randint":
                high = inp.high or inp.low + 1
                t = torch.randint(inp.low, high, shape, generator=gen, dtype=dtype)
            elif inp.fill == "randn":
                t = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
            elif inp.fill == "ones":
                t = torch.ones(shape, dtype=dtype)
            else:
                t = torch.zeros(shape, dtype=dtype)
            out[inp.name] = t.to(device)
        except (RuntimeError, ValueError, OverflowError, MemoryError) as exc:
            raise _SpecProblem(
                f"inputs.{i}",
                f"cannot make input {inp.name!r} {list(shape)} {inp.dtype} on {device} for "
                f"bucket {bucket.key}: {_one_line(exc)}",
            ) from exc
    return out


_ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "bool": 1}


def check_input_memory(spec: Spec, device: Any) -> None:
    """Refuse a grid whose largest bucket's inputs cannot fit, before compiling anything.

    The spec's bounds stop absurd sizes at parse time, but what fits depends on the machine: an
    allocation past it is an opaque allocator error at best and the OOM killer at worst.
    """
    budget, where = _memory_budget(device)
    if budget is None:
        return
    for bucket in expand(spec):
        sizes = [
            (math.prod(bucket.shape_of(inp.shape)) * _ITEM_BYTES[inp.dtype], i)
            for i, inp in enumerate(spec.inputs)
        ]
        total = sum(n for n, _ in sizes)
        if total > budget:
            largest, i = max(sizes)
            inp = spec.inputs[i]
            raise _SpecProblem(
                f"inputs.{i}.shape",
                f"bucket {bucket.key} needs {_gib(total)} for its inputs ({inp.name!r} "
                f"{list(bucket.shape_of(inp.shape))} {inp.dtype}: {_gib(largest)}), more than "
                f"the {_gib(budget)} {where}",
            )


def _memory_budget(device: Any) -> tuple[int | None, str]:
    """Bytes this process can still allocate on ``device`` (None: unknown), and what bounds it."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0]), f"free on {device}"
    bounds: list[tuple[int, str]] = []
    for limit, name in ((resource.RLIMIT_AS, "RLIMIT_AS"), (resource.RLIMIT_DATA, "RLIMIT_DATA")):
        soft, _ = resource.getrlimit(limit)
        if soft != resource.RLIM_INFINITY:
            bounds.append((soft, f"this process may allocate ({name})"))
    with contextlib.suppress(OSError, ValueError):
        info = dict(
            (line.split(":")[0], int(line.split()[1]) * 1024)
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.split()[1:2] and line.split()[1].isdigit()
        )
        bounds.append((info["MemAvailable"] + info.get("SwapFree", 0), "available on this machine"))
    with contextlib.suppress(OSError, ValueError):  # a cgroup v2 memory limit (containers)
        cgroup = Path("/sys/fs/cgroup")
        limit_text = (cgroup / "memory.max").read_text().strip()
        if limit_text != "max":
            used = int((cgroup / "memory.current").read_text())
            bounds.append((int(limit_text) - used, "left under this container's memory limit"))
    return min(bounds) if bounds else (None, "")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """torch's messages can run to pages (every option name, a C++ trace): the first line."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def check_call(model: Any, spec: Spec) -> None:
    """Refuse inputs or call_kwargs the forward cannot take, before compiling it.

    Called with a keyword it lacks, a compiled forward fails deep inside Dynamo with a
    traceback; the signature says the same thing in one line, at the key.
    """
    import torch

    target = model.forward if isinstance(model, torch.nn.Module) else model
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check against
        return
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items() if p.kind in keyword]

    def accepts(name: str) -> bool:
        return takes_any or name in named

    takes = ", ".join(named) or "no keyword arguments"
    for i, inp in enumerate(spec.inputs):
        if not accepts(inp.name):
            raise _SpecProblem(
                f"inputs.{i}.name", f"forward() has no argument {inp.name!r} (it takes: {takes})"
            )
    for key in spec.model.call_kwargs:
        if not accepts(key):
            raise _SpecProblem(
                f"model.call_kwargs.{key}",
                f"forward() has no argument {key!r} (it takes: {takes})",
            )
    given = {inp.name for inp in spec.inputs} | set(spec.model.call_kwargs)
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    for name, p in params.items():
        required = p.default is inspect.Parameter.empty and p.kind not in variadic
        if required and (name not in given or p.kind is inspect.Parameter.POSITIONAL_ONLY):
            raise _SpecProblem(
                "inputs", f"forward() needs {name!r}, which no input or call_kwargs gives"
            )


def _is_allocation_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError)
        and ("out of memory" in text or "can't allocate memory" in text)
    )


def run(request: WorkerRequest) -> WorkerResult:
    """One grid pass as ``request`` asks: the model built, then every bucket's first call, then
    its warm calls, each bucket measured; then the caches saved and the environment recorded."""
    clock = _Phases()
    watch = _watch(request)
    started = watch.snapshot() if watch else None  # before torch: its import may write too
    activation = _activate(request)  # a server calling kiln.activate() does so first
    import torch

    torch_import_s = clock.mark("kiln.activate()" if activation else "import torch")
    spec = request.load_spec()
    device = _setup_device(spec, request.device_index)
    joined = _join(spec, device)
    clock.mark("device init")
    loaded = _load_megacache(request.megacache_load)
    clock.mark("Mega-Cache load")
    buckets = {b.key: b for b in expand(spec)}
    compiling = request.torch_kwargs is not None
    dynamo = _watch_dynamo(len(buckets), compiling=compiling)
    if compiling and request.route is None:  # a served route does what its server does
        prepare_inductor(request.torch_kwargs or {})
        clock.mark("Inductor import + worker pool start")
    model = _build_model(spec, device)
    clock.mark("model build")
    forward = _forward(request, spec, model, _synchronizer(device), activation)
    clock.mark(_setup_phase(forward))
    model_ready = time.time()
    _emit(WorkerStarted(buckets=len(request.order), torch_import_s=torch_import_s))
    grid = _Grid(
        spec=spec,
        device=device,
        seeds={key: request.input_seed + i * _SEED_STRIDE for i, key in enumerate(buckets)},
        forward=forward,
        meter=_Meter(request.cache_root, dynamo, forward, watch, started),
    )
    order = [buckets[k] for k in request.order]
    with torch.inference_mode():
        firsts = grid.first_pass(order)
        first_pass_done = time.time()
        _emit(FirstPassDone())
        warms = grid.warm_pass(order, request, calls=_calls(request, spec))
    warm_done = time.time()
    saved = _save_caches(request, forward)
    building = request.aoti_build is not None
    ranks.leave(joined)
    return WorkerResult(
        buckets=[_bucket_stats(b, firsts[b.key], warms[b.key]) for b in order],
        process_start=_START,
        torch_import_s=torch_import_s,
        model_ready=model_ready,
        precompile_load_s=forward.load_s,
        forward_module=frames.module_of(model),
        first_pass_done=first_pass_done,
        warm_done=warm_done,
        megacache=MegacacheInfo(
            loaded=loaded.loaded,
            saved=saved.saved,
            entries=saved.entries if saved.saved else loaded.entries,
        ),
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
    )


def _setup_phase(forward: _Forward) -> str:
    """What the step between the model's build and its first call was, as bench names it."""
    if forward.aoti is not None and not forward.building:
        return "AOTInductor packages load"
    return "precompiled load" if forward.load_s is not None else "compile set-up"


# --- the steps of a pass ---------------------------------------------------------------------
class _Phases:
    """Start-up, phase by phase: where a restored process spends the time before its first
    call (bench shows it; the first one, since process start, includes kiln's own imports)."""

    def __init__(self) -> None:
        self.last = _START
        self.phases: dict[str, float] = {}

    def mark(self, name: str) -> float:
        now = time.time()
        self.phases[name] = round(now - self.last, 4)
        self.last = now
        return self.phases[name]


def _setup_device(spec: Spec, index: int) -> Any:
    """The spec's device (``cuda`` means ``cuda:INDEX``), made current; a GPU torch cannot see
    is the spec's problem at ``model.device``, said with what torch was built with."""
    import torch

    device = torch.device(spec.model.device, index if spec.model.device == "cuda" else None)
    if device.type != "cuda":
        return device
    if spec.distributed and torch.cuda.is_available() and index >= torch.cuda.device_count():
        raise _SpecProblem(
            "distributed.world_size",
            f"rank {index} needs cuda:{index}, but torch sees {torch.cuda.device_count()} GPU(s)",
        )
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA support"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hidden = "" if visible is None else f"; CUDA_VISIBLE_DEVICES={visible!r}"
        raise _SpecProblem(
            "model.device",
            f"device: cuda, but torch sees no CUDA device here (torch {torch.__version__} "
            f"with {build}{hidden})",
        )
    torch.cuda.set_device(device)
    return device


def _join(spec: Spec, device: Any) -> bool:
    """Join the launch's process group (distributed specs); a world size the launch does not
    have is the spec's problem."""
    try:
        return ranks.join(spec, _RANK, device)
    except ValueError as exc:
        raise _SpecProblem("distributed.world_size", str(exc)) from exc


def _synchronizer(device: Any) -> Callable[[], None]:
    """What makes a timed call end when the device is done, not when the launch returns."""
    import torch

    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _load_megacache(path: str | None) -> MegacacheInfo:
    """Hot-load a Mega-Cache blob before anything compiles (bench's ``megacache`` modes)."""
    if not path:
        return MegacacheInfo()
    import torch

    info = torch.compiler.load_cache_artifacts(Path(path).read_bytes())
    return MegacacheInfo(loaded=info is not None, entries=_cache_info_counts(info))


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


def _build_model(spec: Spec, device: Any) -> Any:
    """The factory's model on the spec's device and dtype, in eval mode, checked against the
    inputs; each failure is the spec's, at the key that caused it."""
    import torch

    check_input_memory(spec, device)
    factory = resolve_factory(spec)
    kwargs_key = "model.kwargs" if spec.model.kwargs else "model.factory"
    rank_kwargs, refused = ranks.factory_kwargs(spec, factory, _RANK)
    if refused:
        raise _SpecProblem("distributed", refused)
    try:
        model = factory(**spec.model.kwargs, **rank_kwargs)
    except TypeError as exc:
        raise _SpecProblem("model.kwargs", f"factory rejected its kwargs: {exc}") from exc
    except Exception as exc:  # the factory is the spec's code: its failure is the spec's
        raise _SpecProblem(
            kwargs_key, f"the factory raised {type(exc).__name__}: {_one_line(exc)}"
        ) from exc
    if isinstance(model, torch.nn.Module):
        try:
            model = model.to(device=device, dtype=getattr(torch, spec.model.dtype)).eval()
        except Exception as exc:
            if not _is_allocation_error(exc):
                raise
            raise _SpecProblem(
                kwargs_key, f"the model does not fit on {device}: {_one_line(exc)}"
            ) from exc
    check_call(model, spec)
    return model


@dataclass
class _Forward:
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
    def misses(self) -> int:
        """Calls no precompiled forward (or AOTInductor package) accepted so far."""
        served = self.precompiled or self.aoti
        return served.misses if served is not None else 0


def _forward(
    request: WorkerRequest,
    spec: Spec,
    model: Any,
    sync: Callable[[], None],
    activation: Activation | None = None,
) -> _Forward:
    """Compile ``model`` with exactly ``request.torch_kwargs`` (None: eager), or build or load
    precompiled forwards with them, or (the activate route) as ``activation.compile`` does.
    Synchronizes first: start-up includes moving the weights."""
    sync()
    call_kwargs = dict(spec.model.call_kwargs)
    if activation is not None:
        return _activated(activation, model, call_kwargs, sync)
    kwargs = request.torch_kwargs
    if request.aoti_build or request.aoti_load:
        return _aoti_forward(request, spec, model, sync)
    if request.precompile_save or request.precompile_load:
        assert kwargs is not None  # WorkerRequest's own rule
        precompiled, load_s = _precompiled(request, model, kwargs)
        building = bool(request.precompile_save)
        return _Forward(precompiled, call_kwargs, sync, precompiled, building, load_s)
    if kwargs is None:
        return _Forward(model, call_kwargs, sync)
    import torch

    try:
        if request.frames:
            framed = _framed(request, model, kwargs)
            return _Forward(framed, call_kwargs, sync, serves_frames=request.frames == "serve")
        return _Forward(torch.compile(model, **kwargs), call_kwargs, sync)
    except RuntimeError as exc:  # torch checks the backend and option names here
        key = "compile.backend" if "backend" in str(exc).lower() else "compile.options"
        message = _one_line(exc).split(", known options are")[0]
        raise _SpecProblem(key, f"torch.compile refused it: {message}") from exc


def _activated(
    activation: Activation, model: Any, call_kwargs: dict[str, Any], sync: Callable[[], None]
) -> _Forward:
    """The activate route: what ``activation.compile(model)`` returns, timed and counted (a
    precompiled forward counts its misses; served frames count a traced frame as one)."""
    from kiln.compiler.precompile import PrecompiledForward

    t0 = time.time()
    fn = activation.compile(model)
    if activation.manifest.aoti is not None:  # compile.route: aoti: the packages, loaded
        from kiln.compiler.aoti_serve import AotiModel

        packages = getattr(fn, "compiled", fn)  # under kiln.compiler.padded's wrapper, if any
        assert isinstance(packages, AotiModel)
        packages.on_miss = "eager"  # a miss is counted (verify fails on it), not raised mid-pass
        return _Forward(fn, call_kwargs, sync, load_s=time.time() - t0, aoti=packages)
    fell_back = bool(activation.warnings)  # precompiled forwards or frames refused: traced
    precompiled = fn if isinstance(fn, PrecompiledForward) else None
    frames_served = activation.manifest.precompiled_frames is not None and not fell_back
    load_s = time.time() - t0 if precompiled is not None else None
    return _Forward(fn, call_kwargs, sync, precompiled, False, load_s, frames_served)


def _activate(request: WorkerRequest) -> Activation | None:
    """``kiln.activate()`` on the served folder, first thing, as a server on that route does."""
    if request.route != "activate":
        return None
    assert request.cache_root is not None
    from kiln.compiler.activate import activate

    folder = Path(request.cache_root).parent
    if folder.parent.name == RANKS_DIR:  # a rank's own folder: activate the artifact's
        folder = folder.parent.parent
    return activate(folder, compat="ignore", device_index=request.device_index)


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


def _aoti_forward(
    request: WorkerRequest, spec: Spec, model: Any, sync: Callable[[], None]
) -> _Forward:
    """route: aoti: build the packages ahead of each bucket's first call (bake), or load the
    restored ones as ``kiln.activate().compile()`` does (serve); either way calls go through
    :class:`~kiln.compiler.aoti_serve.AotiModel`. Serving imports neither Dynamo nor Inductor."""
    from kiln.compiler import aoti_serve

    call_kwargs = dict(spec.model.call_kwargs)
    index = request.device_index if spec.model.device == "cuda" else 0
    if request.aoti_load:
        from kiln.artifact.archive import read_manifest

        folder = Path(request.aoti_load)
        manifest = read_manifest(folder)
        rank = _RANK.rank if _RANK is not None and manifest.distributed is not None else None
        aoti = aoti_serve.served_packages(manifest, rank)
        t0 = time.time()
        try:
            # A miss is counted as one (verify fails on it) rather than raised mid-pass.
            served = aoti_serve.AotiModel(
                model, aoti, rank_dir(folder, rank), device_index=index, on_miss="eager"
            )
        except aoti_serve.WeightsMismatchError as exc:
            raise _SpecProblem("model", str(exc)) from exc
        forward = _Forward(served, call_kwargs, sync, aoti=served)
        forward.load_s = time.time() - t0
        return forward
    from kiln.compiler.aoti_bake import AotiBuilder

    build = request.aoti_build
    assert build is not None
    builder = AotiBuilder(
        model,
        Path(build.folder),
        inputs=aoti_serve.spec_inputs(spec),
        axes=list(spec.buckets),
        call_kwargs=call_kwargs,
        device=spec.model.device,
        device_index=index,
        options=build.options,
        weights=build.weights,
        ranges={a: [min(s), max(s)] for a, s in spec.buckets.items()} if build.ranged else None,
        base=spec.base_dir.resolve(),
    )

    def served(*args: Any, **kwargs: Any) -> Any:
        assert builder.served is not None  # add() ran first
        return builder.served(*args, **kwargs)

    return _Forward(served, call_kwargs, sync, building=True, aoti=builder)


def _framed(request: WorkerRequest, model: Any, kwargs: dict[str, Any]) -> Any:
    """``model`` compiled with Dynamo's saved frames recorded (bake) or served (verify, bench,
    a proof): what ``kiln.activate().compile()`` does for such an artifact."""
    reason = frames.unsupported_reason()
    if reason:
        raise _SpecProblem("compile.precompile", reason)
    if request.frames == "record":
        frames.record()
    else:
        frames.serve()
    return frames.compile_model(model, kwargs)


def _precompiled(
    request: WorkerRequest, model: Any, kwargs: dict[str, Any]
) -> tuple[PrecompiledForward, float | None]:
    """The precompiled forward this pass builds (bake) or loads (serve), with its load time."""
    from kiln.compiler.precompile import PrecompiledForward, unsupported_reason

    reason = unsupported_reason()
    if reason:
        raise _SpecProblem("compile.precompile", reason)
    if request.precompile_save:
        return PrecompiledForward.empty(model, kwargs), None
    assert request.precompile_load is not None
    t0 = time.time()
    try:
        loaded = PrecompiledForward.load(model, kwargs, Path(request.precompile_load).read_bytes())
    except Exception as exc:  # torch's checks raise assorted types
        raise _Incompatible(
            f"this torch refuses the precompiled forwards ({type(exc).__name__}: {exc}); "
            "`kiln check` names the factor that differs"
        ) from exc
    return loaded, time.time() - t0


class _Meter:
    """Measures what one step compiled: the difference in torch's counters, what Dynamo logged
    (recompiles, graph breaks, frames), the precompiled-forward misses, and the files the step
    added to the cache root."""

    def __init__(
        self,
        cache_root: str | None,
        dynamo: DynamoLog,
        forward: _Forward,
        watch: Watch | None = None,
        started: Snapshot | None = None,
    ) -> None:
        self.root = Path(cache_root) if cache_root else None
        self.dynamo, self.forward = dynamo, forward
        self.watch, self.started = watch, started
        self.breaks: list[GraphBreak] = []  # every bucket's, merged into the result

    def _files(self) -> set[str]:
        return snapshot(self.root) if self.root else set()

    def _written(self, step: Callable[[], _T]) -> tuple[_T, list[str]]:
        """``step``'s value and what it wrote where a served process must not (the first
        step also owns what start-up wrote: the import, the model build, the compile call)."""
        assert self.watch is not None
        before = self.started or self.watch.snapshot()
        self.started = None
        value = step()
        return value, self.watch.written(before, self.watch.snapshot())

    def measure(self, key: str, step: Callable[[], _T]) -> tuple[_T, CompileCounts]:
        before = CompileCounters.read()
        files = self._files() if self.watch is None else set()
        mark, missed = self.dynamo.mark(), self.forward.misses
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
        if self.forward.serves_frames:  # the saved frames did not cover these
            misses += len(traced)
        compiles = compile_counts(
            CompileCounters.read() - before,
            new_files,
            served=self.watch is not None,
            recompile_reasons=self.dynamo.recompiles_since(mark),
            precompile_misses=misses,
            frames=traced,
        )
        return value, compiles


@dataclass
class _Grid:
    """The two phases of a pass over the grid, each bucket measured by ``meter``."""

    spec: Spec
    device: Any
    seeds: dict[str, int]  # a bucket's inputs are seeded by its place in the grid, not the order
    forward: _Forward
    meter: _Meter

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


def _save_caches(request: WorkerRequest, forward: _Forward) -> MegacacheInfo:
    """Write what this pass was asked to keep: the precompiled forwards it built, and torch's
    Mega-Cache blob of everything compiled or loaded in this process."""
    if forward.building and request.precompile_save:
        assert forward.precompiled is not None
        Path(request.precompile_save).write_bytes(forward.precompiled.to_bytes())
    if not request.megacache_save and request.frames != "record":
        return MegacacheInfo()
    import torch

    saved = torch.compiler.save_cache_artifacts()  # also writes recorded frames to the root
    if not request.megacache_save:
        return MegacacheInfo()
    if saved is None:
        return MegacacheInfo(saved=False)
    Path(request.megacache_save).write_bytes(saved[0])
    return MegacacheInfo(saved=True, entries=_cache_info_counts(saved[1]))


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


def _cache_info_counts(info: Any) -> dict[str, int]:
    if info is None:
        return {}
    artifacts = getattr(info, "artifacts", None)
    if isinstance(artifacts, dict):
        return {k: len(v) for k, v in artifacts.items()}
    return {k: len(v) for k, v in vars(info).items() if isinstance(v, list)}


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
    except _Incompatible as exc:
        traceback.print_exc()
        outcome = WorkerOutcome(failure=WorkerFailure(kind="incompatible", message=str(exc)))
        code = 5
    except (_SpecProblem, AotiBuildError) as exc:
        outcome = WorkerOutcome(failure=WorkerFailure(kind="spec", key=exc.key, message=str(exc)))
        code = 2
    except Exception as exc:
        traceback.print_exc()
        message = f"{type(exc).__name__}: {exc}"
        outcome = WorkerOutcome(failure=WorkerFailure(kind="internal", message=message))
        code = 1
    outcome_path.write_text(outcome.model_dump_json())
    return code


if __name__ == "__main__":
    sys.exit(main())
