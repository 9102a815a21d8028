"""What a worker pass calls: the model compiled with exactly the request's ``torch.compile``
arguments, or eager, or precompiled forwards built or loaded, Dynamo's saved frames, AOTInductor
packages, or (the activate route) what ``kiln.activate().compile()`` returns; each as a
:class:`~kiln.compiler.measure.Forward` that times and counts its calls.
"""

from __future__ import annotations

import ast
import contextlib
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.compiler import frames
from kiln.compiler.failures import Incompatible, SpecProblem, one_line
from kiln.compiler.measure import Forward
from kiln.compiler.protocol import WorkerRequest
from kiln.compiler.ranks import Rank
from kiln.layout import CacheLayout
from kiln.padding import PadGrid
from kiln.spec import Spec
from kiln.spec_yaml import did_you_mean

if TYPE_CHECKING:
    from kiln.artifact.manifest import Aoti
    from kiln.compiler.activate import Activation
    from kiln.compiler.precompile import PrecompiledForward


def make_forward(
    request: WorkerRequest,
    spec: Spec,
    model: Any,
    sync: Callable[[], None],
    activation: Activation | None = None,
    *,
    launched: Rank | None = None,
) -> Forward:
    """Compile ``model`` with exactly ``request.torch_kwargs`` (None: eager), or build or load
    precompiled forwards with them, or (the activate route) as ``activation.compile`` does.
    ``launched``: this process's rank when a launcher started it (a rank serves its own
    AOTInductor packages). Synchronizes first: start-up includes moving the weights."""
    sync()
    call_kwargs = dict(spec.model.call_kwargs)
    if activation is not None:
        return _activated(activation, model, call_kwargs, sync)
    kwargs = request.torch_kwargs
    if request.aoti_build or request.aoti_load:
        return _aoti_forward(request, spec, model, sync, launched)
    if request.precompile_save or request.precompile_load:
        assert kwargs is not None  # WorkerRequest's own rule
        precompiled, load_s = _precompiled(request, model, kwargs)
        building = bool(request.precompile_save)
        return Forward(precompiled, call_kwargs, sync, precompiled, building, load_s)
    if kwargs is None:
        return Forward(model, call_kwargs, sync)
    import torch

    try:
        if request.frames:
            framed = _framed(request, model, kwargs)
            return Forward(framed, call_kwargs, sync, serves_frames=request.frames == "serve")
        return Forward(torch.compile(model, **kwargs), call_kwargs, sync)
    except RuntimeError as exc:  # torch checks the backend and option names here
        raise _refused(exc) from exc


_UNKNOWN_OPTION = re.compile(r"Unexpected optimization option (\S+), known options are (\[.*\])")


def _refused(exc: RuntimeError) -> SpecProblem:
    """torch.compile's refusal at the spec's key: an option name it does not know at that
    option (``compile.options.max_autotun``, with the known name nearest to it), a backend at
    ``compile.backend``. (Its option error lists all 600-odd names, ``cpu_backend`` among them:
    it is no backend error for saying "backend".)"""
    text = str(exc)
    unknown = _UNKNOWN_OPTION.search(text)
    if unknown is None:
        key = "compile.backend" if "backend" in text.lower() else "compile.options"
        return SpecProblem(key, f"torch.compile refused it: {one_line(exc)}")
    name, hint = unknown.group(1), ""
    with contextlib.suppress(ValueError, SyntaxError):
        hint = did_you_mean(name, ast.literal_eval(unknown.group(2)))
    message = f"torch.compile refused it: unknown Inductor option {name!r}{hint}"
    return SpecProblem(f"compile.options.{name}", message)


@contextlib.contextmanager
def _model_as_baked() -> Iterator[None]:
    """The spec's model not the one the packages were built for (its weights' shapes or
    dtypes): the spec's problem, at ``model`` (exit 2), not a crash."""
    from kiln.compiler.aoti_serve import WeightsMismatchError

    try:
        yield
    except WeightsMismatchError as exc:
        raise SpecProblem("model", str(exc)) from exc


