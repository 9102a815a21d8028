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
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kiln.artifact.archive import sha256_file, source_date_epoch, write_artifact
from kiln.artifact.manifest import (
    RANKS_FORMAT,
    Distributed,
    FileEntry,
    Manifest,
    PassStats,
    RankCaches,
)
from kiln.compiler import ranks
from kiln.compiler.capture import capture, payload_sha256
from kiln.compiler.launch import WorkerRun, run_worker
from kiln.compiler.protocol import WorkerRequest
from kiln.errors import UsageError
from kiln.events import Capturing, EventSink, Packed, Packing, PassStarted, ignore
from kiln.grid import Bucket, expand, rotations
from kiln.serving import (
    INDUCTOR_DIR,
    MEGACACHE_NAME,
    PRECOMPILED_NAME,
    RANKS_DIR,
    cold_torch_kwargs,
    compile_env,
    rank_dir,
    torch_kwargs,
)
from kiln.spec import MAX_PASSES, Spec, load_spec

MAX_AUTO_PASSES = 4


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
        return {
            "artifact": str(self.artifact),
            "sha256": self.sha256,
            "size": self.size,
            "name": self.manifest.name,
            "buckets": len(self.manifest.grid),
            "files": len(self.manifest.entries()),
            "passes": len(self.manifest.passes),
            "totals": self.manifest.totals,
            "wall_s": round(self.wall_s, 3),
            "warnings": self.manifest.warnings,
        }


def bake(
    spec: Spec | str | Path,
    out: str | Path,
    *,
    passes: int | None = None,
    on_event: EventSink | None = None,
    keep_workdir: Path | None = None,
) -> BakeResult:
    """Compile ``spec``'s grid and write a deterministic artifact to ``out``.

    Nothing is written at ``out`` unless the whole bake succeeds. ``keep_workdir`` moves the
    bake's cache folder there instead of removing it (bench starts its stock modes from it).
    """
    spec = spec if isinstance(spec, Spec) else load_spec(spec)
    out = Path(out)
    buckets = expand(spec)
    if not buckets:
        raise UsageError("the grid is empty after `exclude`")
    if passes is not None and not 1 <= passes <= MAX_PASSES:
        raise UsageError(f"passes must be between 1 and {MAX_PASSES}")
    emit = on_event or ignore
    t0 = time.time()
    with _stable_workdir(spec.name) as work:
        runs, pass_stats = _compile_passes(spec, buckets, work, passes, emit)
        emit(Capturing())
        files, stored = _capture(spec, work)
        manifest = _manifest(spec, buckets, runs, pass_stats, files)
        if stored is not None:
            manifest = _with_ranks(spec, manifest, runs, stored)
        emit(Packing(total=sum(f.size for f in files)))
        sha, size = write_artifact(out, manifest, work, on_bytes=lambda n: emit(Packed(bytes=n)))
        kept = _keep(work, keep_workdir) if keep_workdir is not None else None
    return BakeResult(
        artifact=out,
        sha256=sha,
        size=size,
        manifest=manifest,
        wall_s=time.time() - t0,
        workdir=kept,
        runs=runs,
    )


def _capture(spec: Spec, work: Path) -> tuple[list[FileEntry], ranks.Stored | None]:
    """The files of ``work``'s layout; for K ranks, each rank's under ``ranks/R/``, stored once
    where ranks share them (:func:`kiln.compiler.ranks.store_once`; the rest are copies)."""
    if spec.distributed is None:
        return capture(work / INDUCTOR_DIR, work / MEGACACHE_NAME, work / PRECOMPILED_NAME), None
    by_rank = []
    for rank in range(spec.world_size):
        folder = rank_dir(work, rank)
        prefix = f"{RANKS_DIR}/{rank}/"
        entries = capture(folder / INDUCTOR_DIR, folder / MEGACACHE_NAME, folder / PRECOMPILED_NAME)
        by_rank.append([e.model_copy(update={"path": prefix + e.path}) for e in entries])
    stored = ranks.store_once(by_rank)
    return stored.files, stored


def _with_ranks(
    spec: Spec, manifest: Manifest, runs: list[WorkerRun], stored: ranks.Stored
) -> Manifest:
    """``manifest`` as a K-rank artifact (format 2): every rank's fingerprint, grid, passes and
    blobs, and the copies; the top-level fields are rank 0's."""
    assert spec.distributed is not None
    copies = stored.copies
    listed = {f.path for f in manifest.files} | {c.path for c in copies}

    def blob(rank: int, name: str) -> str | None:
        path = f"{RANKS_DIR}/{rank}/{name}"
        return path if path in listed else None

    per_rank = [
        RankCaches(
            rank=rank,
            fingerprint=runs[0].results[rank].fingerprint or {},
            grid=_sorted_grid(runs[0].results[rank].buckets, manifest.grid),
            passes=[
                PassStats(order=p.order, compiles=run.results[rank].compiles, wall_s=p.wall_s)
                for p, run in zip(manifest.passes, runs, strict=True)
            ],
            megacache=blob(rank, MEGACACHE_NAME),
            precompiled=blob(rank, PRECOMPILED_NAME),
            same_as=stored.same_as[rank],
        )
        for rank in range(spec.world_size)
    ]
    distributed = Distributed(
        world_size=spec.world_size, backend=spec.distributed.backend, ranks=per_rank
    )
    update = {
        "format": RANKS_FORMAT,
        "distributed": distributed,
        "copies": copies,
        "megacache": per_rank[0].megacache,
        "precompiled": per_rank[0].precompiled,
    }
    out = Manifest.model_validate({**manifest.model_dump(), **update})
    # Every file a restore installs, copies included: a copy changed is a different payload.
    return out.model_copy(update={"payload_sha256": payload_sha256(out.entries())})


