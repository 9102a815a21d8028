"""Unpacking a hostile archive into a staging folder: only what the manifest lists, checked.

The manifest (first member) is the allow-list: only regular files and folders it names, with
the sizes and sha256 it gives, are written, by kiln, never by ``tarfile.extract`` (whose
filters have had escapes). The staged tree is checked once more right before it is swapped in.
Torch-free.
"""

from __future__ import annotations

import hashlib
import os
import queue
import shutil
import stat
import tarfile
import threading
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO, Protocol, TypeVar

import zstandard

from kiln.artifact.archive import open_tar_stream, read_manifest_member
from kiln.artifact.manifest import FileEntry, Manifest, path_problem
from kiln.artifact.swap import STAGING_INFIX
from kiln.bytecode import header_problem
from kiln.errors import IntegrityError, KilnError
from kiln.events import EventSink, Extracting
from kiln.files import CHUNK
from kiln.layout import LOCKS_TARGET, RESERVED_NAMES, lock_links

_QUEUE = 16  # chunks in flight between the decompressing and the writing thread
_HEADROOM = 1 << 20


class HashingReader:
    """Hashes every byte the decompressor reads from ``fh``, then the rest of the file.

    :meth:`finish` is thus the digest of exactly the bytes that were unpacked (plus any trailing
    bytes the archive reader never needed), however the file changed on disk meanwhile.
    """

    def __init__(self, fh: BinaryIO) -> None:
        self._fh = fh
        self._h = hashlib.sha256()
        self.size = 0  # bytes hashed so far

    def read(self, n: int = -1) -> bytes:
        data = self._fh.read(n)
        self._h.update(data)
        self.size += len(data)
        return data

    def readinto(self, buf: Any) -> int:
        n = self._fh.readinto(buf)
        self._h.update(memoryview(buf)[:n])
        self.size += n
        return n

    def finish(self) -> str:
        while chunk := self._fh.read(CHUNK):
            self._h.update(chunk)
            self.size += len(chunk)
        return self._h.hexdigest()


def check_stage(tree: Path, dest: Path, manifest: Manifest) -> None:
    """The staged tree must be exactly what the manifest lists, right before it is swapped in.

    The extractor wrote and checked every file, but the staging folder sits beside DEST where
    other processes can reach it; a tree missing files (or with others added) is never swapped.
    """
    expected = {f.path: f.size for f in manifest.entries()}
    own = RESERVED_NAMES
    links = set(lock_links(manifest.rank_world))
    found: dict[str, int] = {}
    odd: list[str] = []
    for root, dirs, files in os.walk(tree):
        for name in (*dirs, *files):
            full = Path(root, name)
            st = full.lstat()
            rel = full.relative_to(tree).as_posix()
            if stat.S_ISREG(st.st_mode):
                found[rel] = st.st_size
            elif stat.S_ISLNK(st.st_mode) and rel in links and str(full.readlink()) == LOCKS_TARGET:
                continue
            elif not stat.S_ISDIR(st.st_mode):
                odd.append(rel)
    missing = sorted((set(expected) | own) - set(found))
    wrong = sorted(p for p, size in expected.items() if p in found and found[p] != size)
    extra = sorted(set(found) - set(expected) - own) + odd
    if missing or wrong or extra:
        problems = [
            f"{len(items)} file(s) {what}, e.g. {items[0]!r}"
            for items, what in (
                (missing, "missing"),
                (wrong, "of the wrong size"),
                (extra, "unlisted"),
            )
            if items
        ]
        raise IntegrityError(
            f"{dest}: the staged tree does not match the manifest ({'; '.join(problems)}): "
            "another process changed it; nothing was changed"
        )


