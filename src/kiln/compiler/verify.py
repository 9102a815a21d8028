"""Verify: prove, in a fresh process, that a restored cache hits for the whole grid.

Serving teams need a readiness gate, not a hope: verify runs every bucket against the restored
folder in a new interpreter (as a pod would start), in a shuffled order (as traffic arrives),
counts every kind of compile (FX/AOT misses, Triton kernels, new native objects), calls each
bucket enough times that CUDA graphs are recorded, and fails (exit 6) naming the bucket and
torch's own reason if anything compiled. ``--ready-file`` is written only on success.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from kiln.artifact.archive import read_manifest
from kiln.artifact.manifest import BucketStats, GraphBreak, Manifest
from kiln.compiler.check import CheckReport, compare_manifest
from kiln.compiler.dynamo_log import RESUME_FRAME
from kiln.compiler.launch import run_worker
from kiln.compiler.protocol import WorkerRequest, input_stream
from kiln.errors import IncompatibleError, NotFoundError
from kiln.events import EventSink
from kiln.files import atomic_write
from kiln.grid import expand, ordered
from kiln.serving import (
    BYTECODE_DIR,
    INDUCTOR_DIR,
    PRECOMPILED_NAME,
    cache_env,
    rank_dir,
    served_torch_kwargs,
)
from kiln.spec import Spec, load_spec

_VERIFY_STREAMS = 100  # input streams below this are the bake's passes


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

    @property
    def failing(self) -> list[BucketStats]:
        return [b for b in self.buckets if b.compiles > 0]

    @property
    def ok(self) -> bool:
        return not self.failing

    def reasons(self) -> list[str]:
        factors = ", ".join(f.name for f in self.check.misses) if self.check else ""
        return [explain(b, factors, self.graph_breaks) for b in self.failing]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "order": self.order,
            "spec_matches": self.spec_matches,
            "time_to_ready_s": round(self.time_to_ready_s, 3),
            "time_to_warm_s": round(self.time_to_warm_s, 3),
            "compiles": sum(b.compiles for b in self.buckets),
            "failing": self.reasons(),
            "buckets": [b.model_dump(mode="json") | {"compiles": b.compiles} for b in self.buckets],
            "check": self.check.to_dict() if self.check else None,
            **self.extra,
        }


def explain(bucket: BucketStats, factors: str = "", breaks: Sequence[GraphBreak] = ()) -> str:
    """One line on what compiled in ``bucket`` and the most specific cause we know.

    A graph that missed is a cache-key question (name the differing factor), or the code after
    a data-dependent graph break reached with data the bake never drew (name the break: a
    shape guard quoted there would send the reader the wrong way), else torch's recompile
    reason. Kernels rebuilt while every graph hit are a different problem again — Triton
    re-tuning or rebuilding.
    """
    b = bucket
    graphs = b.fx_misses + b.fx_bypass + b.aot_misses + b.precompile_misses
    counts = (
        (b.fx_misses + b.fx_bypass, "FX graph", "FX graphs"),
        (b.aot_misses, "AOT graph", "AOT graphs"),
        (b.precompile_misses, "precompiled miss", "precompiled misses"),
        (b.new_native, "kernel binary", "kernel binaries"),
        (b.autotunes, "autotune run", "autotune runs"),
    )
    what = ", ".join(f"{n} {one if n == 1 else many}" for n, one, many in counts if n)
    seam = data_dependent_break(b, breaks) if graphs and not factors else None
    if seam is not None:
        hint = (
            f"serving data reached code after the data-dependent graph break at {seam.where} "
            f"({seam.reason}) that the bake's inputs never did"
        )
    elif graphs:
        why = b.recompile_reasons[-1].splitlines()[-1].strip("- ") if b.recompile_reasons else ""
        hint = f"environment differs: {factors}" if factors else "no cached entry matched"
        if why and not factors:
            hint += f"; Dynamo traced it because {why}"
    else:
        kernels = sorted({PurePosixPath(n).stem for n in b.new_files})[:3]
        hint = "every graph hit; Triton rebuilt or re-tuned kernels" + (
            f": {', '.join(kernels)}" if kernels else ""
        )
    return f"{b.key}: {b.compiles} compile(s): {what} ({hint})"


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


def served_request(cache: Path, manifest: Manifest, order: list[str], calls: int) -> WorkerRequest:
    """A pass that serves ``order`` from the restored folder ``cache`` as a pod would (its
    environment is :func:`~kiln.serving.cache_env`), timing a fresh first request and the steady
    latency of each bucket: verify and bench share this. For a K-rank artifact the paths are
    the layout's names under ``cache``, which :mod:`kiln.compiler.ranks` moves into each rank's
    folder."""
    precompiled = manifest.precompiled
    if precompiled and manifest.distributed:
        precompiled = PRECOMPILED_NAME  # ranks/0/precompiled.bin is rank 0's: each has its own
    return WorkerRequest(
        order=order,
        torch_kwargs=served_torch_kwargs(manifest),
        calls=calls,
        steady_calls=10,
        first_request=True,
        cache_root=str(cache / INDUCTOR_DIR),
        precompile_load=str(cache / precompiled) if precompiled else None,
        frames="serve" if manifest.precompiled_frames else None,
        bytecode=str(cache / BYTECODE_DIR) if manifest.bytecode else None,
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


def verify(
    spec: Spec | str | Path,
    cache: str | Path,
    *,
    order: str = "shuffle",
    seed: int = 0,
    device_index: int = 0,
    ready_file: str | Path | None = None,
    keys: Sequence[str] | None = None,
    on_event: EventSink | None = None,
) -> VerifyReport:
    """Run ``spec``'s grid (only the buckets ``keys`` names, when given: a shard's slice)
    against the restored folder ``cache`` in a fresh process."""
    spec = spec if isinstance(spec, Spec) else load_spec(spec)
    cache = Path(cache).absolute()
    first = rank_dir(cache, 0) if (cache / "ranks").is_dir() else cache
    if not (first / INDUCTOR_DIR).is_dir():
        raise NotFoundError(f"{cache}: no {INDUCTOR_DIR}/ folder (restore an artifact there first)")
    manifest = read_manifest(cache)
    check_world_size(spec, manifest)
    grid = [b for b in expand(spec) if keys is None or b.key in keys]
    order_keys = [b.key for b in ordered(grid, order, seed)]
    request = served_request(cache, manifest, order_keys, spec.warmup.calls).replace(
        fingerprint=True,
        device_index=device_index,
        # Data the bake never drew, as traffic's is: a path the bake's inputs missed shows here.
        input_seed=input_stream(_VERIFY_STREAMS + seed),
    )
    run = run_worker(spec, request, cache_env(cache, manifest.env), on_event=on_event)
    checks = [
        compare_manifest(
            manifest,
            result.fingerprint,
            rank=rank if manifest.distributed else None,
            world_size=spec.world_size if manifest.distributed else None,
        )
        for rank, result in enumerate(run.results)
        if result.fingerprint
    ]
    report = VerifyReport(
        name=manifest.name,
        order=order_keys,
        # A re-trace that hit the cache is how a fresh process works: no reason to show.
        buckets=[
            b if b.compiles else b.model_copy(update={"recompile_reasons": []})
            for b in rank_buckets(run.results, labelled=manifest.distributed is not None)
        ],
        # The first rank whose environment differs names the factor, else rank 0's.
        check=next((c for c in checks if not c.ok), checks[0]) if checks else None,
        time_to_ready_s=run.time_to_ready,
        time_to_warm_s=run.time_to_warm,
        spec_matches=spec.sha256() == manifest.spec_sha256,
        graph_breaks=manifest.graph_breaks,
        extra={
            "precompile_load_s": run.result.precompile_load_s,
            "ranks": spec.world_size,
            "bytecode_modules": run.result.bytecode_modules,  # imported from the artifact's
        },
    )
    if ready_file is not None:
        _mark_ready(Path(ready_file), report)
    return report


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
