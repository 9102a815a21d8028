"""Bake: compile a spec's grid in an isolated cache root and package what a pod needs to hit.

The bake compiles in fresh worker processes whose only cache is a private temporary root, so the
artifact holds this model's entries and nothing a previous job left in ``/tmp/torchinductor_*``.
With automatic-dynamic shapes (``dynamic: null``) what a pod compiles depends on the order its
requests arrive, so after the first pass the bake runs further fresh-process passes in other
orders until one compiles nothing: the artifact then covers orders, not just the one CI used.
Autotuning modes get the same treatment: with coordinate-descent tuning, a fresh process that
reads the tuned configs back rebuilds Triton kernels the first pass never compiled under those
exact options (measured on the H200, torch 2.11), so a second pass writes them into the cache.
The first pass compiles with Inductor's worker pool; later passes load as a server will, with
the spec's serving arguments (:func:`kiln.serving.torch_kwargs`).

A GPU spec first runs a tuning pre-pass whose graphs are thrown away. Inductor saves each
statically launchable kernel in its FX entry as an autotuner pickled at compile time, before its
first call benchmarked the candidate launch configs, and with the bake's absolute path, where a
restored process looks for the tuning result and finds none: the first process of every pod
benchmarked again (H200, default mode: 38 kernels, 188 benchmarks). Compiled after the
pre-pass, each kernel reads its tuning result as it loads, so the entries that ship hold the
one config it chose and a served process has nothing to tune.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln import bytecode
from kiln.artifact.archive import (
    ARTIFACT_SUFFIX,
    artifact_target,
    source_date_epoch,
    write_artifact,
)
from kiln.artifact.manifest import (
    MAX_GRAPH_BREAKS,
    RANKS_FORMAT,
    WORK_KINDS,
    Aoti,
    Bytecode,
    Distributed,
    FileEntry,
    GraphBreak,
    Manifest,
    PassStats,
    PrecompiledFrames,
    ProofStats,
    RankCaches,
    ShardInfo,
    Workdir,
)
from kiln.artifact.payload import payload_sha256
from kiln.artifact.rank_copies import Stored, store_once
from kiln.compiler import user_launch
from kiln.compiler.aoti_bake import dropped_cudagraphs
from kiln.compiler.capture import capture, capture_aoti, capture_bytecode
from kiln.compiler.dynamo_log import merge_breaks
from kiln.compiler.launch import WorkerRun, run_worker
from kiln.compiler.protocol import AotiBuild, WorkerRequest, input_stream
from kiln.compiler.writes import driver_entry
from kiln.errors import Param, UsageError, VerificationError, Worded
from kiln.events import (
    Capturing,
    EventSink,
    Packed,
    Packing,
    PassStarted,
    Proving,
    ServingImports,
    Tuning,
    Waiting,
    ignore,
)
from kiln.grid import Bucket, Shard, expand, ordered, rotations, shard_grid
from kiln.layout import CacheLayout
from kiln.serving import (
    DEFAULT_ON_MISS,
    SERVING_ENV,
    cold_torch_kwargs,
    compile_env,
    location_env,
    torch_kwargs,
)
from kiln.spec import MAX_PASSES, Spec, error_at, load_spec
from kiln.workdir import keyed_entries, logical_cwd

if TYPE_CHECKING:
    from kiln.compiler.verify import VerifyReport

MAX_AUTO_PASSES = 4
# Inductor's graph-level caches under its root: the tuning pre-pass drops them (and Dynamo's).
_GRAPH_DIRS = ("fxgraph", "aotautograd")
MAX_REBAKES = 2  # passes added when the proof compiled, each proven again
PROOF_SEED = 7919  # the proof's shuffle (and input stream): not an order a pass used


@dataclass
class BakeResult:
    artifact: Path
    sha256: str
    size: int
    manifest: Manifest
    wall_s: float
    workdir: Path | None = None  # kept only when asked (bench compares against the raw folder)
    runs: list[WorkerRun] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "artifact": str(self.artifact),
            "sha256": self.sha256,
            "size": self.size,
            "name": m.name,
            "buckets": len(m.grid),
            "files": len(m.entries()),
            "passes": len(m.passes),
            "totals": m.totals,
            "wall_s": round(self.wall_s, 3),
            "proof": m.proof.model_dump(mode="json") if m.proof else None,
            "graph_breaks": [b.model_dump(mode="json") for b in m.graph_breaks],
            "warnings": m.warnings,
        }


@dataclass(frozen=True)
class FollowerResult:
    """What :func:`bake` returns on a rank above 0 of a user's launch: this rank ran its own
    workers for rank 0, which alone packs and writes the artifact, so there is none here to
    sign, print or restore. :attr:`message` says so in one line."""

    rank: int
    world_size: int

    @property
    def message(self) -> str:
        return f"rank {self.rank}: baked; rank 0 writes the artifact"


def bake(
    spec: Spec | str | Path,
    out: str | Path,
    *,
    passes: int | None = None,
    prove: bool = True,
    strict: bool = False,
    on_event: EventSink | None = None,
    keep_workdir: Path | None = None,
    shard: Shard | tuple[int, int] | str | None = None,
) -> BakeResult | FollowerResult:
    """Compile ``spec``'s grid and write a deterministic artifact to ``out`` (an existing
    folder, or a path ending in ``/``: ``NAME[.shard-I-of-N].kiln.tar.zst`` inside it; one that
    cannot be written is a :class:`~kiln.errors.ParameterError` before anything compiles).

    ``prove`` (the default) ends the bake with a fresh process that serves the packed artifact,
    restored at another path, over the whole grid in a new order; whatever it compiles is baked
    in by another pass and proven again (at most :data:`MAX_REBAKES` times). What still
    compiles after that is a warning in the manifest, or with ``strict`` a
    :class:`~kiln.errors.VerificationError` (exit 6) and no artifact.

    Nothing is written at ``out`` unless the whole bake succeeds. ``keep_workdir`` moves the
    bake's cache folder there instead of removing it (bench starts its stock modes from it).
    ``shard`` (``Shard(i, n)``, ``(i, n)`` or ``"i/n"``) bakes only that slice of the grid
    (:func:`kiln.grid.shard_buckets`); ``kiln merge`` combines the shards' artifacts.

    A distributed spec baked inside a launch the user started (``RANK``/``WORLD_SIZE`` set;
    :mod:`kiln.compiler.user_launch`): rank 0 bakes and writes ``out``; every other rank runs its
    own rank's workers for rank 0 and returns a :class:`FollowerResult` (no artifact).
    """
    spec = spec if isinstance(spec, Spec) else load_spec(spec)
    launched = user_launch.in_launch(spec)  # exit 2 when the launch's size is not the spec's
    if launched is not None and launched.rank != 0:
        user_launch.follow(spec, launched, _workdir_base() / spec.name)
        return FollowerResult(launched.rank, launched.world_size)
    sliced = Shard.of(shard) if shard is not None else None
    # Before any work: an OUT that cannot be written fails now, not after minutes of compiling.
    out = artifact_target(out, f"{spec.name}{sliced.suffix if sliced else ''}{ARTIFACT_SUFFIX}")
    buckets = _baked_buckets(spec, sliced)
    workdir = _bake_workdir(spec)
    if passes is not None and not 1 <= passes <= MAX_PASSES:
        raise UsageError(f"passes must be between 1 and {MAX_PASSES}")
    emit = on_event or ignore
    t0 = time.time()
    # Shards too bake in the one workdir of their spec's name: torch writes that path into
    # native objects, so shards baked elsewhere would collide in `kiln merge` (exit 3).
    with (
        _stable_workdir(spec.name, lambda text: emit(Waiting(message=text))) as work,
        user_launch.lead(work, launched) if launched else contextlib.nullcontext(),
    ):
        baker = _Baker(spec, buckets, work, emit, workdir, shard=sliced)
        baker.compile_passes(passes)
        manifest = baker.manifest()
        if prove:
            manifest = baker.prove(manifest, strict=strict)
        emit(Packing(total=manifest.total_bytes))
        sha, size = write_artifact(out, manifest, work, on_bytes=lambda n: emit(Packed(bytes=n)))
        kept = _keep(work, keep_workdir) if keep_workdir is not None else None
    return BakeResult(
        artifact=out,
        sha256=sha,
        size=size,
        manifest=manifest,
        wall_s=time.time() - t0,
        workdir=kept,
        runs=baker.runs,
    )


def _bake_workdir(spec: Spec) -> Path:
    """Where the bake runs its processes (kiln.workdir says why): the server's folder, which
    the spec names and which must exist here, else the folder this bake runs in."""
    declared = spec.serve.workdir
    if declared is None:
        here = logical_cwd()
        if here is None:
            raise UsageError("the working directory was removed: bake from an existing folder")
        return Path(here)
    if not Path(declared).is_dir():
        raise error_at(
            spec,
            "serve.workdir",
            f"{declared} is no folder on this machine: the bake runs its processes there, as "
            "the server will (create it, or bake where it exists)",
        )
    return Path(declared)


def keyed_workdir(work: Path, files: list[FileEntry], workdir: Path) -> Workdir | None:
    """``workdir``, when driver JIT entries of ``files`` (under ``work``, a rank's included)
    carry it (kiln.workdir)."""
    entries = [work / f.path for f in files if driver_entry(f.path)]
    keyed = keyed_entries(entries, str(workdir))
    return Workdir(path=str(workdir), keyed=keyed) if keyed else None


def _baked_buckets(spec: Spec, sliced: Shard | None) -> list[Bucket]:
    """The buckets this bake compiles: the grid, or the shard's slice of it (a route that
    builds its packages in one piece is never sliced)."""
    buckets = expand(spec)  # never empty: the spec refuses an `exclude` that empties it
    if sliced is None:
        return buckets
    if spec.compile.route == "aoti" and spec.compile.dynamic is True:
        raise UsageError("route: aoti with dynamic: true builds one program for the whole grid")
    if spec.compile.route == "aoti" and spec.distributed is not None:
        raise UsageError("route: aoti bakes a multi-rank spec in one piece (no shards)")
    return shard_grid(spec, buckets, sliced)


def _capture(spec: Spec, work: Path) -> tuple[list[FileEntry], Stored | None]:
    """The files of ``work``'s layout; for K ranks, each rank's under ``ranks/R/``, stored once
    where ranks share them (:func:`kiln.artifact.rank_copies.store_once`; the rest are copies)."""
    aoti = spec.compile.route == "aoti"  # packages and the driver's JIT cache: no Inductor cache
    top = CacheLayout(work)
    shared = capture_bytecode(top.bytecode)  # one tree at the root, whatever the ranks
    if spec.distributed is None:
        files = capture_aoti(top.dir) if aoti else capture(top.dir)
        return sorted(files + shared, key=lambda e: e.path), None
    by_rank = []
    for layout in CacheLayout.ranks(work, spec.world_size):
        entries = capture_aoti(layout.dir) if aoti else capture(layout.dir)
        by_rank.append([e.model_copy(update={"path": layout.prefix + e.path}) for e in entries])
    stored = store_once(by_rank)
    return stored.files + shared, stored


def _with_ranks(spec: Spec, manifest: Manifest, runs: list[WorkerRun], stored: Stored) -> Manifest:
    """``manifest`` as a K-rank artifact (format 2): every rank's fingerprint, grid, passes and
    blobs, and the copies; the top-level fields are rank 0's."""
    assert spec.distributed is not None
    copies = stored.copies
    listed = {f.path for f in manifest.files} | {c.path for c in copies}
    per_rank = []
    for rank in range(spec.world_size):
        layout = CacheLayout(rank=rank)
        per_rank.append(
            RankCaches(
                rank=rank,
                fingerprint=runs[0].results[rank].fingerprint or {},
                grid=_sorted_grid(runs[0].results[rank].buckets, manifest.grid),
                passes=[
                    PassStats(order=p.order, compiles=run.results[rank].compiles, wall_s=p.wall_s)
                    for p, run in zip(manifest.passes, runs, strict=True)
                ],
                megacache=_listed(listed, layout, layout.megacache),
                precompiled=_listed(listed, layout, layout.precompiled),
                aoti=_aoti(spec, runs[0].results[rank].aoti),
                same_as=stored.same_as[rank],
            )
        )
    distributed = Distributed(
        world_size=spec.world_size, backend=spec.distributed.backend, ranks=per_rank
    )
    update = {
        "format": RANKS_FORMAT,
        "distributed": distributed,
        "copies": copies,
        "megacache": per_rank[0].megacache,
        "precompiled": per_rank[0].precompiled,
        "aoti": per_rank[0].aoti,
    }
    out = Manifest.model_validate({**manifest.model_dump(), **update})
    # Every file a restore installs, copies included: a copy changed is a different payload.
    return out.model_copy(update={"payload_sha256": payload_sha256(out.entries())})


