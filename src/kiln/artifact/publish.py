"""Publishing an artifact: the artifact, then its signed attestation beside it. Torch-free.

Sits above :mod:`kiln.artifact.storage` (which moves bytes and knows nothing of attestations
or bundles; an ``oci://`` push goes through :mod:`kiln.artifact.oci_publish`)
and :mod:`kiln.artifact.attestation` (which reads attestations through storage): the one place
that knows an artifact and its ``.intoto.jsonl`` travel together.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kiln.artifact.attestation import check_attests
from kiln.artifact.storage import backend, scheme_of
from kiln.artifact.storage.base import ATTESTATION_SUFFIX, PushResult, Store, cannot_push
from kiln.errors import NotFoundError


def push(artifact: str | Path, dest: str) -> PushResult:
    """Copy an artifact to ``dest``; the result names its digest so CI can pin it.

    When ``ARTIFACT.intoto.jsonl`` (``kiln sign``) lies beside the artifact it goes too, after
    the artifact (a registry referrer needs its subject first): beside the pushed object as
    ``DEST.intoto.jsonl``, or attached as an OCI referrer; ``PushResult.attestation`` says where.
    An attestation whose subject is another artifact is refused before anything is uploaded.
    ``PushResult.summary()`` is what ``kiln push --json`` prints.
    """
    src = Path(artifact)
    if not src.is_file():
        raise NotFoundError(f"{artifact}: no such artifact")
    from kiln.artifact.bundle import read_head

    read_head(src)  # a README or a spec is exit 3 before anything is uploaded or pinned
    store = _pusher(dest)
    attestation = src.with_name(src.name + ATTESTATION_SUFFIX)
    if attestation.is_file():
        check_attests(attestation, src)
    result = store.push(src, dest)
    if not attestation.is_file():
        return result
    return dataclasses.replace(result, attestation=store.push_attestation(attestation, result))


def _pusher(dest: str) -> Store:
    """The store that takes ``dest``: for ``oci://``, kiln's own layout in a registry (an image
    manifest per artifact, an index per bundle, attestations as referrers), which the storage
    transport leaves to the layer above it."""
    scheme = scheme_of(dest)
    if scheme == "oci":
        from kiln.artifact.oci_publish import OciPublisher

        return OciPublisher()
    store = backend(scheme)
    if store is None:
        raise cannot_push(dest)
    return store
