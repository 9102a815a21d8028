"""S3 and GCS object stores through fsspec (extras ``torch-kiln[s3]``, ``torch-kiln[gcs]``).

Credentials come from each ecosystem's usual places and nowhere else: the AWS environment,
profile and instance metadata (s3fs/botocore), Google's application-default credentials (gcsfs).
kiln adds no credential files of its own. fsspec is imported when an ``s3://``/``gs://`` URL is
used, with a one-line hint naming the extra when it is missing.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

from kiln.artifact.storage.base import (
    ByteSink,
    Deadline,
    Digest,
    PushResult,
    Store,
    copy_hashing,
    need_extra,
    scheme_of,
)
from kiln.errors import KilnError, NotFoundError, UsageError


def _extra(url: str) -> str:
    return "s3" if scheme_of(url) == "s3" else "gcs"


def _client_options(scheme: str, deadline: Deadline) -> dict[str, Any]:
    """Client timeouts for one fetch: each wait is bounded by the idle limit (S3), or each
    request by what is left of the deadline (GCS); the copy loop checks the total."""
    if scheme == "s3":
        idle = deadline.idle
        return {"config_kwargs": {"connect_timeout": idle, "read_timeout": idle}}
    return {"requests_timeout": max(deadline.remaining(), 0.001), "skip_instance_cache": True}


class CloudStore(Store):
    """``s3://bucket/key`` and ``gs://bucket/key`` (``gcs://`` too)."""

    def fetch(
        self, url: str, into: IO[bytes], *, deadline: Deadline, on_bytes: ByteSink | None
    ) -> Digest:
        fsspec = need_extra("fsspec", _extra(url))
        try:
            fs, path = fsspec.core.url_to_fs(url, **_client_options(scheme_of(url), deadline))
            total = fs.size(path)
            deadline.check(url)
            with fs.open(path, "rb") as src:
                return copy_hashing(
                    src.read, into, total=total, on_bytes=on_bytes, deadline=deadline, source=url
                )
        except FileNotFoundError:
            raise NotFoundError(f"{url}: no such object") from None
        except ImportError as exc:
            raise UsageError(
                f"{url}: missing client library ({exc.name}); install kiln's extra"
            ) from None
        except KilnError:
            raise
        except Exception as exc:  # the client's own errors (timeouts, refused connections, ...)
            if deadline.expired:
                raise deadline.error(url) from None
            raise KilnError(f"{url}: download failed: {type(exc).__name__}: {exc}") from None

    def push(self, src: Path, url: str) -> PushResult:
        """Upload ``src``; a URL ending in ``/`` is a prefix: the object keeps the file name."""
        fsspec = need_extra("fsspec", _extra(url))
        fs, path = fsspec.core.url_to_fs(url)
        if url.endswith("/"):  # url_to_fs strips the slash
            path = f"{path.rstrip('/')}/{src.name}"
        with open(src, "rb") as fh, fs.open(path, "wb") as out:
            sha, size = copy_hashing(fh.read, out)
        return PushResult(f"{url.split('://', 1)[0]}://{path}", sha, size)