def _listed(listed: set[str], layout: CacheLayout, path: Path) -> str | None:
    """``path`` of the relative ``layout`` as a member name, when the artifact lists it."""
    member = layout.member(path)
    return member if member in listed else None


def _sorted_grid(buckets: list[Any], like: list[Any]) -> list[Any]:
    order = {b.key: i for i, b in enumerate(like)}
    return sorted(buckets, key=lambda b: order[b.key])


def ships_bytecode(spec: Spec) -> bool:
    """Whether this bake ships the imported modules' bytecode: asked for, or (``auto``) this
    image compiles torch from source at every start, so the serving image built from it likely
    does too. A K-rank artifact ships one tree for every rank: the ranks import the same
    modules from the same files."""
    if spec.bytecode == "never":
        return False
    return spec.bytecode == "always" or bytecode.uncached_reason() is not None


def _pass_count(spec: Spec, passes: int | None) -> tuple[int, bool]:
    """How many fresh-process passes to run at most, and whether to stop at the first quiet one
    (automatic: only specs whose compiles depend on order or on tuning results need more)."""
    if spec.compile.route == "aoti":  # packages are built once; a later pass has no use for them
        return 1, True
    chosen = passes or spec.warmup.passes
    if chosen is not None:
        return chosen, False
    # Saved frames are recorded with keys a plain torch.compile does not look up: a later pass
    # gives servers on kiln.env (no kiln.activate) their own entries.
    settled = (
        spec.compile.dynamic is False
        and not spec.compile.autotunes
        and spec.compile.precompile_route != "frames"
    )
    if not settled:
        return MAX_AUTO_PASSES, True
    # One pass left the plain route's entries of precompiled forwards to the proof, which
    # compiled them and re-baked: two processes more than a second pass.
    return _compiling_passes(spec), True


