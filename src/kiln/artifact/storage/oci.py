"""OCI registries through oras (extra ``torch-kiln[oci]``).

The artifact is a real image layer (tar+zstd): ``COPY --from`` and Kubernetes image volumes can
use it as is. The config blob is kiln's manifest, so a registry UI or ``kiln inspect`` can read
the fingerprint without pulling the payload; its media type marks the artifact as kiln's (oras-py
0.2 cannot set ``artifactType``, and an empty config would require it). Credentials come from the
docker config, as oras reads it; kiln adds none of its own.

A bundle (:mod:`kiln.artifact.bundle`) is pushed as an OCI image index: one such manifest per
variant, each index entry annotated with what selects it (``dev.kiln.gpu``, ``dev.kiln.torch``…)
and the OCI ``platform`` of its bake, so registries and their tools list the variants natively.
Restore reads the index, chooses from those annotations as it would from a bundle file, and
fetches only the chosen variant; a pin (``--sha256`` or ``@sha256:``) names the index.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kiln.artifact.manifest import first_problem
from kiln.artifact.storage.base import (
    ATTEMPTS,
    DOWNLOAD_NAME,
    ByteSink,
    CappedBuffer,
    Deadline,
    Digest,
    Fetched,
    PushResult,
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
OCI_CONFIG_TYPE = "application/vnd.kiln.manifest.v1+json"
OCI_MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
# The attestation as an OCI 1.1 referrer: an image manifest whose ``subject`` is the artifact's
# manifest, ``artifactType`` the DSSE envelope type (what cosign and ORAS use for attestations),
# the OCI empty config, and one layer holding the ``.intoto.jsonl`` bytes as ``kiln sign`` wrote
# them (one DSSE envelope per line).
DSSE_TYPE = "application/vnd.dsse.envelope.v1+json"
OCI_EMPTY_TYPE = "application/vnd.oci.empty.v1+json"
OCI_EMPTY = b"{}"
MAX_REFERRERS = 64  # attestation referrers read per artifact
MAX_REFERRER_BYTES = 16 << 20  # per manifest, index or attestation layer
# Annotations of a bundle's index entries: what restore selects a variant by (VariantKey).
VARIANT_ANNOTATIONS = {
    "name": "dev.kiln.variant",
    "device": "dev.kiln.device",
    "gpu": "dev.kiln.gpu",
    "capability": "dev.kiln.capability",
    "torch": "dev.kiln.torch",
    "cuda": "dev.kiln.cuda",
}
_ARCHITECTURES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


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
    ) -> Fetched:
        """The artifact, or for a bundle (an image index) the variant ``select`` chooses."""
        dest = workdir / DOWNLOAD_NAME
        out = open(dest, "x+b")  # noqa: SIM115 - handed to the caller inside Fetched
        try:
            got, choice, release = self._fetch(url, out, deadline, on_bytes, select)
            out.flush()
            out.seek(0)
        except BaseException:
            out.close()
            raise
        return Fetched(dest, got.sha256, got.size, True, out, choice=choice, release_sha256=release)

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
        host, ref = _oci_ref(url)
        reg = _registry(host, deadline)
        container = reg.get_container(ref)
        reg.auth.load_configs(container)
        headers = {"Accept": f"{OCI_MANIFEST_TYPE}, {OCI_INDEX_TYPE}"}
        manifest_url = f"{reg.prefix}://{container.manifest_url()}"
        body = _read_small(
            _check(_request(reg, manifest_url, deadline, url, headers=headers, stream=True), url),
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
            candidates, entries = _index_variants(doc, url)
            choice = select(candidates, url)
            entry = entries[choice.variant.name]
            release = _digest_of(body).removeprefix("sha256:")
            body = _get_json_bytes(
                reg, container.manifest_url(entry), deadline, url, OCI_MANIFEST_TYPE
            )
            if _digest_of(body) != entry:
                raise IntegrityError(f"{url}: registry served variant {entry} with other bytes")
        layer = _kiln_layer(body, url)
        blob_url = f"{reg.prefix}://{container.get_blob_url(layer['digest'])}"
        blob = _check(
            _request(reg, blob_url, deadline, url, headers=dict(reg.headers), stream=True), url
        )
        size = layer.get("size") if isinstance(layer.get("size"), int) else None
        got = _copy_response(blob, into, size, on_bytes, deadline, url)
        if "sha256:" + got.sha256 != layer["digest"]:
            raise IntegrityError(f"{url}: layer digest mismatch")
        return got, choice, release

    def push(self, src: Path, url: str) -> OciPushResult:
        from kiln.artifact.bundle import BundleIndex, read_head

        need_extra("oras.oci", "oci")
        host, ref = _oci_ref(url)
        reg = _registry(host)
        container = reg.get_container(ref)
        reg.auth.load_configs(container)
        head = read_head(src)
        if isinstance(head, BundleIndex):
            return _push_bundle(reg, container, src, url, ref)
        body, digest, layer = _push_artifact(reg, container, src, url, head, tag=None)
        return OciPushResult(
            dest=url,
            sha256=layer["digest"].removeprefix("sha256:"),
            size=layer["size"],
            manifest_digest=digest,
            pinned=f"oci://{_repo(ref)}@{digest}",
            manifest_size=len(body),
        )

    def push_attestation(self, attestation: Path, pushed: PushResult) -> str:
        """Attach ``attestation`` to the artifact just pushed as an OCI 1.1 referrer.

        The registry learns of it through the referrers API where it has one (it then answers
        the manifest PUT with ``OCI-Subject``); otherwise through the referrers *tag schema*
        the OCI 1.1 distribution spec defines for older registries (the CNCF distribution 2.x
        has no referrers API): an image index tagged ``sha256-<hex of the subject>`` listing
        every referrer, read, extended and put back. Returns ``oci://repo@<referrer digest>``.
        """
        oci = need_extra("oras.oci", "oci")
        if not isinstance(pushed, OciPushResult) or pushed.manifest_size is None:
            raise KilnError(f"{pushed.dest}: no manifest descriptor to attach the attestation to")
        host, ref = _oci_ref(pushed.dest)
        reg = _registry(host)
        container = reg.get_container(ref)
        reg.auth.load_configs(container)
        url = pushed.dest
        with tempfile.TemporaryDirectory(prefix="kiln-oci-") as tmp:
            empty = Path(tmp, "empty.json")
            empty.write_bytes(OCI_EMPTY)
            config, _ = oci.ManifestConfig(str(empty), OCI_EMPTY_TYPE)
            _check(reg.upload_blob(str(empty), container, config), url)
        layer = oci.NewLayer(str(attestation), media_type=DSSE_TYPE, is_dir=False)
        layer["annotations"] = {"org.opencontainers.image.title": attestation.name}
        _check(reg.upload_blob(str(attestation), container, layer), url)
        subject = {
            "mediaType": OCI_MANIFEST_TYPE,
            "digest": pushed.manifest_digest,
            "size": pushed.manifest_size,
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
        body = _canonical(manifest)
        digest = _digest_of(body)
        resp = _put_manifest(reg, container, digest, body, OCI_MANIFEST_TYPE, url)
        if not resp.headers.get("OCI-Subject"):
            descriptor = {
                "mediaType": OCI_MANIFEST_TYPE,
                "digest": digest,
                "size": len(body),
                "artifactType": DSSE_TYPE,
                "annotations": manifest["annotations"],
            }
            _add_to_referrers_tag(reg, container, str(pushed.manifest_digest), descriptor, url)
        return f"oci://{_repo(ref)}@{digest}"


def fetch_attestations(url: str, deadline: Deadline) -> bytes:
    """Every attestation attached to the artifact at ``url`` as an OCI referrer, concatenated
    (``.intoto.jsonl`` lines); :class:`NotFoundError` when it has none.

    The artifact's manifest is resolved once (a tag to its digest; a pinned digest is checked);
    its referrers come from the registry's referrers API, or, where that answers 404, from the
    ``sha256-<hex>`` tag. Which artifact the attestation is for is decided later by its signed
    subject, against the digest of the bytes actually unpacked, so a tag that moves meanwhile
    cannot pair one artifact's signature with another's bytes.
    """
    host, ref = _oci_ref(url)
    reg = _registry(host, deadline)
    container = reg.get_container(ref)
    reg.auth.load_configs(container)
    subject = _manifest_digest(reg, container, deadline, url)
    index = _referrers(reg, container, subject, deadline, url)
    found: list[bytes] = []
    entries = index.get("manifests")
    for entry in (entries if isinstance(entries, list) else [])[:MAX_REFERRERS]:
        if not isinstance(entry, dict) or entry.get("artifactType") != DSSE_TYPE:
            continue
        digest = entry.get("digest")
        if not isinstance(digest, str):
            continue
        body = _get_json_bytes(
            reg, container.manifest_url(digest), deadline, url, OCI_MANIFEST_TYPE
        )
        if _digest_of(body) != digest:
            raise IntegrityError(f"{url}: registry served referrer {digest} with other bytes")
        manifest = json_object(body, f"{url}: the registry's referrer manifest")
        referred = manifest.get("subject")
        if not isinstance(referred, dict) or referred.get("digest") != subject:
            continue
        layers = manifest.get("layers")
        for layer in layers if isinstance(layers, list) else []:
            if isinstance(layer, dict) and layer.get("mediaType") == DSSE_TYPE:
                found.append(_get_blob(reg, container, layer, deadline, url))
                if sum(map(len, found)) > MAX_REFERRER_BYTES:
                    raise IntegrityError(
                        f"{url}: attestations over {MAX_REFERRER_BYTES} bytes in all"
                    )
    if not found:
        raise NotFoundError(f"{url}: no attestation attached in the registry")
    return b"\n".join(chunk.rstrip(b"\n") for chunk in found) + b"\n"


def _push_artifact(
    reg: Any,
    container: Any,
    src: Path,
    url: str,
    kiln_manifest: Any,
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
        **(annotations or {}),
    }
    body = _canonical(manifest)
    digest = _digest_of(body)
    resp = _put_manifest(reg, container, digest if tag == "" else tag, body, OCI_MANIFEST_TYPE, url)
    return body, resp.headers.get("Docker-Content-Digest") or digest, layer


def _push_bundle(reg: Any, container: Any, src: Path, url: str, ref: str) -> OciPushResult:
    """A bundle as an image index: each variant pushed as an artifact (by digest), then the
    index, at the reference's tag, one entry per variant with its selection annotations."""
    from kiln.artifact.archive import read_manifest
    from kiln.artifact.bundle import split_bundle

    entries: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kiln-oci-") as tmp:
        for variant, path in split_bundle(src, Path(tmp)):
            kiln_manifest = read_manifest(path)
            annotations = {
                VARIANT_ANNOTATIONS[k]: str(v)
                for k, v in {"name": variant.name, **variant.selection()}.items()
                if v is not None
            }
            annotations["dev.kiln.name"] = kiln_manifest.name
            annotations.setdefault(VARIANT_ANNOTATIONS["gpu"], "cpu")  # as artifacts say it
            body, digest, _ = _push_artifact(
                reg, container, path, url, kiln_manifest, tag="", annotations=annotations
            )
            entry: dict[str, Any] = {
                "mediaType": OCI_MANIFEST_TYPE,
                "digest": digest,
                "size": len(body),
                "annotations": annotations,
            }
            platform = _platform(kiln_manifest.fingerprint.get("platform"))
            if platform is not None:
                entry["platform"] = platform
            entries.append(entry)
    index = {
        "schemaVersion": 2,
        "mediaType": OCI_INDEX_TYPE,
        "manifests": entries,
        "annotations": {"org.opencontainers.image.title": src.name, "dev.kiln.bundle": "1"},
    }
    body = _canonical(index)
    resp = _put_manifest(reg, container, None, body, OCI_INDEX_TYPE, url)
    digest = resp.headers.get("Docker-Content-Digest") or _digest_of(body)
    return OciPushResult(
        dest=url,
        sha256=digest.removeprefix("sha256:"),
        size=len(body),
        manifest_digest=digest,
        pinned=f"oci://{_repo(ref)}@{digest}",
        manifest_size=len(body),
    )


