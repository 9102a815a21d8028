"""Where artifacts live: local paths, HTTP(S), and (through extras) S3, GCS and OCI registries.

Every source is turned into one *open* local file whose sha256 was computed while it was read, so
restore can refuse a wrong digest before unpacking a byte, and then unpack from that same open
file (a path can be replaced between two opens; an open file cannot). Downloads run under a
:class:`Deadline`: a total budget (``kiln restore --timeout``) and an idle limit per wait, so a
server that stalls or trickles cannot hold an init container forever. Torch-free; the cloud
clients are optional extras imported only when their scheme is used, so a slim init container
carries only what it fetches from.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import http.client
import math
import os
import re
import socket
import ssl
import stat
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO

from kiln.errors import IntegrityError, KilnError, NotFoundError, UsageError

_CHUNK = 1 << 20
ByteSink = Callable[[int, int | None], None]  # (bytes so far, total or None)

DEFAULT_TIMEOUT = 600.0  # seconds a whole download may take: `kiln restore --timeout`
IDLE_TIMEOUT = 60.0  # seconds one wait on the network may take (or a quarter of the total)
ATTEMPTS = 3  # tries per download (HTTP, OCI), all inside the one deadline

_DIGEST = re.compile(r"(?:sha256:)?([0-9a-f]{64})")


def parse_digest(value: str | None) -> str | None:
    """The bare, lower-case hex of a pinned sha256 (``sha256:`` prefix optional); None for None.

    Anything else is a :class:`UsageError` (exit 2): an empty or mistyped pin must never mean
    "no pin", which is what a check of ``if expected:`` silently did.
    """
    if value is None:
        return None
    match = _DIGEST.fullmatch(value.lower()) if isinstance(value, str) else None
    if match is None:
        raise UsageError(
            f"--sha256 {value!r}: expected 64 hex digits, optionally prefixed by 'sha256:'"
        )
    return match.group(1)


def check_timeout(value: object) -> float:
    """A download budget in seconds: a finite number above zero, else :class:`UsageError`."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise UsageError(f"--timeout {value!r}: expected a positive number of seconds")
    return float(value)


class Deadline:
    """The time budget of one fetch: ``total`` seconds for everything, ``idle`` for one wait.

    Socket timeouts bound each wait, not their sum: a server that sends one byte every few
    seconds never trips them. So every copy loop also checks :meth:`check`, and the HTTP client
    shuts its sockets down when the total runs out (:class:`_Watchdog`). The idle limit is a
    quarter of the total when that is shorter than :data:`IDLE_TIMEOUT`, so a stalled first
    attempt still leaves time for the retries.
    """

    def __init__(self, total: float = DEFAULT_TIMEOUT) -> None:
        self.total = check_timeout(total)
        self.idle = min(IDLE_TIMEOUT, self.total / 4)
        self.end = time.monotonic() + self.total
        self.cut = False  # set when a watchdog shut the connection down at the deadline

    def remaining(self) -> float:
        return self.end - time.monotonic()

    @property
    def expired(self) -> bool:
        return self.cut or self.remaining() <= 0

    def error(self, source: str) -> KilnError:
        return KilnError(f"{source}: download did not finish within --timeout {self.total:g}s")

    def check(self, source: str) -> None:
        if self.expired:
            raise self.error(source)

    def sleep(self, seconds: float) -> None:
        """Back off before a retry, never past the deadline."""
        time.sleep(max(0.0, min(seconds, self.remaining())))


@dataclass(frozen=True)
class Fetched:
    """A fetched artifact: ``file`` is open at offset 0 and holds exactly the bytes hashed.

    Read the artifact from ``file``, never by opening ``path`` again. Use as a context manager
    (or call :meth:`close`).
    """

    path: Path
    sha256: str
    size: int
    downloaded: bool  # False for local files: nothing to clean up
    file: BinaryIO = field(repr=False)

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> Fetched:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def scheme_of(source: str) -> str:
    head, sep, _ = source.partition("://")
    return head.lower() if sep else "file"


def is_remote(source: str) -> bool:
    return scheme_of(source) != "file"


def _copy_hashing(
    src: IO[bytes],
    dst: IO[bytes],
    total: int | None,
    on_bytes: ByteSink | None,
    deadline: Deadline | None = None,
    source: str = "",
) -> tuple[str, int]:
    h = hashlib.sha256()
    n = 0
    while True:
        if deadline is not None:
            deadline.check(source)
        chunk = src.read(_CHUNK)
        if not chunk:
            break
        h.update(chunk)
        dst.write(chunk)
        n += len(chunk)
        if on_bytes:
            on_bytes(n, total)
    return h.hexdigest(), n