def _compiling_passes(spec: Spec) -> int:
    """The passes that compile by design: the first; with precompiled forwards (which it
    saves) also the second, the first plain torch.compile, which writes the entries a server
    on kiln.env looks up. A later pass that compiles is a process that would compile too."""
    return 2 if spec.compile.precompile_route == "aot" else 1


@dataclass
class _Baker:
    """One bake's work folder and the fresh-process passes run into it.

    Every pass compiles into ``work``'s cache root (one path for every bake of this name, see
    :func:`_stable_workdir`): the first from nothing, in parallel, saving the Mega-Cache blob
    and any precompiled forwards; every later pass a fresh process loading what it left, as a
    server will, with the spec's serving arguments. Each pass draws its own input stream.
    """

    spec: Spec
    buckets: list[Bucket]
    work: Path
    emit: EventSink
    workdir: Path  # every process of the bake runs there, as the server will (kiln.workdir)
    shard: Shard | None = None
    runs: list[WorkerRun] = field(default_factory=list)
    pass_stats: list[PassStats] = field(default_factory=list)
    # The files capture() found, and after how many passes: only a pass changes the work
    # folder (the proof serves a copy elsewhere), so a proven bake hashes its cache once.
    _captured: tuple[int, tuple[list[FileEntry], Stored | None]] | None = None
    _bytecode: Bytecode | None = None
    _serving_missed: str = ""  # what the AOT route's serving-imports pass had to compile

    def __post_init__(self) -> None:
        # The 1-rank layout: kiln.compiler.ranks moves each of its paths into a rank's folder.
        self.layout = CacheLayout(self.work)
        self.root = self.layout.inductor
        self.root.mkdir()
        self.env = {
            **compile_env(self.spec),
            # Inductor's root, and the caches outside it that torch's defaults would put in
            # HOME (~/.triton, ~/.nv): all private to the bake, all shipped.
            **location_env(self.layout),
        }
        route = self.spec.compile.precompile_route
        precompile = self.layout.precompiled if route == "aot" else None
        self.first = WorkerRequest(
            order=[b.key for b in self.buckets],
            torch_kwargs=cold_torch_kwargs(self.spec.compile),
            calls=self.spec.warmup.calls,
            steady_calls=5,
            cache_root=str(self.root),
            megacache_save=str(self.layout.megacache),
            precompile_save=str(precompile) if precompile else None,
            frames="record" if route == "frames" else None,
            fingerprint=True,
            report_imports=ships_bytecode(self.spec),
            check_eager=True,  # the bake's first process (the tuning pre-pass, if any)
        )
        if self.spec.compile.route == "aoti":
            self.first = self.first.replace(megacache_save=None, aoti_build=self._aoti_build())
        # Later passes compile as a server without kiln.activate() does (plain torch.compile
        # through kiln.env), so that route finds its entries too; the proof serves the route
        # the artifact is made for.
        self.later = self.first.replace(
            torch_kwargs=torch_kwargs(self.spec.compile),
            megacache_save=None,
            precompile_save=None,
            frames=None,
            fingerprint=False,
            check_eager=False,
        )

    def _aoti_build(self) -> AotiBuild:
        c = self.spec.compile
        return AotiBuild(
            folder=str(self.layout.aoti),
            options=c.inductor_options(),
            weights=c.weights,
            ranged=c.dynamic is True,
        )

    def run_pass(self, order: list[str], passes: int) -> int:
        """One fresh-process pass over ``order``; returns what it compiled."""
        i = len(self.runs)
        self.emit(PassStarted(index=i, passes=max(passes, i + 1), order=order))
        base = self.first if i == 0 else self.later
        request = base.replace(order=order, input_seed=input_stream(i))
        env = self.env if i == 0 else self.env | SERVING_ENV  # later passes load as servers do
        run = run_worker(self.spec, request, env, on_event=self.emit, cwd=self.workdir)
        self.runs.append(run)
        compiles = sum(result.compiles for result in run.results)  # quiet: every rank is
        self.pass_stats.append(PassStats(order=order, compiles=compiles, wall_s=run.wall_s))
        return compiles

    def tune(self) -> None:
        """A GPU spec's tuning pre-pass (the module docstring says why): compile and call every
        bucket once, then keep only what it tuned and compiled below the graphs (the kernels'
        sources, ``.best_config`` files and Triton's binaries); the graphs compile again in the
        first pass, with their kernels' chosen configs. Not for the AOT route: its packages
        are compiled whole, tuning included, by AOTInductor."""
        if self.spec.model.device != "cuda" or self.spec.compile.route == "aoti":
            return
        self.emit(Tuning())
        request = self.first.replace(
            calls=1,
            steady_calls=1,
            megacache_save=None,
            precompile_save=None,
            frames=None,
            fingerprint=False,
            report_imports=False,
        )
        run_worker(self.spec, request, self.env, on_event=self.emit, cwd=self.workdir)
        self.first = self.first.replace(check_eager=False)  # the pre-pass checked the spec
        world = self.spec.world_size if self.spec.distributed else None
        for layout in CacheLayout.ranks(self.work, world):
            for graphs in (*(layout.inductor / name for name in _GRAPH_DIRS), layout.frames):
                shutil.rmtree(graphs, ignore_errors=True)
            for blob in (layout.megacache, layout.precompiled):
                blob.unlink(missing_ok=True)

    def compile_passes(self, passes: int | None) -> None:
        """The passes ``passes`` (or the spec) asks for, each in another order; automatic
        counts stop at the first later pass that compiled nothing."""
        self.tune()
        count, auto = _pass_count(self.spec, passes)
        for i, order in enumerate(rotations(self.buckets, count)):
            compiles = self.run_pass([b.key for b in order], count)
            if auto and i > 0 and compiles == 0:
                break

    def manifest(self, proof: ProofStats | None = None, proof_warning: str = "") -> Manifest:
        """What the work folder holds now, described (captured again after a re-bake's pass)."""
        if self._captured is None or self._captured[0] != len(self.runs):
            self.emit(Capturing())
            self._bytecode = self._write_bytecode()
            self._captured = (len(self.runs), _capture(self.spec, self.work))
        files, stored = self._captured[1]
        warnings = _warnings(self.spec, self.runs, self.pass_stats, proof, proof_warning)
        if proof is None and self._serving_missed:  # a proof that ran judged the same packages
            warnings.append(self._serving_missed)
        runs, stats = self.runs, self.pass_stats
        # What a server must pass: the arguments the later passes (and the proof) compiled with,
        # derived once, on the request, not again from the spec.
        manifest = _manifest(
            self.spec,
            self.buckets,
            runs,
            stats,
            files,
            warnings,
            proof,
            self.later.torch_kwargs,
            self._bytecode,
            keyed_workdir(self.work, files, self.workdir),
        )
        if stored is not None:
            manifest = _with_ranks(self.spec, manifest, runs, stored)
        if self.shard is not None:
            manifest.shard = ShardInfo.of(self.shard.count, [self.shard.index])
        return manifest

    def _write_bytecode(self) -> Bytecode | None:
        """The bytecode of the library modules a server imports, compiled into the work
        folder's ``bytecode/`` tree, when the spec ships it (:func:`ships_bytecode`)."""
        sources = self._served_sources()
        if not sources:
            return None
        folder = self.layout.bytecode
        shutil.rmtree(folder, ignore_errors=True)
        count = bytecode.write(sources, folder)
        return Bytecode(python=sys.implementation.cache_tag, modules=count) if count else None

    def _served_sources(self) -> list[str]:
        """The library sources whose bytecode ships: every module the passes imported (a
        compile-route server imports Dynamo and Inductor as they did), or for the AOT route
        what a fresh process serving the built packages imports. Its passes imported
        Inductor, Dynamo and sympy to build them, a server never does: ~1,600 modules, two
        thirds of the bytecode (63 MB of pycs against 22 MB, H100 and CPU alike), shipped
        and never read. The pass serves as the proof does, each rank its own packages,
        ``kiln.activate()``'s check included (``fingerprint``: the modules it imports), and
        like a later pass it may add the CUDA driver's JIT entries to the work folder, which
        ship."""
        built = {s for run in self.runs for r in run.results for s in r.imported_sources}
        results = self.runs[0].results if self.runs else ()
        packages = [r.aoti for r in results if r.aoti is not None]  # each rank's, in order
        if not built or not packages or len(packages) != len(results):
            return sorted(built)
        self.emit(ServingImports())
        request = WorkerRequest(
            order=[b.key for b in self.buckets],
            torch_kwargs=None,
            calls=1,
            steady_calls=1,
            aoti_load=str(self.work),
            aoti_packages=packages,
            fingerprint=True,
            report_imports=True,
            input_seed=input_stream(len(self.runs)),
        )
        run = run_worker(
            self.spec, request, self.env | SERVING_ENV, on_event=self.emit, cwd=self.workdir
        )
        self._serving_missed = _serving_missed(run)
        return sorted({s for r in run.results for s in r.imported_sources})

    def prove(self, manifest: Manifest, *, strict: bool) -> Manifest:
        """Serve the packed artifact from a fresh process, restored at another path, in a new
        order; bake in what that compiled and prove again, at most :data:`MAX_REBAKES` times.

        The packed files, not the work folder, are what ships: a file capture missed, a path
        baked into an entry, or a kernel one pass happened to build and the next loads from a
        place restore does not fill would all pass a check of the work folder.
        """
        missed: list[tuple[str, tuple[int, ...]]] | None = None
        for attempt in range(MAX_REBAKES + 1):
            report, wall_s = self._serve_packed(manifest, attempt)
            proof = ProofStats(
                order=report.order,
                compiles=sum(b.compiles for b in report.buckets),
                wall_s=round(wall_s, 3),
                rebakes=attempt,
            )
            if report.ok:
                return self.manifest(proof)
            # A re-bake after which the proof misses exactly what it missed before wrote entries
            # that no process hits (a model that differs per process, a kernel tuned in every
            # process): another would cost a pass and a proof (minutes on a GPU) for the same.
            stuck = missed is not None and _missed(report) == missed
            if stuck or attempt == MAX_REBAKES or self.spec.compile.route == "aoti":
                break  # (aoti: packages are complete once built: another pass would add nothing)
            missed = _missed(report)
            self.run_pass(report.order, len(self.runs) + 1)
            manifest = self.manifest()
        same = " (the last changed nothing it missed)" if stuck else ""
        warning = (
            f"the bake's proof (a fresh process serving the packed artifact restored at another "
            f"path, in a new order) still compiled {proof.compiles} time(s) after "
            f"{proof.rebakes} re-bake(s){same}: {'; '.join(report.reasons()[:3])}. Serving will "
            "compile too; `kiln verify` will fail"
        )
        if strict:
            raise VerificationError(
                Worded(Param("strict"), f": {warning}"), detail=report.to_dict()
            )
        return self.manifest(proof, warning)

    def _new_order_seed(self, seed: int) -> int:
        """A shuffle seed whose order no pass used yet (when the grid has one to give)."""
        used = {tuple(p.order) for p in self.pass_stats}
        mine = set(self.buckets)
        grid = [b for b in expand(self.spec) if b in mine]  # as verify() orders them
        for candidate in range(seed, seed + 50):
            if tuple(b.key for b in ordered(grid, "shuffle", candidate)) not in used:
                return candidate
        return seed

    def _serve_packed(self, manifest: Manifest, attempt: int) -> tuple[VerifyReport, float]:
        from kiln.artifact.restore import restore
        from kiln.compiler.verify import proof_routes, verify

        self.emit(Proving(attempt=attempt))
        t0 = time.time()
        staged = self.work / f"proof-{attempt}.kiln.tar.zst"
        proof_dir = self.work / f"proof-{attempt}"  # another path than the bake's root
        try:
            write_artifact(staged, manifest, self.work)
            restore(staged, proof_dir)
            seed = self._new_order_seed(PROOF_SEED + 100 * attempt)
            keys = [b.key for b in self.buckets]  # a shard proves its own slice
            report = verify(
                self.spec,
                proof_dir,
                order="shuffle",
                seed=seed,
                keys=keys,
                routes=proof_routes(manifest),
                on_event=self.emit,
            )
        finally:
            staged.unlink(missing_ok=True)
            shutil.rmtree(proof_dir, ignore_errors=True)
        return report, time.time() - t0


