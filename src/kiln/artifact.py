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
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, BinaryIO

import zstandard
from pydantic import ValidationError

from kiln.errors import IntegrityError, NotFoundError, UsageError
from kiln.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest

SUFFIX = ".kiln.tar.zst"
ZSTD_LEVEL = 6
# threads >= 1 give identical bytes for any count; 0 (single-threaded API) gives other bytes.
ZSTD_THREADS = 2
MAX_MANIFEST_BYTES = 64 << 20
_CHUNK = 1 << 20


def source_date_epoch() -> int:
    """The fixed mtime for members: SOURCE_DATE_EPOCH (reproducible-builds convention) or 0."""
    try:
        return int(os.environ.get("SOURCE_DATE_EPOCH", "0"))
    except ValueError:
        return 0


def _tarinfo(name: str, size: int, mtime: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = mtime  # int: a float would add PAX mtime records and break determinism
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info


class _HashingWriter(io.RawIOBase):
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


def write_artifact(
    out: Path,
    manifest: Manifest,
    root: Path,
    *,
    on_bytes: Callable[[int], None] | None = None,
) -> tuple[str, int]:
    """Pack ``manifest.files`` (paths relative to ``root``) into ``out`` atomically.

    Writes to a temporary file beside ``out`` and renames it into place only when complete, so
    a crash or Ctrl-C never leaves a truncated artifact at ``out``. Returns (sha256, size).
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    mtime = source_date_epoch()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as raw:
            hashing = _HashingWriter(raw)
            cctx = zstandard.ZstdCompressor(
                level=ZSTD_LEVEL, threads=ZSTD_THREADS, write_checksum=True
            )
            with (
                cctx.stream_writer(hashing, closefd=False) as zw,
                tarfile.open(fileobj=zw, mode="w|", format=tarfile.PAX_FORMAT) as tar,
            ):
                body = manifest.to_bytes()
                tar.addfile(_tarinfo(MANIFEST_NAME, len(body), mtime), io.BytesIO(body))
                for entry in sorted(manifest.files, key=lambda e: e.path):
                    src = root / entry.path
                    with open(src, "rb") as fh:
                        reader = _CheckedReader(fh, entry.path, entry.size, entry.sha256)
                        tar.addfile(_tarinfo(entry.path, entry.size, mtime), reader)
                        reader.finish()
                    if on_bytes:
                        on_bytes(entry.size)
            raw.flush()
            os.fsync(raw.fileno())
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o666 & ~umask)  # mkstemp made it 0600; an artifact is meant to be shared
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return hashing.sha.hexdigest(), hashing.size


class _CheckedReader:
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
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
            if on_bytes:
                on_bytes(len(chunk))
    return h.hexdigest()


@contextlib.contextmanager
def open_tar_stream(fh: IO[bytes]) -> Iterator[tarfile.TarFile]:
    """A streaming (``r|``) tar reader over zstd: no seeking, so it works on HTTP bodies too."""
    dctx = zstandard.ZstdDecompressor()
    with (
        dctx.stream_reader(fh, closefd=False) as zr,
        tarfile.open(fileobj=zr, mode="r|", format=tarfile.PAX_FORMAT) as tar,
    ):
        yield tar


def parse_manifest(data: bytes) -> Manifest:
    try:
        manifest = Manifest.model_validate_json(data)
    except ValidationError as exc:
        raise IntegrityError(
            f"manifest.json is not a kiln manifest: {exc.errors()[0]['msg']}"
        ) from None
    if manifest.format > FORMAT_VERSION:
        raise UsageError(
            f"artifact format {manifest.format} is newer than this kiln understands "
            f"({FORMAT_VERSION}): upgrade kiln"
        )
    return manifest


def read_manifest_member(tar: tarfile.TarFile) -> Manifest:
    """Read the first member, which must be ``manifest.json``."""
    try:
        first = tar.next()
    except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
        raise IntegrityError(f"not a readable kiln artifact: {exc}") from None
    if first is None or first.name != MANIFEST_NAME or not first.isreg():
        raise IntegrityError("not a kiln artifact: manifest.json is not the first member")
    if first.size > MAX_MANIFEST_BYTES:
        raise IntegrityError("manifest.json is implausibly large")
    fh = tar.extractfile(first)
    assert fh is not None
    try:
        data = fh.read()
    except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
        raise IntegrityError(f"artifact truncated in manifest.json: {exc}") from None
    return parse_manifest(data)


def read_manifest(path: str | Path) -> Manifest:
    """The manifest of an artifact file, or of a restored folder. Decompresses only what
    precedes the payload, so it is instant even for multi-GB artifacts."""
    p = Path(path)
    if p.is_dir():
        m = p / MANIFEST_NAME
        if not m.is_file():
            raise NotFoundError(f"{p}: no {MANIFEST_NAME} (not a restored kiln folder)")
        return parse_manifest(m.read_bytes())
    if not p.exists():
        raise NotFoundError(f"{p}: no such artifact")
    try:
        with open(p, "rb") as fh, open_tar_stream(fh) as tar:
            return read_manifest_member(tar)
    except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
        raise IntegrityError(f"{p}: not a readable kiln artifact: {exc}") from None
