"""Where artifacts live: local paths, HTTP(S), and (through extras) S3, GCS and OCI registries.

Every source is turned into a local file whose sha256 was computed while it arrived, so restore
can refuse a wrong digest *before* unpacking a byte. Torch-free; the cloud clients are optional
extras imported only when their scheme is used, so a slim init container carries only what it
fetches from.
"""

from __future__ import annotations

import hashlib
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kiln.errors import IntegrityError, KilnError, NotFoundError, UsageError

_CHUNK = 1 << 20
ByteSink = Callable[[int, int | None], None]  # (bytes so far, total or None)


@dataclass(frozen=True)
class Fetched:
    path: Path
    sha256: str
    size: int
    downloaded: bool  # False for local files: nothing to clean up


def scheme_of(source: str) -> str:
    head, sep, _ = source.partition("://")
    return head.lower() if sep else "file"


def is_remote(source: str) -> bool:
    return scheme_of(source) != "file"


def _copy_hashing(
    src: IO[bytes], dst: IO[bytes], total: int | None, on_bytes: ByteSink | None
) -> tuple[str, int]:
    h = hashlib.sha256()
    n = 0
    while chunk := src.read(_CHUNK):
        h.update(chunk)
        dst.write(chunk)
        n += len(chunk)
        if on_bytes:
            on_bytes(n, total)
    return h.hexdigest(), n


def check_digest(expected: str | None, actual: str, what: str) -> None:
    if expected and expected.lower().removeprefix("sha256:") != actual:
        raise IntegrityError(f"{what}: sha256 {actual} does not match the pinned {expected}")


def fetch(
    source: str,
    workdir: Path,
    *,
    expected_sha256: str | None = None,
    on_bytes: ByteSink | None = None,
) -> Fetched:
    """Make ``source`` available as a local file (downloading into ``workdir`` if remote)."""
    scheme = scheme_of(source)
    if scheme == "file":
        path = Path(source.removeprefix("file://"))
        if not path.is_file():
            raise NotFoundError(f"{source}: no such artifact")
        total = path.stat().st_size
        with open(path, "rb") as fh:
            sha, size = _copy_hashing(fh, _Null(), total, on_bytes)
        check_digest(expected_sha256, sha, source)
        return Fetched(path, sha, size, downloaded=False)
    dest = workdir / "artifact.download"
    if scheme not in _OPENERS:
        import kiln.remote  # noqa: F401 - registers the optional-extra schemes
    opener = _OPENERS.get(scheme)
    if opener is None:
        raise UsageError(f"{source}: unsupported source scheme {scheme!r}")
    sha, size = opener(source, dest, on_bytes)
    check_digest(expected_sha256, sha, source)
    return Fetched(dest, sha, size, downloaded=True)


class _Null:
    def write(self, data: bytes) -> int:
        return len(data)


def _http(source: str, dest: Path, on_bytes: ByteSink | None) -> tuple[str, int]:
    last: Exception | None = None
    for attempt in range(3):
        try:
            req = urllib.request.Request(source, headers={"User-Agent": "kiln"})
            with urllib.request.urlopen(req, timeout=60) as resp, open(dest, "wb") as out:
                length = resp.headers.get("Content-Length")
                total = int(length) if length and length.isdigit() else None
                sha, size = _copy_hashing(resp, out, total, on_bytes)
            if total is not None and size != total:
                raise IntegrityError(f"{source}: got {size} of {total} bytes")
            return sha, size
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                raise NotFoundError(f"{source}: HTTP 404 not found") from None
            if exc.code < 500:
                raise KilnError(f"{source}: HTTP {exc.code} {exc.reason}") from None
            last = exc
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            last = exc
        time.sleep(0.5 * (attempt + 1))
    raise KilnError(f"{source}: download failed: {last}")


_OPENERS: dict[str, Callable[[str, Path, ByteSink | None], tuple[str, int]]] = {
    "http": _http,
    "https": _http,
}


def register(scheme: str, opener: Callable[[str, Path, ByteSink | None], tuple[str, int]]) -> None:
    _OPENERS[scheme] = opener


def push(artifact: str | Path, dest: str) -> dict[str, str | int]:
    """Copy an artifact to ``dest``; returns its digest so CI can pin it."""
    src = Path(artifact)
    if not src.is_file():
        raise NotFoundError(f"{artifact}: no such artifact")
    scheme = scheme_of(dest)
    if scheme == "file":
        target = Path(dest.removeprefix("file://"))
        if target.is_dir():
            target = target / src.name
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        with open(src, "rb") as fh, open(tmp, "wb") as out:
            sha, size = _copy_hashing(fh, out, None, None)
        tmp.replace(target)
        return {"dest": str(target), "sha256": sha, "size": size}
    from kiln.remote import PUSHERS

    pusher = PUSHERS.get(scheme)
    if pusher is None:
        raise UsageError(f"{dest}: cannot push to scheme {scheme!r} (file, s3, gs, oci)")
    return pusher(src, dest)
