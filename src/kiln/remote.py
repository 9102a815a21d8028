"""Remote artifact stores (optional extras): S3 and GCS through fsspec, OCI registries via oras.

Credentials come from each ecosystem's usual places and nowhere else: the AWS environment,
profile and instance metadata (s3fs/botocore), Google's application-default credentials
(gcsfs), and the docker config (oras). kiln adds no credential files of its own. Torch-free; each
client is imported only when its scheme is used, with a one-line hint when the extra is missing.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from kiln.errors import IntegrityError, KilnError, NotFoundError, UsageError
from kiln.storage import ByteSink, _copy_hashing, register

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


def _fsspec_fetch(source: str, dest: Path, on_bytes: ByteSink | None) -> tuple[str, int]:
    fsspec = _need("fsspec", "s3" if source.startswith("s3") else "gcs")
    try:
        fs, path = fsspec.core.url_to_fs(source)
        total = fs.size(path)
        with fs.open(path, "rb") as src, open(dest, "wb") as out:
            return _copy_hashing(src, out, total, on_bytes)
    except FileNotFoundError:
        raise NotFoundError(f"{source}: no such object") from None
    except ImportError as exc:
        raise UsageError(
            f"{source}: missing client library ({exc.name}); install kiln's extra"
        ) from None


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


def _registry(host: str) -> Any:
    provider = _need("oras.provider", "oci")
    return provider.Registry(hostname=host, insecure=_insecure(host))


def _check(response: Any, what: str) -> Any:
    if response.status_code == 404:
        raise NotFoundError(f"{what}: not found in the registry")
    if response.status_code >= 400:
        raise KilnError(
            f"{what}: registry answered HTTP {response.status_code}: {response.text[:200]}"
        )
    return response


def _oci_fetch(source: str, dest: Path, on_bytes: ByteSink | None) -> tuple[str, int]:
    host, ref = _oci_ref(source)
    reg = _registry(host)
    container = reg.get_container(ref)
    reg.auth.load_configs(container)
    headers = {"Accept": OCI_MANIFEST_TYPE}
    resp = _check(
        reg.do_request(f"{reg.prefix}://{container.manifest_url()}", "GET", headers=headers), source
    )
    if "@sha256:" in ref:
        pinned = ref.rsplit("@", 1)[1]
        actual = "sha256:" + hashlib.sha256(resp.content).hexdigest()
        if actual != pinned:
            raise IntegrityError(f"{source}: registry served manifest {actual}")
    manifest = json.loads(resp.content)
    layers = [
        layer for layer in manifest.get("layers", []) if layer.get("mediaType") == OCI_LAYER_TYPE
    ]
    if len(layers) != 1:
        raise IntegrityError(f"{source}: not a kiln artifact (expected one {OCI_LAYER_TYPE} layer)")
    layer = layers[0]
    blob = _check(reg.get_blob(container, layer["digest"], stream=True), source)
    h = hashlib.sha256()
    n = 0
    with open(dest, "wb") as out:
        for chunk in blob.iter_content(chunk_size=_CHUNK):
            h.update(chunk)
            out.write(chunk)
            n += len(chunk)
            if on_bytes:
                on_bytes(n, layer.get("size"))
    if "sha256:" + h.hexdigest() != layer["digest"]:
        raise IntegrityError(f"{source}: layer digest mismatch")
    return h.hexdigest(), n


def _oci_push(src: Path, dest: str) -> dict[str, Any]:
    from kiln.artifact import read_manifest

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
