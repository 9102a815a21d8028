"""Bench: what does a baked cache buy, against eager, a cold compile and the stock alternatives?

Each mode runs the whole grid in its own fresh process on this machine, in one run, so the numbers
compare like with like: time-to-ready (process start → every bucket ran once, interpreter and
torch import included), per-bucket first-call time, steady-state latency, and compiles counted.

Modes: ``eager`` (no compile) · ``cold`` (torch.compile, empty cache) · ``kiln`` (restored from
the artifact this run baked, at a new path, through ``kiln.env``) · ``megacache`` (the Mega-Cache
blob alone, loaded into an empty cache folder) · ``copied`` (the raw cache folder copied to a new
path: the hand-rolled approach) · opt-in ``kiln-blob`` (the restored folder and its Mega-Cache
blob hot-loaded, as ``kiln.activate`` does) · opt-in ``kiln-serial`` (``kiln`` with
``compile_threads: 1``: kernels load in the serving process and no compile worker pool starts,
as kiln already serves autotuning specs; it measures what that costs or saves the rest). ``cold``
is the bake's own first pass unless ``cold_run`` asks for a separate bare loop: both are a fresh
process compiling into an empty cache. For a ``precompile`` spec, ``kiln`` loads the precompiled
forwards, and ``cold``, ``megacache`` and ``copied`` come from a separate plain ``torch.compile``
run, as a user without kiln would have them.

Opt-in ``aoti`` bakes the spec a second time on ``compile.route: aoti`` (AOTInductor packages)
and serves that artifact, restored, as ``kiln.activate().compile()`` would: no Dynamo, no
Inductor. The other modes then serve the spec on ``route: compile`` (a spec written for the
AOT route is benched against its torch.compile counterpart), so one run compares both routes:
time to ready, steady latency, and the two artifacts' sizes.

With ``workdir``, the bakes stay in that folder, and a later bench there reuses each one that
still matches (:func:`reusable_bake`: the same spec, model source and kiln version, the artifact
unchanged, the Python bytecode a bake here would ship, and ``kiln check``'s verdict on this
machine: compatible) instead of baking again:
the modes can then be run again, others added, or ``--repeat`` raised, for the price of the
served runs alone. Every served run still gets a fresh folder.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln._version import __version__
from kiln.artifact.archive import read_manifest, sha256_file
from kiln.artifact.manifest import WORK_KINDS, BucketStats
from kiln.artifact.restore import restore
from kiln.bytecode import uncached_reason
from kiln.compiler.bake import BakeResult, bake, ships_bytecode
from kiln.compiler.launch import WorkerRun, run_worker
from kiln.compiler.protocol import WorkerRequest, WorkerResult
from kiln.compiler.verify import first_process, made_for, rank_buckets, served_request
from kiln.errors import Param, UsageError, Worded
from kiln.events import EventSink, ModeStarted, ignore
from kiln.grid import expand, ordered
from kiln.layout import CacheLayout
from kiln.serving import (
    cache_env,
    cold_torch_kwargs,
    compile_env,
    served_torch_kwargs,
    torch_kwargs,
    with_compile_threads,
)
from kiln.spec import Spec, load_spec
from kiln.workdir import served_in

MODES = ("eager", "cold", "kiln", "megacache", "copied")
# Opt-in: the restored folder *plus* the hot-loaded blob (kiln.activate's route), and kiln with
# kernels loaded in-process.
EXTRA_MODES = ("kiln-blob", "kiln-serial", "aoti")
_RESTORED = "restored"  # the folder of the work folder that bench restores the artifact into
# What one bench run serves from in its work folder, each made afresh (a kept work folder's are
# removed before the next bench there): the restore, the plain cold run's caches, and one
# folder (with its HOME and TMPDIR) per served run.
_RUN_FOLDER = re.compile(
    rf"{_RESTORED}|cold|(eager|kiln|kiln-blob|kiln-serial|megacache|copied|aoti)-\d+(-home|-tmp)?"
)
ALL_MODES = (*MODES, *EXTRA_MODES)  # what bench() accepts, in report order


@dataclass
class ModeResult:
    mode: str
    time_to_ready_s: float
    time_to_warm_s: float
    startup_s: float  # process start → model built (and precompiled forwards loaded)
    buckets: list[BucketStats]
    startup_phases: dict[str, float] = field(default_factory=dict)  # start-up, phase by phase
    note: str = ""
    ready_runs_s: list[float] = field(default_factory=list)  # every repeat's time to ready

    @property
    def compiles(self) -> int:
        return sum(b.compiles for b in self.buckets)

    @property
    def first_calls_s(self) -> float:
        return sum(b.first_call_s for b in self.buckets)

    def work(self) -> dict[str, int]:
        """Compile work over the grid, by kind (what ``compiles`` adds up)."""
        return {kind: sum(getattr(b, kind) for b in self.buckets) for kind in WORK_KINDS}

    @property
    def worst_first_request_ratio(self) -> float | None:
        """Max over buckets of first real request (after warmup) / steady latency."""
        ratios = [
            b.first_request_s / b.steady_s for b in self.buckets if b.first_request_s and b.steady_s
        ]
        return max(ratios) if ratios else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "time_to_ready_s": round(self.time_to_ready_s, 3),
            "time_to_warm_s": round(self.time_to_warm_s, 3),
            "startup_s": round(self.startup_s, 3),
            # A list: JSON readers (and --json's sorted keys) would lose a dict's order.
            "startup_phases": [{"phase": k, "s": v} for k, v in self.startup_phases.items()],
            "ready_runs_s": [round(t, 3) for t in self.ready_runs_s],
            "first_calls_s": round(self.first_calls_s, 3),
            "compiles": self.compiles,
            "work": self.work(),
            "steady_median_s": statistics.median(b.steady_s for b in self.buckets),
            "worst_first_request_ratio": self.worst_first_request_ratio,
            "note": self.note,
            "buckets": [b.model_dump(mode="json") | {"compiles": b.compiles} for b in self.buckets],
        }


@dataclass
class BenchReport:
    name: str
    spec: dict[str, Any]
    fingerprint: dict[str, Any]
    modes: dict[str, ModeResult]
    bake_wall_s: float
    bare_compile_wall_s: float
    artifact_bytes: int
    restore_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def ratio(self, a: str, b: str) -> float | None:
        if a in self.modes and b in self.modes and self.modes[b].time_to_ready_s > 0:
            return self.modes[a].time_to_ready_s / self.modes[b].time_to_ready_s
        return None

    def ratios(self) -> dict[str, float | None]:
        out = {
            f"{a}/{b}": self.ratio(a, b)
            for a, b in (
                ("kiln", "cold"),
                ("kiln-blob", "kiln"),
                ("kiln-serial", "kiln"),
                ("kiln", "megacache"),
                ("kiln", "copied"),
                ("kiln", "eager"),
                ("aoti", "eager"),
                ("aoti", "kiln"),
                ("copied", "eager"),
                ("megacache", "eager"),
                ("cold", "eager"),
            )
        }
        out["bake/bare_compile"] = (
            self.bake_wall_s / self.bare_compile_wall_s if self.bare_compile_wall_s else None
        )
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "spec": self.spec,
            "fingerprint": {k: v for k, v in self.fingerprint.items() if k not in ("inductor",)},
            "bake_wall_s": round(self.bake_wall_s, 3),
            "bare_compile_wall_s": round(self.bare_compile_wall_s, 3),
            "artifact_bytes": self.artifact_bytes,
            "restore_s": round(self.restore_s, 3),
            "ratios": self.ratios(),
            "modes": {k: v.to_dict() for k, v in self.modes.items()},
            **self.extra,
        }


def check_modes(modes: Iterable[str]) -> tuple[str, ...]:
    """``modes`` if every one is a bench mode (:data:`ALL_MODES`), else a usage error (exit 2).

    Checked before anything is baked: a typo must not cost a bake and then run nothing.
    """
    chosen = tuple(modes)
    unknown = sorted(set(chosen) - set(ALL_MODES))
    if unknown:
        raise UsageError(
            f"unknown bench mode(s): {', '.join(unknown)} (known: {', '.join(ALL_MODES)})"
        )
    return chosen


def bench(
    spec: Spec | str | Path,
    *,
    modes: Iterable[str] = MODES,
    order: str = "shuffle",
    seed: int = 0,
    cold_run: bool = False,
    repeat: int = 1,
    workdir: str | Path | None = None,
    on_event: EventSink | None = None,
) -> BenchReport:
    """Bake ``spec`` then time every mode in a fresh process; see the module docstring.

    ``modes`` are names from :data:`ALL_MODES` (another is exit 2). ``repeat`` runs each served
    mode (all but ``cold``) that many times, interleaved in rotating order, and reports the run
    with the median time to ready plus every run's time: on a shared machine process start-up
    alone varies by seconds, and one run per mode cannot tell that apart from a real difference.
    ``workdir`` keeps the bakes there, and reuses the ones a bench left there that still match
    (the module docstring says when); the report's ``bake_reused`` says whether it did.
    """
    chosen = check_modes(modes)
    if repeat < 1:
        raise UsageError(Worded(Param("repeat"), " must be at least 1"))
    spec = spec if isinstance(spec, Spec) else load_spec(spec)
    emit = on_event or ignore
    work = bench_folder(spec, workdir)
    aoti_spec = with_route(spec, "aoti") if "aoti" in chosen else None
    spec = with_route(spec, "compile")
    reused: list[bool] = []
    try:
        _clear_runs(work)
        aoti_baked = (
            _bench_bake(aoti_spec, work, _AOTI_BAKE, emit, reused)
            if aoti_spec is not None
            else None
        )
        # --modes eager,aoti needs no torch.compile bake: the AOT one stands in for it
        only_aoti = aoti_baked is not None and set(chosen) <= {"eager", "aoti"}
        baked = aoti_baked if only_aoti else _bench_bake(spec, work, _COMPILE_BAKE, emit, reused)
        assert baked is not None
        keys = [b.key for b in ordered(expand(spec), order, seed)]
        bench_ = _Bench(spec, work, baked, keys, emit, repeat, aoti_baked)
        # A precompile bake fills its folder through torch's AOT route, which a plain
        # torch.compile only partly hits: the stock alternatives get a plain compile's caches.
        plain_cold = cold_run or spec.compile.precompile
        results, bare_wall = bench_.cold(chosen, plain_cold, cold_run)
        t0 = time.time()
        restore(baked.artifact, work / _RESTORED)
        restore_s = time.time() - t0
        results |= _served(bench_.plans(), chosen, repeat)
        return BenchReport(
            name=spec.name,
            spec=spec.canonical(),
            fingerprint=baked.manifest.fingerprint,
            modes={m: results[m] for m in ALL_MODES if m in results},
            bake_wall_s=baked.wall_s,
            bare_compile_wall_s=bare_wall,
            artifact_bytes=baked.size,
            restore_s=restore_s,
            extra={
                **bench_.aoti_extra(),
                "order": keys,
                "cold_source": "separate plain run" if plain_cold else "bake pass 1",
                "bytecode": uncached_reason(),  # what no restored cache wins back, if anything
                **({"bake_reused": all(reused)} if workdir is not None else {}),
            },
        )
    finally:
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def with_route(spec: Spec, route: str) -> Spec:
    """``spec`` served on ``route`` (itself when it already is): the AOT route's counterpart
    compiles full graphs without precompile; the torch.compile route's drops the AOT keys."""
    if spec.compile.route == route:
        return spec
    if route == "aoti":
        update: dict[str, Any] = {"route": "aoti", "precompile": False, "fullgraph": True}
    else:
        update = {"route": "compile", "weights": "external", "on_miss": "error"}
    # A copy keeps the spec's file (private attributes travel with model_copy): error positions
    # and relative paths stay the original's.
    return spec.model_copy(update={"compile": spec.compile.model_copy(update=update)})


