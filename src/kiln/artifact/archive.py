"""The artifact file: a deterministic, zstd-compressed PAX tar with ``manifest.json`` first.

Plain ``tar --zstd -xf`` can read it, so nobody is locked in. Determinism (sorted members, fixed
mtime/owner/mode, fixed compression parameters) makes the digest a content address: packing the
same cache twice gives the same bytes, so CI can pin it and restores can skip what they have.
Manifest-first lets ``inspect`` and ``restore`` decide before reading a byte of payload.
Torch-free.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, BinaryIO

import zstandard
from pydantic import ValidationError

from kiln.artifact.manifest import (
    FORMAT_VERSION,
    Manifest,
    first_problem,
    folders_of,
)
from kiln.errors import (
    IntegrityError,
    NotAnArtifactError,
    NotFoundError,
    ParameterError,
    UsageError,
)
from kiln.files import CHUNK, atomic_write
from kiln.layout import MANIFEST_NAME, MAX_MANIFEST_BYTES, CacheLayout

ARTIFACT_SUFFIX = ".kiln.tar.zst"  # NAME.kiln.tar.zst: an artifact or a bundle (the same format)
# Every zstd frame starts with these bytes: a file without them is no artifact (nor bundle).
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
NOT_ZSTD = (
    "not a kiln artifact (not zstd data: kiln bake, merge and bundle write .kiln.tar.zst files)"
)
ZSTD_LEVEL = 6
# threads >= 1 give identical bytes for any count; 0 (single-threaded API) gives other bytes.
ZSTD_THREADS = 2
# The most one member's headers (ustar + PAX/GNU extensions) may take. A kiln member's path is at
# most 1 KiB, so its headers fit in ~2 KiB; tarfile reads a PAX header whole into memory, and
# follows a chain of them by recursion, so without a bound a 1 KB archive could ask for gigabytes
# or overflow the stack.
MAX_HEADER_BYTES = 64 << 10
# What tarfile may raise on malformed input besides TarError (a PAX number that does not parse,
# an over-long header chain, ...): all of it means a corrupt archive, never a bug in kiln.
TAR_FAULTS = (
    tarfile.TarError,
    zstandard.ZstdError,
    EOFError,
    ValueError,
    OverflowError,
    RecursionError,
)


def source_date_epoch() -> int:
    """The fixed mtime for members: SOURCE_DATE_EPOCH (reproducible-builds convention) or 0."""
    try:
        return int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    except ValueError:
        return 0


def tar_member(name: str, size: int, mtime: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = mtime  # int: a float would add PAX mtime records and break determinism
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


class HashingWriter(io.RawIOBase):
    """Counts and hashes what the compressor writes, so the digest costs no second read."""

    def __init__(self, fh: BinaryIO) -> None:
        self._fh = fh
        self.sha = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.sha.update(data)
        self.size += len(data)
        return self._fh.write(data)


def artifact_target(out: str | Path, name: str) -> Path:
    """Where an artifact named ``name`` (``NAME.kiln.tar.zst``) is written for ``out``: inside
    ``out`` when it is an existing folder or ends in ``/`` (as ``kiln push`` keeps the name),
    else ``out`` itself. Raises :class:`~kiln.errors.ParameterError` (exit 2) when it could not
    be written there: called before the work that makes the artifact (a bake takes minutes),
    not after it."""
    target = Path(out) / name if str(out).endswith("/") or Path(out).is_dir() else Path(out)
    if target.is_dir():
        raise ParameterError("out", str(out), f"{target} is a folder")
    folder = target.parent.absolute()
    while not os.path.lexists(folder) and folder != folder.parent:
        folder = folder.parent  # atomic_write makes the missing folders: this one must allow it
    if not folder.is_dir():
        raise ParameterError("out", str(out), f"{folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ParameterError("out", str(out), f"{folder} is not writable")
    return target


def write_artifact(
    out: Path,
    manifest: Manifest,
    root: Path,
    *,
    on_bytes: Callable[[int], None] | None = None,
) -> tuple[str, int]:
    """Pack ``manifest.files`` (paths relative to ``root``) into ``out`` atomically.

    Writes through :func:`kiln.files.atomic_write`, so a crash or Ctrl-C never leaves a
    truncated artifact at ``out``. Returns (sha256, size).
    """
    mtime = source_date_epoch()
    with atomic_write(out) as raw:
        hashing = HashingWriter(raw)
        cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=ZSTD_THREADS, write_checksum=True)
        with (
            cctx.stream_writer(hashing, closefd=False) as zw,
            tarfile.open(fileobj=zw, mode="w|", format=tarfile.PAX_FORMAT) as tar,
        ):
            body = manifest.to_bytes()
            if len(body) > MAX_MANIFEST_BYTES:
                raise UsageError(
                    f"{len(manifest.files)} files make a {len(body) >> 20} MiB manifest, "
                    f"more than restore accepts ({MAX_MANIFEST_BYTES >> 20} MiB): "
                    "bake fewer buckets per artifact"
                )
            tar.addfile(tar_member(MANIFEST_NAME, len(body), mtime), io.BytesIO(body))
            for entry in sorted(manifest.files, key=lambda e: e.path):
                src = root / entry.path
                with open(src, "rb") as fh:
                    reader = CheckedReader(fh, entry.path, entry.size, entry.sha256)
                    tar.addfile(tar_member(entry.path, entry.size, mtime), reader)
                    reader.finish()
                if on_bytes:
                    on_bytes(entry.size)
    return hashing.sha.hexdigest(), hashing.size


class CheckedReader:
    """Feeds tarfile while re-hashing: a file changed after capture must not ship silently."""

    def __init__(self, fh: BinaryIO, name: str, size: int, sha256: str) -> None:
        self._fh, self._name, self._size, self._sha = fh, name, size, sha256
        self._h = hashlib.sha256()
        self._n = 0

    def read(self, n: int = -1) -> bytes:
        data = self._fh.read(n)
        if (n < 0 or len(data) < n) and self._n + len(data) < self._size:
            raise IntegrityError(f"{self._name} changed while packing the artifact")
        self._h.update(data)
        self._n += len(data)
        return data

    def finish(self) -> None:
        if self._n != self._size or self._h.hexdigest() != self._sha:
            raise IntegrityError(f"{self._name} changed while packing the artifact")


def sha256_file(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    with open(path, "rb") as fh:
        return sha256_of(fh, on_bytes)


def sha256_of(fh: IO[bytes], on_bytes: Callable[[int], None] | None = None) -> str:
    """The sha256 of what is left to read in ``fh`` (an open file: hashed once, by descriptor)."""
    h = hashlib.sha256()
    while chunk := fh.read(CHUNK):
        h.update(chunk)
        if on_bytes:
            on_bytes(len(chunk))
    return h.hexdigest()


class _BoundedReader:
    """The decompressed stream under tarfile, refusing to be read past a moving limit.

    :class:`_BoundedTarFile` sets the limit before each header (its start plus
    ``MAX_HEADER_BYTES``) and after it (the end of that member's data), so no header, and no
    member the reader did not ask for, can make tarfile buffer more than that.
    """

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self.pos = 0
        self.limit = MAX_HEADER_BYTES
        self.why = "a tar header is implausibly large"

    def read(self, n: int = -1) -> bytes:
        if self.pos >= self.limit:
            raise IntegrityError(f"not a kiln artifact: {self.why}")
        data = self._raw.read(n)
        self.pos += len(data)
        return data


class _BoundedTarFile(tarfile.TarFile):
    """A streaming TarFile that bounds every header and, once the manifest is known, the count
    of members; whatever it meets that is malformed becomes :class:`IntegrityError`."""

    def __init__(self, *args: Any, reader: _BoundedReader, **kwargs: Any) -> None:
        self._reader = reader
        self.max_members: int | None = None  # set by read_manifest_member
        super().__init__(*args, **kwargs)  # reads the first header: self.next() runs already

    def next(self) -> tarfile.TarInfo | None:
        reader = self._reader
        # tarfile's stream reads ahead by one record; allow for it on top of the header bound.
        reader.limit = self.offset + MAX_HEADER_BYTES + tarfile.RECORDSIZE
        reader.why = f"a tar header is larger than {MAX_HEADER_BYTES} bytes"
        try:
            member = super().next()
        except TAR_FAULTS as exc:
            if self.offset == 0:  # not even a first header: zstd data, but no tar in it
                raise NotAnArtifactError(
                    f"not a kiln artifact (zstd, but not a tar: {exc})"
                ) from None
            raise IntegrityError(f"artifact is corrupt or truncated: {exc}") from None
        # Now self.offset is where the next header starts: this member's data lies before it.
        reader.limit = self.offset + tarfile.RECORDSIZE
        reader.why = "a member's data is longer than its header says"
        limit = self.max_members
        if member is not None and limit is not None and len(self.members) > limit:
            raise IntegrityError(
                f"the archive holds more than the {limit} members its manifest accounts for"
            )
        return member


class _Prefixed:
    """A stream whose first bytes were read already (to check them): they come first again."""

    def __init__(self, head: bytes, fh: IO[bytes]) -> None:
        self._head, self._fh = head, fh

    def read(self, size: int = -1) -> bytes:
        if not self._head:
            return self._fh.read(size)
        if size is None or size < 0:
            data, self._head = self._head + self._fh.read(), b""
            return data
        data, self._head = self._head[:size], self._head[size:]
        return data


def _zstd_start(fh: IO[bytes]) -> _Prefixed:
    """``fh`` after checking that it starts as zstd data: a spec, a README or a plain tar given
    where an artifact belongs is :class:`NotAnArtifactError`, not "corrupt or truncated"."""
    head = b""
    while len(head) < len(ZSTD_MAGIC) and (more := fh.read(len(ZSTD_MAGIC) - len(head))):
        head += more
    if head != ZSTD_MAGIC:
        raise NotAnArtifactError("not a kiln artifact (an empty file)" if not head else NOT_ZSTD)
    return _Prefixed(head, fh)


@contextlib.contextmanager
def naming(source: object) -> Iterator[None]:
    """A :class:`NotAnArtifactError` raised inside, with ``source`` (a path, a URL) named."""
    try:
        yield
    except NotAnArtifactError as exc:
        raise NotAnArtifactError(f"{source}: {exc.message}") from None


@contextlib.contextmanager
def open_tar_stream(fh: IO[bytes]) -> Iterator[tarfile.TarFile]:
    """A streaming (``r|``) tar reader over zstd: no seeking, so it works on HTTP bodies too.

    Bounded: see :class:`_BoundedTarFile`. Errors while reading headers are
    :class:`IntegrityError`; reading a member's data may still raise tarfile/zstd errors.
    Data that is not zstd at all is :class:`NotAnArtifactError`.
    """
    dctx = zstandard.ZstdDecompressor()
    with dctx.stream_reader(_zstd_start(fh), closefd=False) as zr:
        reader = _BoundedReader(zr)
        try:
            tar = _BoundedTarFile.open(
                fileobj=reader,  # type: ignore[arg-type]
                mode="r|",
                format=tarfile.PAX_FORMAT,
                reader=reader,
            )
        except TAR_FAULTS as exc:
            raise NotAnArtifactError(f"not a kiln artifact (zstd, but not a tar: {exc})") from None
        with tar:
            yield tar


def parse_manifest(data: bytes) -> Manifest:
    """Validate ``data`` as a manifest: :class:`IntegrityError` (exit 3) for anything the
    :class:`Manifest` model refuses, :class:`UsageError` for a newer format."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise IntegrityError(
            f"manifest.json is {len(data)} bytes, more than kiln reads ({MAX_MANIFEST_BYTES})"
        )
    try:
        manifest = Manifest.model_validate_json(data)
    except ValidationError as exc:
        raise IntegrityError(_validation_message(exc)) from None
    if manifest.format > FORMAT_VERSION:
        raise UsageError(
            f"artifact format {manifest.format} is newer than this kiln understands "
            f"({FORMAT_VERSION}): upgrade kiln"
        )
    return manifest


