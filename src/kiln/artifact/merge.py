"""``kiln merge``: the artifacts of a sharded bake, combined into the one a single process bakes.

``kiln bake --shard I/N`` bakes a slice of the grid on each of N machines (an Indexed Job, a CI
matrix); merging is then cheap because the caches are content addressed, as Bazel's remote cache
is: an entry's path is a hash of what it holds, so shards write disjoint files, and a file two
shards both compiled (a kernel shared by buckets) is the same bytes at the same path, stored once.
Everything is decided from the manifests before a byte of payload is unpacked:

- one spec (``spec_sha256``, model source, compile arguments; exit 2) and one environment (every
  fingerprint factor in torch's cache keys; exit 5, naming it, as ``kiln check`` words it);
- shards of one count, each index once, each bucket from one shard (exit 2), and every index
  there unless ``partial`` (exit 2: a release missing buckets would compile in production);
- two different files at one path is exit 3, naming the path and both artifacts: the shards
  did not bake the same thing (another torch or compiler, another cache root, see below). The
  CUDA driver's JIT cache (``cuda-cache/``) is the exception: not content addressed (one
  ``index`` per folder, rewritten by every process that adds an entry), it is taken whole from
  the first shard that has one, and the merge warns that the others' were left out.

The inputs are untrusted like any artifact: each is unpacked by the restore path's extractor
(:func:`kiln.artifact.extract.extract`: the manifest is the allow-list, every size and sha256
checked, bounded), then the union is packed by the same deterministic writer as a bake. The
merged manifest's ``created`` is the latest shard's (or ``SOURCE_DATE_EPOCH``), inputs are
ordered by shard index: the same shards in any order give the same bytes. Torch-free.

Multi-rank (``distributed:``) shards merge rank by rank: one world size and backend (exit 2),
each rank's fingerprint compared like the top-level one (exit 5 naming the factor and the
rank), each rank's grid, passes and blobs the union of that rank's in every shard, and every
file a rank has (stored or a copy) taken into one set whose storage is decided again, across
ranks, by the rule a K-rank bake uses (:func:`kiln.artifact.rank_copies.store_once`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kiln._version import __version__
from kiln.artifact.archive import read_manifest, sha256_file, source_date_epoch, write_artifact
from kiln.artifact.blobs import BlobFormatError, merge_megacache, merge_precompiled
from kiln.artifact.extract import extract
from kiln.artifact.manifest import (
    MAX_SHARDS,
    RANKS_FORMAT,
    BucketStats,
    Distributed,
    FileEntry,
    Manifest,
    PassStats,
    RankCaches,
    ShardInfo,
    first_problem,
    folders_of,
)
from kiln.artifact.payload import payload_sha256
from kiln.artifact.rank_copies import store_once
from kiln.errors import IncompatibleError, IntegrityError, Param, UsageError, Worded
from kiln.events import EventSink, Packed, Packing, ignore
from kiln.factors import compare, misses
from kiln.grid import assign_shards, expand
from kiln.layout import CUDA_CACHE_DIR, MEGACACHE_NAME, CacheLayout, rank_of
from kiln.spec import Spec

# Manifest fields one spec determines: shards that differ in one were not baked from one spec.
_SAME_SPEC = ("name", "spec_sha256", "model_source_sha256", "compile_kwargs", "env")
# How far a shard may expand: its manifest's files against the artifact file's size. zstd
# packs a real cache 3-10 times; a file of zeros, ten thousand times. Refused from the
# manifest, before a byte is unpacked (the floor keeps tiny shards, mostly headers, out of it).
MAX_EXPANSION = 1024
EXPANSION_FLOOR = 64 << 20


@dataclass
class MergeResult:
    artifact: Path
    sha256: str
    size: int
    manifest: Manifest
    inputs: list[Path]  # in shard order
    shared_files: int  # files more than one shard held, stored once
    wall_s: float
    warnings: list[str] = field(default_factory=list)  # the merge's own (also in the manifest)

    def summary(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "artifact": str(self.artifact),
            "sha256": self.sha256,
            "size": self.size,
            "name": m.name,
            "shard": m.shard.model_dump() if m.shard is not None else None,
            "world_size": m.world_size,
            "inputs": [str(p) for p in self.inputs],
            "buckets": len(m.grid),
            "files": len(m.files),
            "shared_files": self.shared_files,
            "megacache": m.megacache is not None,
            "precompiled": m.precompiled is not None,
            "wall_s": round(self.wall_s, 3),
            "warnings": m.warnings,
        }


@dataclass
class _Input:
    path: Path
    manifest: Manifest
    shard: ShardInfo  # an unsharded bake: the whole grid, as shard 0 of 1

    @property
    def label(self) -> str:
        return f"{self.path.name} (shard {self.shard.label})"


def merge(
    artifacts: Sequence[str | Path],
    out: str | Path,
    *,
    partial: bool = False,
    on_event: EventSink | None = None,
) -> MergeResult:
    """Combine shard artifacts into one at ``out`` (written atomically, nothing on failure)."""
    t0 = time.time()
    out = Path(out)
    emit = on_event or ignore
    if not artifacts:
        raise UsageError("kiln merge needs the shard artifacts to combine")
    if len(artifacts) > MAX_SHARDS:
        raise UsageError(f"{len(artifacts)} artifacts: kiln merges at most {MAX_SHARDS}")
    if out.is_dir():
        raise UsageError(f"-o {out}: is a folder; name the artifact file to write")
    inputs = [_read(Path(a)) for a in artifacts]
    world = _same_ranks(inputs)
    spec = _same_spec(inputs)
    _same_environment(inputs)
    inputs, shard, missing = _shards(inputs, spec, partial)
    grid = _grid(inputs, spec)
    rank_grids = [_grid(inputs, spec, rank) for rank in range(world)] if world > 1 else []
    files, shared, left_out = _files(inputs)
    warnings = _warnings(inputs, shard, missing, spec) + _left_out_lines(left_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".kiln-merge-", dir=out.parent))
    try:
        trees = _extract_inputs(inputs, stage, emit)
        merged = stage / "merged"
        for entry, index in files.values():
            _place(trees[index] / entry.path, merged / entry.path)
        entries = [entry for entry, _ in files.values()]
        if world > 1:
            blobs = [_blobs(inputs, trees, merged, entries, warnings, r) for r in range(world)]
            megacache, precompiled = blobs[0]
            distributed = _distributed(inputs, rank_grids, blobs)
        else:
            megacache, precompiled = _blobs(inputs, trees, merged, entries, warnings)
            distributed = None
        manifest = _manifest(
            inputs, spec, grid, entries, shard, warnings, megacache, precompiled, distributed
        )
        emit(Packing(total=manifest.total_bytes))
        sha, size = write_artifact(out, manifest, merged, on_bytes=lambda n: emit(Packed(bytes=n)))
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return MergeResult(
        artifact=out,
        sha256=sha,
        size=size,
        manifest=manifest,
        inputs=[i.path for i in inputs],
        shared_files=shared,
        wall_s=time.time() - t0,
        warnings=warnings,
    )


def _read(path: Path) -> _Input:
    if path.is_dir():
        raise UsageError(f"{path}: is a folder; kiln merge takes artifact files")
    manifest = read_manifest(path)  # exit 4 missing, exit 3 not an artifact
    size = path.stat().st_size
    if manifest.total_bytes > max(MAX_EXPANSION * size, EXPANSION_FLOOR):
        raise IntegrityError(
            f"{path.name}: its manifest lists {manifest.total_bytes} bytes in a {size}-byte "
            f"artifact, more than {MAX_EXPANSION} times its size: refused unpacked"
        )
    return _Input(path, manifest, manifest.shard or ShardInfo.of(1, [0]))


def _ranks_of(manifest: Manifest) -> str:
    d = manifest.distributed
    return f"{d.world_size} ranks ({d.backend})" if d is not None else "1 rank"


def _same_ranks(inputs: list[_Input]) -> int:
    """The one world size every input was baked for (1: not distributed); exit 2 naming the
    first that differs. Checked before the spec so the message says what differs."""
    first = inputs[0]
    for other in inputs[1:]:
        a, b = first.manifest.distributed, other.manifest.distributed
        if (a and (a.world_size, a.backend)) != (b and (b.world_size, b.backend)):
            raise UsageError(
                f"{other.path.name} was baked for {_ranks_of(other.manifest)} and "
                f"{first.path.name} for {_ranks_of(first.manifest)}: merge the shards of one bake"
            )
    return first.manifest.world_size


def _rank(manifest: Manifest, rank: int) -> RankCaches:
    assert manifest.distributed is not None
    return manifest.distributed.ranks[rank]


def _same_spec(inputs: list[_Input]) -> Spec:
    """The one spec every input was baked from; exit 2 naming the first that differs."""
    first = inputs[0]
    for other in inputs[1:]:
        for name in _SAME_SPEC:
            a, b = getattr(first.manifest, name), getattr(other.manifest, name)
            if a != b:
                raise UsageError(
                    f"{other.path.name} was baked from another spec than {first.path.name} "
                    f"({name}: {_short(b)} vs {_short(a)}): merge the shards of one bake"
                )
    try:
        spec = Spec.model_validate(first.manifest.spec)
    except ValidationError as exc:
        where = ".".join(str(p) for p in exc.errors()[0]["loc"])
        raise UsageError(
            f"{first.path.name}: its spec is not one this kiln reads ({where}): "
            "merge with the kiln that baked it"
        ) from None
    if spec.sha256() != first.manifest.spec_sha256:
        raise IntegrityError(f"{first.path.name}: the manifest's spec does not match its sha256")
    return spec


def _short(value: object) -> str:
    text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
    return repr(text if len(text) <= 24 else text[:24] + "…")


def _fingerprints(manifest: Manifest) -> list[tuple[str, dict[str, Any]]]:
    """(where, fingerprint): the top-level one, then each rank's (a rank's process has its
    own, its device index included), each checked like the top-level one."""
    out = [("", manifest.fingerprint)]
    if manifest.distributed is not None:
        out += [(f" on rank {r.rank}", r.fingerprint) for r in manifest.distributed.ranks]
    return out


def _same_environment(inputs: list[_Input]) -> None:
    """Every factor torch folds into its cache keys is the same in every shard: a merged
    artifact is checked (``kiln check``) against one fingerprint, so it must hold for all."""
    first = inputs[0]
    for other in inputs[1:]:
        pairs = zip(_fingerprints(first.manifest), _fingerprints(other.manifest), strict=True)
        for (where, mine), (_, theirs) in pairs:
            differ = misses(compare(mine, theirs))
            if differ:
                names = ", ".join(f"{f.name} ({f.here!r} vs {f.baked!r})" for f in differ)
                raise IncompatibleError(
                    f"{other.path.name} was baked in another environment than "
                    f"{first.path.name}{where}: {names}: bake every shard on one machine type "
                    "and image",
                    detail={"differing": [f.to_dict() for f in differ], "where": where.strip()},
                )


def _shards(
    inputs: list[_Input], spec: Spec, partial: bool
) -> tuple[list[_Input], ShardInfo, list[int]]:
    """Inputs in shard order, the merged :class:`ShardInfo`, and the indexes missing."""
    count = inputs[0].shard.count
    owner: dict[int, _Input] = {}
    for item in inputs:
        if item.shard.count != count:
            raise UsageError(
                Worded(
                    f"{item.label} and {inputs[0].label} slice the grid differently: "
                    "merge the shards of one ",
                    Param("shard"),
                    " count",
                )
            )
        for index in item.shard.indexes:
            if index in owner:
                raise UsageError(
                    f"shard {index}/{count} is in both {owner[index].path.name} and "
                    f"{item.path.name}: give each shard once"
                )
            owner[index] = item
    missing = [i for i in range(count) if i not in owner]
    if missing and not partial:
        shown = ", ".join(f"{i}/{count}" for i in missing[:8]) + (" …" if len(missing) > 8 else "")
        raise UsageError(
            Worded(
                f"shard(s) {shown} missing: pass all {count}, or ",
                Param("partial"),
                " for an artifact without their buckets",
            )
        )
    ordered = sorted(inputs, key=lambda i: i.shard.indexes)
    return ordered, ShardInfo.of(count, sorted(owner)), missing


def _grid(inputs: list[_Input], spec: Spec, rank: int | None = None) -> list[BucketStats]:
    """The union of the shards' bucket stats (``rank``'s, or the top-level ones), in grid order;
    each bucket from one shard, the one :func:`kiln.grid.assign_shards` deals it to (so two
    kilns that slice differently cannot leave a bucket out or bake it twice unnoticed)."""
    buckets = expand(spec)
    place = {b.key: i for i, b in enumerate(buckets)}
    count = inputs[0].shard.count
    dealt = assign_shards(buckets, count) if count <= len(buckets) else {}
    where = "" if rank is None else f" (rank {rank})"

    def grid_of(item: _Input) -> list[BucketStats]:
        return item.manifest.grid if rank is None else _rank(item.manifest, rank).grid

    seen: dict[str, _Input] = {}
    for item in inputs:
        for stats in grid_of(item):
            if stats.key not in place:
                raise IntegrityError(
                    f"{item.label}: bucket {stats.key}{where} is not in its spec's grid"
                )
            if stats.key in seen:
                raise UsageError(
                    f"bucket {stats.key}{where} is in both {seen[stats.key].path.name} and "
                    f"{item.path.name}: each bucket must come from one shard"
                )
            if count > 1 and dealt.get(stats.key) not in item.shard.indexes:
                raise UsageError(
                    f"{item.label} holds bucket {stats.key}{where}, which this kiln deals to "
                    f"shard {dealt.get(stats.key)}/{count}: bake every shard with one kiln version"
                )
            seen[stats.key] = item
    return sorted((s for i in inputs for s in grid_of(i)), key=lambda s: place[s.key])


def _blob_paths(manifest: Manifest) -> set[str]:
    """The blobs merged on their own (every rank's, for a K-rank artifact)."""
    blobs = [manifest.megacache, manifest.precompiled]
    if manifest.distributed is not None:
        blobs += [p for r in manifest.distributed.ranks for p in (r.megacache, r.precompiled)]
    return {p for p in blobs if p is not None}


def _files(
    inputs: list[_Input],
) -> tuple[dict[str, tuple[FileEntry, int]], int, dict[str, list[str]]]:
    """path → (entry, index of the input it is taken from); how many were shared; and for
    each driver cache folder, the inputs whose copy of it was left out.
    Identical files are stored once; two different files at one path, whatever kind the
    manifests claim, or a file at a path another shard has as a folder, is exit 3. A K-rank
    shard's copies count as the files they are (restore's extractor writes them): which of
    the union are stored and which copied is decided again for the merged artifact. A driver
    cache folder (:func:`_driver_cache`) comes whole from the first input that has it."""
    chosen: dict[str, tuple[FileEntry, int]] = {}
    shared = 0
    owner: dict[str, int] = {}  # driver cache folder -> the input it is taken from
    left_out: dict[str, list[str]] = {}
    for index, item in enumerate(inputs):
        blobs = _blob_paths(item.manifest)
        for entry in item.manifest.entries():
            if entry.path in blobs:
                continue
            folder = _driver_cache(entry.path)
            if folder is not None and owner.setdefault(folder, index) != index:
                names = left_out.setdefault(folder, [])
                if item.path.name not in names:
                    names.append(item.path.name)
                continue
            if entry.path in chosen:
                first, where = chosen[entry.path]
                if first.sha256 != entry.sha256 or first.size != entry.size:
                    raise IntegrityError(
                        f"{entry.path!r} differs between {inputs[where].path.name} and "
                        f"{item.path.name}: the shards did not compile the same code (another "
                        "torch or compiler, or another cache root: bake every shard as the "
                        "same user with the same TMPDIR)"
                    )
                shared += 1
                continue
            chosen[entry.path] = (entry, index)
    _one_layout(inputs)
    return dict(sorted(chosen.items())), shared, left_out


def _driver_cache(path: str) -> str | None:
    """The CUDA driver's JIT cache folder ``path`` is in (``cuda-cache/``, or a rank's
    ``ranks/R/cuda-cache/``), or None."""
    prefix = CacheLayout(rank=rank_of(path)).prefix
    if path.startswith(f"{prefix}{CUDA_CACHE_DIR}/"):
        return f"{prefix}{CUDA_CACHE_DIR}/"
    return None


def _workdir(inputs: list[_Input]) -> dict[str, Any] | None:
    """The folder the shipped driver entries are keyed by (kiln.workdir): that of the shard
    whose driver cache ships (:func:`_files`: the first that has one)."""
    for item in inputs:
        if any(_driver_cache(e.path) for e in item.manifest.entries()):
            return item.manifest.workdir.model_dump() if item.manifest.workdir else None
    return None


def _left_out_lines(left_out: dict[str, list[str]]) -> list[str]:
    """One warning per driver cache folder that only one shard's copy of could ship."""
    return [
        f"{folder} of {', '.join(names)} left out: the CUDA driver's JIT cache is one index "
        "per folder and ships whole from one shard; a served process JIT-compiles what the "
        "others held (verify counts it)"
        for folder, names in left_out.items()
    ]


def _one_layout(inputs: list[_Input]) -> None:
    """No path is a file in one shard (a blob included) and a folder in another: exit 3."""
    owner: dict[str, int] = {}
    for index, item in enumerate(inputs):
        for entry in item.manifest.entries():
            owner.setdefault(entry.path, index)
    for folder in sorted(folders_of(list(owner)) & set(owner)):
        inside = next(i for p, i in owner.items() if p.startswith(folder + "/"))
        raise IntegrityError(
            f"{folder!r} is a file in {inputs[owner[folder]].path.name} and a folder in "
            f"{inputs[inside].path.name}: the shards did not bake the same layout"
        )


def _warnings(inputs: list[_Input], shard: ShardInfo, missing: list[int], spec: Spec) -> list[str]:
    out: list[str] = []
    for item in inputs:
        merged = len(item.shard.indexes) > 1  # a merge's warnings already say their shard
        for warning in item.manifest.warnings:
            line = warning if merged else f"shard {item.shard.label}: {warning}"
            if line not in out:
                out.append(line)
    first = inputs[0]
    for other in inputs[1:]:
        pairs = zip(_fingerprints(first.manifest), _fingerprints(other.manifest), strict=True)
        for (where, mine), (_, theirs) in pairs:
            for f in compare(mine, theirs):
                if not f.matches:
                    line = (
                        f"shards differ{where} in {f.name} ({f.baked!r} vs {f.here!r}), which is "
                        f"not in torch's cache keys; the manifest records {first.path.name}'s"
                    )
                    if line not in out:
                        out.append(line)
    if missing:
        baked = {s.key for i in inputs for s in i.manifest.grid}
        absent = [b.key for b in expand(spec) if b.key not in baked]
        out.append(
            f"partial merge: shards {', '.join(map(str, missing))} of {shard.count} are "
            f"missing, so {len(absent)} bucket(s) are not baked ({', '.join(absent[:6])}"
            f"{' …' if len(absent) > 6 else ''}): serving them compiles, `kiln verify` fails"
        )
    return out


def _extract_inputs(inputs: list[_Input], stage: Path, emit: EventSink) -> list[Path]:
    """Each input extracted by restore's extractor into its own folder; the manifest it holds
    must still be the one the checks above read (the file may have changed since)."""
    trees: list[Path] = []
    for index, item in enumerate(inputs):
        tree = stage / f"input-{index}"
        tree.mkdir()
        with open(item.path, "rb") as fh:
            unpacked = extract(fh, tree, emit)
        if unpacked.to_bytes() != item.manifest.to_bytes():
            raise IntegrityError(f"{item.path.name} changed while merging")
        trees.append(tree)
    return trees


def _place(src: Path, dst: Path) -> None:
    """A hard link where the filesystem allows it (the staging folders share one), else a copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _blobs(
    inputs: list[_Input],
    trees: list[Path],
    merged: Path,
    entries: list[FileEntry],
    warnings: list[str],
    rank: int | None = None,
) -> tuple[str | None, str | None]:
    """Merge the Mega-Cache blobs and the precompiled forwards (``rank``'s, in its rank folder,
    or the top-level ones) into ``merged``; add their entries. The blob goes when it cannot be
    merged (it is not what a server reads; say so), the precompiled forwards are required (a
    ``precompile: true`` server loads them)."""
    target = CacheLayout(merged, rank)
    where = "" if rank is None else f"rank {rank}: "

    def blob(item: _Input, field: str) -> str | None:
        owner: Manifest | RankCaches = item.manifest if rank is None else _rank(item.manifest, rank)
        value: str | None = getattr(owner, field)
        return value

    megacache: str | None = None
    pairs = list(zip(inputs, trees, strict=True))
    have = [(i.path.name, t / m) for i, t in pairs if (m := blob(i, "megacache"))]
    if have and len(have) == len(inputs):
        out = target.megacache
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            merge_megacache(have, out)
            megacache = target.member(out)
        except BlobFormatError as exc:
            out.unlink(missing_ok=True)
            warnings.append(f"{where}no Mega-Cache blob in the merged artifact: {exc}")
    elif have:
        lacking = [i.path.name for i in inputs if not blob(i, "megacache")]
        warnings.append(
            f"{where}no Mega-Cache blob in the merged artifact: {', '.join(lacking)} has none "
            "(the cache folder, which servers read, is complete)"
        )
    precompiled: str | None = None
    built = [(i.path.name, t / p) for i, t in pairs if (p := blob(i, "precompiled"))]
    if built:
        lacking = [i.path.name for i in inputs if not blob(i, "precompiled")]
        if lacking:
            raise IntegrityError(
                f"{where}{', '.join(lacking)} has no precompiled forwards and other shards do: "
                "their buckets would compile in a precompile server"
            )
        out = target.precompiled
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            merge_precompiled(built, out)
        except BlobFormatError as exc:
            raise IntegrityError(f"{where}cannot merge the precompiled forwards: {exc}") from None
        precompiled = target.member(out)
    for name in (megacache, precompiled):
        if name is not None:
            entries.append(_entry(merged / name, name))
    entries.sort(key=lambda e: e.path)
    return megacache, precompiled


def _entry(path: Path, name: str) -> FileEntry:
    # As capture.cache_kind says.
    kind = "megacache" if name.endswith(MEGACACHE_NAME) else "precompile"
    return FileEntry(path=name, size=path.stat().st_size, sha256=sha256_file(path), kind=kind)


def _distributed(
    inputs: list[_Input],
    rank_grids: list[list[BucketStats]],
    blobs: list[tuple[str | None, str | None]],
) -> Distributed:
    """The merged per-rank layout: each rank's union grid, its passes in shard order, its merged
    blobs; ``same_as`` is left for :func:`_manifest` (it depends on the merged files)."""
    first = inputs[0].manifest.distributed
    assert first is not None
    ranks = [
        RankCaches(
            rank=rank,
            fingerprint=first.ranks[rank].fingerprint,
            grid=rank_grids[rank],
            passes=[p for i in inputs for p in _rank(i.manifest, rank).passes],
            megacache=megacache,
            precompiled=precompiled,
        )
        for rank, (megacache, precompiled) in enumerate(blobs)
    ]
    return Distributed(world_size=first.world_size, backend=first.backend, ranks=ranks)


def _created(inputs: list[_Input]) -> str:
    """``SOURCE_DATE_EPOCH`` when set (reproducible builds), else the latest shard's time."""
    epoch = source_date_epoch()
    if epoch:
        return datetime.fromtimestamp(epoch, tz=timezone.utc).isoformat(timespec="seconds")
    times: list[tuple[datetime, str]] = []
    for item in inputs:
        try:
            when = datetime.fromisoformat(item.manifest.created)
        except ValueError:
            raise IntegrityError(
                f"{item.path.name}: created {_short(item.manifest.created)} is not ISO 8601"
            ) from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        times.append((when, item.manifest.created))
    return max(times)[1]


def _bytecode(inputs: list[_Input], entries: list[FileEntry]) -> dict[str, Any] | None:
    """The union of the shards' Python bytecode (kiln.bytecode), which every shard ships for
    the modules its server imports (one copy per source: :func:`_files`)."""
    shipped = [i.manifest.bytecode for i in inputs if i.manifest.bytecode is not None]
    if not shipped:
        return None
    modules = sum(1 for e in entries if e.kind == "bytecode")
    return {"python": shipped[0].python, "modules": modules}


def _aoti(inputs: list[_Input], grid: list[BucketStats]) -> dict[str, Any] | None:
    """The union of the shards' AOTInductor packages (compile.route: aoti), in grid order: each
    shard built its own buckets' packages, in folders named by bucket (no two shards share one).
    """
    shipped = [i.manifest.aoti for i in inputs if i.manifest.aoti is not None]
    if not shipped:
        return None
    if len(shipped) != len(inputs):
        raise IntegrityError("some shards were baked on route: aoti and others were not")
    order = {b.key: n for n, b in enumerate(grid)}
    programs = sorted(
        (p for a in shipped for p in a.programs), key=lambda p: order.get(p.buckets[0], 0)
    )
    constants: dict[str, Any] = {}
    for a in shipped:
        constants.update(a.constants)
    carriers = sorted(
        (c for a in shipped for c in a.carriers), key=lambda c: (order.get(c.bucket, 0), c.axis)
    )
    first = shipped[0].model_dump()
    return first | {
        "programs": [p.model_dump() for p in programs],
        "constants": {k: v.model_dump() for k, v in sorted(constants.items())},
        "carriers": [c.model_dump() for c in carriers],
    }


def _manifest(
    inputs: list[_Input],
    spec: Spec,
    grid: list[BucketStats],
    entries: list[FileEntry],
    shard: ShardInfo,
    warnings: list[str],
    megacache: str | None,
    precompiled: str | None,
    distributed: Distributed | None = None,
) -> Manifest:
    first = inputs[0].manifest
    layout: dict[str, Any] = {}
    if distributed is not None:
        # Every file each rank has, stored once across ranks as a K-rank bake stores it.
        by_rank: list[list[FileEntry]] = [[] for _ in range(distributed.world_size)]
        shared = [e for e in entries if e.is_bytecode]  # one tree for every rank
        for entry in entries:
            if entry.is_bytecode:
                continue
            rank = rank_of(entry.path)
            if rank is None or rank >= distributed.world_size:
                raise IntegrityError(f"{entry.path!r} is in no rank folder of the merged artifact")
            by_rank[rank].append(entry)
        stored = store_once(by_rank)
        entries = stored.files + shared
        ranks = [
            r.model_copy(update={"same_as": same})
            for r, same in zip(distributed.ranks, stored.same_as, strict=True)
        ]
        layout = {
            "format": RANKS_FORMAT,
            "distributed": distributed.model_copy(update={"ranks": ranks}).model_dump(),
            "copies": [c.model_dump() for c in stored.copies],
        }
    totals: dict[str, float] = {}
    for item in inputs:  # every total is a sum over buckets or passes, and shards are disjoint
        for key, value in item.manifest.totals.items():
            totals[key] = round(totals.get(key, 0.0) + value, 3)
    passes = [PassStats.model_validate(p.model_dump()) for i in inputs for p in i.manifest.passes]
    values: dict[str, Any] = {
        "kiln_version": __version__,
        "name": first.name,
        "created": _created(inputs),
        "spec": first.spec,
        "spec_sha256": first.spec_sha256,
        "model_source_sha256": first.model_source_sha256,
        "fingerprint": first.fingerprint,
        "env": first.env,
        "grid": [s.model_dump() for s in grid],
        "passes": [p.model_dump() for p in passes],
        "totals": dict(sorted(totals.items())),
        "files": [e.model_dump() for e in entries],
        "megacache": megacache,
        "precompiled": precompiled,
        "bytecode": _bytecode(inputs, entries),
        "aoti": _aoti(inputs, grid),
        "workdir": _workdir(inputs),
        "payload_sha256": None,  # below: over every file restore installs, copies included
        "compile_kwargs": first.compile_kwargs,
        "warnings": warnings,
        "shard": shard.model_dump() if shard.count > 1 else None,
        **layout,
    }
    try:
        manifest = Manifest.model_validate(values)
    except ValidationError as exc:
        raise IntegrityError(f"the merged manifest is refused: {first_problem(exc)}") from None
    return manifest.model_copy(update={"payload_sha256": payload_sha256(manifest.entries())})