@dataclass(frozen=True)
class _BakeFiles:
    """Where one of bench's bakes lives in its work folder, and its progress label."""

    mode: str  # "bake" or "bake aoti"
    artifact: str
    workdir: str  # the bake's cache folder, kept: the stock modes start from it
    record: str  # what reusing the bake needs that its manifest does not hold (its first pass)

    def paths(self, work: Path) -> tuple[Path, Path, Path]:
        return work / self.artifact, work / self.workdir, work / self.record


# The artifact every kiln mode restores, baked as ``kiln bake`` would; and the ``aoti`` mode's,
# ``spec`` baked on the AOT route (its work folder kept too, for when it is the only bake).
_COMPILE_BAKE = _BakeFiles("bake", "bench.kiln.tar.zst", "bake-workdir", "bench-bake.json")
_AOTI_BAKE = _BakeFiles("bake aoti", "bench-aoti.kiln.tar.zst", "aoti-workdir", "bench-aoti.json")


def _bench_bake(
    spec: Spec, work: Path, files: _BakeFiles, emit: EventSink, reused: list[bool]
) -> BakeResult:
    """``spec`` baked into ``work`` as ``files`` names, or the bake a bench left there when it
    still matches (:func:`reusable_bake`); ``reused`` gets whether it was."""
    found = reusable_bake(spec, work, files)
    reused.append(isinstance(found, BakeResult))
    if isinstance(found, BakeResult):
        emit(ModeStarted(mode=f"{files.mode}: reused from {work}"))
        return found
    artifact, kept, record = files.paths(work)
    for stale in (record, artifact):
        stale.unlink(missing_ok=True)
    shutil.rmtree(kept, ignore_errors=True)
    emit(ModeStarted(mode=files.mode))
    result = bake(spec, artifact, keep_workdir=kept, on_event=emit)
    if not isinstance(result, BakeResult):  # a rank > 0 of a user's launch: rank 0 bakes it
        raise UsageError(f"{spec.name}: run kiln bench once, outside torchrun")
    first = result.runs[0]
    record.write_text(
        json.dumps(
            {
                "sha256": result.sha256,
                "wall_s": result.wall_s,
                "first_pass": {
                    "spawned": first.spawned,
                    "ended": first.ended,
                    "results": [r.model_dump(mode="json") for r in first.results],
                },
            }
        )
    )
    return result


