"""Verify: prove, in a fresh process, that a restored cache hits for the whole grid.

Serving teams need a readiness gate, not a hope: verify serves every bucket from the restored
folder the way the pod will, as the first process after the restore, in a shuffled order (as
traffic arrives), calling each bucket enough times that CUDA graphs are recorded. It runs the
documented routes as written (:data:`ROUTES`): a fresh interpreter on ``kiln.env``'s
environment calling plain ``torch.compile`` with no kiln code before it, and one calling
``kiln.activate()``. Each serves a private copy of the folder with an empty ``HOME`` and
``TMPDIR``, as a new pod has, so the folder stays exactly as found (a failed verify stays
failed) and everything the process compiled, tuned, built or wrote is seen: FX/AOT misses,
Triton kernels, launchers built with gcc, kernels benchmarked, files written
(:mod:`kiln.compiler.writes`). Anything is exit 6, one line per bucket naming what and why;
a folder changed since restore is named too. ``--ready-file`` is written only on success.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from kiln import bytecode
from kiln.artifact.archive import read_manifest
from kiln.artifact.drift import changes, env_folder
from kiln.artifact.manifest import BucketStats, GraphBreak, Manifest
from kiln.artifact.restore import read_installed
from kiln.compiler.check import CheckReport, compare_manifest
from kiln.compiler.dynamo_log import RESUME_FRAME
from kiln.compiler.launch import WorkerRun, run_worker
from kiln.compiler.protocol import WorkerRequest, input_stream
from kiln.compiler.writes import driver_jit, in_driver_cache
from kiln.errors import IncompatibleError, NotFoundError, PackageLoadError, UsageError
from kiln.events import EventSink, SpecDiffers
from kiln.files import atomic_write
from kiln.grid import expand, off_grid, ordered
from kiln.kernel_locks import describe as describe_locks
from kiln.kernel_locks import foreign_locks
from kiln.layout import (
    CUDA_CACHE_DIR,
    ENV_NAME,
    INDUCTOR_DIR,
    CacheLayout,
    lock_links,
    unserved_path,
)
from kiln.serving import cache_env, served_torch_kwargs
from kiln.spec import Spec, differing_keys, load_spec
from kiln.workdir import FACTOR as WORKDIR_FACTOR
from kiln.workdir import logical_cwd, served_in

_VERIFY_STREAMS = 100  # input streams below this are the bake's passes
# The routes a server takes to a restored folder: plain torch.compile after `. kiln.env`, and
# kiln.activate(DIR).compile(model).
ROUTES = ("plain", "activate")


@dataclass
class VerifyReport:
    name: str
    order: list[str]
    buckets: list[BucketStats]
    check: CheckReport | None
    time_to_ready_s: float
    time_to_warm_s: float
    spec_matches: bool
    graph_breaks: list[GraphBreak] = field(default_factory=list)  # what the bake saw
    extra: dict[str, Any] = field(default_factory=dict)
    routes: list[str] = field(default_factory=lambda: ["plain"])
    # How the folder differs from what restore installed (files added, removed, changed).
    folder_changes: list[str] = field(default_factory=list)
    spec_differs: list[str] = field(default_factory=list)  # dotted keys, when not spec_matches
    env_names: str | None = None  # the folder a changed kiln.env names, when not this one
    # Kernel lock files of the folder this user cannot open (kiln.kernel_locks): the served
    # copy has its own, so its buckets pass, but a server of the folder would fail to load.
    foreign_locks: list[str] = field(default_factory=list)
    baked_grid: list[dict[str, int]] = field(default_factory=list)  # each baked bucket's sizes
    source_changed: str | None = None  # the model's source differs from the bake's (a line)

    @property
    def failing(self) -> list[BucketStats]:
        return [b for b in self.buckets if b.compiles > 0]

    def on_route(self, route: str) -> list[BucketStats]:
        """The buckets ``route`` served, keyed as the grid names them (:func:`route_key`)."""
        if route not in self.routes:
            return []
        if len(self.routes) == 1:
            return list(self.buckets)
        prefix = route_key(route, "")
        return [
            b.model_copy(update={"key": b.key.removeprefix(prefix)})
            for b in self.buckets
            if b.key.startswith(prefix)
        ]

    @property
    def ok(self) -> bool:
        return not self.failing and not self.folder_changes and not self.foreign_locks

    def reasons(self) -> list[str]:
        misses = [f.name for f in self.check.misses] if self.check else []
        # The working directory keys no graph (kiln.workdir): only the driver's JIT cache.
        graphs = ", ".join(name for name in misses if name != WORKDIR_FACTOR)
        changed = [changed_line(self.folder_changes, self.env_names)] if self.folder_changes else []
        if self.foreign_locks:
            changed.append(describe_locks([Path(p) for p in self.foreign_locks]))
        if self.failing and self.extra.get("unserved_workdir"):
            changed.append(self.extra["unserved_workdir"])
        if self.failing and self.source_changed:  # the likeliest cause: said before the guards
            changed.append(self.source_changed)
        route = self.extra.get("route", "compile")
        return changed + [
            explain(
                b,
                graphs,
                self.graph_breaks,
                off_grid(b.sizes, self.baked_grid),
                ", ".join(misses),
                route=route,
            )
            for b in self.failing
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "order": self.order,
            "spec_matches": self.spec_matches,
            "spec_differs": self.spec_differs,
            "time_to_ready_s": round(self.time_to_ready_s, 3),
            "time_to_warm_s": round(self.time_to_warm_s, 3),
            "routes": self.routes,
            "folder_changes": self.folder_changes,
            "foreign_locks": self.foreign_locks,
            "env_names": self.env_names,
            "model_source_changed": self.source_changed,
            "compiles": sum(b.compiles for b in self.buckets),
            "failing": self.reasons(),
            "buckets": [b.model_dump(mode="json") | {"compiles": b.compiles} for b in self.buckets],
            "check": self.check.to_dict() if self.check else None,
            **self.extra,
        }


# What a precompile_misses count is, by route: a precompiled forward's miss, or on the AOT
# route a call that no package took.
_MISS_WORDS = {
    "compile": ("precompiled miss", "precompiled misses"),
    "aoti": ("call no package took", "calls no package took"),
}


def explain(
    bucket: BucketStats,
    factors: str = "",
    breaks: Sequence[GraphBreak] = (),
    outside: str | None = None,
    driver_factors: str = "",
    *,
    route: str = "compile",
) -> str:
    """One line on what compiled in ``bucket`` and the most specific cause we know.

    A graph that missed is a cache-key question (name the differing factor), or the code after
    a data-dependent graph break reached with data the bake never drew (name the break: a
    shape guard quoted there would send the reader the wrong way), else torch's recompile
    reason. Kernels rebuilt while every graph hit are a different problem again — Triton
    re-tuning or rebuilding. ``outside`` (:func:`kiln.grid.off_grid`) says the bucket was never
    baked: that is the cause, whatever guard torch quotes. ``driver_factors``: the factors that
    differ for the CUDA driver's JIT cache (``factors`` and the working directory).
    ``route``: the artifact's; on ``aoti`` a miss is a call no package took (served eagerly).
    """
    b = bucket
    graphs = b.fx_misses + b.fx_bypass + b.aot_misses + b.precompile_misses
    counts = (
        (b.fx_misses + b.fx_bypass, "FX graph", "FX graphs"),
        (b.aot_misses, "AOT graph", "AOT graphs"),
        (b.precompile_misses, *_MISS_WORDS[route]),
        (b.new_native, "kernel binary", "kernel binaries"),
        (b.launchers, "native helper built with gcc", "native helpers built with gcc"),
        (b.autotunes, "autotune run", "autotune runs"),
        (b.kernel_tunings, "kernel's configs benchmarked", "kernels' configs benchmarked"),
        (b.written, "file written", "files written"),
    )
    what = ", ".join(f"{n} {one if n == 1 else many}" for n, one, many in counts if n)
    seam = data_dependent_break(b, breaks) if graphs and not factors else None
    if outside is not None:
        hint = f"{outside}: the bake never compiled it"
    elif seam is not None:
        hint = (
            f"serving data reached code after the data-dependent graph break at {seam.where} "
            f"({seam.reason}) that the bake's inputs never did"
        )
    elif graphs:
        why = b.recompile_reasons[-1].splitlines()[-1].strip("- ") if b.recompile_reasons else ""
        nothing = "no package takes these inputs" if route == "aoti" else "no cached entry matched"
        hint = f"environment differs: {factors}" if factors else nothing
        if why and not factors:
            hint += f"; Dynamo traced it because {why}"
    else:
        jit = driver_jit(b.new_files)
        others = [n for n in b.new_files if not in_driver_cache(n)]
        names = sorted({PurePosixPath(n).name for n in others})[:3]
        what_ran = [", ".join(names)] if names else []
        if jit:
            differs = f" (environment differs: {driver_factors})" if driver_factors else ""
            what_ran.insert(
                0,
                f"the CUDA driver JIT-compiled {jit} kernel(s) into {CUDA_CACHE_DIR}/ that the "
                f"shipped driver cache lacks{differs}",
            )
        if b.tuned_kernels:  # which kernel to look at, not just how many
            what_ran.append("benchmarked " + ", ".join(b.tuned_kernels[:3]))
        hint = "every graph hit; the process built, tuned or wrote" + (
            f": {'; '.join(what_ran)}" if what_ran else " at run time"
        )
        if factors and not jit:  # e.g. cpp.paths: kernels keyed apart from their graphs
            hint += f" (environment differs: {factors})"
    return f"{b.key}: {b.compiles} compile(s): {what} ({hint})"


def changed_line(changes: Sequence[str], elsewhere: str | None = None) -> str:
    """One line on a restored folder that is no longer what restore installed; ``elsewhere``:
    the folder its ``kiln.env`` names instead of this one (:func:`moved_env`)."""
    if elsewhere is not None and list(changes) == [f"~{ENV_NAME}"]:
        return (
            f"{ENV_NAME} names {elsewhere}, where the folder was restored, not this path (moved, "
            "copied or mounted elsewhere): a server that sources it reads caches there; restore "
            "at the path the server uses"
        )
    return (
        f"the folder changed since it was restored ({len(changes)} file(s), e.g. "
        f"{', '.join(changes[:3])}): something wrote into it or deleted from it; restore it again"
    )


def folder_drift(cache: Path, manifest: Manifest) -> tuple[list[str], str | None]:
    """:func:`folder_changes` and :func:`moved_env` together: what verify and a traffic
    replay report of the folder before serving it."""
    changes = folder_changes(cache, manifest)
    return changes, moved_env(cache, manifest, changes)


def moved_env(cache: Path, manifest: Manifest, changes: Sequence[str]) -> str | None:
    """The folder ``cache``'s changed ``kiln.env`` was written for, when it is restore's file
    for another path: the folder moved, copied or mounted elsewhere, not the file edited (None
    otherwise)."""
    if f"~{ENV_NAME}" not in changes:
        return None
    return env_folder(cache, manifest)


def folder_changes(cache: Path, manifest: Manifest) -> list[str]:
    """How ``cache`` differs from what restore installed there (:mod:`kiln.artifact.drift`):
    ``+name`` added, ``~name`` changed, ``-name`` removed."""
    state = read_installed(cache)
    found = state.changes if state is not None else changes(cache, manifest, None)
    return (
        [f"+{p}" for p in found.added]
        + [f"~{p}" for p in found.changed]
        + [f"-{p}" for p in found.removed]
    )


def data_dependent_break(bucket: BucketStats, breaks: Sequence[GraphBreak]) -> GraphBreak | None:
    """The data-dependent break whose resume frame Dynamo traced in ``bucket``, if any.

    The code after a graph break at line N is a frame of its own, named
    ``torch_dynamo_resume_in_FN_at_N``; tracing it in a served process while the bake's graphs
    all matched the bucket's shapes means the data took a path the bake never compiled.
    """
    seams = {b.line: b for b in breaks if b.data_dependent and b.line}
    for frame in bucket.frames:
        name, _, where = frame.partition(" ")
        resumed = RESUME_FRAME.match(name)
        if resumed is None:
            continue
        place = (where.rpartition(":")[0].rsplit("/", 1)[-1], int(resumed.group(1)))
        if place in seams:
            return seams[place]
    return None


def served_request(
    cache: Path, manifest: Manifest, order: list[str], calls: int, route: str | None = None
) -> WorkerRequest:
    """A pass that serves ``order`` from the restored folder ``cache`` as a pod would (its
    environment is :func:`~kiln.serving.cache_env`), timing a fresh first request and the steady
    latency of each bucket: verify and bench share this. ``route`` (one of :data:`ROUTES`)
    serves as that server does; None loads what the artifact carries the way bench's modes do.
    For a K-rank artifact the paths are the layout's names under ``cache``, which
    :mod:`kiln.compiler.ranks` moves into each rank's folder. A ``compile.route: aoti``
    artifact's packages are called without Dynamo or Inductor (nothing is compiled)."""
    layout = CacheLayout(cache)
    bytecode = str(layout.bytecode) if manifest.bytecode else None
    if manifest.aoti is not None:
        request = WorkerRequest(
            order=order, torch_kwargs=None, calls=calls, steady_calls=10, first_request=True
        )
        if route is not None:  # kiln.activate(DIR).compile(model), as its server does
            return request.replace(cache_root=str(layout.inductor), route=route)
        return request.replace(aoti_load=str(cache), bytecode=bytecode)
    base = WorkerRequest(
        order=order,
        torch_kwargs=served_torch_kwargs(manifest),
        calls=calls,
        steady_calls=10,
        first_request=True,
        cache_root=str(layout.inductor),
    )
    if route is not None:  # the route's server loads what it loads itself
        return base.replace(route=route)
    precompiled = cache / manifest.precompiled if manifest.precompiled else None
    if precompiled and manifest.distributed:
        precompiled = layout.precompiled  # ranks/0/precompiled.bin is rank 0's: each has its own
    return base.replace(
        precompile_load=str(precompiled) if precompiled else None,
        frames="serve" if manifest.precompiled_frames else None,
        bytecode=bytecode,
    )


