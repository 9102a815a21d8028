"""What every storage backend shares: the :class:`Store` base class and the rules of a fetch.

A backend (one module each: ``file``, ``http``, ``cloud``, ``oci``) implements :meth:`Store.fetch`
(copy one artifact into an open file, hashing it) and, where the store can take uploads,
:meth:`Store.push`. Everything that must behave the same whatever the backend lives here, so a
new backend cannot get it subtly wrong: the digest is computed while the bytes are copied
(:func:`copy_hashing`), every download runs under one :class:`Deadline` (``kiln restore
--timeout``), and redirects follow one rule (:func:`redirect_allowed`). Torch-free, and
stdlib-only: the clients a backend needs are imported by that backend, when its scheme is used.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import json
import math
import re
import threading
import time
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import IO, Any, BinaryIO, NamedTuple

from kiln.errors import IntegrityError, KilnError, Param, ParameterError, UsageError, Worded
from kiln.files import CHUNK
from kiln.installs import extra_hint

ByteSink = Callable[[int, int | None], None]  # (bytes so far, total or None)
# A bundle's variant chooser for a store whose bundles are not files (an OCI image index), which
# chooses while fetching: (index document, source) -> (choice, the chosen variant's manifest
# digest); kiln.artifact.oci_layout.variant_select. The store knows nothing of bundles.
Select = Callable[[dict[str, Any], str], tuple[Any, str]]

DEFAULT_TIMEOUT = 600.0  # seconds a whole download may take: `kiln restore --timeout`
IDLE_TIMEOUT = 60.0  # seconds one wait on the network may take (or a quarter of the total)
ATTEMPTS = 3  # tries per download (HTTP, OCI), all inside the one deadline
DOWNLOAD_NAME = "artifact.download"  # what a remote artifact is downloaded to, in the workdir
PUSH_SCHEMES = "file, s3, gs, oci"  # named in the message for a scheme that takes no uploads
ATTESTATION_SUFFIX = ".intoto.jsonl"  # ARTIFACT.intoto.jsonl: an artifact's signed attestation

_DIGEST = re.compile(r"(?:sha256:)?([0-9a-f]{64})")


def scheme_of(source: str) -> str:
    """``s3`` for ``s3://bucket/key``; ``file`` for a plain path."""
    head, sep, _ = source.partition("://")
    return head.lower() if sep else "file"


# --- digests and budgets --------------------------------------------------------------------


def parse_digest(value: str | None) -> str | None:
    """The bare, lower-case hex of a pinned sha256 (``sha256:`` prefix optional); None for None.

    Anything else is a :class:`UsageError` (exit 2): an empty or mistyped pin must never mean
    "no pin", which is what a check of ``if expected:`` silently did.
    """
    if value is None:
        return None
    match = _DIGEST.fullmatch(value.lower()) if isinstance(value, str) else None
    if match is None:
        raise ParameterError(
            "sha256", value, "expected 64 hex digits, optionally prefixed by 'sha256:'"
        )
    return match.group(1)


def check_digest(expected: str | None, actual: str, what: str) -> None:
    pinned = parse_digest(expected)
    if pinned is not None and pinned != actual:
        raise IntegrityError(f"{what}: sha256 {actual} does not match the pinned {expected}")


MAX_TIMEOUT = 7 * 24 * 3600  # a week: more is a typo (and past what timers can hold)