def bench_folder(spec: Spec, workdir: str | Path | None) -> Path:
    """Where a bench keeps its bakes and restores: ``workdir`` (made absolute: the served
    processes may run in the spec's ``serve.workdir``, kiln.workdir), else a new temporary
    folder."""
    if not workdir:
        return Path(tempfile.mkdtemp(prefix=f"kiln-bench-{spec.name}-"))
    work = Path(workdir).absolute()
    work.mkdir(parents=True, exist_ok=True)
    return work


def reusable_bake(spec: Spec, work: Path, files: _BakeFiles = _COMPILE_BAKE) -> BakeResult | str:
    """The bake a bench left in ``work`` (as ``files`` names it), when a bench of ``spec`` here
    may serve it again: made from the same spec, model source and kiln version, the artifact
    unchanged since, its kept cache folder there, and compatible with this machine as
    ``kiln check`` judges it, with Python bytecode where a bake here would ship it (one made
    on an image with bytecode ships none, and would serve this one's imports from source; the
    other way round serves as a bake here would, kiln.bytecode.use declining). Otherwise why
    not, in a few words."""
    artifact, kept, record = files.paths(work)
    if not (artifact.is_file() and kept.is_dir() and record.is_file()):
        return "no bake in the work folder"
    saved = json.loads(record.read_text())
    manifest = read_manifest(artifact)
    if manifest.spec_sha256 != spec.sha256():
        return "baked from another spec"
    if manifest.model_source_sha256 != spec.model_source_sha256():
        return "the model's source changed"
    if manifest.kiln_version != __version__:
        return f"baked by kiln {manifest.kiln_version}"
    if ships_bytecode(spec) and not manifest.bytecode:
        return "baked on an image with torch's bytecode (none shipped; this image lacks it)"
    if sha256_file(artifact) != saved["sha256"]:
        return "the artifact changed"
    from kiln.compiler.check import check

    served = served_in(spec.serve.workdir)  # where bench serves, judged as such
    report = check(
        artifact,
        rank=0 if spec.distributed else None,
        workdir=str(served) if served else None,
    )
    if not report.ok:
        return report.miss_message()
    first = saved["first_pass"]
    results = tuple(WorkerResult.model_validate(r) for r in first["results"])
    run = WorkerRun(
        results[0], first["spawned"], first["ended"], "", results if len(results) > 1 else ()
    )
    return BakeResult(
        artifact=artifact,
        sha256=saved["sha256"],
        size=artifact.stat().st_size,
        manifest=manifest,
        wall_s=saved["wall_s"],
        workdir=kept,
        runs=[run],
    )