def check_world_size(spec: Spec, manifest: Manifest) -> None:
    """Serving K ranks from an artifact baked for another number is exit 5, said at once."""
    if spec.world_size != manifest.world_size or bool(spec.distributed) != bool(
        manifest.distributed
    ):
        raise IncompatibleError(
            f"{manifest.name}: baked for {manifest.world_size} rank(s), the spec runs "
            f"{spec.world_size}: every rank's shard and graphs differ"
        )


def source_changed(spec: Spec, manifest: Manifest) -> str | None:
    """A line when the factory's source file is not the one baked (its sha256 against the
    manifest's ``model_source_sha256``): a model whose code changed traces other graphs, and
    the guard torch quotes for the miss (``expected 1, actual 4``) points elsewhere. Said with
    a miss, as its likely cause; by itself no failure (an edited comment hits). Torch-free."""
    baked = manifest.model_source_sha256
    try:
        here = spec.model_source_sha256()
    except OSError:
        return None
    if baked is None or here is None or here == baked:
        return None
    origin = spec.factory_origin()
    name = origin.name if origin else spec.model.factory
    return (
        f"the model's source ({name}) changed since the bake: a changed model compiles anew "
        "(bake it again)"
    )


def check_spec_fits(spec: Spec, manifest: Manifest) -> None:
    """A spec for another model than the artifact's is exit 5, said at once: its ranks
    (:func:`check_world_size`), its grid's axes or its inputs' names are not the baked spec's.
    Served, every bucket would miss on keys no bucket of the artifact has, and the inputs it
    makes would not be those the artifact's server wraps (a padded grid's ``ShapeError``)."""
    check_world_size(spec, manifest)
    baked = manifest.spec
    axes, baked_axes = list(spec.buckets), list(baked.get("buckets") or {})
    names = [inp.name for inp in spec.inputs]
    baked_names = [str(inp.get("name")) for inp in baked.get("inputs") or []]
    baked_says, spec_says = [], []
    if axes != baked_axes:
        baked_says.append(f"grid axes {' × '.join(baked_axes)}")
        spec_says.append(f"axes {' × '.join(axes)}")
    if sorted(names) != sorted(baked_names):
        baked_says.append(f"inputs ({', '.join(baked_names)})")
        spec_says.append(f"inputs ({', '.join(names)})")
    if baked_says:
        raise IncompatibleError(
            f"{manifest.name} was baked for {' and '.join(baked_says)}; the spec has "
            f"{' and '.join(spec_says)}: it is another model's spec (serve the artifact with "
            "the spec it was baked from)"
        )