def _validation_message(exc: ValidationError) -> str:
    """One line for the first problem, naming where it is (``files.3.path``)."""
    if exc.errors()[0]["type"] == "value_error":  # one of the Manifest model's own rules
        return f"manifest.json refused: {first_problem(exc)}"
    return f"manifest.json is not a kiln manifest: {first_problem(exc)}"


def read_index_bytes(tar: tarfile.TarFile, member: tarfile.TarInfo, limit: int, what: str) -> bytes:
    """The bytes of ``member``, an archive's index (an artifact's ``manifest.json``, a bundle's
    ``bundle.json``): refused from its tar header when it is over ``limit``, before a byte of
    it is read; a stream cut inside it is exit 3."""
    if member.size > limit:
        raise IntegrityError(
            f"{member.name} is {member.size} bytes, more than kiln reads ({limit})"
        )
    fh = tar.extractfile(member)
    assert fh is not None
    try:
        return fh.read()
    except TAR_FAULTS as exc:
        raise IntegrityError(f"{what} truncated in {member.name}: {exc}") from None


def first_member(tar: tarfile.TarFile) -> tarfile.TarInfo | None:
    """The archive's first member (None for an empty archive): ``manifest.json`` in an artifact,
    ``bundle.json`` in a bundle (:mod:`kiln.artifact.bundle`), which is how readers tell them
    apart from one stream."""
    try:
        return tar.next()
    except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
        raise IntegrityError(f"not a readable kiln artifact: {exc}") from None