def _sorted_grid(buckets: list[Any], like: list[Any]) -> list[Any]:
    order = {b.key: i for i, b in enumerate(like)}
    return sorted(buckets, key=lambda b: order[b.key])


def _pass_count(spec: Spec, passes: int | None) -> tuple[int, bool]:
    """How many fresh-process passes to run at most, and whether to stop at the first quiet one
    (automatic: only specs whose compiles depend on order or on tuning results need more)."""
    chosen = passes or spec.warmup.passes
    if chosen is not None:
        return chosen, False
    settled = spec.compile.dynamic is False and not spec.compile.autotunes
    return (1 if settled else MAX_AUTO_PASSES), True


def _compile_passes(
    spec: Spec, buckets: list[Bucket], work: Path, passes: int | None, emit: EventSink
) -> tuple[list[WorkerRun], list[PassStats]]:
    """Run the bake's passes into ``work``'s cache root, each in a fresh worker, in other orders.

    The first pass compiles from nothing (in parallel) and saves the Mega-Cache blob and any
    precompiled forwards; every later pass is a fresh process loading what it left, exactly as
    a server will, with the spec's serving arguments.
    """
    count, auto = _pass_count(spec, passes)
    orders = rotations(buckets, count)
    root = work / INDUCTOR_DIR
    root.mkdir()
    env = {
        **compile_env(spec),
        "TORCHINDUCTOR_CACHE_DIR": str(root),
        # Triton's own default (~/.triton) is outside the root: keep it private too.
        "TRITON_HOME": str(work / "triton-home"),
    }
    first = WorkerRequest(
        order=[b.key for b in buckets],
        torch_kwargs=cold_torch_kwargs(spec.compile),
        calls=spec.warmup.calls,
        steady_calls=5,
        cache_root=str(root),
        megacache_save=str(work / MEGACACHE_NAME),
        precompile_save=str(work / PRECOMPILED_NAME) if spec.compile.precompile else None,
        fingerprint=True,
    )
    later = first.replace(
        torch_kwargs=torch_kwargs(spec.compile),
        megacache_save=None,
        precompile_save=None,
        fingerprint=False,
    )
    runs: list[WorkerRun] = []
    pass_stats: list[PassStats] = []
    for i, order in enumerate(orders):
        keys = [b.key for b in order]
        emit(PassStarted(index=i, passes=len(orders), order=keys))
        request = (first if i == 0 else later).replace(order=keys)
        run = run_worker(spec, request, env, on_event=emit)
        runs.append(run)
        # A pass is quiet only when every rank compiled nothing.
        compiles = sum(result.compiles for result in run.results)
        pass_stats.append(PassStats(order=keys, compiles=compiles, wall_s=run.wall_s))
        if auto and i > 0 and compiles == 0:
            break
    return runs, pass_stats


def _keep(work: Path, target: Path) -> Path:
    """Move the finished work folder to ``target``, out of the way of its removal (bench
    compares against it, inside a folder it removes). Usually the same temporary filesystem:
    a rename, not a copy of the whole cache."""
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(work, target)
    return target


@contextlib.contextmanager
def _stable_workdir(name: str) -> Iterator[Path]:
    """The same cache root for every bake of ``name`` on this machine, one bake at a time.

    Torch writes the cache root's absolute path into FX entries and native objects; a random
    temporary folder would make every bake's bytes differ and leave stale paths in the artifact.
    The folder is removed on the way out, failed bake or not (a kept one was moved away first).
    """
    base = Path(tempfile.gettempdir()) / f"kiln-bake-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    with open(base / f"{name}.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        work = base / name
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        try:
            yield work
        finally:
            shutil.rmtree(work, ignore_errors=True)


def _manifest(
    spec: Spec,
    buckets: list[Bucket],
    runs: list[WorkerRun],
    pass_stats: list[PassStats],
    files: list[Any],
) -> Manifest:
    first = runs[0]
    grid = list(first.result.buckets)
    order = {b.key: i for i, b in enumerate(buckets)}
    grid.sort(key=lambda b: order[b.key])
    origin = spec.factory_origin()
    epoch = source_date_epoch()
    created = datetime.fromtimestamp(epoch or time.time(), tz=timezone.utc)
    return Manifest(
        name=spec.name,
        created=created.isoformat(timespec="seconds"),
        spec=spec.canonical(),
        spec_sha256=spec.sha256(),
        model_source_sha256=sha256_file(origin) if origin and origin.is_file() else None,
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
        # while the artifact digest also covers timings (kiln.compiler.capture explains).
        payload_sha256=payload_sha256(files),
        megacache=MEGACACHE_NAME if any(f.path == MEGACACHE_NAME for f in files) else None,
        precompiled=PRECOMPILED_NAME if any(f.path == PRECOMPILED_NAME for f in files) else None,
        compile_kwargs=torch_kwargs(spec.compile),
        warnings=_unsettled(runs, pass_stats),
    )


def _unsettled(runs: list[WorkerRun], pass_stats: list[PassStats]) -> list[str]:
    """Say it when the last fresh-process pass still compiled: that pod would compile too."""
    if len(pass_stats) < 2 or pass_stats[-1].compiles == 0:
        return []
    where = ", ".join(f"{b.key} ({b.compiles})" for b in runs[-1].result.buckets if b.compiles)
    return [
        f"after {len(pass_stats)} fresh-process passes a new process still compiles "
        f"{pass_stats[-1].compiles} time(s): {where}; `kiln verify` will fail. Usual causes: the "
        "model reads per-process state (a global, a random value, a path), a Dynamo restart "
        "that torch does not cache, or a grad-mode/dtype mismatch"
    ]
