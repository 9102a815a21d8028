"""Real servers on loopback for storage tests: an OCI registry, S3- and GCS-compatible servers.

In CI (CI=true) a server that cannot start fails the tests loudly; on a developer machine without
the binary they are skipped with the reason.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
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
