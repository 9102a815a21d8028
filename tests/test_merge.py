"""Sharded bakes and `kiln merge` (issue 14): shards combine into what one process bakes.

The fast tests build shard artifacts by hand with kiln's own deterministic writer (real
manifests of a real spec, real Mega-Cache blobs written by torch's serializer) and run
`kiln merge` as users do, with torch blocked. The slow one bakes 3 real shards on CPU, merges
them, restores the result at a new path and verifies zero compiles in shuffled orders.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import struct
import zlib
from pathlib import Path
from typing import Any

import pytest

from kiln.artifact.archive import read_manifest, write_artifact
from kiln.artifact.blobs import read_megacache
from kiln.artifact.manifest import (
    BucketStats,
    Bytecode,
    FileEntry,
    Manifest,
    ShardInfo,
    Workdir,
)
from kiln.artifact.merge import merge
from kiln.errors import IntegrityError, UsageError
from kiln.grid import Shard, expand, shard_buckets
from kiln.spec import load_spec
from tests.archives import PYC_TAG, pyc, reg, write_archive
from tests.conftest import limited_cli, mlp_spec

FINGERPRINT = {
    "device.type": "cpu",
    "torch.version": "2.13.0+cpu",
    "cpu.isa": "avx2",
    "cpu.model": "AMD EPYC",
    "python": "3.11.7",
}
SHARED = {"inductor/th/kernel.so": b"\x7fELF shared kernel"}  # compiled by every shard


def megacache_blob(artifacts: dict[str, list[tuple[str, bytes]]]) -> bytes:
    """A Mega-Cache blob written by torch's own serializer (the format kiln merges)."""
    from torch.compiler._cache import _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    class _Artifact:  # what _serialize_single_cache reads: key and content
        def __init__(self, key: str, content: bytes) -> None:
            self.key, self.content = key, content

    serializer = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    serializer.extend(
        (kind, [_Artifact(k, c) for k, c in items]) for kind, items in artifacts.items()
    )
    return serializer.to_bytes()


def shard_artifact(
    tmp: Path,
    spec_path: Path,
    index: int,
    count: int,
    *,
    files: dict[str, bytes] | None = None,
    fingerprint: dict[str, Any] | None = None,
    created: str = "2026-12-03T10:00:00+00:00",
    megacache: bytes | None = None,
    precompiled: bytes | None = None,
    name: str | None = None,
    bytecode: Bytecode | None = None,
    fields: dict[str, dict[str, Any]] | None = None,
    workdir: Workdir | None = None,
) -> Path:
    """Shard ``index``/``count`` of the spec as `kiln bake --shard` writes it, by hand: the
    buckets the shard owns, one FX entry per bucket, SHARED, and optional blobs; ``fields``
    replaces entries' fields (kind, a pyc's source) by path."""
    spec = load_spec(spec_path)
    buckets = shard_buckets(expand(spec), Shard(index, count))
    content = dict(SHARED)
    for b in buckets:
        content[f"inductor/fxgraph/{b.key}/entry-{index}"] = f"graph {b.key}".encode()
    content.update(files or {})
    if megacache is not None:
        content["megacache.bin"] = megacache
    if precompiled is not None:
        content["precompiled.bin"] = precompiled
    root = tmp / f"root-{name or index}"
    entries = []
    for path, data in sorted(content.items()):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
        kind = {"megacache.bin": "megacache", "precompiled.bin": "precompile"}.get(path, "other")
        digest = hashlib.sha256(data).hexdigest()
        values = {"path": path, "size": len(data), "sha256": digest, "kind": kind}
        entries.append(FileEntry(**{**values, **(fields or {}).get(path, {})}))
    manifest = Manifest(
        name=spec.name,
        created=created,
        spec=spec.canonical(),
        spec_sha256=spec.sha256(),
        fingerprint=fingerprint or FINGERPRINT,
        grid=[
            BucketStats(key=b.key, sizes=b.as_dict(), first_call_s=1.0, steady_s=0.01, fx_misses=1)
            for b in buckets
        ],
        totals={"compile_s": 1.0 * len(buckets)},
        files=entries,
        megacache="megacache.bin" if megacache is not None else None,
        precompiled="precompiled.bin" if precompiled is not None else None,
        bytecode=bytecode,
        compile_kwargs={"backend": "inductor", "dynamic": False},
        shard=ShardInfo.of(count, [index]),
        workdir=workdir,
    )
    out = tmp / f"{name or f'shard-{index}'}.kiln.tar.zst"
    write_artifact(out, manifest, root)
    return out