def require_space(where: Path, need: int, what: str) -> None:
    free = shutil.disk_usage(where).free
    if free < need + _HEADROOM:
        shown = next((p for p in where.parents if STAGING_INFIX not in p.name), where)
        raise KilnError(
            f"{shown}: not enough free space for {what}: need {_mib(need + _HEADROOM)}, "
            f"have {_mib(free)}; nothing was changed"
        )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def safe_member_name(name: str) -> str:
    """The member name if it is a plain relative path, else raise :class:`IntegrityError`."""
    problem = path_problem(name.rstrip("/") or name)  # the manifest's rule, bounds included
    if problem:
        raise IntegrityError(problem)
    return name.rstrip("/")


class _Listed(Protocol):
    @property
    def size(self) -> int: ...


_L = TypeVar("_L", bound=_Listed)


def listed_member(
    member: tarfile.TarInfo, name: str, listed: Mapping[str, _L], seen: set[str], listing: str
) -> _L:
    """``member``'s entry in ``listed`` (a manifest's files, a bundle's variants); exit 3 unless
    it is a regular file, listed, met once, at its listed size. One rule for every reader of an
    untrusted tar stream, so a bundle is held to what an artifact is."""
    if not member.isreg():
        raise IntegrityError(f"{name!r} is a {_member_kind(member)}, not a regular file: refused")
    entry = listed.get(name)
    if entry is None:
        raise IntegrityError(f"{name!r} is not in {listing}")
    if name in seen:
        raise IntegrityError(f"{name!r} appears twice in the archive")
    seen.add(name)
    if member.size != entry.size:
        raise IntegrityError(f"{name!r} is {member.size} bytes, {listing} says {entry.size}")
    return entry


def _member_kind(m: tarfile.TarInfo) -> str:
    if m.issym():
        return "symlink"
    if m.islnk():
        return "hardlink"
    if m.ischr() or m.isblk():
        return "device"
    if m.isfifo():
        return "fifo"
    return f"type {m.type!r}"


