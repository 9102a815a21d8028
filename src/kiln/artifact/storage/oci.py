"""OCI registries through oras (extra ``torch-kiln[oci]``): the registry transport.

The artifact is a real image layer (tar+zstd): ``COPY --from`` and Kubernetes image volumes can
use it as is. Credentials come from the docker config, as oras reads it; kiln adds none of its
own. This module moves documents and blobs: every request under the fetch's :class:`Deadline`
and kiln's redirect rule, every document read bounded, every digest checked. What kiln's objects
look like in a registry (kiln's manifest as the config, a bundle as an image index, attestations
as referrers) is decided above storage, in :mod:`kiln.artifact.oci_layout` and
:mod:`kiln.artifact.oci_publish`, as httpx transports know nothing of the layers above.

Fetching, an image index (a bundle) is resolved by the ``select`` the caller passes
(:func:`kiln.artifact.oci_layout.variant_select`): it names the variant's manifest, and only
that variant's layer is fetched; a pin (``--sha256`` or ``@sha256:``) names the index.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import urllib.parse
from pathlib import Path
from typing import IO, Any

from kiln.artifact.storage.base import (
    ATTEMPTS,
    DOWNLOAD_NAME,
    ByteSink,
    CappedBuffer,
    Deadline,
    Digest,
    FetchedFile,
    RedirectRefused,
    Select,
    Store,
    copy_hashing,
    json_object,
    need_extra,
    redirect_allowed,
    shown,
)
from kiln.errors import IntegrityError, KilnError, NotFoundError, UsageError

OCI_LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar+zstd"
OCI_MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
MAX_DOCUMENT_BYTES = 16 << 20  # per manifest, index or attestation layer


class OciStore(Store):
    """``oci://registry/repository[:tag|@sha256:digest]``."""

    def open(
        self,
        url: str,
        workdir: Path,
        *,
        deadline: Deadline,
        on_bytes: ByteSink | None,
        select: Select | None = None,
    ) -> FetchedFile:
        """The artifact, or for a bundle (an image index) the variant ``select`` chooses."""
        dest = workdir / DOWNLOAD_NAME
        out = open(dest, "x+b")  # noqa: SIM115 - handed to the caller inside FetchedFile
        try:
            got, choice, release = self._fetch(url, out, deadline, on_bytes, select)
            out.flush()
            out.seek(0)
        except BaseException:
            out.close()
            raise
        return FetchedFile(
            dest, got.sha256, got.size, True, out, choice=choice, release_sha256=release
        )

    def fetch(
        self, url: str, into: IO[bytes], *, deadline: Deadline, on_bytes: ByteSink | None
    ) -> Digest:
        return self._fetch(url, into, deadline, on_bytes, None)[0]

    def _fetch(
        self,
        url: str,
        into: IO[bytes],
        deadline: Deadline,
        on_bytes: ByteSink | None,
        select: Select | None,
    ) -> tuple[Digest, Any, str | None]:
        """Copy the artifact's layer into ``into``; for an image index, the chosen variant's.
        Returns what was copied, the choice, and the index's digest (hex) that a pin names."""
        reg, container, ref = connect(url, deadline)
        headers = {"Accept": f"{OCI_MANIFEST_TYPE}, {OCI_INDEX_TYPE}"}
        manifest_url = f"{reg.prefix}://{container.manifest_url()}"
        body = read_document(
            check_response(
                registry_get(reg, manifest_url, deadline, url, headers=headers, stream=True), url
            ),
            deadline,
            url,
        )
        if "@sha256:" in ref:
            pinned = ref.rsplit("@", 1)[1]
            actual = "sha256:" + hashlib.sha256(body).hexdigest()
            if actual != pinned:
                raise IntegrityError(f"{url}: registry served manifest {actual}")
        choice: Any = None
        release: str | None = None
        doc = json_object(body, f"{url}: the registry's manifest")
        if doc.get("mediaType") == OCI_INDEX_TYPE or "manifests" in doc:
            if select is None:
                raise UsageError(f"{url}: is a kiln bundle (an OCI image index): kiln restore it")
            choice, entry = select(doc, url)
            release = digest_of(body).removeprefix("sha256:")
            body = _chosen_manifest(reg, container, entry, deadline, url)
        layer = _kiln_layer(body, url)
        blob_url = f"{reg.prefix}://{container.get_blob_url(layer['digest'])}"
        blob = check_response(
            registry_get(reg, blob_url, deadline, url, headers=dict(reg.headers), stream=True), url
        )
        size = layer.get("size") if isinstance(layer.get("size"), int) else None
        got = copy_response(blob, into, size, on_bytes, deadline, url)
        if "sha256:" + got.sha256 != layer["digest"]:
            raise IntegrityError(f"{url}: layer digest mismatch")
        return got, choice, release