def _platform(value: object) -> dict[str, str] | None:
    """The OCI platform of a fingerprint's ``platform`` (``Linux-x86_64``), where it maps."""
    if not isinstance(value, str) or "-" not in value:
        return None
    system, _, machine = value.partition("-")
    arch = _ARCHITECTURES.get(machine.lower())
    return {"architecture": arch, "os": system.lower()} if arch else None


def _index_variants(doc: dict[str, Any], url: str) -> tuple[list[Any], dict[str, str]]:
    """A bundle index's entries as selection candidates, and each one's manifest digest.

    The registry's document is untrusted: entries are bounded in number, their annotations go
    through the same model as a bundle file's index (:class:`kiln.artifact.bundle.Candidate`),
    and two entries with one name or one selection key are refused.
    """
    from pydantic import ValidationError

    from kiln.artifact.bundle import MAX_VARIANTS, Candidate

    manifests = doc.get("manifests")
    if not isinstance(manifests, list) or len(manifests) > MAX_VARIANTS:
        raise IntegrityError(f"{url}: not a kiln bundle (at most {MAX_VARIANTS} index entries)")
    candidates: list[Any] = []
    digests: dict[str, str] = {}
    keys: set[tuple[str | None, ...]] = set()
    for entry in manifests:
        annotations = entry.get("annotations") if isinstance(entry, dict) else None
        digest = entry.get("digest") if isinstance(entry, dict) else None
        if not isinstance(annotations, dict) or VARIANT_ANNOTATIONS["name"] not in annotations:
            continue  # not a kiln variant (an attestation, someone else's entry)
        if not isinstance(digest, str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
            raise IntegrityError(f"{url}: a bundle index entry without a sha256 digest")
        fields = {k: annotations.get(a) for k, a in VARIANT_ANNOTATIONS.items()}
        if fields["device"] == "cpu":
            fields["gpu"] = None  # "cpu", as a plain artifact's manifest annotation says
        try:
            candidate = Candidate(**{k: v for k, v in fields.items() if v is not None})
        except ValidationError as exc:
            raise IntegrityError(
                f"{url}: bundle index entry refused: {first_problem(exc)}"
            ) from None
        if candidate.name in digests or candidate.key in keys:
            raise IntegrityError(f"{url}: bundle index lists {candidate.name!r} twice")
        digests[candidate.name] = digest
        keys.add(candidate.key)
        candidates.append(candidate)
    if not candidates:
        raise IntegrityError(f"{url}: an image index without kiln variants")
    return candidates, digests


def _canonical(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()


def _digest_of(body: bytes) -> str:
    return "sha256:" + hashlib.sha256(body).hexdigest()


def _repo(ref: str) -> str:
    """``registry/repo`` of ``registry/repo[:tag|@digest]``."""
    name = ref.split("@", 1)[0]
    head, _, last = name.rpartition("/")
    return f"{head}/{last.split(':', 1)[0]}"


def _put_manifest(
    reg: Any, container: Any, tag: str | None, body: bytes, media_type: str, url: str
) -> Any:
    """PUT exactly ``body`` (so its digest is the one computed here) as a manifest."""
    target = f"{reg.prefix}://{container.manifest_url(tag)}"
    return _check(
        reg.do_request(target, "PUT", headers={"Content-Type": media_type}, data=body), url
    )


def _get_json_bytes(reg: Any, path: str, deadline: Deadline, url: str, accept: str) -> bytes:
    resp = _request(
        reg, f"{reg.prefix}://{path}", deadline, url, headers={"Accept": accept}, stream=True
    )
    return _read_small(_check(resp, url), deadline, url)


def _read_small(resp: Any, deadline: Deadline, url: str, limit: int = MAX_REFERRER_BYTES) -> bytes:
    """A registry document (manifest, index, attestation) read within ``deadline`` and at most
    ``limit`` bytes: a hostile registry can neither trickle it forever nor send gigabytes."""
    declared = resp.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > limit:
        resp.close()
        raise IntegrityError(f"{url}: registry document over {limit} bytes")
    out = CappedBuffer(limit, url)
    _copy_response(resp, out, None, None, deadline, url)
    return out.getvalue()


def _manifest_digest(reg: Any, container: Any, deadline: Deadline, url: str) -> str:
    body = _get_json_bytes(reg, container.manifest_url(), deadline, url, OCI_MANIFEST_TYPE)
    digest = _digest_of(body)
    if container.digest and container.digest != digest:
        raise IntegrityError(f"{url}: registry served manifest {digest}")
    return digest


def _referrers(
    reg: Any, container: Any, subject: str, deadline: Deadline, url: str
) -> dict[str, Any]:
    """The referrers index of ``subject``: the API's answer, else the tag schema's index."""
    api = f"{container.registry}/v2/{container.api_prefix}/referrers/{subject}"
    resp = _request(
        reg, f"{reg.prefix}://{api}", deadline, url, headers={"Accept": OCI_INDEX_TYPE}, stream=True
    )
    if resp.status_code == 200 and resp.headers.get("Content-Type", "").startswith(OCI_INDEX_TYPE):
        body = _read_small(resp, deadline, url)
    else:
        resp.close()
        try:
            body = _get_json_bytes(
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
        _check(resp, url)
    index["manifests"].append(descriptor)
    _put_manifest(reg, container, tag, _canonical(index), OCI_INDEX_TYPE, url)


def _get_blob(
    reg: Any, container: Any, layer: dict[str, Any], deadline: Deadline, url: str
) -> bytes:
    digest, size = layer.get("digest"), layer.get("size")
    if not isinstance(digest, str) or not isinstance(size, int) or size > MAX_REFERRER_BYTES:
        raise IntegrityError(f"{url}: attestation layer without a usable digest and size")
    blob_url = f"{reg.prefix}://{container.get_blob_url(digest)}"
    resp = _check(
        _request(reg, blob_url, deadline, url, headers=dict(reg.headers), stream=True), url
    )
    data = _read_small(resp, deadline, url, limit=size)
    if _digest_of(data) != digest:
        raise IntegrityError(f"{url}: attestation layer digest mismatch")
    return data


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
