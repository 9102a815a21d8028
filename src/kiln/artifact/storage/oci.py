"""OCI registries through oras (extra ``torch-kiln[oci]``).

The artifact is a real image layer (tar+zstd): ``COPY --from`` and Kubernetes image volumes can
use it as is. The config blob is kiln's manifest, so a registry UI or ``kiln inspect`` can read
the fingerprint without pulling the payload; its media type marks the artifact as kiln's (oras-py
0.2 cannot set ``artifactType``, and an empty config would require it). Credentials come from the
docker config, as oras reads it; kiln adds none of its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kiln.artifact.storage.base import (
    ATTEMPTS,
    ByteSink,
    Deadline,
    Digest,
    PushResult,
    RedirectRefused,
    Store,
    copy_hashing,
    need_extra,
    redirect_allowed,
    shown,
)
from kiln.errors import IntegrityError, KilnError, NotFoundError, UsageError

OCI_LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar+zstd"
OCI_CONFIG_TYPE = "application/vnd.kiln.manifest.v1+json"
OCI_MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"


@dataclass(frozen=True)
class OciPushResult(PushResult):
    """A push to a registry also names the image manifest, and the reference that pins it."""

    manifest_digest: str | None
    pinned: str | None  # oci://registry/repo@sha256:… (None if the registry sent no digest)


class OciStore(Store):
    """``oci://registry/repository[:tag|@sha256:digest]``."""

    def fetch(
        self, url: str, into: IO[bytes], *, deadline: Deadline, on_bytes: ByteSink | None
    ) -> Digest:
        host, ref = _oci_ref(url)
        reg = _registry(host, deadline)
        container = reg.get_container(ref)
        reg.auth.load_configs(container)
        headers = {"Accept": OCI_MANIFEST_TYPE}
        manifest_url = f"{reg.prefix}://{container.manifest_url()}"
        resp = _check(_request(reg, manifest_url, deadline, url, headers=headers), url)
        if "@sha256:" in ref:
            pinned = ref.rsplit("@", 1)[1]
            actual = "sha256:" + hashlib.sha256(resp.content).hexdigest()
            if actual != pinned:
                raise IntegrityError(f"{url}: registry served manifest {actual}")
        layer = _kiln_layer(resp.content, url)
        blob_url = f"{reg.prefix}://{container.get_blob_url(layer['digest'])}"
        blob = _check(
            _request(reg, blob_url, deadline, url, headers=dict(reg.headers), stream=True), url
        )
        size = layer.get("size") if isinstance(layer.get("size"), int) else None
        got = _copy_response(blob, into, size, on_bytes, deadline, url)
        if "sha256:" + got.sha256 != layer["digest"]:
            raise IntegrityError(f"{url}: layer digest mismatch")
        return got

    def push(self, src: Path, url: str) -> OciPushResult:
        from kiln.artifact.archive import read_manifest

        oci = need_extra("oras.oci", "oci")
        host, ref = _oci_ref(url)
        reg = _registry(host)
        container = reg.get_container(ref)
        reg.auth.load_configs(container)
        kiln_manifest = read_manifest(src)
        layer = oci.NewLayer(str(src), media_type=OCI_LAYER_TYPE, is_dir=False)
        layer["annotations"] = {"org.opencontainers.image.title": src.name}
        _check(reg.upload_blob(str(src), container, layer), url)
        with tempfile.TemporaryDirectory(prefix="kiln-oci-") as tmp:
            config_path = Path(tmp, "config.json")
            config_path.write_bytes(kiln_manifest.to_bytes())
            config, _ = oci.ManifestConfig(str(config_path), OCI_CONFIG_TYPE)
            _check(reg.upload_blob(str(config_path), container, config), url)
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
        resp = _check(reg.upload_manifest(manifest, container), url)
        digest = resp.headers.get("Docker-Content-Digest")
        repo = ref.split("@", 1)[0].rsplit(":", 1)[0] if ":" in ref.split("/", 1)[1] else ref
        return OciPushResult(
            dest=url,
            sha256=layer["digest"].removeprefix("sha256:"),
            size=layer["size"],
            manifest_digest=digest,
            pinned=f"oci://{repo}@{digest}" if digest else None,
        )


