"""Real servers on loopback for storage tests: an OCI registry, S3- and GCS-compatible servers,
and scripted HTTP(S) servers that misbehave on purpose.

In CI (CI=true) a server that cannot start fails the tests loudly; on a developer machine without
the binary they are skipped with the reason.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import shutil
import socket
import socketserver
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"test server unavailable in CI: {reason}")
    pytest.skip(reason)


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            unavailable(f"{url} server exited: {log.read_text()[-500:]}")
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.1)
    proc.kill()
    unavailable(f"{url} did not answer within {timeout}s")


@contextmanager
def server(argv: list[str], url: str, workdir: Path) -> Iterator[str]:
    log = workdir / "server.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, cwd=workdir)
    try:
        wait_http(url, proc, log)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextmanager
def oci_registry(workdir: Path) -> Iterator[str]:
    """The CNCF distribution registry (Debian package `docker-registry`)."""
    binary = shutil.which("docker-registry") or shutil.which("registry")
    if binary is None:
        unavailable("no docker-registry binary (apt-get install docker-registry)")
    port = free_port()
    config = workdir / "registry.yml"
    config.write_text(
        "version: 0.1\n"
        "log: {level: warn}\n"
        f"storage: {{filesystem: {{rootdirectory: {workdir / 'data'}}}}}\n"
        f"http: {{addr: '127.0.0.1:{port}'}}\n"
    )
    with server([binary, "serve", str(config)], f"http://127.0.0.1:{port}/v2/", workdir):
        yield f"127.0.0.1:{port}"


@contextmanager
def s3_server(workdir: Path) -> Iterator[str]:
    """moto's S3-compatible server (`moto[server]`, in the test extra)."""
    binary = shutil.which("moto_server") or str(Path(os.sys.executable).parent / "moto_server")
    if not Path(binary).exists():
        unavailable("no moto_server (pip install 'moto[server]')")
    port = free_port()
    with server([binary, "-H", "127.0.0.1", "-p", str(port)], f"http://127.0.0.1:{port}/", workdir):
        yield f"http://127.0.0.1:{port}"


@contextmanager
def gcs_server(workdir: Path, bucket: str) -> Iterator[str]:
    """gcp-storage-emulator (in the test extra), in memory, with ``bucket`` created.

    gcsfs talks to it when ``STORAGE_EMULATOR_HOST`` names it, the variable Google's own clients
    honour, so kiln's code path is the production one.
    """
    binary = Path(os.sys.executable).parent / "gcp-storage-emulator"
    if not binary.exists():
        unavailable("no gcp-storage-emulator (pip install gcp-storage-emulator)")
    port = free_port()
    argv = [str(binary), "start", "-H", "127.0.0.1", "--port", str(port), "-M", "-q"]
    with server([*argv, "--default-bucket", bucket], f"http://127.0.0.1:{port}/", workdir):
        yield f"http://127.0.0.1:{port}"


# --- scripted HTTP: the misbehaving servers that real ones only show on a bad day ----------------

Script = Callable[["Exchange"], None]


class Exchange:
    """One request to a :func:`scripted_http` server: the script answers it by hand."""

    def __init__(self, conn: socket.socket, path: str, index: int, stop: threading.Event) -> None:
        self.conn, self.path, self.index, self.stop = conn, path, index, stop

    def send(self, data: bytes) -> None:
        self.conn.sendall(data)

    def head(self, status: str = "200 OK", **headers: str | int) -> None:
        lines = [f"HTTP/1.1 {status}", "Connection: close"]
        lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
        self.send(("\r\n".join(lines) + "\r\n\r\n").encode())

    def body(self, data: bytes) -> None:
        self.head(Content_Length=len(data), Content_Type="application/octet-stream")
        self.send(data)

    def redirect(self, location: str, status: str = "302 Found") -> None:
        self.head(status, Location=location, Content_Length=0)

    def trickle(self, data: bytes, every: float) -> None:
        """Send ``data`` one byte at a time, ``every`` seconds apart, until the test ends."""
        for i in range(len(data)):
            if self.stop.wait(every):
                return
            self.send(data[i : i + 1])

    def hang(self) -> None:
        """Answer nothing until the test ends."""
        self.stop.wait(60)


@contextmanager
def serve_folder(folder: Path) -> Iterator[str]:
    """A well-behaved loopback HTTP server (the standard library's) for the files in ``folder``;
    yields its base URL."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(folder))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def scripted_http(script: Script, tls: ssl.SSLContext | None = None) -> Iterator[str]:
    """A loopback HTTP/1.1 server whose every answer ``script(exchange)`` writes by hand.

    For behaviours no well-behaved server shows on demand: trickling or stalling, cutting a
    body off, redirecting to odd schemes. Yields the base URL; requests are counted in
    ``exchange.index`` (0 for the first), so a script can fail once and then serve.
    """
    stop = threading.Event()
    count = iter(range(1 << 30))
    lock = threading.Lock()

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            conn: socket.socket = self.request
            if tls is not None:
                try:
                    conn = tls.wrap_socket(conn, server_side=True)
                except (OSError, ssl.SSLError):
                    return
            conn.settimeout(10)
            data = b""
            try:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    data += chunk
                path = data.split(b" ", 2)[1].decode()
                with lock:
                    index = next(count)
                script(Exchange(conn, path, index, stop))
            except OSError:
                pass  # the client gave up (a deadline), as the tests intend
            finally:
                with contextlib.suppress(OSError):
                    conn.close()

    class Server(socketserver.ThreadingTCPServer):
        daemon_threads = True
        allow_reuse_address = True

    srv = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05})
    thread.daemon = True
    thread.start()
    scheme = "https" if tls is not None else "http"
    try:
        yield f"{scheme}://127.0.0.1:{srv.server_address[1]}"
    finally:
        stop.set()
        srv.shutdown()
        srv.server_close()


def self_signed_tls(workdir: Path) -> tuple[ssl.SSLContext, Path] | None:
    """A server context with a fresh certificate for 127.0.0.1, and the certificate file a
    client must trust (SSL_CERT_FILE); None without the openssl command."""
    if shutil.which("openssl") is None:
        return None
    key, cert = workdir / "key.pem", workdir / "cert.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-nodes", "-days", "1"),
            *("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1"),
            *("-addext", "subjectAltName=IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    return context, cert