@pytest.fixture
def spec_path(write_spec) -> Path:
    return write_spec(mlp_spec())  # batch: [2, 3, 5]: 3 buckets, one per shard of 3


@pytest.fixture
def shards(tmp_path: Path, spec_path: Path) -> list[Path]:
    blobs = [
        megacache_blob({"inductor": [(f"fkey{i}", b"entry %d" % i)], "aot_autograd": []})
        for i in range(3)
    ]
    return [
        shard_artifact(tmp_path, spec_path, i, 3, megacache=blobs[i], created=f"2026-12-0{i + 1}")
        for i in range(3)
    ]


def test_merge_in_any_order_gives_the_same_bytes(shards: list[Path], tmp_path: Path, cli) -> None:
    a = cli("merge", *shards, "-o", tmp_path / "a.kiln.tar.zst", "--json", no_torch=True)
    assert a.returncode == 0, a.stderr
    reordered = [shards[2], shards[0], shards[1]]
    b = cli("merge", *reordered, "-o", tmp_path / "b.kiln.tar.zst", no_torch=True)
    assert b.returncode == 0, b.stderr
    assert (tmp_path / "a.kiln.tar.zst").read_bytes() == (tmp_path / "b.kiln.tar.zst").read_bytes()

    summary = json.loads(a.stdout)
    assert summary["shard"] == {"count": 3, "indexes": [0, 1, 2], "complete": True}
    assert summary["shared_files"] == 2  # the kernel, stored once for three shards
    m = read_manifest(tmp_path / "a.kiln.tar.zst")
    assert [s.key for s in m.grid] == ["batch=2", "batch=3", "batch=5"]  # grid order
    assert m.created == "2026-12-03"  # the latest shard's
    assert m.totals == {"compile_s": 3.0}
    paths = [f.path for f in m.files]
    assert paths == sorted(paths) and paths.count("inductor/th/kernel.so") == 1
    assert sum(p.startswith("inductor/fxgraph/") for p in paths) == 3
    assert m.megacache == "megacache.bin" and m.warnings == []


def test_merged_megacache_is_the_union_torch_reads(shards: list[Path], tmp_path: Path) -> None:
    from torch.compiler._cache import CacheArtifactManager

    out = tmp_path / "m.kiln.tar.zst"
    merge(shards, out)
    dest = tmp_path / "restored"
    import kiln

    kiln.restore(out, dest)
    blob = (dest / "megacache.bin").read_bytes()
    loaded = CacheArtifactManager.deserialize(blob)
    assert loaded is not None
    assert sorted(a.key for a in loaded["inductor"]) == ["fkey0", "fkey1", "fkey2"]
    assert len(read_megacache(dest / "megacache.bin")) == 3


def test_a_differing_fingerprint_is_exit_5_naming_the_factor(
    tmp_path: Path, spec_path: Path, cli
) -> None:
    a = shard_artifact(tmp_path, spec_path, 0, 2)
    b = shard_artifact(
        tmp_path, spec_path, 1, 2, fingerprint={**FINGERPRINT, "torch.version": "2.12.0+cpu"}
    )
    proc = cli("merge", a, b, "-o", tmp_path / "m.kiln.tar.zst", no_torch=True)
    assert proc.returncode == 5, proc.stderr
    assert "torch.version ('2.12.0+cpu' vs '2.13.0+cpu')" in proc.stderr
    assert not (tmp_path / "m.kiln.tar.zst").exists()
    # A factor outside torch's keys (another CPU model in the node pool) merges, with a warning.
    c = shard_artifact(
        tmp_path, spec_path, 1, 2, fingerprint={**FINGERPRINT, "cpu.model": "Intel"}, name="c"
    )
    result = merge([a, c], tmp_path / "m.kiln.tar.zst")
    assert any("cpu.model" in w for w in result.manifest.warnings)


