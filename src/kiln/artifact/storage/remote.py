"""Remote artifact stores (optional extras): S3 and GCS through fsspec, OCI registries via oras.

Credentials come from each ecosystem's usual places and nowhere else: the AWS environment,
profile and instance metadata (s3fs/botocore), Google's application-default credentials
(gcsfs), and the docker config (oras). kiln adds no credential files of its own. Torch-free; each
client is imported only when its scheme is used, with a one-line hint when the extra is missing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import threading
import urllib.parse
from pathlib import Path
from typing import IO, Any

from kiln.artifact.storage import (
    ATTEMPTS,
    ByteSink,
    Deadline,
    _copy_hashing,
    _shown,
    register,
    scheme_of,
)
from kiln.errors import IntegrityError, KilnError, NotFoundError, UsageError

# The artifact is a real image layer (tar+zstd): `COPY --from` and Kubernetes image volumes can use
# it as is. The config blob is kiln's manifest, so a registry UI or `kiln inspect` can read the
# fingerprint without pulling the payload; its media type marks the artifact as kiln's (oras-py
# 0.2 cannot set `artifactType`, and an empty config would require it).
OCI_LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar+zstd"
OCI_CONFIG_TYPE = "application/vnd.kiln.manifest.v1+json"
OCI_MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
_CHUNK = 1 << 20


def _need(module: str, extra: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UsageError(
            f"this source needs the {extra!r} extra: pip install 'torch-kiln[{extra}]'"
        ) from None


# --- S3 / GCS through fsspec ----------------------------------------------------------------


def _fsspec_options(scheme: str, deadline: Deadline) -> dict[str, Any]:
    """Client timeouts for one fetch: each wait is bounded by the idle limit (S3), or each
    request by what is left of the deadline (GCS); the copy loop checks the total."""
    if scheme == "s3":
        idle = deadline.idle
        return {"config_kwargs": {"connect_timeout": idle, "read_timeout": idle}}
    return {"requests_timeout": max(deadline.remaining(), 0.001), "skip_instance_cache": True}


def _fsspec_fetch(
    source: str, out: IO[bytes], on_bytes: ByteSink | None, deadline: Deadline
) -> tuple[str, int]:
    scheme = scheme_of(source)
    fsspec = _need("fsspec", "s3" if scheme == "s3" else "gcs")
    try:
        fs, path = fsspec.core.url_to_fs(source, **_fsspec_options(scheme, deadline))
        total = fs.size(path)
        deadline.check(source)
        with fs.open(path, "rb") as src:
            return _copy_hashing(src, out, total, on_bytes, deadline, source)
    except FileNotFoundError:
        raise NotFoundError(f"{source}: no such object") from None
    except ImportError as exc:
        raise UsageError(
            f"{source}: missing client library ({exc.name}); install kiln's extra"
        ) from None
    except KilnError:
        raise
    except Exception as exc:  # the client's own errors (timeouts, refused connections, ...)
        if deadline.expired:
            raise deadline.error(source) from None
        raise KilnError(f"{source}: download failed: {type(exc).__name__}: {exc}") from None


def _fsspec_push(src: Path, dest: str) -> dict[str, Any]:
    fsspec = _need("fsspec", "s3" if dest.startswith("s3") else "gcs")
    fs, path = fsspec.core.url_to_fs(dest)
    if dest.endswith("/"):  # url_to_fs strips it: a "folder" destination keeps the file name
        path = f"{path.rstrip('/')}/{src.name}"
    with open(src, "rb") as fh, fs.open(path, "wb") as out:
        sha, size = _copy_hashing(fh, out, None, None)
    return {"dest": f"{dest.split('://', 1)[0]}://{path}", "sha256": sha, "size": size}


# --- OCI registries through oras ------------------------------------------------------------


def _oci_ref(url: str) -> tuple[str, str]:
    ref = url.removeprefix("oci://")
    host = ref.split("/", 1)[0]
    if "/" not in ref:
        raise UsageError(f"{url}: expected oci://REGISTRY/REPOSITORY[:TAG|@sha256:DIGEST]")
    return host, ref


def _insecure(host: str) -> bool:
    """Plain HTTP for loopback registries, or where KILN_OCI_INSECURE lists the host."""
    name = host.split(":", 1)[0]
    allowed = {h.strip() for h in os.environ.get("KILN_OCI_INSECURE", "").split(",") if h.strip()}
    return name in ("localhost", "127.0.0.1", "::1") or host in allowed or name in allowed


def _registry(host: str, deadline: Deadline | None = None) -> Any:
    provider = _need("oras.provider", "oci")
    reg = provider.Registry(hostname=host, insecure=_insecure(host))
    if deadline is not None:
        _bound_session(reg.session, deadline)
    return reg


def _bound_session(session: Any, deadline: Deadline) -> None:
    """Give every request of this oras session the idle limit, and follow redirects only to
    http(s) (never https to http), as kiln's own HTTP client does.

    requests has no timeout unless one is passed per call, and oras passes none: a registry that
    stops answering would hold the restore forever.
    """
    import requests.adapters

    class Bounded(requests.adapters.HTTPAdapter):
        def send(self, request: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("timeout") is None:
                kwargs["timeout"] = (deadline.idle, deadline.idle)
            return super().send(request, *args, **kwargs)

    def redirects(response: Any, *args: Any, **kwargs: Any) -> None:
        if not response.is_redirect:
            return
        target = urllib.parse.urljoin(response.url, response.headers.get("Location", ""))
        old = urllib.parse.urlsplit(response.url).scheme.lower()
        new = urllib.parse.urlsplit(target).scheme.lower()
        if new not in ("http", "https") or (old == "https" and new == "http"):
            response.close()
            raise IntegrityError(
                f"{response.url}: redirect to {_shown(target)} refused "
                "(only http(s) is followed, and never from https to http)"
            )

    for prefix in ("http://", "https://"):
        session.mount(prefix, Bounded())
    session.hooks["response"].append(redirects)


def _check(response: Any, what: str) -> Any:
    if response.status_code == 404:
        raise NotFoundError(f"{what}: not found in the registry")
    if response.status_code >= 400:
        raise KilnError(
            f"{what}: registry answered HTTP {response.status_code}: {_shown(response.text[:200])}"
        )
    return response


def _request(reg: Any, url: str, deadline: Deadline, source: str, **kwargs: Any) -> Any:
    """One registry GET, retried within ``deadline`` (oras's own retry sleeps up to 83 s per
    try and ignores any deadline, so its undecorated ``do_request`` is called)."""
    import requests

    do_request = getattr(type(reg).do_request, "__wrapped__", None)
    last: BaseException | None = None
    for attempt in range(ATTEMPTS):
        if attempt:
            deadline.sleep(0.5 * attempt)
        deadline.check(source)
        try:
            if do_request is not None:
                response = do_request(reg, url, "GET", **kwargs)
            else:
                response = reg.do_request(url, "GET", **kwargs)
        except requests.exceptions.InvalidSchema as exc:
            raise IntegrityError(
                f"{source}: registry redirected to an unsupported URL: {exc}"
            ) from None
        except (requests.exceptions.RequestException, OSError) as exc:
            last = exc
            continue
        if response.status_code < 500:
            return response
        response.close()
        last = KilnError(f"HTTP {response.status_code}")
    if deadline.expired:
        raise deadline.error(source)
    raise KilnError(f"{source}: registry request failed after {ATTEMPTS} attempts: {last}")


def _oci_fetch(
    source: str, out: IO[bytes], on_bytes: ByteSink | None, deadline: Deadline
) -> tuple[str, int]:
    host, ref = _oci_ref(source)
    reg = _registry(host, deadline)
    container = reg.get_container(ref)
    reg.auth.load_configs(container)
    headers = {"Accept": OCI_MANIFEST_TYPE}
    url = f"{reg.prefix}://{container.manifest_url()}"
    resp = _check(_request(reg, url, deadline, source, headers=headers), source)
    if "@sha256:" in ref:
        pinned = ref.rsplit("@", 1)[1]
        actual = "sha256:" + hashlib.sha256(resp.content).hexdigest()
        if actual != pinned:
            raise IntegrityError(f"{source}: registry served manifest {actual}")
    try:
        manifest = json.loads(resp.content)
        layers = [
            layer
            for layer in manifest.get("layers", [])
            if isinstance(layer, dict) and layer.get("mediaType") == OCI_LAYER_TYPE
        ]
    except (ValueError, AttributeError):
        raise IntegrityError(f"{source}: the registry's manifest is not OCI JSON") from None
    if len(layers) != 1 or not isinstance(layers[0].get("digest"), str):
        raise IntegrityError(f"{source}: not a kiln artifact (expected one {OCI_LAYER_TYPE} layer)")
    layer = layers[0]
    blob_url = f"{reg.prefix}://{container.get_blob_url(layer['digest'])}"
    blob = _check(
        _request(reg, blob_url, deadline, source, headers=dict(reg.headers), stream=True), source
    )
    size = layer.get("size") if isinstance(layer.get("size"), int) else None
    sha, n = _copy_response(blob, out, size, on_bytes, deadline, source)
    if "sha256:" + sha != layer["digest"]:
        raise IntegrityError(f"{source}: layer digest mismatch")
    return sha, n


def _copy_response(
    blob: Any,
    out: IO[bytes],
    total: int | None,
    on_bytes: ByteSink | None,
    deadline: Deadline,
    source: str,
) -> tuple[str, int]:
    """Stream a requests response body, hashing it, within ``deadline``.

    ``read1`` returns after one receive, so the deadline is checked between receives; a timer
    shuts the connection down when the deadline passes (urllib3's ``shutdown`` unblocks a read
    in progress), so a registry that trickles bytes is cut too.
    """
    import requests
    import urllib3.exceptions

    raw = blob.raw
    read = getattr(raw, "read1", None) or raw.read
    shutdown = getattr(raw, "shutdown", None)

    def cut() -> None:
        deadline.cut = True
        if shutdown is not None:
            with contextlib.suppress(Exception):
                shutdown()

    timer = threading.Timer(max(0.0, deadline.remaining()), cut)
    timer.daemon = True
    timer.start()
    h = hashlib.sha256()
    n = 0
    try:
        while True:
            chunk = read(_CHUNK)
            deadline.check(source)
            if not chunk:
                break
            h.update(chunk)
            out.write(chunk)
            n += len(chunk)
            if on_bytes:
                on_bytes(n, total)
    except (
        requests.exceptions.RequestException,
        urllib3.exceptions.HTTPError,
        OSError,
    ) as exc:
        if deadline.expired:
            raise deadline.error(source) from None
        raise KilnError(f"{source}: layer download failed: {exc}") from None
    finally:
        timer.cancel()
        blob.close()
    return h.hexdigest(), n


def _oci_push(src: Path, dest: str) -> dict[str, Any]:
    from kiln.artifact.archive import read_manifest

    oci = _need("oras.oci", "oci")
    host, ref = _oci_ref(dest)
    reg = _registry(host)
    container = reg.get_container(ref)
    reg.auth.load_configs(container)
    kiln_manifest = read_manifest(src)
    layer = oci.NewLayer(str(src), media_type=OCI_LAYER_TYPE, is_dir=False)
    layer["annotations"] = {"org.opencontainers.image.title": src.name}
    _check(reg.upload_blob(str(src), container, layer), dest)
    with tempfile.TemporaryDirectory(prefix="kiln-oci-") as tmp:
        config_path = Path(tmp, "config.json")
        config_path.write_bytes(kiln_manifest.to_bytes())
        config, _ = oci.ManifestConfig(str(config_path), OCI_CONFIG_TYPE)
        _check(reg.upload_blob(str(config_path), container, config), dest)
    manifest = oci.NewManifest()
    manifest["config"] = config
    manifest["layers"] = [layer]
    manifest["annotations"] = {
        "org.opencontainers.image.title": kiln_manifest.name,
        "dev.kiln.name": kiln_manifest.name,
        "dev.kiln.spec-sha256": kiln_manifest.spec_sha256,
        "dev.kiln.torch": str(kiln_manifest.fingerprint.get("torch.version")),
        "dev.kiln.gpu": str(kiln_manifest.fingerprint.get("gpu.name") or "cpu"),
    }
    resp = _check(reg.upload_manifest(manifest, container), dest)
    digest = resp.headers.get("Docker-Content-Digest")
    repo = ref.split("@", 1)[0].rsplit(":", 1)[0] if ":" in ref.split("/", 1)[1] else ref
    return {
        "dest": dest,
        "sha256": layer["digest"].removeprefix("sha256:"),
        "size": layer["size"],
        "manifest_digest": digest,
        "pinned": f"oci://{repo}@{digest}" if digest else None,
    }


for _scheme in ("s3", "gs", "gcs"):
    register(_scheme, _fsspec_fetch)
register("oci", _oci_fetch)

PUSHERS = {"s3": _fsspec_push, "gs": _fsspec_push, "gcs": _fsspec_push, "oci": _oci_push}