def check_timeout(value: object) -> float:
    """A download budget in seconds: a finite number above zero, else :class:`UsageError`."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
        or value > MAX_TIMEOUT
    ):
        raise ParameterError(
            "timeout", value, f"expected a positive number of seconds, at most {MAX_TIMEOUT}"
        )
    return float(value)


def json_object(data: bytes | str, what: str) -> dict[str, Any]:
    """``data`` parsed as one JSON object, else :class:`IntegrityError` naming ``what``.

    For documents from elsewhere (registry manifests, attestation lines): any JSON error,
    nesting too deep for the parser included, is an integrity failure, never a crash.
    """
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        raise IntegrityError(f"{what} is not JSON") from None
    if not isinstance(doc, dict):
        raise IntegrityError(f"{what} is not a JSON object")
    return doc


class CappedBuffer(io.BytesIO):
    """An in-memory sink that refuses (:class:`IntegrityError`) past ``limit`` bytes: for small
    documents from elsewhere (registry manifests, attestations), which must never fill memory
    or a disk however much a server sends."""

    def __init__(self, limit: int, source: str) -> None:
        super().__init__()
        self._limit, self._source = limit, source

    def write(self, data: Any) -> int:
        if self.tell() + len(data) > self._limit:
            raise IntegrityError(f"{shown(self._source)}: more than {self._limit} bytes")
        return super().write(data)


class Deadline:
    """The time budget of one fetch: ``total`` seconds for everything, ``idle`` for one wait.

    Socket timeouts bound each wait, not their sum: a server that sends one byte every few
    seconds never trips them. So every copy loop also checks :meth:`check`, and a backend whose
    reads can block cuts its connections when the total runs out (:meth:`alarm`). The idle limit
    is a quarter of the total when that is shorter than :data:`IDLE_TIMEOUT`, so a stalled first
    attempt still leaves time for the retries.
    """

    def __init__(self, total: float = DEFAULT_TIMEOUT) -> None:
        self.total = check_timeout(total)
        self.idle = min(IDLE_TIMEOUT, self.total / 4)
        self.end = time.monotonic() + self.total
        self.cut = False  # set when an alarm fired: a connection was shut down at the deadline

    def remaining(self) -> float:
        return self.end - time.monotonic()

    @property
    def expired(self) -> bool:
        return self.cut or self.remaining() <= 0

    def error(self, source: str) -> KilnError:
        return KilnError(
            Worded(
                f"{source}: download did not finish within ",
                Param("timeout", f"{self.total:g}s"),
            )
        )

    def check(self, source: str) -> None:
        if self.expired:
            raise self.error(source)

    def sleep(self, seconds: float) -> None:
        """Back off before a retry, never past the deadline."""
        time.sleep(max(0.0, min(seconds, self.remaining())))

    @contextlib.contextmanager
    def alarm(self, action: Callable[[], None]) -> Iterator[None]:
        """While the block runs, call ``action`` (on a timer thread) when the deadline passes,
        after marking the deadline :attr:`cut`.

        Why: a blocked ``recv`` cannot be interrupted from Python except by shutting its socket
        down from another thread; the read then ends (EOF or an error), and the copy loop, which
        checks :attr:`expired` after every read, reports the deadline rather than a short body.
        """

        def fire() -> None:
            self.cut = True
            action()

        timer = threading.Timer(max(0.0, self.remaining()), fire)
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()


# --- copying --------------------------------------------------------------------------------


class Digest(NamedTuple):
    """What a copy saw: the sha256 (hex) and the count of the bytes it copied."""

    sha256: str
    size: int


def copy_hashing(
    read: Callable[[int], bytes],
    dst: IO[bytes] | None,
    *,
    total: int | None = None,
    on_bytes: ByteSink | None = None,
    deadline: Deadline | None = None,
    source: str = "",
) -> Digest:
    """Copy ``read`` to ``dst`` (None: only hash) in :data:`CHUNK` reads, hashing as it goes.

    The digest is of exactly the bytes written, with no second read that could see other bytes.
    With a ``deadline`` it is checked before each read and after it, before the end-of-data
    test: an empty read may be an :meth:`Deadline.alarm` shutting the connection down. Pass a
    read that returns after one receive (``read1``), so a trickle is checked between receives.
    """
    h = hashlib.sha256()
    n = 0
    while True:
        if deadline is not None:
            deadline.check(source)
        chunk = read(CHUNK)
        if deadline is not None:
            deadline.check(source)
        if not chunk:
            break
        h.update(chunk)
        if dst is not None:
            dst.write(chunk)
        n += len(chunk)
        if on_bytes:
            on_bytes(n, total)
    return Digest(h.hexdigest(), n)


# --- redirects and messages -----------------------------------------------------------------


def redirect_allowed(url: str, target: str) -> bool:
    """A redirect from ``url`` to ``target`` (already joined) may be followed: http(s) only,
    and never from https down to http. urllib alone follows ``ftp://`` too; requests follows
    https to http."""
    old = urllib.parse.urlsplit(url).scheme.lower()
    new = urllib.parse.urlsplit(target).scheme.lower()
    return new in ("http", "https") and not (old == "https" and new == "http")


class RedirectRefused(IntegrityError):
    """A redirect :func:`redirect_allowed` refuses: unsafe input from the source, exit 3."""

    def __init__(self, url: str, target: str) -> None:
        super().__init__(
            f"{url}: redirect to {shown(target)} refused "
            "(only http(s) is followed, and never from https to http)"
        )


def shown(text: str) -> str:
    """A URL or reason from a server, safe to print in a one-line message."""
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= 200 else text[:200] + "…"


def need_extra(module: str, extra: str) -> ModuleType:
    """Import an optional client, or say in one line which extra installs it (exit 2)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UsageError(f"this source needs the {extra!r} extra: {extra_hint(extra)}") from None


