"""File helpers shared by both worlds: the copy chunk size and the atomic write. Torch-free.

Every file kiln hands to someone else (an artifact, a pushed copy, ``kiln.env`` for ``--env-file``,
verify's ``--ready-file``) is written the same way: into a temporary file beside the target, made
durable, then renamed over the target in one step. A reader (a Kubernetes probe, a restore, a CI
step) therefore sees the old file or the new one, never a half-written one, even if kiln is
killed mid-write.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

CHUNK = 1 << 20  # bytes per read when copying, hashing or unpacking: large enough, never huge

_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@contextlib.contextmanager
def atomic_write(target: str | Path) -> Iterator[BinaryIO]:
    """A binary file to write ``target`` through: it replaces ``target`` only if the block ends
    without an exception.

    The temporary file is created beside ``target`` (same filesystem, so ``os.replace`` is one
    atomic rename), named ``.NAME.RANDOM.tmp`` with ``O_EXCL`` (never an existing file or link),
    and with mode ``0o666`` less the umask, as ``open`` would make ``target``. Its data is
    fsynced before the rename and the folder after it, so a crash leaves the old file or the
    complete new one. On failure the temporary file is removed and the error propagates.
    ``target``'s parent folders are created.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, _TMP_FLAGS, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_folder(target.parent)


def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable. Best effort: some filesystems refuse a folder fsync,
    and the rename itself has already happened."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