def verify(
    spec: Spec | str | Path,
    cache: str | Path,
    *,
    order: str = "shuffle",
    seed: int = 0,
    device_index: int = 0,
    ready_file: str | Path | None = None,
    keys: Sequence[str] | None = None,
    routes: Sequence[str] = ROUTES,
    on_event: EventSink | None = None,
) -> VerifyReport:
    """Serve ``spec``'s grid (only the buckets ``keys`` names, when given: a shard's slice)
    from the restored folder ``cache`` on each of ``routes``, each in a fresh process that
    serves a private copy of the folder (``cache`` itself is never written)."""
    shown = "the spec" if isinstance(spec, Spec) else str(spec)
    spec = spec if isinstance(spec, Spec) else load_spec(spec)
    cache = _restored(Path(cache).absolute())
    manifest = read_manifest(cache)
    check_spec_fits(spec, manifest)
    routes = served_routes(manifest, routes)
    grid = [b for b in expand(spec) if keys is None or b.key in keys]
    order_keys = [b.key for b in ordered(grid, order, seed)]
    changes, elsewhere = folder_drift(cache, manifest)
    matches = spec.sha256() == manifest.spec_sha256
    differs = [] if matches else differing_keys(manifest.spec, spec.canonical())
    baked_grid = [b.sizes for b in manifest.grid]
    if not matches and on_event is not None:
        unbaked = [why for b in grid if (why := off_grid(b.as_dict(), baked_grid)) is not None]
        on_event(SpecDiffers(spec=shown, keys=differs, unbaked=unbaked))
    try:
        runs = [
            (
                route,
                serve_copy(spec, cache, manifest, order_keys, route, device_index, seed, on_event),
            )
            for route in routes
        ]
    except PackageLoadError as exc:  # the folder could not serve at all: say what changed
        if not changes:
            raise
        raise PackageLoadError(exc.problem, advice=changed_line(changes, elsewhere)) from exc
    # The route the artifact is made for leads the timings.
    lead = next((run for route, run in runs if route == made_for(manifest)), runs[0][1])
    report = VerifyReport(
        name=manifest.name,
        order=order_keys,
        buckets=_route_buckets(runs, manifest),
        check=_environment_check(spec, manifest, lead),
        time_to_ready_s=lead.time_to_ready,
        time_to_warm_s=lead.time_to_warm,
        spec_matches=matches,
        spec_differs=differs,
        baked_grid=baked_grid,
        graph_breaks=manifest.graph_breaks,
        extra={
            "precompile_load_s": lead.result.precompile_load_s,
            "ranks": spec.world_size,
            "bytecode_modules": lead.result.bytecode_modules,  # imported from the artifact's
            "route": manifest.route,
            "compiler_modules": lead.result.compiler_modules,  # Dynamo/Inductor, if imported
            "unserved_workdir": _unserved_workdir(spec),
        },
        routes=list(routes),
        folder_changes=changes,
        env_names=elsewhere,
        source_changed=source_changed(spec, manifest),
        foreign_locks=[
            str(lock)
            for layout in CacheLayout.ranks(cache, manifest.rank_world)
            if manifest.aoti is None
            for lock in foreign_locks(layout)
        ],
    )
    if ready_file is not None:
        _mark_ready(Path(ready_file), report)
    return report


