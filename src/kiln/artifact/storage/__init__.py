"""Where artifacts live: local paths, HTTP(S), and (through extras) S3, GCS and OCI registries.

Every source is turned into one *open* local file whose sha256 was computed while it was read, so
restore can refuse a wrong digest before unpacking a byte, and then unpack from that same open
file (a path can be replaced between two opens; an open file cannot). Downloads run under a
:class:`Deadline`: a total budget (``kiln restore --timeout``) and an idle limit per wait, so a
server that stalls or trickles cannot hold an init container forever.

Each backend is a :class:`Store` in its own module (``file``, ``http``, ``cloud``, ``oci``),
found through the static :data:`BACKENDS` table and imported only when a URL of its scheme is
used: a slim init container that restores from S3 needs neither oras nor (for a local file) even
the HTTP client. Nothing registers itself at import time, and no backend imports this package's
``__init__``: they share only :mod:`kiln.artifact.storage.base`. Torch-free.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from kiln.artifact.storage.base import (
    DEFAULT_TIMEOUT,
    ByteSink,
    CappedBuffer,
    Deadline,
    FetchedFile,
    PushResult,
    Select,
    Store,
    check_digest,
    check_timeout,
    parse_digest,
    scheme_of,
)
from kiln.errors import UsageError

__all__ = [
    "BACKENDS",
    "DEFAULT_TIMEOUT",
    "Deadline",
    "FetchedFile",
    "PushResult",
    "Store",
    "backend",
    "check_timeout",
    "fetch",
    "is_remote",
    "parse_digest",
    "read_small",
    "scheme_of",
]

# scheme -> (module under kiln.artifact.storage, Store class in it)
BACKENDS: dict[str, tuple[str, str]] = {
    "file": ("file", "FileStore"),
    "http": ("http", "HttpStore"),
    "https": ("http", "HttpStore"),
    "s3": ("cloud", "CloudStore"),
    "gs": ("cloud", "CloudStore"),
    "gcs": ("cloud", "CloudStore"),
    "oci": ("oci", "OciStore"),
}


def backend(scheme: str) -> Store | None:
    """The store for ``scheme`` (importing its module now), or None for an unknown scheme."""
    entry = BACKENDS.get(scheme)
    if entry is None:
        return None
    module, name = entry
    store: type[Store] = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    return store()


def is_remote(source: str) -> bool:
    return scheme_of(source) != "file"


def fetch(
    source: str,
    workdir: Path,
    *,
    expected_sha256: str | None = None,
    on_bytes: ByteSink | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    select: Select | None = None,
) -> FetchedFile:
    """Make ``source`` available as an open local file (downloading into ``workdir`` if remote).

    The digest is checked against ``expected_sha256`` before this returns (for a bundle a store
    resolves itself, an OCI image index, against the index's digest: the release's); a download
    must finish within ``timeout`` seconds. ``select`` chooses such a bundle's variant. The
    caller owns (closes) the returned :class:`FetchedFile`.
    """
    parse_digest(expected_sha256)
    deadline = Deadline(timeout)
    store = backend(scheme_of(source))
    if store is None:
        raise UsageError(f"{source}: unsupported source scheme {scheme_of(source)!r}")
    fetched = store.open(source, workdir, deadline=deadline, on_bytes=on_bytes, select=select)
    try:
        check_digest(expected_sha256, fetched.release_sha256 or fetched.sha256, source)
    except BaseException:
        fetched.close()
        raise
    return fetched


def read_small(source: str, limit: int, *, timeout: float = DEFAULT_TIMEOUT) -> bytes:
    """A small document at ``source`` (an attestation beside an artifact), read into memory
    within ``timeout`` and refused past ``limit`` bytes as it arrives: nothing touches a disk,
    so it works with a read-only root filesystem and cannot fill one."""
    store = backend(scheme_of(source))
    if store is None:
        raise UsageError(f"{source}: unsupported source scheme {scheme_of(source)!r}")
    out = CappedBuffer(limit, source)
    store.fetch(source, out, deadline=Deadline(timeout), on_bytes=None)
    return out.getvalue()