def _keep(work: Path, target: Path) -> Path:
    """Move the finished work folder to ``target``, out of the way of its removal (bench
    compares against it, inside a folder it removes). Usually the same temporary filesystem:
    a rename, not a copy of the whole cache."""
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(work, target)
    return target


def _workdir_base() -> Path:
    """This user's bake folders on this machine (a rank of a user's launch finds rank 0's here:
    per machine, so all ranks on one node, or a shared ``TMPDIR``)."""
    return Path(tempfile.gettempdir()) / f"kiln-bake-{os.getuid()}"


def _take_lock(lock: Any, path: Path, name: str, on_wait: Callable[[str], None]) -> None:
    """Lock ``path`` (open as ``lock``) for this bake; when another holds it, say whose it is
    and that this bake waits (a second bake of a name waited a minute without a word), then
    wait. The holder's pid and start time are written into the file for the next one to read."""
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read(200).decode(errors="replace").strip() or "another process"
        on_wait(f"waiting: another bake of {name} ({holder}) holds {path}")
        t0 = time.time()
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        on_wait(f"lock taken after {time.time() - t0:.0f} s: baking {name}")
    lock.seek(0)
    lock.truncate()
    started = time.strftime("%H:%M:%S")
    lock.write(f"pid {os.getpid()}, started {started}".encode())
    lock.flush()


