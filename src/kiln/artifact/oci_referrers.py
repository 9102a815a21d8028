"""Attestations in an OCI registry: OCI 1.1 referrers of the artifact's manifest.

``kiln push`` attaches a signed artifact's ``.intoto.jsonl`` (:func:`attach`), ``kiln restore
--verify-key`` reads them back (:func:`fetch_attestations`). The registry learns of a referrer
through its referrers API where it has one, else through the referrers *tag schema* the OCI 1.1
distribution spec defines for older registries. Above :mod:`kiln.artifact.storage.oci` (the
transport). Torch-free.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from typing import Any

from kiln.artifact.storage.base import Deadline, json_object, need_extra
from kiln.artifact.storage.oci import (
    MAX_DOCUMENT_BYTES,
    OCI_INDEX_TYPE,
    OCI_MANIFEST_TYPE,
    canonical,
    check_response,
    connect,
    digest_of,
    get_json_bytes,
    manifest_digest,
    put_manifest,
    read_document,
    registry_get,
    repo_of,
)
from kiln.errors import IntegrityError, NotFoundError

# The attestation as an OCI 1.1 referrer: an image manifest whose ``subject`` is the artifact's
# manifest, ``artifactType`` the DSSE envelope type (what cosign and ORAS use for attestations),
# the OCI empty config, and one layer holding the ``.intoto.jsonl`` bytes as ``kiln sign`` wrote
# them (one DSSE envelope per line).
DSSE_TYPE = "application/vnd.dsse.envelope.v1+json"
OCI_EMPTY_TYPE = "application/vnd.oci.empty.v1+json"
OCI_EMPTY = b"{}"
MAX_REFERRERS = 64  # attestation referrers read per artifact


def attach(attestation: Path, url: str, manifest_digest: str, manifest_size: int) -> str:
    """Attach ``attestation`` as an OCI 1.1 referrer to the artifact just pushed to ``url``,
    whose image manifest (the referrer's subject) has ``manifest_digest`` and ``manifest_size``.

    The registry learns of it through the referrers API where it has one (it then answers
    the manifest PUT with ``OCI-Subject``); otherwise through the referrers *tag schema*
    the OCI 1.1 distribution spec defines for older registries (the CNCF distribution 2.x
    has no referrers API): an image index tagged ``sha256-<hex of the subject>`` listing
    every referrer, read, extended and put back. Returns ``oci://repo@<referrer digest>``.
    """
    oci = need_extra("oras.oci", "oci")
    reg, container, ref = connect(url)
    with tempfile.TemporaryDirectory(prefix="kiln-oci-") as tmp:
        empty = Path(tmp, "empty.json")
        empty.write_bytes(OCI_EMPTY)
        config, _ = oci.ManifestConfig(str(empty), OCI_EMPTY_TYPE)
        check_response(reg.upload_blob(str(empty), container, config), url)
    layer = oci.NewLayer(str(attestation), media_type=DSSE_TYPE, is_dir=False)
    layer["annotations"] = {"org.opencontainers.image.title": attestation.name}
    check_response(reg.upload_blob(str(attestation), container, layer), url)
    subject = {
        "mediaType": OCI_MANIFEST_TYPE,
        "digest": manifest_digest,
        "size": manifest_size,
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST_TYPE,
        "artifactType": DSSE_TYPE,
        "config": {"mediaType": OCI_EMPTY_TYPE, "digest": config["digest"], "size": 2},
        "layers": [layer],
        "subject": subject,
        "annotations": {"org.opencontainers.image.title": attestation.name},
    }
    body = canonical(manifest)
    digest = digest_of(body)
    resp = put_manifest(reg, container, digest, body, OCI_MANIFEST_TYPE, url)
    if not resp.headers.get("OCI-Subject"):
        descriptor = {
            "mediaType": OCI_MANIFEST_TYPE,
            "digest": digest,
            "size": len(body),
            "artifactType": DSSE_TYPE,
            "annotations": manifest["annotations"],
        }
        _add_to_referrers_tag(reg, container, manifest_digest, descriptor, url)
    return f"oci://{repo_of(ref)}@{digest}"


def fetch_attestations(url: str, deadline: Deadline) -> bytes:
    """Every attestation attached to the artifact at ``url`` as an OCI referrer, concatenated
    (``.intoto.jsonl`` lines); :class:`NotFoundError` when it has none.

    The artifact's manifest is resolved once (a tag to its digest; a pinned digest is checked);
    its referrers come from the registry's referrers API, or, where that answers 404, from the
    ``sha256-<hex>`` tag. Which artifact the attestation is for is decided later by its signed
    subject, against the digest of the bytes actually unpacked, so a tag that moves meanwhile
    cannot pair one artifact's signature with another's bytes.
    """
    reg, container, _ = connect(url, deadline)
    subject = manifest_digest(reg, container, deadline, url)
    index = _referrers(reg, container, subject, deadline, url)
    found: list[bytes] = []
    entries = index.get("manifests")
    for entry in (entries if isinstance(entries, list) else [])[:MAX_REFERRERS]:
        if not isinstance(entry, dict) or entry.get("artifactType") != DSSE_TYPE:
            continue
        digest = entry.get("digest")
        if not isinstance(digest, str):
            continue
        body = get_json_bytes(reg, container.manifest_url(digest), deadline, url, OCI_MANIFEST_TYPE)
        if digest_of(body) != digest:
            raise IntegrityError(f"{url}: registry served referrer {digest} with other bytes")
        manifest = json_object(body, f"{url}: the registry's referrer manifest")
        referred = manifest.get("subject")
        if not isinstance(referred, dict) or referred.get("digest") != subject:
            continue
        layers = manifest.get("layers")
        for layer in layers if isinstance(layers, list) else []:
            if isinstance(layer, dict) and layer.get("mediaType") == DSSE_TYPE:
                found.append(_get_blob(reg, container, layer, deadline, url))
                if sum(map(len, found)) > MAX_DOCUMENT_BYTES:
                    raise IntegrityError(
                        f"{url}: attestations over {MAX_DOCUMENT_BYTES} bytes in all"
                    )
    if not found:
        raise NotFoundError(f"{url}: no attestation attached in the registry")
    return b"\n".join(chunk.rstrip(b"\n") for chunk in found) + b"\n"


def _referrers(
    reg: Any, container: Any, subject: str, deadline: Deadline, url: str
) -> dict[str, Any]:
    """The referrers index of ``subject``: the API's answer, else the tag schema's index."""
    api = f"{container.registry}/v2/{container.api_prefix}/referrers/{subject}"
    resp = registry_get(
        reg, f"{reg.prefix}://{api}", deadline, url, headers={"Accept": OCI_INDEX_TYPE}, stream=True
    )
    if resp.status_code == 200 and resp.headers.get("Content-Type", "").startswith(OCI_INDEX_TYPE):
        body = read_document(resp, deadline, url)
    else:
        resp.close()
        try:
            body = get_json_bytes(
                reg, container.manifest_url(_referrers_tag(subject)), deadline, url, OCI_INDEX_TYPE
            )
        except NotFoundError:
            return {}
    return json_object(body, f"{url}: the registry's referrers index")


def _referrers_tag(subject: str) -> str:
    """The OCI 1.1 referrers tag schema: ``<alg>-<ref>`` of the subject's digest."""
    return subject.replace(":", "-", 1)


def _add_to_referrers_tag(
    reg: Any, container: Any, subject: str, descriptor: dict[str, Any], url: str
) -> None:
    tag = _referrers_tag(subject)
    resp = reg.do_request(
        f"{reg.prefix}://{container.manifest_url(tag)}",
        "GET",
        headers={"Accept": OCI_INDEX_TYPE},
    )
    index: dict[str, Any] = {"schemaVersion": 2, "mediaType": OCI_INDEX_TYPE, "manifests": []}
    if resp.status_code == 200:
        with contextlib.suppress(ValueError):
            old = json.loads(resp.content)
            if isinstance(old, dict) and isinstance(old.get("manifests"), list):
                index["manifests"] = [
                    m for m in old["manifests"] if m.get("digest") != descriptor["digest"]
                ]
    elif resp.status_code != 404:
        check_response(resp, url)
    index["manifests"].append(descriptor)
    put_manifest(reg, container, tag, canonical(index), OCI_INDEX_TYPE, url)


def _get_blob(
    reg: Any, container: Any, layer: dict[str, Any], deadline: Deadline, url: str
) -> bytes:
    digest, size = layer.get("digest"), layer.get("size")
    if not isinstance(digest, str) or not isinstance(size, int) or size > MAX_DOCUMENT_BYTES:
        raise IntegrityError(f"{url}: attestation layer without a usable digest and size")
    blob_url = f"{reg.prefix}://{container.get_blob_url(digest)}"
    resp = check_response(
        registry_get(reg, blob_url, deadline, url, headers=dict(reg.headers), stream=True), url
    )
    data = read_document(resp, deadline, url, limit=size)
    if digest_of(data) != digest:
        raise IntegrityError(f"{url}: attestation layer digest mismatch")
    return data