def _activated(
    activation: Activation, model: Any, call_kwargs: dict[str, Any], sync: Callable[[], None]
) -> Forward:
    """The activate route: what ``activation.compile(model)`` returns, timed and counted (a
    precompiled forward counts its misses; served frames count a traced frame as one)."""
    from kiln.compiler.padded import PaddedModel
    from kiln.compiler.precompile import PrecompiledForward

    t0 = time.time()
    with _model_as_baked():
        fn = activation.compile(model)
    if activation.manifest.aoti is not None:  # compile.route: aoti: the packages, loaded
        from kiln.compiler.aoti_serve import AotiModel

        packages = getattr(fn, "compiled", fn)  # under kiln.compiler.padded's wrapper, if any
        assert isinstance(packages, AotiModel)
        packages.on_miss = "eager"  # a miss is counted (verify fails on it), not raised mid-pass
        return Forward(fn, call_kwargs, sync, load_s=time.time() - t0, aoti=packages)
    fell_back = bool(activation.warnings)  # precompiled forwards or frames refused: traced
    inner = fn.compiled if isinstance(fn, PaddedModel) else fn  # the grid's wrapper, if any
    precompiled = inner if isinstance(inner, PrecompiledForward) else None
    frames_served = activation.manifest.precompiled_frames is not None and not fell_back
    load_s = time.time() - t0 if precompiled is not None else None
    return Forward(fn, call_kwargs, sync, precompiled, False, load_s, frames_served)


def _aoti_forward(
    request: WorkerRequest,
    spec: Spec,
    model: Any,
    sync: Callable[[], None],
    launched: Rank | None,
) -> Forward:
    """route: aoti: build the packages ahead of each bucket's first call (bake), or load the
    restored ones as ``kiln.activate().compile()`` does (serve); either way calls go through
    :class:`~kiln.compiler.aoti_serve.AotiModel`. Serving imports neither Dynamo nor Inductor."""
    call_kwargs = dict(spec.model.call_kwargs)
    index = request.device_index if spec.model.device == "cuda" else 0
    if request.aoti_load:
        folder, packages = Path(request.aoti_load), request.aoti_packages
        return _aoti_served(folder, packages, model, call_kwargs, sync, index, launched)
    from kiln.compiler import aoti_serve
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
        pads=PadGrid.from_spec(spec) if spec.paddable_axes() else None,
    )

    def served(*args: Any, **kwargs: Any) -> Any:
        assert builder.served is not None  # add() ran first
        return builder.served(*args, **kwargs)

    return Forward(served, call_kwargs, sync, building=True, aoti=builder)


def _aoti_served(
    folder: Path,
    packages: list[Aoti] | None,
    model: Any,
    call_kwargs: dict[str, Any],
    sync: Callable[[], None],
    index: int,
    launched: Rank | None,
) -> Forward:
    """The restored packages in ``folder`` (a rank's own, for a distributed artifact), loaded
    and timed as a server on the route loads them; ``packages`` (each rank's) where the folder
    has no manifest yet (a bake's work folder)."""
    from kiln.artifact.archive import read_manifest
    from kiln.compiler import aoti_serve

    rank = None
    sizes = None
    if packages is not None:  # a launched rank is a distributed spec's: its own folder
        rank = launched.rank if launched is not None else None
        aoti = packages[rank or 0]
    else:
        manifest = read_manifest(folder)
        if launched is not None and manifest.distributed is not None:
            rank = launched.rank
        aoti = aoti_serve.served_packages(manifest, rank)
        sizes = aoti_serve.library_sizes(manifest)
    t0 = time.time()
    with _model_as_baked():
        # A miss is counted as one (verify fails on it) rather than raised mid-pass.
        served = aoti_serve.AotiModel(
            model,
            aoti,
            CacheLayout(folder, rank).dir,
            device_index=index,
            on_miss="eager",
            sizes=sizes,
        )
    forward = Forward(served, call_kwargs, sync, aoti=served)
    forward.load_s = time.time() - t0
    return forward


def _framed(request: WorkerRequest, model: Any, kwargs: dict[str, Any]) -> Any:
    """``model`` compiled with Dynamo's saved frames recorded (bake) or served (verify, bench,
    a proof): what ``kiln.activate().compile()`` does for such an artifact."""
    reason = frames.unsupported_reason()
    if reason:
        raise SpecProblem("compile.precompile", reason)
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
        raise SpecProblem("compile.precompile", reason)
    if request.precompile_save:
        return PrecompiledForward.empty(model, kwargs), None
    assert request.precompile_load is not None
    t0 = time.time()
    try:
        loaded = PrecompiledForward.load(model, kwargs, Path(request.precompile_load).read_bytes())
    except Exception as exc:  # torch's checks raise assorted types
        raise Incompatible(
            f"this torch refuses the precompiled forwards ({type(exc).__name__}: {exc}); "
            "`kiln check` names the factor that differs"
        ) from exc
    return loaded, time.time() - t0