@contextlib.contextmanager
def _stable_workdir(name: str, on_wait: Callable[[str], None]) -> Iterator[Path]:
    """The same cache root for every bake of ``name`` on this machine, one bake at a time.

    Torch writes the cache root's absolute path into FX entries and native objects; a random
    temporary folder would make every bake's bytes differ and leave stale paths in the artifact.
    The folder is removed on the way out, failed bake or not (a kept one was moved away first).
    """
    base = _workdir_base()
    base.mkdir(mode=0o700, exist_ok=True)
    with open(base / f"{name}.lock", "a+b") as lock:
        _take_lock(lock, base / f"{name}.lock", name, on_wait)
        work = base / name
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        try:
            yield work
        finally:
            shutil.rmtree(work, ignore_errors=True)
            lock.truncate(0)  # who held it is said only while it is held


def _manifest(
    spec: Spec,
    buckets: list[Bucket],
    runs: list[WorkerRun],
    pass_stats: list[PassStats],
    files: list[Any],
    warnings: list[str],
    proof: ProofStats | None,
    compile_kwargs: dict[str, Any] | None,
    bytecode: Bytecode | None = None,
    workdir: Workdir | None = None,
) -> Manifest:
    first = runs[0]
    top = CacheLayout()
    listed = {f.path for f in files}
    frames = _frames(spec, first, files)
    if spec.compile.precompile_route == "frames" and frames is None:
        warnings = [
            *warnings,
            "precompile: true, but torch saved no Dynamo frames (Dynamo traced nothing: is "
            "TORCH_COMPILE_DISABLE set?): a restored process traces every bucket again",
        ]
    if spec.compile.route == "aoti" and dropped_cudagraphs(spec.compile.inductor_options()):
        warnings = [
            *warnings,
            "route: aoti serves without CUDA graphs (kiln.compiler.aoti_serve says why): the "
            "mode's triton.cudagraphs was left out of the packages",
        ]
    grid = list(first.result.buckets)
    order = {b.key: i for i, b in enumerate(buckets)}
    grid.sort(key=lambda b: order[b.key])
    epoch = source_date_epoch()
    created = datetime.fromtimestamp(epoch or time.time(), tz=timezone.utc)
    return Manifest(
        name=spec.name,
        created=created.isoformat(timespec="seconds"),
        spec=spec.canonical(),
        spec_sha256=spec.sha256(),
        model_source_sha256=spec.model_source_sha256(),
        fingerprint=first.result.fingerprint or {},
        env=compile_env(spec),
        grid=grid,
        passes=pass_stats,
        totals={
            "compile_s": round(sum(b.compile_s for b in grid), 3),
            "first_calls_s": round(sum(b.first_call_s for b in grid), 3),
            "bake_passes_s": round(sum(p.wall_s for p in pass_stats), 3),
            "graph_breaks": float(sum(b.graph_breaks for b in grid)),
            "unique_graphs": float(sum(b.unique_graphs for b in grid)),
        },
        files=files,
        # Extra field (manifests allow them): equal for two bakes that compiled the same thing,
        # while the artifact digest also covers timings (kiln.artifact.payload explains).
        payload_sha256=payload_sha256(files),
        megacache=_listed(listed, top, top.megacache),
        precompiled=_listed(listed, top, top.precompiled),
        precompiled_frames=frames,
        bytecode=bytecode,  # with the files: the manifest checks each pyc against it
        # a K-rank bake's are each rank's, set by _with_ranks
        aoti=_aoti(spec, first.result.aoti) if spec.distributed is None else None,
        compile_kwargs=compile_kwargs,
        graph_breaks=_graph_breaks(runs),
        warnings=warnings,
        proof=proof,
        workdir=workdir,
    )


