"""Local paths and ``file://`` URLs: read in place, pushed by an atomic copy.

A local artifact is not copied before it is unpacked: it is opened once, hashed through that
descriptor, rewound, and unpacked from the same descriptor (restore hashes it again as it reads),
so replacing the path in between changes nothing.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path
from typing import IO, BinaryIO

from kiln.artifact.storage.base import (
    ByteSink,
    Deadline,
    Digest,
    FetchedFile,
    PushResult,
    Select,
    Store,
    copy_hashing,
)
from kiln.errors import NotFoundError, UsageError
from kiln.files import atomic_write


def local_path(url: str) -> Path:
    """The path of ``file:///x`` or of a plain path."""
    _, sep, rest = url.partition("://")
    return Path(rest if sep else url)


def open_regular(path: Path, source: str) -> BinaryIO:
    """Open a local artifact for reading, refusing anything but a regular file.

    ``O_NONBLOCK`` keeps a FIFO swapped in for the file from blocking the open forever; the type
    is checked on the open descriptor (``fstat``), so there is no window between check and use.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
    try:
        fd = os.open(path, flags)
    except (FileNotFoundError, NotADirectoryError):
        raise NotFoundError(f"{source}: no such artifact") from None
    except OSError as exc:
        raise UsageError(f"{source}: cannot open: {exc.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "folder" if stat.S_ISDIR(mode) else "special file"
            raise UsageError(f"{source}: is a {kind}, not an artifact file")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class FileStore(Store):
    """A filesystem path. Local reads are not downloads: no deadline applies to them."""

    def open(
        self,
        url: str,
        workdir: Path,
        *,
        deadline: Deadline,
        on_bytes: ByteSink | None,
        select: Select | None = None,
    ) -> FetchedFile:
        path = local_path(url)
        fh = open_regular(path, url)
        try:
            total = os.fstat(fh.fileno()).st_size
            sha, size = copy_hashing(fh.read, None, total=total, on_bytes=on_bytes)
            fh.seek(0)
        except BaseException:
            fh.close()
            raise
        return FetchedFile(path, sha, size, downloaded=False, file=fh)

    def fetch(
        self, url: str, into: IO[bytes], *, deadline: Deadline, on_bytes: ByteSink | None
    ) -> Digest:
        with open_regular(local_path(url), url) as fh:
            total = os.fstat(fh.fileno()).st_size
            return copy_hashing(fh.read, into, total=total, on_bytes=on_bytes)

    def push(self, src: Path, url: str) -> PushResult:
        """Copy ``src`` to ``url`` atomically. A destination ending in ``/``, or an existing
        folder, is a folder: it is created if needed and the artifact keeps its own name in
        it (as ``s3://bucket/prefix/`` does), rather than becoming a file named after it."""
        target = local_path(url)
        if url.endswith("/") or target.is_dir():
            target = target / src.name
        with open(src, "rb") as fh, atomic_write(target) as out:
            sha, size = copy_hashing(fh.read, out)
        return PushResult(str(target), sha, size)
