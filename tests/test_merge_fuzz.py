"""Property-based fuzzing of ``kiln merge`` under hard limits (issue 27).

Whatever shards are given (mutated archives, manifests and blobs, starting from valid shards of
a real spec), ``kiln merge`` runs as users run it, in a child the kernel holds to 1 GiB of
address space and 30 CPU seconds (:func:`tests.conftest.limited_cli`), and must end in a
documented exit code (0, 2, 3 or 5) within them: never a crash, a MemoryError or a kill. It
writes nothing but ``-o``: every other file under the work folder, ``TMPDIR`` included, is as
it was, and a failed merge leaves nothing at all. Each example is a process (forked with kiln
imported, ~0.1 s), so the default run is short; ``KILN_FUZZ_EXAMPLES=500`` searches deeper.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import pickle
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Any

import zstandard
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kiln.artifact.archive import read_manifest
from tests.archives import reg, write_archive
from tests.conftest import import_scratch, limited_cli, mlp_spec
from tests.test_manifest_fuzz import mutated_bytes, odd_values
from tests.test_merge import shard_artifact

_DEEP = os.environ.get("KILN_FUZZ_EXAMPLES")
LIMITED = settings(
    max_examples=int(_DEEP or 15),
    deadline=None,  # each example is bounded by the child's own limits
    derandomize=not _DEEP,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
EXITS = (0, 2, 3, 5)  # ok, usage, integrity, incompatible: README "Exit codes"

ROOT = import_scratch("kiln-merge-fuzz-")
SPEC = ROOT / "spec.yaml"
SPEC.write_text(mlp_spec())  # 3 buckets: shards 0/2 and 1/2


def _megacache(records: list[tuple[str, bytes]]) -> bytes:
    text = base64.b64encode(b"inductor")
    parts = [struct.pack(">QQ", 1, len(text)), text, struct.pack(">Q", len(records))]
    for key, content in records:
        k = base64.b64encode(key.encode())
        parts += [struct.pack(">Q", len(k)), k, struct.pack(">Q", len(content)), content]
    body = b"".join(parts)
    return struct.pack(">I", zlib.crc32(body)) + body


PRECOMPILED = pickle.dumps([b"graph-a", b"graph-b"], protocol=4)
MEGACACHE = _megacache([("fkey0", b"entry 0"), ("fkey1", b"entry 1")])
GOOD = shard_artifact(ROOT, SPEC, 0, 2, precompiled=PRECOMPILED, megacache=MEGACACHE)


def snapshot(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under ``root``."""
    out: dict[str, bytes | None] = {}
    for path in sorted(root.rglob("*")):
        out[path.relative_to(root).as_posix()] = path.read_bytes() if path.is_file() else None
    return out


def check_merge(work: Path, *shards: Path) -> None:
    """The property: a documented exit within the limits, nothing written but ``-o``."""
    out = work / "out" / "m.kiln.tar.zst"
    (work / "tmp").mkdir()
    before = snapshot(work)
    proc = limited_cli(
        work, "merge", *shards, "-o", out, "--partial", env={"TMPDIR": str(work / "tmp")}
    )
    assert proc.returncode in EXITS, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    after = snapshot(work)
    outside = {k: v for k, v in after.items() if k != "out" and not k.startswith("out/")}
    assert outside == before
    made = sorted(k for k in after if k.startswith("out/"))
    assert made == (["out/m.kiln.tar.zst"] if proc.returncode == 0 else []), made
    if proc.returncode == 0:
        read_manifest(out)  # what was written is an artifact restore reads


def _shard(work: Path, **blobs: bytes) -> Path:
    return shard_artifact(work, SPEC, 1, 2, name="fuzzed", **blobs)


# --- the blobs: any precompiled forwards, any Mega-Cache bytes --------------------------------

pickle_ops = st.lists(
    st.one_of(
        st.sampled_from([b"]", b"(", b"a", b"e", b"\x94", b".", b"\x80\x04", b"\x80\x05"]),
        st.binary(max_size=8).map(lambda d: b"C" + bytes([len(d)]) + d),
        st.binary(max_size=8).map(lambda d: b"B" + struct.pack("<I", len(d)) + d),
        st.integers(0, 2**64 - 1).map(lambda n: b"\x8e" + struct.pack("<Q", n)),
        st.integers(0, 2**32 - 1).map(lambda n: b"r" + struct.pack("<I", n)),
        st.integers(0, 2**32 - 1).map(lambda n: b"j" + struct.pack("<I", n)),
        st.integers(0, 255).map(lambda n: b"h" + bytes([n])),
        st.integers(0, 255).map(lambda n: b"q" + bytes([n])),
        st.integers(0, 2**64 - 1).map(lambda n: b"\x95" + struct.pack("<Q", n)),
        st.binary(min_size=1, max_size=4),
        # what made unpickling costly: a huge memo index, marks and references by the million
        st.sampled_from([b"r\x00\x00\x00\x10", b"r\xff\xff\xff\x7f", b"j\xff\xff\xff\x7f"]),
        st.integers(1, 1_000_000).map(lambda n: b"(" * n),
        st.integers(1, 500_000).map(lambda n: b"h\x01a" * n),
    ),
    max_size=40,
).map(b"".join)


# Found by hand before this fuzzer (issue 27): a 2 GiB memo, 200 GB of hashing. Always run.
HUGE_MEMO = b"\x80\x04]r\x00\x00\x00\x10."
SHARED_REFERENCE = (
    b"\x80\x04]\x94B\x00\x00\x10\x00" + b"x" * (1 << 20) + b"\x94a" + b"h\x01a" * 200_000
)