def _unserved_workdir(spec: Spec) -> str | None:
    """A line when the spec's ``serve.workdir`` is no folder here, so verify served elsewhere:
    a driver entry keyed by it then shows as compiled (kiln.workdir)."""
    declared = spec.serve.workdir
    if declared is None or served_in(declared) is not None:
        return None
    here = logical_cwd() or "a removed folder"
    return f"serve.workdir {declared} is no folder on this machine: verify served in {here}"


def _restored(cache: Path) -> Path:
    """``cache``, when it holds a restored artifact's caches (rank 0's of a K-rank artifact, or
    AOTInductor packages); else NotFoundError."""
    if (problem := unserved_path(cache)) is not None:
        raise NotFoundError(problem)
    top = CacheLayout(cache)
    first = CacheLayout(cache, 0) if top.ranks_dir.is_dir() else top
    if not first.inductor.is_dir() and not top.aoti.is_dir():
        raise NotFoundError(f"{cache}: no {INDUCTOR_DIR}/ folder (restore an artifact there first)")
    return cache


def _environment_check(spec: Spec, manifest: Manifest, lead: WorkerRun) -> CheckReport | None:
    """The served environment against the baked one, per rank of the leading route: the first
    rank whose environment differs names the factor, else rank 0's."""
    checks = [
        compare_manifest(
            manifest,
            result.fingerprint,
            rank=rank if manifest.distributed else None,
            world_size=spec.world_size if manifest.distributed else None,
            workdir=result.workdir,
        )
        for rank, result in enumerate(lead.results)
        if result.fingerprint
    ]
    return next((c for c in checks if not c.ok), checks[0]) if checks else None