def _clear_runs(work: Path) -> None:
    """Remove what an earlier bench's served runs left in ``work`` (only bench's own folders)."""
    for path in work.iterdir():
        if path.is_dir() and _RUN_FOLDER.fullmatch(path.name):
            shutil.rmtree(path)


@dataclass(frozen=True)
class _Plan:
    """How to run one served mode (its ``i``-th repeat), and what its row says it is."""

    run: Callable[[int], WorkerRun]
    note: str


@dataclass
class _Bench:
    """One bench's workspace: the bake it compares against, the request order, and a runner
    per mode. Every run of a served mode gets its own fresh folder: a process writes into the
    cache it reads (output code, kernels), and a second run must not start warmer than the
    first."""

    spec: Spec
    work: Path
    baked: BakeResult
    order: list[str]
    emit: EventSink
    repeat: int = 1
    aoti_baked: BakeResult | None = None  # the aoti mode's artifact (compile.route: aoti)

    def __post_init__(self) -> None:
        assert self.baked.workdir is not None  # bench bakes with keep_workdir
        # The stock alternatives' source: the bake's own folder and blob, unless a plain cold
        # run replaces them (cold()).
        self.stock = CacheLayout(self.baked.workdir)
        self.env = compile_env(self.spec)
        self.request = WorkerRequest(
            order=self.order,
            torch_kwargs=torch_kwargs(self.spec.compile),
            calls=self.spec.warmup.calls,
            steady_calls=10,
            first_request=True,
        )

    def _run(
        self, mode: str, i: int, env: dict[str, str], request: WorkerRequest, runs: int = 0
    ) -> WorkerRun:
        self.emit(ModeStarted(mode=mode, run=i + 1, runs=runs or self.repeat))
        # Every mode where the server runs, as the bakes did (kiln.workdir).
        cwd = served_in(self.spec.serve.workdir)
        return run_worker(self.spec, request, env, on_event=self.emit, cwd=cwd)

    def _empty(self, name: str) -> Path:
        root = CacheLayout(self.work / name).inductor
        root.mkdir(parents=True)
        return root

    def cold(
        self, modes: tuple[str, ...], plain: bool, own_wall: bool
    ) -> tuple[dict[str, ModeResult], float]:
        """The ``cold`` row and the bare compile's wall time: the bake's first pass, or (for
        ``plain``) a separate plain torch.compile run whose folder and blob then feed the stock
        modes."""
        first = self.baked.runs[0]
        if not plain:
            if "cold" not in modes:
                return {}, first.wall_s
            note = "the bake's first pass (fresh process, empty cache)"
            return {"cold": _mode("cold", first, note)}, first.wall_s
        if not {"cold", "megacache", "copied"} & set(modes):
            return {}, first.wall_s
        self.stock = CacheLayout(self._empty("cold").parent)
        request = self.request.replace(
            torch_kwargs=cold_torch_kwargs(self.spec.compile),
            cache_root=str(self.stock.inductor),
            megacache_save=str(self.stock.megacache),
        )
        env = {**self.env, "TORCHINDUCTOR_CACHE_DIR": str(self.stock.inductor)}
        run = self._run("cold", 0, env, request, runs=1)
        row = _mode("cold", run, "plain torch.compile, empty cache")
        return {"cold": row}, run.wall_s if own_wall else first.wall_s

    def eager(self, i: int) -> WorkerRun:
        root = self._empty(f"eager-{i}")
        request = self.request.replace(torch_kwargs=None)
        return self._run("eager", i, {"TORCHINDUCTOR_CACHE_DIR": str(root)}, request)

    def kiln(self, i: int, mode: str = "kiln") -> WorkerRun:
        """A fresh restore served first: ``kiln`` as a user's server on the route the artifact
        is made for, with an empty HOME and TMPDIR (everything it builds or writes counts);
        ``kiln-blob`` and ``kiln-serial`` load what the artifact carries as bench always did."""
        dest = self.work / f"{mode}-{i}"
        manifest = self.baked.manifest
        restore(self.baked.artifact, dest)
        env = cache_env(dest, manifest.env)
        request = served_request(dest, manifest, self.order, self.spec.warmup.calls)
        if mode == "kiln":
            home, temp = self.work / f"{mode}-{i}-home", self.work / f"{mode}-{i}-tmp"
            home.mkdir()
            temp.mkdir()
            route = made_for(manifest)
            request, env = first_process(
                served_request(dest, manifest, self.order, self.spec.warmup.calls, route),
                manifest,
                home,
                temp,
            )
        if mode == "kiln-blob":
            request = request.replace(megacache_load=str(CacheLayout(dest).megacache))
        if mode == "kiln-serial":
            kwargs = with_compile_threads(served_torch_kwargs(manifest), 1)
            request = request.replace(torch_kwargs=kwargs)
        return self._run(mode, i, env, request)

    def aoti(self, i: int) -> WorkerRun:
        """The AOT route's artifact restored at a new path and served as ``kiln`` is: a user's
        first process (``kiln.activate(DIR).compile(model)``, empty HOME and TMPDIR)."""
        assert self.aoti_baked is not None
        dest = self.work / f"aoti-{i}"
        manifest = self.aoti_baked.manifest
        restore(self.aoti_baked.artifact, dest)
        home, temp = self.work / f"aoti-{i}-home", self.work / f"aoti-{i}-tmp"
        home.mkdir()
        temp.mkdir()
        calls = self.spec.warmup.calls
        served = served_request(dest, manifest, self.order, calls, made_for(manifest))
        request, env = first_process(served, manifest, home, temp)
        return self._run("aoti", i, env, request)

    def aoti_extra(self) -> dict[str, Any]:
        """The AOT route's bake, for the report: its size against the torch.compile route's."""
        if self.aoti_baked is None:
            return {}
        return {
            "aoti_artifact_bytes": self.aoti_baked.size,
            "aoti_bake_wall_s": round(self.aoti_baked.wall_s, 3),
            # False for --modes eager,aoti: artifact_bytes is then the AOT artifact's too
            "compile_route_baked": self.baked is not self.aoti_baked,
        }

    def megacache(self, i: int) -> WorkerRun:
        root = self._empty(f"megacache-{i}")
        env = {**self.env, "TORCHINDUCTOR_CACHE_DIR": str(root)}
        request = self.request.replace(
            cache_root=str(root), megacache_load=str(self.stock.megacache)
        )
        return self._run("megacache", i, env, request)

    def copied(self, i: int) -> WorkerRun:
        copy = self.work / f"copied-{i}"
        # A K-rank bake: each rank's folder (kiln.compiler.ranks).
        for src in CacheLayout.ranks(self.stock.root, self._world()):
            shutil.copytree(src.inductor, CacheLayout(copy, src.rank).inductor, symlinks=True)
        root = CacheLayout(copy).inductor
        env = {**self.env, "TORCHINDUCTOR_CACHE_DIR": str(root)}
        return self._run("copied", i, env, self.request.replace(cache_root=str(root)))

    def plans(self) -> dict[str, _Plan]:
        """The served modes this bench can run, in report order (call after :meth:`cold`)."""
        m = self.baked.manifest
        precompiled = (
            " + precompiled" if m.precompiled else " + saved frames" if m.precompiled_frames else ""
        )
        precompiled += " + Python bytecode" if m.bytecode else ""
        plans = {
            "eager": _Plan(self.eager, ""),
            "kiln": _Plan(self.kiln, f"restored artifact at a new path, via kiln.env{precompiled}"),
            "kiln-blob": _Plan(
                functools.partial(self.kiln, mode="kiln-blob"),
                "restored folder + Mega-Cache blob loaded",
            ),
            "kiln-serial": _Plan(
                functools.partial(self.kiln, mode="kiln-serial"),
                "kiln, kernels loaded in-process (compile_threads: 1)",
            ),
            "megacache": _Plan(self.megacache, "Mega-Cache blob alone into an empty folder"),
            "copied": _Plan(self.copied, "raw cache folder copied to a new path"),
            "aoti": _Plan(
                self.aoti,
                "route: aoti: AOTInductor packages, restored, without Dynamo or Inductor",
            ),
        }
        if self.aoti_baked is None:
            plans.pop("aoti")
        first = 0 if self.spec.distributed else None  # rank 0's stands for every rank's
        if not CacheLayout(self.work / _RESTORED, first).megacache.is_file():
            plans.pop("kiln-blob")
        if not CacheLayout(self.stock.root, first).megacache.is_file():
            plans.pop("megacache")
        return plans

    def _world(self) -> int | None:
        return self.spec.world_size if self.spec.distributed else None