def _aoti(spec: Spec, built: Aoti | None) -> Aoti | None:
    """The packages a first pass built (a rank's), with the spec's ``on_miss`` for servers."""
    on_miss = spec.compile.on_miss or DEFAULT_ON_MISS
    return built.model_copy(update={"on_miss": on_miss}) if built else None


def _frames(spec: Spec, first: WorkerRun, files: list[FileEntry]) -> PrecompiledFrames | None:
    """Dynamo's saved frames, when the spec asked for them and the first pass wrote some."""
    top = CacheLayout()
    prefix = top.member(top.frames) + "/"
    module = first.result.forward_module
    if spec.compile.precompile_route != "frames" or module is None:
        return None
    if not any(f.path.startswith(prefix) and f.path.endswith("/entry") for f in files):
        return None
    return PrecompiledFrames(module=module)


def _warnings(
    spec: Spec,
    runs: list[WorkerRun],
    pass_stats: list[PassStats],
    proof: ProofStats | None,
    failed: str,
) -> list[str]:
    """What a user must know before shipping: the proof's failure (or, unproven, a last pass
    that still compiled), and the graph breaks that depend on tensor data (serving data may
    reach frames the bake never saw)."""
    data_dependent = [b for b in _graph_breaks(runs) if b.data_dependent]
    out = [failed] if failed else [] if proof else _unsettled(spec, runs, pass_stats)
    if data_dependent:
        sites = "; ".join(f"{b.where} ({b.reason})" for b in data_dependent[:5])
        more = f" and {len(data_dependent) - 5} more" if len(data_dependent) > 5 else ""
        out.append(
            f"{len(data_dependent)} graph break(s) depend on tensor data: {sites}{more}. The "
            "bake compiled the code after them only for the inputs it drew; serving data may "
            "take a path it never saw and compile. Make the branch branchless (torch.where, "
            "torch.cond) or give the spec inputs that reach every path"
        )
    return out