def _chosen_manifest(reg: Any, container: Any, digest: str, deadline: Deadline, url: str) -> bytes:
    """The image manifest an index entry names, its bytes checked against the entry's digest."""
    body = get_json_bytes(reg, container.manifest_url(digest), deadline, url, OCI_MANIFEST_TYPE)
    if digest_of(body) != digest:
        raise IntegrityError(f"{url}: registry served variant {digest} with other bytes")
    return body


def canonical(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def digest_of(body: bytes) -> str:
    return "sha256:" + hashlib.sha256(body).hexdigest()


def repo_of(ref: str) -> str:
    """``registry/repo`` of ``registry/repo[:tag|@digest]``."""
    name = ref.split("@", 1)[0]
    head, _, last = name.rpartition("/")
    return f"{head}/{last.split(':', 1)[0]}"


def put_manifest(
    reg: Any, container: Any, tag: str | None, body: bytes, media_type: str, url: str
) -> Any:
    """PUT exactly ``body`` (so its digest is the one computed here) as a manifest."""
    target = f"{reg.prefix}://{container.manifest_url(tag)}"
    return check_response(
        reg.do_request(target, "PUT", headers={"Content-Type": media_type}, data=body), url
    )


def get_json_bytes(reg: Any, path: str, deadline: Deadline, url: str, accept: str) -> bytes:
    resp = registry_get(
        reg, f"{reg.prefix}://{path}", deadline, url, headers={"Accept": accept}, stream=True
    )
    return read_document(check_response(resp, url), deadline, url)


def read_document(
    resp: Any, deadline: Deadline, url: str, limit: int = MAX_DOCUMENT_BYTES
) -> bytes:
    """A registry document (manifest, index, attestation) read within ``deadline`` and at most
    ``limit`` bytes: a hostile registry can neither trickle it forever nor send gigabytes."""
    declared = resp.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > limit:
        resp.close()
        raise IntegrityError(f"{url}: registry document over {limit} bytes")
    out = CappedBuffer(limit, url)
    copy_response(resp, out, None, None, deadline, url)
    return out.getvalue()


def connect(url: str, deadline: Deadline | None = None) -> tuple[Any, Any, str]:
    """The oras registry client (bounded by ``deadline`` when given), the container ``url``
    names, with the docker config's credentials loaded, and the reference itself."""
    host, ref = oci_ref(url)
    reg = registry(host, deadline)
    container = reg.get_container(ref)
    reg.auth.load_configs(container)
    return reg, container, ref


def manifest_digest(reg: Any, container: Any, deadline: Deadline, url: str) -> str:
    body = get_json_bytes(reg, container.manifest_url(), deadline, url, OCI_MANIFEST_TYPE)
    digest = digest_of(body)
    if container.digest and container.digest != digest:
        raise IntegrityError(f"{url}: registry served manifest {digest}")
    return digest


def oci_ref(url: str) -> tuple[str, str]:
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
    except (ValueError, AttributeError, TypeError, RecursionError):
        raise IntegrityError(f"{url}: the registry's manifest is not OCI JSON") from None
    if len(layers) != 1 or not isinstance(layers[0].get("digest"), str):
        raise IntegrityError(f"{url}: not a kiln artifact (expected one {OCI_LAYER_TYPE} layer)")
    return layers[0]


def _insecure(host: str) -> bool:
    """Plain HTTP for loopback registries, or where KILN_OCI_INSECURE lists the host."""
    name = host.split(":", 1)[0]
    allowed = {h.strip() for h in os.environ.get("KILN_OCI_INSECURE", "").split(",") if h.strip()}
    return name in ("localhost", "127.0.0.1", "::1") or host in allowed or name in allowed


def registry(host: str, deadline: Deadline | None = None) -> Any:
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


def check_response(response: Any, what: str) -> Any:
    if response.status_code == 404:
        raise NotFoundError(f"{what}: not found in the registry")
    if response.status_code >= 400:
        raise KilnError(
            f"{what}: registry answered HTTP {response.status_code}: {shown(response.text[:200])}"
        )
    return response


def registry_get(reg: Any, url: str, deadline: Deadline, source: str, **kwargs: Any) -> Any:
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


def copy_response(
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