def test_another_spec_is_exit_2(tmp_path: Path, spec_path: Path, write_spec, cli) -> None:
    other = write_spec(mlp_spec().replace("hidden: 32", "hidden: 64"), "other.yaml")
    a = shard_artifact(tmp_path, spec_path, 0, 2)
    b = shard_artifact(tmp_path, other, 1, 2, name="other")
    proc = cli("merge", a, b, "-o", tmp_path / "m.kiln.tar.zst", no_torch=True)
    assert proc.returncode == 2, proc.stderr
    assert "baked from another spec" in proc.stderr and "spec_sha256" in proc.stderr


def test_two_files_at_one_path_is_exit_3_naming_both(tmp_path: Path, spec_path: Path, cli) -> None:
    a = shard_artifact(tmp_path, spec_path, 0, 2, files={"inductor/xy/k.py": b"print(1)\n"})
    b = shard_artifact(tmp_path, spec_path, 1, 2, files={"inductor/xy/k.py": b"print(2)\n"})
    proc = cli("merge", a, b, "-o", tmp_path / "m.kiln.tar.zst", no_torch=True)
    assert proc.returncode == 3, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert (
        "'inductor/xy/k.py' differs between shard-0.kiln.tar.zst and shard-1.kiln.tar.zst" in line
    )
    assert not (tmp_path / "m.kiln.tar.zst").exists()


def test_shards_missing_twice_or_of_another_count(tmp_path: Path, spec_path: Path, cli) -> None:
    s0, s1 = (shard_artifact(tmp_path, spec_path, i, 3) for i in (0, 1))
    out = tmp_path / "m.kiln.tar.zst"
    proc = cli("merge", s0, s1, "-o", out, no_torch=True)
    assert proc.returncode == 2 and "shard(s) 2/3 missing" in proc.stderr, proc.stderr
    with pytest.raises(UsageError, match=r"shard 1/3 is in both"):
        merge([s0, s1, s1], out)
    half = shard_artifact(tmp_path, spec_path, 1, 2, name="half")
    with pytest.raises(UsageError, match="slice the grid differently"):
        merge([s0, half], out)
    # --partial: written, incomplete, and the manifest says which buckets are not baked.
    proc = cli("merge", s0, s1, "-o", out, "--partial", "--json", no_torch=True)
    assert proc.returncode == 0, proc.stderr
    m = read_manifest(out)
    assert m.shard is not None and m.shard.indexes == [0, 1] and not m.shard.complete
    assert any("batch=2" in w and "not baked" in w for w in m.warnings)
    # A merged artifact merges on: the missing shard completes it.
    s2 = shard_artifact(tmp_path, spec_path, 2, 3)
    full = merge([out, s2], tmp_path / "full.kiln.tar.zst")
    assert full.manifest.shard is not None and full.manifest.shard.complete


def test_shard_info_is_validated() -> None:
    assert ShardInfo.of(3, [2, 0, 1]).complete
    for bad in (
        {"count": 3, "indexes": [3], "complete": False},
        {"count": 3, "indexes": [1, 0], "complete": False},
        {"count": 3, "indexes": [0], "complete": True},
        {"count": 0, "indexes": [0], "complete": True},
        {"count": 3, "indexes": [], "complete": False},
    ):
        with pytest.raises(ValueError):
            ShardInfo.model_validate(bad)


def test_hostile_shards_are_refused_like_restore_refuses_them(
    tmp_path: Path, spec_path: Path
) -> None:
    """A shard is an untrusted archive: merge unpacks it with restore's extractor."""
    good = shard_artifact(tmp_path, spec_path, 0, 2)
    other = shard_artifact(tmp_path, spec_path, 1, 2)
    manifest = read_manifest(other)
    listed = {f.path: (tmp_path / "root-1" / f.path).read_bytes() for f in manifest.files}
    out = tmp_path / "m.kiln.tar.zst"
    cases = {
        "unlisted": [*(reg(p, d) for p, d in sorted(listed.items())), reg("inductor/evil", b"x")],
        "tampered": [reg(p, b"X" * len(d)) for p, d in sorted(listed.items())],
        "missing": [reg(p, d) for p, d in sorted(listed.items())][1:],
    }
    for case, members in cases.items():
        bad = write_archive(tmp_path / f"{case}.kiln.tar.zst", manifest, members)
        with pytest.raises(IntegrityError):
            merge([good, bad], out)
        assert not out.exists(), case
        assert not list(tmp_path.glob(".kiln-merge-*")), case  # the staging folder is gone