def check_digest(expected: str | None, actual: str, what: str) -> None:
    pinned = parse_digest(expected)
    if pinned is not None and pinned != actual:
        raise IntegrityError(f"{what}: sha256 {actual} does not match the pinned {expected}")


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


def fetch(
    source: str,
    workdir: Path,
    *,
    expected_sha256: str | None = None,
    on_bytes: ByteSink | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> Fetched:
    """Make ``source`` available as an open local file (downloading into ``workdir`` if remote).

    The digest is checked against ``expected_sha256`` before this returns; a download must finish
    within ``timeout`` seconds. The caller owns (closes) the returned :class:`Fetched`.
    """
    parse_digest(expected_sha256)
    deadline = Deadline(timeout)
    scheme = scheme_of(source)
    if scheme == "file":
        path = Path(source.removeprefix("file://"))
        fh = open_regular(path, source)
        try:
            total = os.fstat(fh.fileno()).st_size
            sha, size = _copy_hashing(fh, _Null(), total, on_bytes)
            check_digest(expected_sha256, sha, source)
            fh.seek(0)
        except BaseException:
            fh.close()
            raise
        return Fetched(path, sha, size, downloaded=False, file=fh)
    if scheme not in _OPENERS:
        import kiln.artifact.storage.remote  # noqa: F401 - registers the optional-extra schemes
    opener = _OPENERS.get(scheme)
    if opener is None:
        raise UsageError(f"{source}: unsupported source scheme {scheme!r}")
    dest = workdir / "artifact.download"
    out = open(dest, "x+b")  # noqa: SIM115 - handed to the caller inside Fetched
    try:
        sha, size = opener(source, out, on_bytes, deadline)
        out.flush()
        check_digest(expected_sha256, sha, source)
        out.seek(0)
    except BaseException:
        out.close()
        raise
    return Fetched(dest, sha, size, downloaded=True, file=out)


class _Null:
    def write(self, data: bytes) -> int:
        return len(data)


# --- HTTP(S) --------------------------------------------------------------------------------


class _Watchdog:
    """Shuts down every socket it watches once the deadline passes.

    Why: a blocked ``recv`` cannot be interrupted from Python except by shutting its socket
    down from another thread; the read then ends (EOF or an error) and the fetch reports the
    deadline. This bounds the headers and the TLS handshake as well as the body.
    """

    def __init__(self, deadline: Deadline) -> None:
        self.deadline = deadline
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(max(0.0, deadline.remaining()), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            if self.deadline.cut:
                _shutdown(sock)
            else:
                self._socks.append(sock)

    def _fire(self) -> None:
        with self._lock:
            self.deadline.cut = True
            for sock in self._socks:
                _shutdown(sock)

    def close(self) -> None:
        self._timer.cancel()
        with self._lock:
            self._socks.clear()


def _shutdown(sock: socket.socket) -> None:
    # OSError: already closed, or detached into a TLS socket that is watched itself.
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _connection_classes(watchdog: _Watchdog) -> tuple[type, type]:
    class Plain(http.client.HTTPConnection):
        def connect(self) -> None:
            super().connect()
            watchdog.watch(self.sock)

    class Tls(http.client.HTTPSConnection):
        def connect(self) -> None:
            # HTTPSConnection.connect, with the handshake under the watchdog too.
            http.client.HTTPConnection.connect(self)
            host = self._tunnel_host or self.host  # type: ignore[attr-defined]
            self.sock = self._context.wrap_socket(  # type: ignore[attr-defined]
                self.sock, server_hostname=host, do_handshake_on_connect=False
            )
            watchdog.watch(self.sock)
            self.sock.do_handshake()

    return Plain, Tls


class _RedirectRefused(IntegrityError):
    pass


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows redirects only to http(s) URLs, and never from https down to plain http.

    urllib alone follows ``ftp://`` too (and reports other schemes as a vague HTTP error). A
    refused redirect is exit 3, like any other unsafe input from the source.
    """

    def http_error_302(self, req: Any, fp: Any, code: int, msg: str, headers: Any) -> Any:
        target = headers.get("Location") or headers.get("URI")
        if target:
            url = urllib.parse.urljoin(req.full_url, target)
            old = urllib.parse.urlsplit(req.full_url).scheme.lower()
            new = urllib.parse.urlsplit(url).scheme.lower()
            if new not in ("http", "https") or (old == "https" and new == "http"):
                fp.close()
                raise _RedirectRefused(
                    f"{req.full_url}: redirect to {_shown(url)} refused "
                    "(only http(s) is followed, and never from https to http)"
                )
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


def _shown(url: str) -> str:
    """A URL from a server, safe to print in a one-line message."""
    text = "".join(c if c.isprintable() else "?" for c in url)
    return text if len(text) <= 200 else text[:200] + "…"


def _opener(watchdog: _Watchdog) -> urllib.request.OpenerDirector:
    plain, tls = _connection_classes(watchdog)
    context = ssl.create_default_context()

    class PlainHandler(urllib.request.HTTPHandler):
        def http_open(self, req: Any) -> Any:
            return self.do_open(plain, req)

    class TlsHandler(urllib.request.HTTPSHandler):
        def https_open(self, req: Any) -> Any:
            return self.do_open(tls, req, context=context)

    return urllib.request.build_opener(_Redirects, PlainHandler, TlsHandler(context=context))


class _CutShort(Exception):
    def __init__(self, got: int, total: int | None) -> None:
        of = f" of {total}" if total is not None else ""
        super().__init__(f"body cut short after {got}{of} bytes")
        self.got, self.total = got, total


def _read_body(
    resp: http.client.HTTPResponse,
    out: IO[bytes],
    total: int | None,
    on_bytes: ByteSink | None,
    deadline: Deadline,
    source: str,
) -> tuple[str, int]:
    """Copy the body, hashing it. ``read1`` returns after one receive at most, so the deadline
    is checked between receives, not after a whole megabyte that may never come."""
    h = hashlib.sha256()
    n = 0
    while True:
        try:
            chunk = resp.read1(_CHUNK)
        except http.client.IncompleteRead as exc:
            raise _CutShort(n + len(exc.partial), total) from None
        deadline.check(source)  # before the EOF test: an EOF may be the watchdog's shutdown
        if not chunk:
            break
        h.update(chunk)
        out.write(chunk)
        n += len(chunk)
        if on_bytes:
            on_bytes(n, total)
    if total is not None and n != total:
        raise _CutShort(n, total)
    return h.hexdigest(), n


def _http(
    source: str, out: IO[bytes], on_bytes: ByteSink | None, deadline: Deadline
) -> tuple[str, int]:
    """GET ``source`` into ``out``: up to :data:`ATTEMPTS` tries, all within ``deadline``.

    A body that ends early (a short ``Content-Length`` body, a chunked body cut off) is retried;
    if the last try is still cut short that is exit 3, the artifact never arrived whole.
    """
    try:
        host = urllib.parse.urlsplit(source).hostname
    except ValueError as exc:
        raise UsageError(f"{source}: not a valid URL: {exc}") from None
    if not host:
        raise UsageError(f"{source}: not a valid URL: no host")
    watchdog = _Watchdog(deadline)
    opener = _opener(watchdog)
    last: BaseException | None = None
    try:
        for attempt in range(ATTEMPTS):
            if attempt:
                deadline.sleep(0.5 * attempt)
            deadline.check(source)
            out.seek(0)
            out.truncate()
            try:
                req = urllib.request.Request(source, headers={"User-Agent": "kiln"})
                with opener.open(req, timeout=deadline.idle) as resp:
                    length = resp.headers.get("Content-Length")
                    total = int(length) if length and length.isdigit() else None
                    return _read_body(resp, out, total, on_bytes, deadline, source)
            except urllib.error.HTTPError as exc:
                exc.close()
                if exc.code == 404:
                    raise NotFoundError(f"{source}: HTTP 404 not found") from None
                if exc.code < 500:
                    raise KilnError(
                        f"{source}: HTTP {exc.code} {_shown(str(exc.reason))}"
                    ) from None
                last = exc
            except (_CutShort, urllib.error.URLError, OSError, http.client.HTTPException) as exc:
                last = exc
            except ValueError as exc:  # http.client.InvalidURL and friends
                raise UsageError(f"{source}: not a valid URL: {exc}") from None
            if deadline.expired:
                raise deadline.error(source) from None
    finally:
        watchdog.close()
    if isinstance(last, _CutShort):
        raise IntegrityError(f"{source}: {last} (the last of {ATTEMPTS} attempts)")
    raise KilnError(f"{source}: download failed after {ATTEMPTS} attempts: {last}")


Opener = Callable[[str, IO[bytes], ByteSink | None, Deadline], tuple[str, int]]
_OPENERS: dict[str, Opener] = {"http": _http, "https": _http}


def register(scheme: str, opener: Opener) -> None:
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
    from kiln.artifact.storage.remote import PUSHERS

    pusher = PUSHERS.get(scheme)
    if pusher is None:
        raise UsageError(f"{dest}: cannot push to scheme {scheme!r} (file, s3, gs, oci)")
    return pusher(src, dest)