def _served(plans: dict[str, _Plan], chosen: tuple[str, ...], repeat: int) -> dict[str, ModeResult]:
    """The served modes asked for, each run ``repeat`` times; each row is its median run."""
    modes = [m for m in plans if m in chosen]
    runs = _run_repeated(plans, modes, repeat)
    results: dict[str, ModeResult] = {}
    for m in modes:
        results[m] = _mode(m, _median(runs[m]), plans[m].note)
        results[m].ready_runs_s = [w.time_to_ready for w in runs[m]]
    return results


def _run_repeated(
    plans: dict[str, _Plan], modes: list[str], repeat: int
) -> dict[str, list[WorkerRun]]:
    """Every mode ``repeat`` times, a round at a time, the order rotated each round: no mode is
    always the first process after the bake."""
    runs: dict[str, list[WorkerRun]] = {m: [] for m in modes}
    for i in range(repeat):
        k = i % max(1, len(modes))
        for m in modes[k:] + modes[:k]:
            runs[m].append(plans[m].run(i))
    return runs


def _median(runs: list[WorkerRun]) -> WorkerRun:
    """The run with the median time to ready (the lower middle one of an even count)."""
    return sorted(runs, key=lambda w: w.time_to_ready)[(len(runs) - 1) // 2]


def _mode(mode: str, run: WorkerRun, note: str = "") -> ModeResult:
    return ModeResult(
        mode=mode,
        time_to_ready_s=run.time_to_ready,
        time_to_warm_s=run.time_to_warm,
        startup_s=run.startup,
        # A K-rank spec: every rank's buckets, named with their rank (a compile on rank 1 counts).
        buckets=rank_buckets(run.results, labelled=len(run.results) > 1),
        startup_phases={
            "interpreter + kiln import": round(run.result.process_start - run.spawned, 4),
            **run.result.phases,
        },
        note=note,
    )