def test_precompiled_forwards_merge_and_a_hostile_pickle_runs_nothing(
    tmp_path: Path, spec_path: Path
) -> None:
    a = shard_artifact(tmp_path, spec_path, 0, 2, precompiled=pickle.dumps([b"graph-a", b"same"]))
    b = shard_artifact(tmp_path, spec_path, 1, 2, precompiled=pickle.dumps([b"same", b"graph-b"]))
    result = merge([b, a], tmp_path / "m.kiln.tar.zst")
    assert result.manifest.precompiled == "precompiled.bin"
    dest = tmp_path / "restored"
    import kiln

    kiln.restore(result.artifact, dest)
    assert pickle.loads((dest / "precompiled.bin").read_bytes()) == [
        b"graph-a",
        b"same",
        b"graph-b",
    ]

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    evil = shard_artifact(
        tmp_path, spec_path, 1, 2, precompiled=pickle.dumps([Evil()]), name="evil"
    )
    with pytest.raises(
        IntegrityError,
        match=r"cannot merge the precompiled forwards: evil\.kiln\.tar\.zst: .* holds a pickle",
    ):
        merge([a, evil], tmp_path / "x.kiln.tar.zst")
    assert not marker.exists()
    lacking = shard_artifact(tmp_path, spec_path, 1, 2, name="lacking")
    with pytest.raises(IntegrityError, match="has no precompiled forwards"):
        merge([a, lacking], tmp_path / "x.kiln.tar.zst")


def test_an_unmergeable_megacache_is_dropped_with_a_warning(
    tmp_path: Path, spec_path: Path
) -> None:
    """The blob is not what servers read: the merge goes on without it and says why."""
    good = megacache_blob({"inductor": [("k", b"a")]})
    corrupt = good[:-1] + bytes([good[-1] ^ 1])
    a = shard_artifact(tmp_path, spec_path, 0, 2, megacache=good)
    b = shard_artifact(tmp_path, spec_path, 1, 2, megacache=corrupt)
    result = merge([a, b], tmp_path / "m.kiln.tar.zst")
    assert result.manifest.megacache is None
    assert "megacache.bin" not in {f.path for f in result.manifest.files}
    assert any("CRC-32" in w for w in result.manifest.warnings)
    conflict = megacache_blob({"autotune": [("xy/k.best_config", b"{}")]})
    other = megacache_blob({"autotune": [("xy/k.best_config", b'{"x": 1}')]})
    c = shard_artifact(tmp_path, spec_path, 0, 2, megacache=conflict, name="c")
    d = shard_artifact(tmp_path, spec_path, 1, 2, megacache=other, name="d")
    result = merge([c, d], tmp_path / "m.kiln.tar.zst")
    assert result.manifest.megacache is None
    assert any("different 'autotune' artifacts" in w for w in result.manifest.warnings)


def test_the_driver_jit_cache_ships_whole_from_one_shard(tmp_path: Path, spec_path: Path) -> None:
    """Each shard's driver rewrote its one ``index``: the first shard's cache ships, whole."""
    caches = [
        {"cuda-cache/index": b"index 0", "cuda-cache/a/2/daf144f9da5951": b"sass 0"},
        {"cuda-cache/index": b"index 1", "cuda-cache/7/3/d687fb890292ee": b"sass 1"},
        {},
    ]
    # Each shard's entries keyed by the folder it ran in (kiln.workdir): the shipped one's holds.
    workdirs = [Workdir(path=f"/app{i}", keyed=1) for i in range(2)] + [None]
    shards = [
        shard_artifact(tmp_path, spec_path, i, 3, files=caches[i], workdir=workdirs[i])
        for i in range(3)
    ]
    merged = merge(list(reversed(shards)), tmp_path / "m.kiln.tar.zst")
    shipped = {f.path for f in merged.manifest.files if f.path.startswith("cuda-cache/")}
    assert shipped == set(caches[0])
    assert merged.manifest.workdir == workdirs[0]
    (line,) = [w for w in merged.warnings if "cuda-cache/" in w]
    assert line.startswith("cuda-cache/ of shard-1.kiln.tar.zst left out")
    assert line in merged.manifest.warnings
    # Anywhere else, two files at one path still conflict.
    clash = shard_artifact(tmp_path, spec_path, 1, 3, files={"cuda-cachex": b"1"}, name="x1")
    other = shard_artifact(tmp_path, spec_path, 0, 3, files={"cuda-cachex": b"0"}, name="x0")
    with pytest.raises(IntegrityError, match="'cuda-cachex' differs"):
        merge([other, clash, shards[2]], tmp_path / "n.kiln.tar.zst")


