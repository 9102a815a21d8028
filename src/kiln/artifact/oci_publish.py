"""kiln's artifacts and bundles pushed to an OCI registry (extra ``torch-kiln[oci]``).

An artifact is one image manifest: its tar+zstd as the one layer (``COPY --from`` and
Kubernetes image volumes can use it as is) and kiln's manifest as the config blob, so a registry
UI or ``kiln inspect`` can read the fingerprint without pulling the payload; the config's media
type marks the artifact as kiln's (oras-py 0.2 cannot set ``artifactType``, and an empty config
would require it). A bundle is an image index over its variants (:mod:`kiln.artifact.oci_layout`).
Above :mod:`kiln.artifact.storage.oci`, the transport, which fetches either without knowing
what a bundle is. Torch-free.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.artifact.archive import read_manifest
from kiln.artifact.bundle import BundleIndex, read_head, split_bundle
from kiln.artifact.manifest import Manifest
from kiln.artifact.oci_layout import platform_of, variant_annotations
from kiln.artifact.oci_referrers import attach
from kiln.artifact.storage.base import PushResult, need_extra
from kiln.artifact.storage.oci import (
    OCI_INDEX_TYPE,
    OCI_LAYER_TYPE,
    OCI_MANIFEST_TYPE,
    OciStore,
    canonical,
    check_response,
    connect,
    digest_of,
    put_manifest,
    repo_of,
)
from kiln.errors import KilnError

OCI_CONFIG_TYPE = "application/vnd.kiln.manifest.v1+json"


@dataclass(frozen=True)
class OciPushResult(PushResult):
    """A push to a registry also names the image manifest, and the reference that pins it."""

    manifest_digest: str | None = None
    pinned: str | None = None  # oci://registry/repo@sha256:… (None if the registry sent none)
    manifest_size: int | None = None  # of the artifact's manifest: the referrer's subject

    def summary(self) -> dict[str, Any]:
        data = super().summary()
        data.pop("manifest_size", None)
        return data


class OciPublisher(OciStore):
    """An OCI store that also pushes: kiln's artifacts and bundles, and attestations attached
    as referrers (:mod:`kiln.artifact.oci_referrers`). :func:`kiln.artifact.publish.push`
    uses it for ``oci://``."""

    def push(self, src: Path, url: str) -> OciPushResult:
        need_extra("oras.oci", "oci")
        reg, container, ref = connect(url)
        head = read_head(src)
        if isinstance(head, BundleIndex):
            return _push_bundle(reg, container, src, url, ref)
        body, digest, layer = _push_artifact(reg, container, src, url, head, tag=None)
        return OciPushResult(
            dest=url,
            sha256=layer["digest"].removeprefix("sha256:"),
            size=layer["size"],
            manifest_digest=digest,
            pinned=f"oci://{repo_of(ref)}@{digest}",
            manifest_size=len(body),
        )

    def push_attestation(self, attestation: Path, pushed: PushResult) -> str:
        """Attach ``attestation`` to the artifact just pushed as an OCI 1.1 referrer."""
        if not isinstance(pushed, OciPushResult) or pushed.manifest_size is None:
            raise KilnError(f"{pushed.dest}: no manifest descriptor to attach the attestation to")
        digest = str(pushed.manifest_digest)
        return attach(attestation, pushed.dest, digest, pushed.manifest_size)


def _push_artifact(
    reg: Any,
    container: Any,
    src: Path,
    url: str,
    kiln_manifest: Manifest,
    *,
    tag: str | None,
    annotations: dict[str, str] | None = None,
) -> tuple[bytes, str, dict[str, Any]]:
    """Upload one artifact: its layer, kiln's manifest as the config, and the image manifest,
    put at the reference's tag (``tag`` None) or by its digest (``tag`` "": a bundle's
    variant, which only the index names). Returns the manifest's bytes, digest and layer."""
    oci = need_extra("oras.oci", "oci")
    layer = oci.NewLayer(str(src), media_type=OCI_LAYER_TYPE, is_dir=False)
    layer["annotations"] = {"org.opencontainers.image.title": src.name}
    check_response(reg.upload_blob(str(src), container, layer), url)
    with tempfile.TemporaryDirectory(prefix="kiln-oci-") as tmp:
        config_path = Path(tmp, "config.json")
        config_path.write_bytes(kiln_manifest.to_bytes())
        config, _ = oci.ManifestConfig(str(config_path), OCI_CONFIG_TYPE)
        check_response(reg.upload_blob(str(config_path), container, config), url)
    manifest = oci.NewManifest()
    manifest["config"] = config
    manifest["layers"] = [layer]
    manifest["annotations"] = {
        "org.opencontainers.image.title": kiln_manifest.name,
        "dev.kiln.name": kiln_manifest.name,
        "dev.kiln.spec-sha256": kiln_manifest.spec_sha256,
        "dev.kiln.torch": str(kiln_manifest.fingerprint.get("torch.version")),
        "dev.kiln.gpu": str(kiln_manifest.fingerprint.get("gpu.name") or "cpu"),
        **(annotations or {}),
    }
    body = canonical(manifest)
    digest = digest_of(body)
    resp = put_manifest(reg, container, digest if tag == "" else tag, body, OCI_MANIFEST_TYPE, url)
    return body, resp.headers.get("Docker-Content-Digest") or digest, layer


def _push_bundle(reg: Any, container: Any, src: Path, url: str, ref: str) -> OciPushResult:
    """A bundle as an image index: each variant pushed as an artifact (by digest), then the
    index, at the reference's tag, one entry per variant with its selection annotations."""
    entries: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-oci-") as tmp:
        for variant, path in split_bundle(src, Path(tmp)):
            kiln_manifest = read_manifest(path)
            annotations = variant_annotations(variant, kiln_manifest.name)
            body, digest, _ = _push_artifact(
                reg, container, path, url, kiln_manifest, tag="", annotations=annotations
            )
            entry: dict[str, Any] = {
                "mediaType": OCI_MANIFEST_TYPE,
                "digest": digest,
                "size": len(body),
                "annotations": annotations,
            }
            platform = platform_of(kiln_manifest.fingerprint.get("platform"))
            if platform is not None:
                entry["platform"] = platform
            entries.append(entry)
    index = {
        "schemaVersion": 2,
        "mediaType": OCI_INDEX_TYPE,
        "manifests": entries,
        "annotations": {"org.opencontainers.image.title": src.name, "dev.kiln.bundle": "1"},
    }
    body = canonical(index)
    resp = put_manifest(reg, container, None, body, OCI_INDEX_TYPE, url)
    digest = resp.headers.get("Docker-Content-Digest") or digest_of(body)
    return OciPushResult(
        dest=url,
        sha256=digest.removeprefix("sha256:"),
        size=len(body),
        manifest_digest=digest,
        pinned=f"oci://{repo_of(ref)}@{digest}",
        manifest_size=len(body),
    )