def read_manifest_member(tar: tarfile.TarFile, first: tarfile.TarInfo | None = None) -> Manifest:
    """Read the first member, which must be ``manifest.json``, refusing an implausible size from
    its header before reading it. Then bound the rest of the archive by what the manifest lists.
    ``first`` is that member when the caller already read its header (:func:`first_member`)."""
    if first is None:
        first = first_member(tar)
    if first is None or first.name != MANIFEST_NAME or not first.isreg():
        raise NotAnArtifactError("not a kiln artifact: manifest.json is not the first member")
    manifest = parse_manifest(read_index_bytes(tar, first, MAX_MANIFEST_BYTES, "artifact"))
    if isinstance(tar, _BoundedTarFile):
        # The manifest, each listed file, and at most one entry per folder they need.
        folders = folders_of([f.path for f in manifest.files])
        tar.max_members = 1 + len(manifest.files) + len(folders)
    return manifest


def read_manifest(path: str | Path) -> Manifest:
    """The manifest of an artifact file, or of a restored folder. Decompresses only what
    precedes the payload, so it is instant even for multi-GB artifacts."""
    p = Path(path)
    if p.is_dir():
        m = CacheLayout(p).manifest
        if not m.is_file():
            raise NotFoundError(f"{p}: no {MANIFEST_NAME} (not a restored kiln folder)")
        with open(m, "rb") as fh:
            data = fh.read(MAX_MANIFEST_BYTES + 1)  # parse_manifest refuses what is longer
        return parse_manifest(data)
    if not p.exists():
        raise NotFoundError(f"{p}: no such artifact file or restored folder")
    try:
        with naming(p), open(p, "rb") as fh, open_tar_stream(fh) as tar:
            return read_manifest_member(tar)
    except TAR_FAULTS as exc:
        raise IntegrityError(f"{p}: not a readable kiln artifact: {exc}") from None