def test_the_shards_python_bytecode_merges_into_one_tree(tmp_path: Path, spec_path: Path) -> None:
    """Each shard ships the bytecode its own passes imported: the merge serves their union."""
    pycs = {m: pyc(f"/usr/lib/python3.12/{m}.py", f"{m} = 1\n".encode()) for m in "abc"}

    def shard(i: int, modules: str) -> Path:
        files = {pycs[m][0]: pycs[m][1] for m in modules}
        fields = {pycs[m][0]: pycs[m][2] for m in modules}
        shipped = Bytecode(python=PYC_TAG, modules=len(files)) if files else None
        return shard_artifact(
            tmp_path, spec_path, i, 3, files=files, bytecode=shipped, fields=fields
        )

    merged = merge([shard(0, "ab"), shard(1, "bc"), shard(2, "")], tmp_path / "m.kiln.tar.zst")
    assert merged.manifest.bytecode == Bytecode(python=PYC_TAG, modules=3)
    shipped = {f.path: f.sha256 for f in merged.manifest.files if f.kind == "bytecode"}
    assert sorted(shipped) == sorted(p for p, _, _ in pycs.values())
    none = [shard_artifact(tmp_path, spec_path, i, 3, name=f"plain-{i}") for i in range(3)]
    assert merge(none, tmp_path / "n.kiln.tar.zst").manifest.bytecode is None


def test_two_bytecode_files_at_one_path_conflict_like_any_other(
    tmp_path: Path, spec_path: Path, cli
) -> None:
    """Issue 27, item 5: conflicts are by content whatever kind the manifest claims (a
    "bytecode" label once kept shard 0's bytes silently), and the payload digest covers them."""
    path, _, fields = pyc("/usr/lib/python3.12/a.py", b"a = 1\n")
    shipped = Bytecode(python=PYC_TAG, modules=1)
    one, other = (pyc("/usr/lib/python3.12/a.py", b"a = 1\n", checked=c)[1] for c in (1, 0))
    a = shard_artifact(
        tmp_path, spec_path, 0, 2, files={path: one}, bytecode=shipped, fields={path: fields}
    )
    # Another code object with the same (checked) header: same path, other bytes.
    swapped = one[:16] + other[16:] + b"\0"
    b = shard_artifact(
        tmp_path, spec_path, 1, 2, files={path: swapped}, bytecode=shipped, fields={path: fields}
    )
    proc = cli("merge", a, b, "-o", tmp_path / "m.kiln.tar.zst", no_torch=True)
    assert proc.returncode == 3, proc.stderr
    assert f"{path!r} differs between shard-0.kiln.tar.zst and shard-1.kiln.tar.zst" in proc.stderr
    assert not (tmp_path / "m.kiln.tar.zst").exists()


def _pickle(*ops: bytes) -> bytes:
    return b"\x80\x04" + b"".join(ops) + b"."


def _binbytes(data: bytes) -> bytes:
    return b"B" + struct.pack("<I", len(data)) + data


def _megacache(kind: str, records: int) -> bytes:
    """A Mega-Cache blob (torch's format, written by hand) of ``records`` empty artifacts."""
    text = base64.b64encode(kind.encode())
    body = struct.pack(">Q", 1) + struct.pack(">Q", len(text)) + text
    body += struct.pack(">Q", records) + b"\0" * 16 * records  # key "" and content b""
    return struct.pack(">I", zlib.crc32(body)) + body