def _oci_ref(url: str) -> tuple[str, str]:
    ref = url.removeprefix("oci://")
    host = ref.split("/", 1)[0]
    if "/" not in ref:
        raise UsageError(f"{url}: expected oci://REGISTRY/REPOSITORY[:TAG|@sha256:DIGEST]")
    return host, ref


def _kiln_layer(content: bytes, url: str) -> dict[str, Any]:
    """The one kiln layer an image manifest must list."""
    try:
        manifest = json.loads(content)
        layers = [
            layer
            for layer in manifest.get("layers", [])
            if isinstance(layer, dict) and layer.get("mediaType") == OCI_LAYER_TYPE
        ]
    except (ValueError, AttributeError):
        raise IntegrityError(f"{url}: the registry's manifest is not OCI JSON") from None
    if len(layers) != 1 or not isinstance(layers[0].get("digest"), str):
        raise IntegrityError(f"{url}: not a kiln artifact (expected one {OCI_LAYER_TYPE} layer)")
    return layers[0]


def _insecure(host: str) -> bool:
    """Plain HTTP for loopback registries, or where KILN_OCI_INSECURE lists the host."""
    name = host.split(":", 1)[0]
    allowed = {h.strip() for h in os.environ.get("KILN_OCI_INSECURE", "").split(",") if h.strip()}
    return name in ("localhost", "127.0.0.1", "::1") or host in allowed or name in allowed


def _registry(host: str, deadline: Deadline | None = None) -> Any:
    provider = need_extra("oras.provider", "oci")
    reg = provider.Registry(hostname=host, insecure=_insecure(host))
    if deadline is not None:
        _bound_session(reg.session, deadline)
    return reg


def _bound_session(session: Any, deadline: Deadline) -> None:
    """Give every request of this oras session the idle limit, and follow only the redirects
    :func:`redirect_allowed` allows, as kiln's own HTTP client does.

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
        if not redirect_allowed(response.url, target):
            response.close()
            raise RedirectRefused(response.url, target)

    for prefix in ("http://", "https://"):
        session.mount(prefix, Bounded())
    session.hooks["response"].append(redirects)


def _check(response: Any, what: str) -> Any:
    if response.status_code == 404:
        raise NotFoundError(f"{what}: not found in the registry")
    if response.status_code >= 400:
        raise KilnError(
            f"{what}: registry answered HTTP {response.status_code}: {shown(response.text[:200])}"
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


def _copy_response(
    blob: Any,
    into: IO[bytes],
    total: int | None,
    on_bytes: ByteSink | None,
    deadline: Deadline,
    source: str,
) -> Digest:
    """Stream a requests response body, hashing it, within ``deadline``.

    ``read1`` returns after one receive, so the deadline is checked between receives; when it
    passes, the alarm shuts the connection down (urllib3's ``shutdown`` unblocks a read in
    progress), so a registry that trickles bytes is cut too.
    """
    import requests
    import urllib3.exceptions

    raw = blob.raw
    read = getattr(raw, "read1", None) or raw.read
    shutdown = getattr(raw, "shutdown", None)

    def cut() -> None:
        if shutdown is not None:
            with contextlib.suppress(Exception):
                shutdown()

    try:
        with deadline.alarm(cut):
            return copy_hashing(
                read, into, total=total, on_bytes=on_bytes, deadline=deadline, source=source
            )
    except (
        requests.exceptions.RequestException,
        urllib3.exceptions.HTTPError,
        OSError,
    ) as exc:
        if deadline.expired:
            raise deadline.error(source) from None
        raise KilnError(f"{source}: layer download failed: {exc}") from None
    finally:
        blob.close()