def _graph_breaks(runs: list[WorkerRun]) -> list[GraphBreak]:
    return merge_breaks([b for r in runs for b in r.result.graph_breaks], MAX_GRAPH_BREAKS)


def _unsettled(spec: Spec, runs: list[WorkerRun], pass_stats: list[PassStats]) -> list[str]:
    """Say it when the last fresh-process pass still compiled, past those that compile by
    design (:func:`_compiling_passes`): that pod would compile too."""
    if len(pass_stats) <= _compiling_passes(spec) or pass_stats[-1].compiles == 0:
        return []
    where = ", ".join(f"{b.key} ({b.compiles})" for b in runs[-1].result.buckets if b.compiles)
    return [
        f"after {len(pass_stats)} fresh-process passes a new process still compiles "
        f"{pass_stats[-1].compiles} time(s): {where}; `kiln verify` will fail. Usual causes: the "
        "model reads per-process state (a global, a random value, a path), a Dynamo restart "
        "that torch does not cache, or a grad-mode/dtype mismatch"
    ]


def _serving_missed(run: WorkerRun) -> str:
    """The serving-imports pass served the built packages in a fresh process, as a pod does:
    what it missed or compiled there (any rank), said even when no proof runs (``--no-prove``),
    since that pod would do the same."""
    from kiln.compiler.verify import explain

    missed = [
        f"{f'rank {rank}: ' if len(run.results) > 1 else ''}{explain(b, route='aoti')}"
        for rank, result in enumerate(run.results)
        for b in result.buckets
        if b.compiles
    ]
    if not missed:
        return ""
    more = f" and {len(missed) - 3} more" if len(missed) > 3 else ""
    return (
        f"a fresh process serving the built AOTInductor packages (the bake's serving-imports "
        f"pass) missed or compiled in {len(missed)} bucket(s): {'; '.join(missed[:3])}{more}. "
        "Serving will do the same; `kiln verify` will fail"
    )


def _missed(report: VerifyReport) -> list[tuple[str, tuple[int, ...]]]:
    """What a proof missed, per bucket (of each route served) and kind of work, whatever order
    it served in: each proof takes a new order, and torch's recompile reasons name the shape
    traced before, so the proof's reason lines differ where the misses do not."""
    work = [(b.key, tuple(getattr(b, kind) for kind in WORK_KINDS)) for b in report.failing]
    return sorted(work + [(f"folder: {change}", ()) for change in report.folder_changes])