# Small shards whose blobs ask for unbounded time or memory (issue 27, items 2 and 7): each must
# end in exit 3 naming the bound, within the limits of tests.conftest.limited_cli.
HOSTILE_BLOBS = {
    # one memoized 1 MiB bytes object, referenced 200,000 times: 200 GB to hash
    "shared-reference": (
        "precompiled",
        _pickle(b"]\x94", _binbytes(b"x" * (1 << 20)), b"\x94a", b"h\x01a" * 200_000),
        "at most 65536 graphs",
    ),
    # a 10-byte pickle whose memo index makes the unpickler allocate 2 GiB
    "memo-index": ("precompiled", _pickle(b"]r\x00\x00\x00\x10"), "memo index 268435456"),
    # a million open MARKs, then an empty list: once "merged" as no graphs at all
    "marks": ("precompiled", _pickle(b"(" * 1_000_000, b"]"), "more than"),
    "empty-list": ("precompiled", _pickle(b"]"), "no graphs"),
    "open-mark": ("precompiled", _pickle(b"(]", _binbytes(b"g"), b"a"), "MARK"),
    # 200,000 empty artifacts in a 3 MB blob: 1.2 GB of bookkeeping at 4M
    "megacache-records": ("megacache", _megacache("inductor", 200_000), "more than 131072"),
}


@pytest.mark.parametrize("case", list(HOSTILE_BLOBS))
def test_hostile_blobs_end_in_exit_3_within_bounds(
    tmp_path: Path, spec_path: Path, case: str
) -> None:
    which, blob, says = HOSTILE_BLOBS[case]
    good = {"precompiled": pickle.dumps([b"graph"]), "megacache": _megacache("inductor", 1)}
    a = shard_artifact(tmp_path, spec_path, 0, 2, **{which: good[which]})
    b = shard_artifact(tmp_path, spec_path, 1, 2, **{which: blob})
    out = tmp_path / "out" / "m.kiln.tar.zst"
    proc = limited_cli(tmp_path, "merge", a, b, "-o", out)
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-2000:])
    assert says in proc.stderr
    assert not out.parent.exists() or list(out.parent.iterdir()) == []


def test_a_shard_that_expands_past_the_bound_is_refused_unread(
    tmp_path: Path, spec_path: Path
) -> None:
    """A precompiled.bin of 256 MiB of zeros compresses to a few KB: merge refuses it from the
    manifest before unpacking a byte (it was unpacked, then read whole into memory)."""
    size = 256 << 20
    root = tmp_path / "root-zeros"
    shard_artifact(tmp_path, spec_path, 1, 2, precompiled=b"", name="zeros")
    m = read_manifest(tmp_path / "zeros.kiln.tar.zst")
    with open(root / "precompiled.bin", "r+b") as fh:
        fh.truncate(size)
    zeros = hashlib.sha256()
    chunk = b"\0" * (1 << 20)
    for _ in range(size >> 20):
        zeros.update(chunk)
    files = [
        f.model_copy(update={"size": size, "sha256": zeros.hexdigest()})
        if f.path == "precompiled.bin"
        else f
        for f in m.files
    ]
    bomb = tmp_path / "bomb.kiln.tar.zst"
    write_artifact(bomb, m.model_copy(update={"files": files}), root)
    assert bomb.stat().st_size < 1 << 20
    good = shard_artifact(tmp_path, spec_path, 0, 2, precompiled=pickle.dumps([b"graph"]))
    out = tmp_path / "out" / "m.kiln.tar.zst"
    proc = limited_cli(tmp_path, "merge", good, bomb, "-o", out, memory=512 << 20)
    assert proc.returncode == 3, (proc.returncode, proc.stderr[-2000:])
    assert "bomb.kiln.tar.zst" in proc.stderr and "1024 times" in proc.stderr
    assert not out.parent.exists() or list(out.parent.iterdir()) == []