def _route_buckets(runs: list[tuple[str, WorkerRun]], manifest: Manifest) -> list[BucketStats]:
    """Every route's buckets (each key named by route when more than one served), every rank's
    labelled; a re-trace that hit the cache is how a fresh process works: no reason shown."""
    buckets = []
    for route, run in runs:
        for b in rank_buckets(run.results, labelled=manifest.distributed is not None):
            b = b if b.compiles else b.model_copy(update={"recompile_reasons": []})
            buckets.append(
                b.model_copy(update={"key": route_key(route, b.key)}) if len(runs) > 1 else b
            )
    return buckets


def route_key(route: str, key: str) -> str:
    """A bucket's key in a report of several routes: ``plain · batch=4``."""
    return f"{route} · {key}"


def served_routes(manifest: Manifest, routes: Sequence[str]) -> Sequence[str]:
    """``routes`` (each one of :data:`ROUTES`) as ``manifest`` can be served: no plain
    ``torch.compile`` server can call an AOTInductor package, so a ``compile.route: aoti``
    artifact has the activate route only."""
    unknown = [r for r in routes if r not in ROUTES]
    if unknown or not routes:
        raise UsageError(f"routes: {unknown or 'none'} (choose from {', '.join(ROUTES)})")
    if manifest.aoti is None:
        return routes
    if "activate" not in routes:
        raise UsageError(
            f"{manifest.name}: compile.route: aoti is served by kiln.activate() only "
            "(route activate)"
        )
    return ("activate",)


