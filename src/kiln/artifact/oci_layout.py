"""How a kiln bundle looks in an OCI registry: an image index, one entry per variant.

A bundle (:mod:`kiln.artifact.bundle`) is pushed as an OCI image index: one image manifest per
variant, each index entry annotated with what selects it (``dev.kiln.gpu``, ``dev.kiln.torch``…)
and the OCI ``platform`` of its bake, so registries and their tools list the variants natively.
Restore reads the index, chooses from those annotations as it would from a bundle file, and
fetches only the chosen variant: :func:`variant_select` is what it hands the storage transport
(:mod:`kiln.artifact.storage.oci`), which knows nothing of bundles. The mapping only, no I/O;
torch-free.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ValidationError

from kiln.artifact.bundle import MAX_VARIANTS, Candidate, Choice, Variant
from kiln.artifact.manifest import first_problem
from kiln.artifact.storage.base import Select
from kiln.errors import IntegrityError

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


def variant_select(choose: Callable[[Sequence[Candidate], str], Choice]) -> Select:
    """The ``select`` of a restore from a registry: the index's variants, chosen by ``choose``
    (:meth:`kiln.artifact.bundle.Selector.choose`), and the chosen variant's manifest digest."""

    def select(index: dict[str, Any], source: str) -> tuple[Choice, str]:
        candidates, digests = index_variants(index, source)
        choice = choose(candidates, source)
        return choice, digests[choice.variant.name]

    return select


def variant_annotations(variant: Variant, name: str) -> dict[str, str]:
    """A variant's index entry annotations: what selects it, and the artifact ``name``."""
    annotations = {
        VARIANT_ANNOTATIONS[k]: str(v)
        for k, v in {"name": variant.name, **variant.selection()}.items()
        if v is not None
    }
    annotations["dev.kiln.name"] = name
    annotations.setdefault(VARIANT_ANNOTATIONS["gpu"], "cpu")  # as artifacts say it
    return annotations


def platform_of(value: object) -> dict[str, str] | None:
    """The OCI platform of a fingerprint's ``platform`` (``Linux-x86_64``), where it maps."""
    if not isinstance(value, str) or "-" not in value:
        return None
    system, _, machine = value.partition("-")
    arch = _ARCHITECTURES.get(machine.lower())
    return {"architecture": arch, "os": system.lower()} if arch else None


def index_variants(doc: dict[str, Any], url: str) -> tuple[list[Candidate], dict[str, str]]:
    """A bundle index's entries as selection candidates, and each one's manifest digest.

    The registry's document is untrusted: entries are bounded in number, their annotations go
    through the same model as a bundle file's index (:class:`kiln.artifact.bundle.Candidate`),
    and two entries with one name or one selection key are refused.
    """
    manifests = doc.get("manifests")
    if not isinstance(manifests, list) or len(manifests) > MAX_VARIANTS:
        raise IntegrityError(f"{url}: not a kiln bundle (at most {MAX_VARIANTS} index entries)")
    candidates: list[Candidate] = []
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