class _FileWriter:
    """Hashes and writes extracted files on a second thread.

    Decompression (zstd), hashing (hashlib) and writes all release the GIL, so the reader thread
    can inflate the next chunk while this one hashes and writes the last: the restore runs at the
    slower of the two instead of their sum. The queue is bounded (memory stays ~_QUEUE chunks),
    and the first error is raised in the reader on its next call.
    """

    def __init__(self) -> None:
        self._queue: queue.Queue[tuple[str, Any] | None] = queue.Queue(maxsize=_QUEUE)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kiln-restore-writer", daemon=True)
        self._thread.start()

    def begin(self, target: Path, entry: FileEntry) -> None:
        self._put(("begin", (target, entry)))

    def write(self, chunk: bytes) -> None:
        self._put(("data", chunk))

    def end(self) -> None:
        self._put(("end", None))

    def close(self) -> None:
        """Wait for every queued byte; raise what the writer hit."""
        self.close_quietly()
        self._check()

    def close_quietly(self) -> None:
        """Stop the thread (idempotent); on the error path the caller's exception wins."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _put(self, item: tuple[str, Any]) -> None:
        self._check()
        self._queue.put(item)

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        out: BinaryIO | None = None
        h = hashlib.sha256()
        entry: FileEntry | None = None
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue  # drain, so a reader blocked on a full queue can go on and see it
            kind, payload = item
            try:
                if kind == "begin":
                    target, entry = payload
                    target.parent.mkdir(parents=True, exist_ok=True)
                    # Open across queue items, closed on "end" or on the way out.
                    out, h = open(target, "xb"), hashlib.sha256()  # noqa: SIM115
                elif kind == "data":
                    assert out is not None
                    h.update(payload)
                    out.write(payload)
                else:
                    assert out is not None and entry is not None
                    out.close()
                    out = None
                    if h.hexdigest() != entry.sha256:
                        raise IntegrityError(f"{entry.path!r}: sha256 differs from the manifest")
            except BaseException as exc:
                self._error = exc
                if out is not None:
                    out.close()
                    out = None
        if out is not None:
            out.close()


def extract(fh: Any, tree: Path, emit: EventSink) -> Manifest:
    """Unpack the artifact read from ``fh`` into ``tree``: what its manifest lists, checked."""
    try:
        with open_tar_stream(fh) as tar:
            return extract_members(tar, read_manifest_member(tar), tree, emit)
    except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
        raise IntegrityError(f"artifact is corrupt or truncated: {exc}") from None


def extract_members(
    tar: tarfile.TarFile, manifest: Manifest, tree: Path, emit: EventSink
) -> Manifest:
    """The members after ``manifest.json`` (already read from ``tar``), written into ``tree``."""
    writer = _FileWriter()
    try:
        allowed = {f.path: f for f in manifest.files}
        dirs = {str(parent) for f in manifest.files for parent in PurePosixPath(f.path).parents}
        for f in allowed:
            safe_member_name(f)
        # Copies are written after the archive's files: the space covers both.
        require_space(tree, manifest.total_bytes, f"{len(manifest.entries())} files")
        total = manifest.stored_bytes
        emit(Extracting(bytes=0, total=total))
        seen: set[str] = set()
        done = 0
        for index, member in enumerate(tar):
            if index == 0:
                continue  # manifest.json, already read (a streaming TarFile yields it again)
            name = safe_member_name(member.name)
            if member.isdir():
                if name not in dirs:
                    raise IntegrityError(f"folder {name!r} is not in the manifest")
                continue
            entry = listed_member(member, name, allowed, seen, "the manifest")
            src = tar.extractfile(member)
            assert src is not None
            writer.begin(tree / name, entry)
            while chunk := src.read(CHUNK):
                writer.write(chunk)
            writer.end()
            done += entry.size
            emit(Extracting(bytes=done, total=total))
        writer.close()
    except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
        raise IntegrityError(f"artifact is corrupt or truncated: {exc}") from None
    finally:
        writer.close_quietly()
    missing = sorted(set(allowed) - seen)
    if missing:
        raise IntegrityError(f"artifact is missing {len(missing)} file(s), e.g. {missing[0]!r}")
    write_copies(tree, manifest)
    check_bytecode(tree, manifest)
    return manifest


def check_bytecode(tree: Path, manifest: Manifest) -> None:
    """Each pyc unpacked under ``bytecode/`` is a checked-hash pyc of the source hash its entry
    names (the manifest checked path, source and kind): Python compares it with the installed
    source before using it. An unchecked one would be imported as it is, whatever the source
    says; exit 3 before the swap."""
    for entry in manifest.files:
        if entry.kind != "bytecode" or entry.source_hash is None:
            continue
        with open(tree / entry.path, "rb") as fh:
            problem = header_problem(fh.read(16), entry.source_hash)
        if problem:
            raise IntegrityError(f"bytecode {entry.path!r}: {problem}: refused")


def write_copies(tree: Path, manifest: Manifest) -> None:
    """Write each of the manifest's copies from its stored file, already unpacked and checked.

    A copy is a new regular file (``open(..., "xb")``: never through a link, never over an
    existing file), read from its source without following links, and hashed as it is written
    against the source's manifest entry: a source changed on disk meanwhile is exit 3, not a
    wrong file installed. Copies, not links: a serving rank that writes into its cache folder
    (a miss) can never change another rank's files.
    """
    stored = {f.path: f for f in manifest.files}
    for copy in manifest.copies:
        entry = stored[copy.source]  # the manifest's own rule: a copy's source is stored
        target = tree / safe_member_name(copy.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tree / safe_member_name(copy.source), flags)
        h = hashlib.sha256()
        with os.fdopen(fd, "rb") as src, open(target, "xb") as out:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise IntegrityError(f"{copy.source!r}: not a regular file in the staged tree")
            while chunk := src.read(CHUNK):
                h.update(chunk)
                out.write(chunk)
        if h.hexdigest() != entry.sha256:
            raise IntegrityError(f"{copy.path!r}: its copy's sha256 differs from the manifest")