def made_for(manifest: Manifest) -> str:
    """The route an artifact is made for: ``kiln.activate()`` loads precompiled graphs, saved
    frames or AOTInductor packages, which plain ``torch.compile`` never uses; a folder of caches
    serves both alike."""
    loads = manifest.precompiled or manifest.precompiled_frames or manifest.aoti
    return "activate" if loads else "plain"


def proof_routes(manifest: Manifest) -> tuple[str, ...]:
    """What the bake's proof serves: both routes where they load different things, else the
    plain one (``kiln.activate()`` then adds only environment and imports to it). AOTInductor
    packages have only the one."""
    if manifest.aoti is not None:
        return ("activate",)
    return ROUTES if made_for(manifest) == "activate" else ("plain",)


def serve_copy(
    spec: Spec,
    cache: Path,
    manifest: Manifest,
    order: list[str],
    route: str,
    device_index: int,
    seed: int,
    on_event: EventSink | None,
) -> WorkerRun:
    """One fresh process serving ``order`` on ``route`` from a private copy of ``cache``,
    with an empty ``HOME`` and ``TMPDIR``: what it writes anywhere there is counted, and the
    restored folder stays as found. It runs where the spec says the server runs
    (:func:`kiln.workdir.served_in`)."""
    with tempfile.TemporaryDirectory(prefix="kiln-serve-") as tmp:
        served, home, temp = private_copy(cache, manifest, Path(tmp))
        request, env = first_process(
            served_request(served, manifest, order, spec.warmup.calls, route), manifest, home, temp
        )
        request = request.replace(
            fingerprint=True,
            device_index=device_index,
            # Data the bake never drew, as traffic's is: a path the bake's inputs missed shows.
            input_seed=input_stream(_VERIFY_STREAMS + seed),
        )
        cwd = served_in(spec.serve.workdir)
        return run_worker(spec, request, env, on_event=on_event, cwd=cwd)