def test_a_file_and_a_folder_at_one_path_is_exit_3(tmp_path: Path, spec_path: Path, cli) -> None:
    """Issue 27, item 6: was FileExistsError (exit 1)."""
    a = shard_artifact(tmp_path, spec_path, 0, 2, files={"inductor/xy": b"a file"})
    b = shard_artifact(tmp_path, spec_path, 1, 2, files={"inductor/xy/k.py": b"print(2)\n"})
    for order in ((a, b), (b, a)):
        proc = cli("merge", *order, "-o", tmp_path / "m.kiln.tar.zst", no_torch=True)
        assert proc.returncode == 3, proc.stderr
        assert "'inductor/xy' is a file in" in proc.stderr and "a folder in" in proc.stderr
        assert not (tmp_path / "m.kiln.tar.zst").exists()
        assert not list(tmp_path.glob(".kiln-merge-*"))


def test_merge_into_an_existing_folder_is_exit_2(shards: list[Path], tmp_path: Path, cli) -> None:
    """Issue 27, item 6: was IsADirectoryError (exit 1), after unpacking every shard."""
    (tmp_path / "taken").mkdir()
    proc = cli("merge", *shards, "-o", tmp_path / "taken", no_torch=True)
    assert proc.returncode == 2, proc.stderr
    assert "is a folder" in proc.stderr
    assert list((tmp_path / "taken").iterdir()) == []


def test_merge_needs_artifacts(tmp_path: Path, cli) -> None:
    with pytest.raises(UsageError):
        merge([], tmp_path / "m.kiln.tar.zst")
    proc = cli("merge", tmp_path / "nope.kiln.tar.zst", "-o", tmp_path / "m", no_torch=True)
    assert proc.returncode == 4, proc.stderr
    proc = cli("merge", tmp_path, "-o", tmp_path / "m", no_torch=True)
    assert proc.returncode == 2 and "is a folder" in proc.stderr


def test_bake_refuses_a_bad_shard_before_compiling(spec_path: Path, write_spec) -> None:
    import kiln

    with pytest.raises(UsageError, match="4 shards for a grid of 3"):
        kiln.bake(spec_path, spec_path.with_suffix(".kiln.tar.zst"), shard=(0, 4))
    with pytest.raises(UsageError, match="at most 2"):
        kiln.bake(spec_path, spec_path.with_suffix(".kiln.tar.zst"), shard="3/3")
    dynamic = write_spec(mlp_spec(dynamic="null"), "dynamic.yaml")
    with pytest.raises(UsageError, match="dynamic: false"):
        kiln.bake(dynamic, spec_path.with_suffix(".kiln.tar.zst"), shard=Shard(0, 2))


@pytest.mark.slow  # three real CPU bakes, a restore and two verifies: ~1 min on 2 cores
def test_three_shards_merge_into_what_one_process_serves(
    tmp_path: Path, spec_path: Path, cli
) -> None:
    from torch.compiler._cache import CacheArtifactManager

    import kiln

    shards = []
    for i in range(3):
        # Unproven: the merged artifact is what this test proves, restored and verified.
        proc = cli("bake", spec_path, "--shard", f"{i}/3", "--no-prove", "--json", "-q")
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout)
        assert result["shard"] == {"count": 3, "indexes": [i], "complete": False}
        assert result["buckets"] == 1
        shards.append(tmp_path / result["artifact"])  # relative to the cwd: tmp_path
    assert shards[1].name == "tiny-mlp.shard-1-of-3.kiln.tar.zst"
    merged = kiln.merge(shards, tmp_path / "merged.kiln.tar.zst")
    again = kiln.merge(shards[::-1], tmp_path / "again.kiln.tar.zst")
    assert merged.sha256 == again.sha256
    m = merged.manifest
    assert [s.key for s in m.grid] == ["batch=2", "batch=3", "batch=5"]
    assert m.shard is not None and m.shard.complete and m.megacache == "megacache.bin"

    dest = tmp_path / "elsewhere" / "cache"  # a new path: nothing of the bakes' roots
    kiln.restore(merged.artifact, dest)
    # One order, both routes (the shuffles of seed 1 and 2, both served here before, are the
    # same order of this grid).
    report = kiln.verify(spec_path, dest, order="shuffle", seed=1)
    assert report.ok, report.to_dict()
    loaded = CacheArtifactManager.deserialize((dest / "megacache.bin").read_bytes())
    assert loaded is not None and len(loaded["inductor"]) >= 3  # every shard's graphs
