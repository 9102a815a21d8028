"""HTTP(S) downloads with the standard library: streamed, retried, and bounded in time.

No extra is needed (urllib, http.client, ssl). Whole-download deadlines need more than socket
timeouts: the sockets of a fetch are shut down when :class:`~kiln.artifact.storage.base.Deadline`
runs out (:class:`_Sockets`), which bounds the headers and the TLS handshake as well as the body.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import ssl
import threading
import urllib.error
import urllib.parse
import urllib.request
from typing import IO, Any

from kiln.artifact.storage.base import (
    ATTEMPTS,
    ByteSink,
    Deadline,
    Digest,
    RedirectRefused,
    Store,
    copy_hashing,
    redirect_allowed,
    shown,
)
from kiln.errors import IntegrityError, KilnError, NotFoundError, UsageError


class HttpStore(Store):
    """``http://`` and ``https://`` (read-only: there is no standard upload)."""

    def fetch(
        self, url: str, into: IO[bytes], *, deadline: Deadline, on_bytes: ByteSink | None
    ) -> Digest:
        """GET ``url`` into ``into``: up to :data:`ATTEMPTS` tries, all within ``deadline``.

        A body that ends early (a short ``Content-Length`` body, a chunked body cut off) is
        retried; if the last try is still cut short that is exit 3, the artifact never arrived
        whole.
        """
        try:
            host = urllib.parse.urlsplit(url).hostname
        except ValueError as exc:
            raise UsageError(f"{url}: not a valid URL: {exc}") from None
        if not host:
            raise UsageError(f"{url}: not a valid URL: no host")
        sockets = _Sockets(deadline)
        opener = _opener(sockets)
        last: BaseException | None = None
        with deadline.alarm(sockets.shutdown_all):
            for attempt in range(ATTEMPTS):
                if attempt:
                    deadline.sleep(0.5 * attempt)
                deadline.check(url)
                into.seek(0)
                into.truncate()
                try:
                    return _get(opener, url, into, on_bytes, deadline)
                except urllib.error.HTTPError as exc:
                    exc.close()
                    if exc.code == 404:
                        raise NotFoundError(f"{url}: HTTP 404 not found") from None
                    if exc.code < 500:
                        raise KilnError(
                            f"{url}: HTTP {exc.code} {shown(str(exc.reason))}"
                        ) from None
                    last = exc
                except (
                    _CutShort,
                    urllib.error.URLError,
                    OSError,
                    http.client.HTTPException,
                ) as exc:
                    last = exc
                except ValueError as exc:  # http.client.InvalidURL and friends
                    raise UsageError(f"{url}: not a valid URL: {exc}") from None
                if deadline.expired:
                    raise deadline.error(url) from None
        if isinstance(last, _CutShort):
            raise IntegrityError(f"{url}: {last} (the last of {ATTEMPTS} attempts)")
        raise KilnError(f"{url}: download failed after {ATTEMPTS} attempts: {last}")


def _get(
    opener: urllib.request.OpenerDirector,
    url: str,
    into: IO[bytes],
    on_bytes: ByteSink | None,
    deadline: Deadline,
) -> Digest:
    """One try. ``read1`` returns after one receive at most, so the deadline is checked between
    receives, not after a whole chunk that may never come."""
    req = urllib.request.Request(url, headers={"User-Agent": "kiln"})
    with opener.open(req, timeout=deadline.idle) as resp:
        length = resp.headers.get("Content-Length")
        total = int(length) if length and length.isdigit() else None
        try:
            got = copy_hashing(
                resp.read1, into, total=total, on_bytes=on_bytes, deadline=deadline, source=url
            )
        except http.client.IncompleteRead as exc:
            raise _CutShort(into.tell() + len(exc.partial), total) from None
    if total is not None and got.size != total:
        raise _CutShort(got.size, total)
    return got


class _CutShort(Exception):
    def __init__(self, got: int, total: int | None) -> None:
        of = f" of {total}" if total is not None else ""
        super().__init__(f"body cut short after {got}{of} bytes")


class _Sockets:
    """The sockets of one fetch, to shut down together when its deadline passes."""

    def __init__(self, deadline: Deadline) -> None:
        self.deadline = deadline
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            if self.deadline.cut:  # connected after the alarm: cut at once
                _shutdown(sock)
            else:
                self._socks.append(sock)

    def shutdown_all(self) -> None:
        with self._lock:
            for sock in self._socks:
                _shutdown(sock)


def _shutdown(sock: socket.socket) -> None:
    # OSError: already closed, or detached into a TLS socket that is watched itself.
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def _connection_classes(sockets: _Sockets) -> tuple[type, type]:
    class Plain(http.client.HTTPConnection):
        def connect(self) -> None:
            super().connect()
            sockets.watch(self.sock)

    class Tls(http.client.HTTPSConnection):
        def connect(self) -> None:
            # HTTPSConnection.connect, with the handshake under the deadline too.
            http.client.HTTPConnection.connect(self)
            host = self._tunnel_host or self.host  # type: ignore[attr-defined]
            self.sock = self._context.wrap_socket(  # type: ignore[attr-defined]
                self.sock, server_hostname=host, do_handshake_on_connect=False
            )
            sockets.watch(self.sock)
            self.sock.do_handshake()

    return Plain, Tls


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows only the redirects :func:`redirect_allowed` allows; any other is exit 3
    (urllib alone follows ``ftp://`` too, and reports other schemes as a vague HTTP error)."""

    def http_error_302(self, req: Any, fp: Any, code: int, msg: str, headers: Any) -> Any:
        target = headers.get("Location") or headers.get("URI")
        if target:
            url = urllib.parse.urljoin(req.full_url, target)
            if not redirect_allowed(req.full_url, url):
                fp.close()
                raise RedirectRefused(req.full_url, url)
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


def _opener(sockets: _Sockets) -> urllib.request.OpenerDirector:
    plain, tls = _connection_classes(sockets)
    context = ssl.create_default_context()

    class PlainHandler(urllib.request.HTTPHandler):
        def http_open(self, req: Any) -> Any:
            return self.do_open(plain, req)

    class TlsHandler(urllib.request.HTTPSHandler):
        def https_open(self, req: Any) -> Any:
            return self.do_open(tls, req, context=context)

    return urllib.request.build_opener(_Redirects, PlainHandler, TlsHandler(context=context))