def private_copy(cache: Path, manifest: Manifest, tmp: Path) -> tuple[Path, Path, Path]:
    """A copy of ``cache`` in ``tmp`` to serve, with an empty ``HOME`` and ``TMPDIR`` beside it:
    ``(served, home, temp)``. What the served process writes lands in the copy, so a failing
    verify fails again. Its lock links (:func:`kiln.layout.lock_links`) point into ``tmp`` as
    well: Inductor leaves a lock file per C++ kernel it loads, owned by whoever loaded it, and
    one left in the shared ``/tmp`` by a root verify in an image's build stops the image's
    non-root server from loading that kernel (``PermissionError``)."""
    served, home, temp, locks = tmp / "dest", tmp / "home", tmp / "tmp", tmp / "locks"
    shutil.copytree(cache, served, symlinks=True)
    for folder in (home, temp, locks):
        folder.mkdir()
    for link in lock_links(manifest.rank_world):
        if (served / link).is_symlink():
            (served / link).unlink()
            (served / link).symlink_to(locks, target_is_directory=True)
    return served, home, temp


def first_process(
    request: WorkerRequest, manifest: Manifest, home: Path, temp: Path
) -> tuple[WorkerRequest, dict[str, str]]:
    """``request`` (a served route's) and its environment as a new pod's first process: the
    served folder's ``kiln.env`` values, an empty ``HOME`` and ``TMPDIR``, all three watched.
    A plain server on an image without bytecode imports from the artifact's, as the README
    tells it to (``kiln.activate()`` does that itself)."""
    assert request.cache_root is not None
    served = Path(request.cache_root).parent
    watch = {"DIR": str(served), "HOME": str(home), "TMPDIR": str(temp)}
    env = cache_env(served, manifest.env) | {"HOME": str(home), "TMPDIR": str(temp)}
    if request.route == "plain" and manifest.bytecode:
        env |= bytecode.plain_env(CacheLayout(served).bytecode)
    return request.replace(watch=watch), env


def rank_buckets(results: Any, *, labelled: bool) -> list[BucketStats]:
    """Every rank's buckets, each key prefixed with its rank for a K-rank artifact: a bucket
    that compiled on one rank is named with it (``rank 1 · batch=4``)."""
    if not labelled:
        return list(results[0].buckets)
    return [
        b.model_copy(update={"key": f"rank {rank} · {b.key}"})
        for rank, result in enumerate(results)
        for b in result.buckets
    ]


def _mark_ready(ready: Path, report: VerifyReport) -> None:
    """Write the readiness file (atomically) when the report is ok; remove a stale one if not."""
    if not report.ok:
        ready.unlink(missing_ok=True)
        return
    with atomic_write(ready) as fh:
        fh.write(json.dumps(report.to_dict(), indent=2).encode())