# --- results --------------------------------------------------------------------------------


@dataclass(frozen=True)
class FetchedFile:
    """A fetched artifact: ``file`` is open at offset 0 and holds exactly the bytes hashed.

    Read the artifact from ``file``, never by opening ``path`` again. Use as a context manager
    (or call :meth:`close`). Named for what it holds, an open file: restore's progress event
    for the bytes on their way is :class:`kiln.events.Fetched`.
    """

    path: Path
    sha256: str
    size: int
    downloaded: bool  # False for local files: nothing to clean up
    file: BinaryIO = field(repr=False)
    # When the source was a bundle the store resolved itself (an OCI image index): the variant
    # it chose (a kiln.artifact.bundle.Choice), and the digest of the release, which a pin names.
    choice: Any = None
    release_sha256: str | None = None

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> FetchedFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class PushResult:
    """Where a push put the artifact and its digest, so CI can pin the restore."""

    dest: str
    sha256: str
    size: int
    attestation: str | None = None  # where ARTIFACT.intoto.jsonl went with it, if it existed

    def summary(self) -> dict[str, Any]:
        """The fields of ``kiln push --json`` (``attestation`` last: the newest field)."""
        data = asdict(self)
        data["attestation"] = data.pop("attestation")
        return data


# --- the base class -------------------------------------------------------------------------


class Store(ABC):
    """One kind of artifact store. Stateless: an instance serves any URL of its schemes."""

    @abstractmethod
    def fetch(
        self, url: str, into: IO[bytes], *, deadline: Deadline, on_bytes: ByteSink | None
    ) -> Digest:
        """Copy the artifact at ``url`` into ``into`` (open, empty), hashing it with
        :func:`copy_hashing`, within ``deadline``. Retries start over in the same file."""

    def push(self, src: Path, url: str) -> PushResult:
        """Upload ``src`` (an existing artifact file) to ``url``. Read-only stores refuse."""
        raise cannot_push(url)

    def push_attestation(self, attestation: Path, pushed: PushResult) -> str:
        """Upload ``attestation`` with the artifact just ``pushed``; returns where it went.

        By default beside it, as ``DEST.intoto.jsonl``: where ``kiln restore --verify-key``
        looks first (``SOURCE.intoto.jsonl``). A registry attaches it instead (OCI referrer).
        """
        return self.push(attestation, pushed.dest + ATTESTATION_SUFFIX).dest

    def open(
        self,
        url: str,
        workdir: Path,
        *,
        deadline: Deadline,
        on_bytes: ByteSink | None,
        select: Select | None = None,
    ) -> FetchedFile:
        """The artifact as one open local file: downloaded into ``workdir`` by :meth:`fetch`.

        The caller checks the digest, then reads (unpacks) from :attr:`FetchedFile.file`, the
        very file that was hashed. A local store overrides this to open the file in place.
        ``select`` is for stores that resolve bundles themselves (OCI); a bundle *file* is chosen
        from as it is unpacked (:func:`kiln.artifact.bundle.extract_chosen`).
        """
        dest = workdir / DOWNLOAD_NAME
        out = open(dest, "x+b")  # noqa: SIM115 - handed to the caller inside FetchedFile
        try:
            sha, size = self.fetch(url, out, deadline=deadline, on_bytes=on_bytes)
            out.flush()
            out.seek(0)
        except BaseException:
            out.close()
            raise
        return FetchedFile(dest, sha, size, downloaded=True, file=out)


def cannot_push(url: str) -> UsageError:
    return UsageError(f"{url}: cannot push to scheme {scheme_of(url)!r} ({PUSH_SCHEMES})")
