"""Restore over HTTP(S) and from registries against servers that misbehave on purpose.

Each server here is real (a socket on loopback) and scripted: it redirects to other schemes,
trickles bytes, stalls, or cuts its body off. Budgets are small (``--timeout 1``..``4``) so the
whole file stays fast.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from kiln.artifact.restore import restore
from kiln.errors import IntegrityError, KilnError, UsageError
from kiln.events import Event
from tests.archives import good_archive
from tests.servers import Exchange, scripted_http, self_signed_tls

FILES = {"inductor/fxgraph/a/entry": b"A" * 1000, "inductor/xy/k.py": b"print(1)\n"}


@pytest.fixture
def artifact(tmp_path: Path) -> bytes:
    return good_archive(tmp_path / "a.kiln.tar.zst", FILES).read_bytes()


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".") and "kiln" in p.name)


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "internal error" not in lines[0] and "Traceback" not in stderr
    return lines[0]


# --- redirects ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    ["ftp://127.0.0.1:1/a.kiln.tar.zst", "file:///etc/passwd", "gopher://127.0.0.1:1/x"],
    ids=["ftp", "file", "gopher"],
)
def test_redirect_to_other_schemes_refused(tmp_path: Path, cli, target: str) -> None:
    with scripted_http(lambda x: x.redirect(target)) as url:
        proc = cli("restore", f"{url}/a.kiln.tar.zst", "--dest", tmp_path / "c", no_torch=True)
    assert proc.returncode == 3, proc.stderr
    assert "refused" in one_line(proc.stderr)
    assert not (tmp_path / "c").exists() and leftovers(tmp_path) == []


def test_redirects_between_http_urls_are_followed(tmp_path: Path, artifact: bytes) -> None:
    def script(x: Exchange) -> None:
        if x.path == "/a.kiln.tar.zst":
            x.redirect("/moved/a.kiln.tar.zst", "301 Moved Permanently")
        else:
            x.body(artifact)

    with scripted_http(script) as url:
        result = restore(f"{url}/a.kiln.tar.zst", tmp_path / "c")
    assert result.sha256 == hashlib.sha256(artifact).hexdigest()


@pytest.fixture
def tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    made = self_signed_tls(tmp_path)
    if made is None:
        pytest.skip("no openssl command to make a test certificate")
    context, cert = made
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    return context


def test_https_works_and_never_downgrades_to_http(tmp_path: Path, artifact: bytes, tls) -> None:
    with scripted_http(lambda x: x.body(artifact)) as plain:

        def script(x: Exchange) -> None:
            if x.path == "/down":
                x.redirect(f"{plain}/a.kiln.tar.zst")
            else:
                x.body(artifact)

        with scripted_http(script, tls=tls) as url:
            result = restore(f"{url}/a.kiln.tar.zst", tmp_path / "c")
            assert result.sha256 == hashlib.sha256(artifact).hexdigest()
            with pytest.raises(IntegrityError, match="refused"):
                restore(f"{url}/down", tmp_path / "d")
    assert not (tmp_path / "d").exists()


# --- deadlines ------------------------------------------------------------------------------


def test_trickled_body_is_cut_by_the_deadline(tmp_path: Path, artifact: bytes) -> None:
    def script(x: Exchange) -> None:
        x.head(Content_Length=len(artifact))
        x.trickle(artifact, every=0.1)  # never idle long enough for the idle limit

    installed = tmp_path / "c"
    restore(good_archive(tmp_path / "old.kiln.tar.zst", {"inductor/o": b"o"}), installed)
    before = sorted(p.name for p in installed.rglob("*"))
    with scripted_http(script) as url:
        t0 = time.monotonic()
        with pytest.raises(KilnError, match=r"did not finish within timeout=1s"):
            restore(f"{url}/a.kiln.tar.zst", installed, timeout=1)
        assert time.monotonic() - t0 < 4  # 1 s and the teardown of one try
    assert sorted(p.name for p in installed.rglob("*")) == before
    assert leftovers(tmp_path) == []


def test_trickled_headers_are_cut_by_the_deadline(tmp_path: Path, cli) -> None:
    def script(x: Exchange) -> None:
        x.trickle(b"HTTP/1.1 200 OK\r\n" + b"X-Slow: " + b"x" * 10_000, every=0.1)

    with scripted_http(script) as url:
        t0 = time.monotonic()
        proc = cli(
            *("restore", f"{url}/a.kiln.tar.zst", "--dest", tmp_path / "c"),
            *("--timeout", "1"),
            no_torch=True,
            timeout=30,
        )
        took = time.monotonic() - t0
    assert proc.returncode == 1, proc.stderr
    assert "did not finish within --timeout 1s" in one_line(proc.stderr)
    assert took < 10  # interpreter start-up included


def test_stalled_connection_is_retried_within_the_deadline(tmp_path: Path, artifact: bytes) -> None:
    def script(x: Exchange) -> None:
        if x.index == 0:
            x.head(Content_Length=len(artifact))
            x.send(artifact[:100])
            x.hang()  # idle: the client must give up on this try and ask again
        else:
            x.body(artifact)

    with scripted_http(script) as url:
        t0 = time.monotonic()
        result = restore(f"{url}/a.kiln.tar.zst", tmp_path / "c", timeout=4)  # idle 1 s
        assert time.monotonic() - t0 < 3.5
    assert result.sha256 == hashlib.sha256(artifact).hexdigest()


def test_registry_that_never_answers_is_cut_by_the_deadline(tmp_path: Path, cli) -> None:
    with scripted_http(Exchange.hang) as url:
        host = url.removeprefix("http://")
        t0 = time.monotonic()
        proc = cli(
            *("restore", f"oci://{host}/kiln/demo:v1", "--dest", tmp_path / "c"),
            *("--timeout", "2"),
            no_torch=True,
            timeout=30,
        )
        took = time.monotonic() - t0
    if "needs the 'oci' extra" in proc.stderr:
        pytest.skip("oras is not installed")
    assert proc.returncode == 1, proc.stderr
    line = one_line(proc.stderr)
    assert "--timeout 2s" in line or "timed out" in line.lower()
    assert took < 12


def test_registry_that_trickles_the_layer_is_cut(tmp_path: Path, artifact: bytes) -> None:
    pytest.importorskip("oras.provider")
    digest = "sha256:" + hashlib.sha256(artifact).hexdigest()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.kiln.manifest.v1+json", "digest": digest},
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar+zstd",
                    "digest": digest,
                    "size": len(artifact),
                }
            ],
        }
    ).encode()

    def script(x: Exchange) -> None:
        if "/manifests/" in x.path:
            x.body(manifest)
        else:
            x.head(Content_Length=len(artifact))
            x.trickle(artifact, every=0.1)

    with scripted_http(script) as url:
        host = url.removeprefix("http://")
        t0 = time.monotonic()
        with pytest.raises(KilnError, match=r"did not finish within timeout=1s"):
            restore(f"oci://{host}/kiln/demo:v1", tmp_path / "c", timeout=1)
        assert time.monotonic() - t0 < 4  # 1 s and the teardown of one try


def test_registry_redirect_to_another_scheme_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("oras.provider")
    with scripted_http(lambda x: x.redirect("ftp://127.0.0.1:1/blob")) as url:
        host = url.removeprefix("http://")
        with pytest.raises(IntegrityError, match="refused"):
            restore(f"oci://{host}/kiln/demo:v1", tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_deadline_is_checked_between_chunks(tmp_path: Path, artifact: bytes) -> None:
    def slow_consumer(event: Event) -> None:
        if event.event == "fetched":
            time.sleep(1.2)

    with (
        scripted_http(lambda x: x.body(artifact)) as url,
        pytest.raises(KilnError, match="did not finish"),
    ):
        restore(f"{url}/a", tmp_path / "c", timeout=1, on_event=slow_consumer)


def test_url_without_a_host_is_a_usage_error(tmp_path: Path) -> None:
    for url in ("http://", "https:///a.kiln.tar.zst", "http://[::1/a"):
        with pytest.raises(UsageError, match="not a valid URL"):
            restore(url, tmp_path / "c")


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_timeout_must_be_a_positive_number(tmp_path: Path, cli, value: str) -> None:
    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    proc = cli("restore", art, "--dest", tmp_path / "c", "--timeout", value, no_torch=True)
    assert proc.returncode == 2, proc.stderr
    assert not (tmp_path / "c").exists()
    with pytest.raises(UsageError):
        restore(art, tmp_path / "c", timeout=float(value) if value != "soon" else value)


# --- bodies cut short -----------------------------------------------------------------------


def _chunked_cut(x: Exchange, artifact: bytes) -> None:
    x.head(Transfer_Encoding="chunked")
    half = artifact[: len(artifact) // 2]
    x.send(f"{len(half):x}\r\n".encode() + half + b"\r\n")  # then hang up: no last chunk


def test_cut_chunked_body_is_an_integrity_error(tmp_path: Path, cli, artifact: bytes) -> None:
    with scripted_http(lambda x: _chunked_cut(x, artifact)) as url:
        proc = cli("restore", f"{url}/a.kiln.tar.zst", "--dest", tmp_path / "c", no_torch=True)
    assert proc.returncode == 3, proc.stderr
    assert "cut short" in one_line(proc.stderr)
    assert not (tmp_path / "c").exists() and leftovers(tmp_path) == []


def test_short_body_is_an_integrity_error(tmp_path: Path, artifact: bytes) -> None:
    def script(x: Exchange) -> None:
        x.head(Content_Length=len(artifact))
        x.send(artifact[:-10])

    with scripted_http(script) as url, pytest.raises(IntegrityError, match="cut short"):
        restore(f"{url}/a.kiln.tar.zst", tmp_path / "c")


def test_cut_body_is_retried(tmp_path: Path, artifact: bytes) -> None:
    def script(x: Exchange) -> None:
        if x.index == 0:
            _chunked_cut(x, artifact)
        else:
            x.body(artifact)

    with scripted_http(script) as url:
        result = restore(f"{url}/a.kiln.tar.zst", tmp_path / "c")
    assert result.sha256 == hashlib.sha256(artifact).hexdigest()


def test_registry_trickling_its_manifest_is_cut_by_the_deadline(tmp_path: Path) -> None:
    """A review found the manifest (and every small registry document) read whole, outside the
    deadline: a registry sending one byte every 0.3 s held a --timeout 2 restore for minutes."""
    pytest.importorskip("oras.provider")
    body = b'{"schemaVersion": 2, "layers": []}' * 10

    def script(x: Exchange) -> None:
        x.head(Content_Length=len(body), Content_Type="application/vnd.oci.image.manifest.v1+json")
        x.trickle(body, every=0.3)

    with scripted_http(script) as url:
        t0 = time.monotonic()
        with pytest.raises(KilnError, match=r"did not finish within timeout=2s"):
            restore(f"oci://{url.removeprefix('http://')}/x/y:v1", tmp_path / "c", timeout=2)
        assert time.monotonic() - t0 < 6
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    "document",
    [b"[" * 100_000, b'{"layers": 5}', b"[1, 2]", b'{"layers": [{"mediaType": 5}]}'],
)
def test_hostile_registry_manifests_are_integrity_errors(tmp_path: Path, document: bytes) -> None:
    pytest.importorskip("oras.provider")
    with scripted_http(lambda x: x.body(document)) as url, pytest.raises(IntegrityError):
        restore(f"oci://{url.removeprefix('http://')}/x/y:v1", tmp_path / "c", timeout=5)
    assert not (tmp_path / "c").exists()


def test_oversized_registry_manifest_is_refused_from_its_length(tmp_path: Path) -> None:
    pytest.importorskip("oras.provider")

    def script(x: Exchange) -> None:
        x.head(Content_Length=1 << 30, Content_Type="application/vnd.oci.image.manifest.v1+json")
        x.hang()

    with scripted_http(script) as url:
        t0 = time.monotonic()
        with pytest.raises(IntegrityError, match="over"):
            restore(f"oci://{url.removeprefix('http://')}/x/y:v1", tmp_path / "c", timeout=20)
        assert time.monotonic() - t0 < 5