@LIMITED
@given(pickle_ops | mutated_bytes(PRECOMPILED))
@example(HUGE_MEMO)
@example(SHARED_REFERENCE + b".")
def test_any_precompiled_forwards(data: bytes) -> None:
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        work = Path(tmp)
        check_merge(work, GOOD, _shard(work, precompiled=data, megacache=MEGACACHE))


@st.composite
def megacache_bytes(draw: st.DrawFn) -> bytes:
    """A mutated Mega-Cache blob, its CRC recomputed more often than not (else it stops there);
    or one of up to 400,000 empty artifacts (4M took 1.2 GB and 40 s to read)."""
    if draw(st.integers(0, 3)) == 0:
        return _megacache([("", b"")] * draw(st.integers(0, 400_000)))
    data = draw(mutated_bytes(MEGACACHE))
    if len(data) > 4 and draw(st.booleans()):
        data = struct.pack(">I", zlib.crc32(data[4:])) + data[4:]
    return data


@LIMITED
@given(megacache_bytes())
@example(_megacache([("", b"")] * 400_000))
def test_any_megacache_blob(data: bytes) -> None:
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        work = Path(tmp)
        check_merge(work, GOOD, _shard(work, precompiled=PRECOMPILED, megacache=data))


# --- the shard itself: its manifest, its archive bytes ------------------------------------------

FUZZED = _shard(ROOT, precompiled=PRECOMPILED, megacache=MEGACACHE)
FUZZED_MANIFEST = read_manifest(FUZZED).model_dump(mode="json")
FUZZED_FILES = {
    f["path"]: (ROOT / "root-fuzzed" / f["path"]).read_bytes() for f in FUZZED_MANIFEST["files"]
}
SHARD_KEYS = ["files", "grid", "shard", "megacache", "precompiled", "bytecode", "spec", "name",
              "fingerprint", "created", "format", "distributed", "copies"]  # fmt: skip
ENTRY_KEYS = ["path", "size", "sha256", "kind", "source", "source_hash"]
_GOOD_ONLY = sorted({f.path for f in read_manifest(GOOD).files} - set(FUZZED_FILES))
# Paths the other shard has as files (here: folders) or folders (here: files), and others.
CLASHING = [
    *(f"{p}/x" for p in _GOOD_ONLY),
    *(p.rsplit("/", 1)[0] for p in _GOOD_ONLY),
    "bytecode/usr/lib/python3.12/a.cpython-312.pyc",
    "inductor/fxgraph",
]


@st.composite
def mutated_shards(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, bytes]]:
    data = json.loads(json.dumps(FUZZED_MANIFEST))
    files = dict(FUZZED_FILES)
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(["entry", "top", "clash"]))
        entries = data.get("files") if isinstance(data.get("files"), list) else []
        if where == "entry" and entries:
            entry = entries[draw(st.integers(0, len(entries) - 1))]
            if isinstance(entry, dict):
                entry[draw(st.sampled_from(ENTRY_KEYS))] = draw(odd_values)
        elif where == "top":
            data[draw(st.sampled_from(SHARD_KEYS))] = draw(odd_values)
        elif isinstance(data.get("files"), list):  # a listed file at a path the other shard uses
            path, content = draw(st.sampled_from(CLASHING)), draw(st.binary(max_size=16))
            data["files"].append(
                {
                    "path": path,
                    "size": len(content),
                    "sha256": hashlib.sha256(content).hexdigest(),
                    "kind": draw(st.sampled_from(["other", "bytecode", "megacache", "fxgraph"])),
                }
            )
            files[path] = content
    return data, files


def _clash(path: str) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The shard with one more file, at ``path``."""
    data = json.loads(json.dumps(FUZZED_MANIFEST))
    entry = {"path": path, "size": 1, "sha256": hashlib.sha256(b"x").hexdigest(), "kind": "other"}
    data["files"].append(entry)
    return data, {**FUZZED_FILES, path: b"x"}


@LIMITED
@given(mutated_shards())
@example(_clash(CLASHING[0]))  # a file inside what the other shard has as a file (issue 27)
@example(_clash(CLASHING[len(_GOOD_ONLY)]))  # a file where the other shard has a folder
def test_any_shard_manifest(shard: tuple[dict[str, Any], dict[str, bytes]]) -> None:
    data, files = shard
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        work = Path(tmp)
        art = write_archive(
            work / "fuzzed.kiln.tar.zst", data, [reg(p, d) for p, d in sorted(files.items())]
        )
        check_merge(work, GOOD, art)


VALID_TAR = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(FUZZED.read_bytes())).read()


@LIMITED
@given(mutated_bytes(VALID_TAR))
def test_any_shard_bytes(data: bytes) -> None:
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        work = Path(tmp)
        art = work / "fuzzed.kiln.tar.zst"
        art.write_bytes(zstandard.ZstdCompressor().compress(data))
        check_merge(work, GOOD, art)


def test_the_valid_shards_merge_within_the_limits() -> None:
    """The property's baseline: the unmutated shards merge (exit 0) under the same limits."""
    with tempfile.TemporaryDirectory(dir=ROOT) as tmp:
        work = Path(tmp)
        out = work / "out" / "m.kiln.tar.zst"
        proc = limited_cli(work, "merge", GOOD, FUZZED, "-o", out)
        assert proc.returncode == 0, proc.stderr
        merged = read_manifest(out)
        assert merged.precompiled == "precompiled.bin" and merged.megacache == "megacache.bin"
