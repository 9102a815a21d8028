"""Bundles: one release holding variants of an artifact baked on different GPUs or torch builds.

A compile cache only hits on the GPU model, compute capability and torch build it was baked
with, so a fleet of H100 and H200 nodes (or two torch builds) needs one artifact each. A bundle
ships them as one release, and ``kiln restore`` installs only the variant that matches the
machine (:class:`Selector`), exactly as restoring that variant's artifact alone would.

The file is the artifact container again: a deterministic zstd PAX tar (``tar --zstd -xf``
reads it) whose first member is ``bundle.json`` (:class:`BundleIndex`: per variant its name,
its fingerprint's selection key, and the sha256 and size of its artifact), followed by the
variant artifacts as ``variants/NAME.kiln.tar.zst``, unchanged, in the index's order. Same
inputs in any order give the same bytes. A bundle comes from elsewhere like any artifact, so it
is read with the same bounds: the index is a strict, bounded model refused (exit 3) before a
variant is read; only regular members it lists, at the listed sizes, are read; the chosen
variant is unpacked by the artifact extractor, hashed as it is read and checked against the
index, and its manifest's selection key must be the index's (:func:`check_variant`). For
``oci://`` a bundle is an OCI image index instead (:mod:`kiln.artifact.oci_layout`).
Torch-free.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Annotated, Any, BinaryIO, Literal

import zstandard
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator

from kiln.artifact.archive import (
    ARTIFACT_SUFFIX,
    TAR_FAULTS,
    ZSTD_THREADS,
    CheckedReader,
    HashingWriter,
    first_member,
    naming,
    open_tar_stream,
    read_index_bytes,
    read_manifest_member,
    sha256_of,
    source_date_epoch,
    tar_member,
)
from kiln.artifact.extract import (
    HashingReader,
    extract,
    extract_members,
    listed_member,
    safe_member_name,
)
from kiln.artifact.machine import CAPABILITY, Machine, detect
from kiln.artifact.manifest import MAX_TOTAL_BYTES, Manifest, Sha256, first_problem
from kiln.artifact.storage.base import copy_hashing
from kiln.errors import (
    IncompatibleError,
    IntegrityError,
    Param,
    ParameterError,
    UsageError,
    Worded,
)
from kiln.events import EventSink
from kiln.files import atomic_write
from kiln.serving import MAX_NAME_LENGTH, NAME_PATTERN

INDEX_NAME = "bundle.json"  # a bundle's first member (an artifact's is manifest.json)
BUNDLE_FORMAT = 1
BUNDLE_KIND = "kiln-bundle"
VARIANTS_DIR = "variants"
MAX_INDEX_BYTES = 1 << 20  # ~2,000 variants' worth; refused from the tar header, unread
MAX_VARIANTS = 64
MAX_TEXT = 128  # characters of a GPU name, a torch or CUDA version
# The variants are compressed already: the outer zstd only frames them, so its fastest level.
BUNDLE_ZSTD_LEVEL = 1
_SHOWN = 60


def _printable(text: str) -> str:
    if not text.isprintable():
        raise ValueError(f"{text[:_SHOWN]!r} holds control characters")
    return text


Text = Annotated[str, Field(min_length=1, max_length=MAX_TEXT), AfterValidator(_printable)]
Name = Annotated[str, Field(max_length=MAX_NAME_LENGTH, pattern=NAME_PATTERN)]


def _folded(name: str) -> str:
    """A GPU name compared as nvidia-smi, /proc and torch may print it: case and spacing aside."""
    return " ".join(name.split()).casefold()


class VariantKey(BaseModel):
    """What selects a variant: the fingerprint factors of its bake that a machine must share.

    Two variants of one bundle may not share a key: restore could not tell them apart.
    """

    model_config = ConfigDict(extra="allow", frozen=True)

    device: Literal["cpu", "cuda"]
    gpu: Text | None = None  # torch's device name, as nvidia-smi prints it: "NVIDIA H200"
    capability: Annotated[str, Field(pattern=CAPABILITY.pattern)] | None = None  # "9.0"
    torch: Text | None = None  # torch.__version__ of the bake: "2.11.0+cu130"
    cuda: Text | None = None  # torch.version.cuda of the bake: "13.0"

    @property
    def key(self) -> tuple[str | None, ...]:
        gpu = _folded(self.gpu) if self.gpu else None
        return (self.device, gpu, self.capability, self.torch, self.cuda)

    def describe(self) -> str:
        """``NVIDIA H200 9.0 · torch 2.11.0+cu130`` (``cpu · torch …`` for a CPU variant)."""
        where = "cpu" if self.device == "cpu" else f"{self.gpu or '?'} {self.capability or '?'}"
        cuda = f" (CUDA {self.cuda})" if self.cuda and self.device == "cuda" else ""
        return f"{where} · torch {self.torch or '?'}{cuda}"

    def selection(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("device", "gpu", "capability", "torch", "cuda")}


class Candidate(VariantKey):
    """A variant as selection sees it: a name and a key (an OCI index entry is no more)."""

    name: Name


class Variant(Candidate):
    """One variant in ``bundle.json``: its key, and which member holds its artifact."""

    path: str
    sha256: Sha256
    size: int = Field(ge=0, le=MAX_TOTAL_BYTES)
    artifact: Name  # the variant manifest's name
    spec_sha256: str | None = Field(default=None, max_length=MAX_TEXT)

    @model_validator(mode="after")
    def _member_path(self) -> Variant:
        # One fixed place per name: nothing in the index can name a path of its choosing.
        if self.path != member_path(self.name):
            raise ValueError(f"path {self.path[:_SHOWN]!r} is not {member_path(self.name)!r}")
        return self


class BundleIndex(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: int = Field(default=BUNDLE_FORMAT, ge=1)
    kind: Literal["kiln-bundle"] = BUNDLE_KIND
    variants: list[Variant] = Field(min_length=1, max_length=MAX_VARIANTS)

    @model_validator(mode="after")
    def _distinct(self) -> BundleIndex:
        names: set[str] = set()
        keys: dict[tuple[str | None, ...], str] = {}
        for v in self.variants:
            if v.name in names:
                raise ValueError(f"variant {v.name!r} is listed twice")
            names.add(v.name)
            if v.key in keys:
                raise ValueError(
                    f"variants {keys[v.key]!r} and {v.name!r} have the same selection key "
                    f"({v.describe()})"
                )
            keys[v.key] = v.name
        return self

    def to_bytes(self) -> bytes:
        return (json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n").encode()

    def summary(self) -> list[dict[str, Any]]:
        """The variants as ``kiln inspect --json`` and refusals list them."""
        return [
            {
                "name": v.name,
                **v.selection(),
                "artifact": v.artifact,
                "size": v.size,
                "sha256": v.sha256,
            }
            for v in self.variants
        ]


def member_path(name: str) -> str:
    return f"{VARIANTS_DIR}/{name}{ARTIFACT_SUFFIX}"


# --- keys from manifests ------------------------------------------------------------------------


def key_of(manifest: Manifest) -> VariantKey:
    """The selection key a manifest's fingerprint records (:mod:`kiln.compiler.fingerprint`)."""
    fp = manifest.fingerprint

    def text(name: str) -> str | None:
        value = fp.get(name)
        return None if value is None or value == "" else str(value)

    device = text("device.type") or ("cuda" if text("gpu.name") else "cpu")
    try:
        return VariantKey(
            device=device,  # type: ignore[arg-type]
            gpu=text("gpu.name") if device == "cuda" else None,
            capability=text("gpu.capability") if device == "cuda" else None,
            torch=text("torch.version"),
            cuda=text("torch.cuda"),
        )
    except ValidationError as exc:
        raise IntegrityError(
            f"{manifest.name}: its fingerprint cannot select a variant: {first_problem(exc)}"
        ) from None


def check_variant(chosen: Candidate, manifest: Manifest) -> None:
    """The chosen variant's artifact is what the index (or registry annotations) said it is:
    its own manifest's selection key, and name where the index gives one. The key chose it, and
    the manifest is what the caches were baked on: an index that calls a CPU artifact "H100"
    is refused (exit 3), never installed on an H100."""
    actual = key_of(manifest)
    if actual.key != chosen.key:
        raise IntegrityError(
            f"variant {chosen.name!r}: the bundle index says {chosen.describe()}, its manifest "
            f"{actual.describe()}: refused"
        )
    named = getattr(chosen, "artifact", manifest.name)
    if named != manifest.name:
        raise IntegrityError(
            f"variant {chosen.name!r}: the bundle index names artifact {named!r}, its manifest "
            f"{manifest.name!r}: refused"
        )


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-.")


def variant_name(key: VariantKey) -> str:
    """A readable name from the key: ``h200-sm90-torch2.11.0-cu130``, ``cpu-torch2.13.0``."""
    if key.device == "cpu":
        parts = ["cpu"]
    else:
        parts = [_slug(key.gpu or "").removeprefix("nvidia-") or "gpu"]
        if key.capability:
            parts.append("sm" + key.capability.replace(".", ""))
    if key.torch:
        parts.append("torch" + _slug(key.torch))
    if key.cuda and key.device == "cuda" and "+cu" not in (key.torch or ""):
        parts.append("cuda" + _slug(key.cuda))
    return "-".join(p for p in parts if p)[: MAX_NAME_LENGTH - 4] or "variant"


# --- writing ------------------------------------------------------------------------------------


@dataclass
class BundleResult:
    path: Path
    sha256: str
    size: int
    index: BundleIndex

    def summary(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "sha256": self.sha256,
            "size": self.size,
            "variants": self.index.summary(),
        }


def write_bundle(inputs: Sequence[str | Path], out: str | Path) -> BundleResult:
    """Bundle the artifacts ``inputs`` into ``out`` (atomically); returns its digest to pin.

    Each input must be a kiln artifact (not a bundle). Two inputs with the same selection key
    (:class:`VariantKey`: the same file twice, or two bakes on one GPU and torch build) are a
    :class:`UsageError`: restore could never choose between them. Each input is hashed first
    (the index precedes the variants) and hashed again as it is copied, through the same open
    file, so an input changed in between is refused rather than shipped under a wrong digest.
    """
    out = Path(out)
    if not inputs:
        raise UsageError("kiln bundle needs at least one artifact")
    with contextlib.ExitStack() as stack:
        found: list[tuple[VariantKey, str, Manifest, BinaryIO, str, int]] = []
        for raw in inputs:
            path = Path(raw)
            head = read_head(path)
            if isinstance(head, BundleIndex):
                raise UsageError(f"{path}: is a bundle already; bundle its variant artifacts")
            fh = stack.enter_context(open(path, "rb"))
            digest = sha256_of(fh)
            size = fh.tell()
            fh.seek(0)
            found.append((key_of(head), str(path), head, fh, digest, size))
        found.sort(key=lambda item: (tuple(x or "" for x in item[0].key), item[4]))
        seen: dict[tuple[str | None, ...], str] = {}
        for key, source, *_ in found:
            if key.key in seen:
                raise UsageError(
                    f"{seen[key.key]} and {source} have the same selection key "
                    f"({key.describe()}): restore could not choose between them"
                )
            seen[key.key] = source
        variants: list[Variant] = []
        names: set[str] = set()
        for key, _, manifest, _, digest, size in found:
            base = name = variant_name(key)
            n = 2
            while name in names:  # two keys that slug alike: deterministic, in key order
                name, n = f"{base}-{n}", n + 1
            names.add(name)
            variants.append(
                Variant(
                    **key.selection(),
                    name=name,
                    path=member_path(name),
                    sha256=digest,
                    size=size,
                    artifact=manifest.name,
                    spec_sha256=manifest.spec_sha256,
                )
            )
        by_name = sorted(zip(variants, found, strict=True), key=lambda pair: pair[0].name)
        index = BundleIndex(variants=[v for v, _ in by_name])
        sha, total = _write(out, index, [(v, item[3]) for v, item in by_name])
    return BundleResult(out, sha, total, index)


def _write(
    out: Path, index: BundleIndex, members: list[tuple[Variant, BinaryIO]]
) -> tuple[str, int]:
    mtime = source_date_epoch()
    body = index.to_bytes()
    with atomic_write(out) as raw:
        hashing = HashingWriter(raw)
        cctx = zstandard.ZstdCompressor(
            level=BUNDLE_ZSTD_LEVEL, threads=ZSTD_THREADS, write_checksum=True
        )
        with (
            cctx.stream_writer(hashing, closefd=False) as zw,
            tarfile.open(fileobj=zw, mode="w|", format=tarfile.PAX_FORMAT) as tar,
        ):
            tar.addfile(tar_member(INDEX_NAME, len(body), mtime), io.BytesIO(body))
            for variant, fh in members:
                reader = CheckedReader(fh, variant.path, variant.size, variant.sha256)
                tar.addfile(tar_member(variant.path, variant.size, mtime), reader)
                reader.finish()
    return hashing.sha.hexdigest(), hashing.size


# --- reading ------------------------------------------------------------------------------------


def parse_index(data: bytes) -> BundleIndex:
    """``bundle.json`` validated: :class:`IntegrityError` for anything the model refuses,
    :class:`UsageError` for a newer format."""
    if len(data) > MAX_INDEX_BYTES:
        raise IntegrityError(f"{INDEX_NAME} is {len(data)} bytes, more than kiln reads")
    try:
        index = BundleIndex.model_validate_json(data)
    except ValidationError as exc:
        raise IntegrityError(f"{INDEX_NAME} refused: {first_problem(exc)}") from None
    if index.format > BUNDLE_FORMAT:
        raise UsageError(
            f"bundle format {index.format} is newer than this kiln understands ({BUNDLE_FORMAT}): "
            "upgrade kiln"
        )
    return index


def read_index_member(tar: tarfile.TarFile, first: tarfile.TarInfo) -> BundleIndex:
    """``bundle.json`` (the ``first`` member, header already read), its size refused from the
    header; then the archive is bounded to the members the index lists."""
    if not first.isreg():
        raise IntegrityError(f"not a kiln bundle: {INDEX_NAME} is not a regular file")
    index = parse_index(read_index_bytes(tar, first, MAX_INDEX_BYTES, "bundle"))
    if hasattr(tar, "max_members"):
        tar.max_members = 1 + len(index.variants)
    return index


def read_head(path: str | Path) -> Manifest | BundleIndex:
    """What a file is, from its first member: an artifact's manifest or a bundle's index.

    A folder is a restored artifact (:func:`kiln.artifact.archive.read_manifest`).
    """
    from kiln.artifact.archive import read_manifest

    p = Path(path)
    if p.is_dir() or not p.exists():
        return read_manifest(p)
    try:
        with naming(p), open(p, "rb") as fh, open_tar_stream(fh) as tar:
            return _head(tar)
    except TAR_FAULTS as exc:
        raise IntegrityError(f"{p}: not a readable kiln artifact: {exc}") from None


def _head(tar: tarfile.TarFile) -> Manifest | BundleIndex:
    first = first_member(tar)
    if first is not None and first.name == INDEX_NAME:
        return read_index_member(tar, first)
    return read_manifest_member(tar, first)


# --- selection ----------------------------------------------------------------------------------


def torch_matches(given: str, baked: str | None) -> bool:
    """``--torch-version`` against a variant's: equal, or equal but for the build tag when none
    is given (``2.11.0`` matches ``2.11.0+cu130``; ``2.11.0+cu128`` does not)."""
    if baked is None:
        return False
    given, baked = given.strip(), baked.strip()
    return given == baked or ("+" not in given and baked.split("+", 1)[0] == given)


@dataclass(frozen=True)
class Choice:
    """The variant restore installs, and why (printed on stderr, ``variant`` in ``--json``)."""

    variant: Candidate
    reason: str
    machine: Machine | None
    torch_version: str | None
    bundle_sha256: str | None = None  # set by restore: what the pin refers to

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.variant.name,
            **self.variant.selection(),
            "reason": self.reason,
            "machine": self.machine.summary() if self.machine else None,
            "torch_version": self.torch_version,
            "bundle_sha256": self.bundle_sha256,
        }


@dataclass
class Selector:
    """How restore picks a bundle's variant: ``--variant NAME``, else the one variant whose key
    matches this machine (:func:`kiln.artifact.machine.detect`, run once, when first needed).

    A variant matches when its device is this machine's (a CPU machine takes a ``cpu`` variant),
    its GPU name is this machine's GPU 0 (case and spacing aside) and, where both are known, its
    compute capability too; with ``torch_version`` (``--torch-version``, the serving image's
    torch), its torch build too (:func:`torch_matches`). None matches: :class:`IncompatibleError`
    (exit 5) listing the variants and the machine's values. Several match (two torch builds for
    one GPU and no ``--torch-version``): :class:`UsageError` (exit 2) naming them.
    """

    variant: str | None = None
    torch_version: str | None = None
    machine: Machine | None = None
    proc_root: str | Path = "/proc"
    _detected: Machine | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.torch_version is not None:
            t = self.torch_version.strip()
            if not t or len(t) > MAX_TEXT or not t.isprintable() or " " in t:
                raise ParameterError(
                    "torch_version", self.torch_version, "expected e.g. 2.11.0+cu130"
                )

    def here(self) -> Machine:
        if self.machine is None:
            self.machine = detect(proc_root=self.proc_root)
        return self.machine

    def matches(self, v: VariantKey) -> bool:
        machine = self.here()
        if v.device != machine.device:
            return False
        gpu = machine.gpu
        if gpu is not None:
            if v.gpu is None or _folded(v.gpu) != _folded(gpu.name):
                return False
            if gpu.capability and v.capability and gpu.capability != v.capability:
                return False
        return self.torch_version is None or torch_matches(self.torch_version, v.torch)

    def describe_here(self) -> Worded:
        torch = (
            Worded(f", torch {self.torch_version} (", Param("torch_version"), ")")
            if self.torch_version
            else ""
        )
        return Worded(self.here().describe(), torch)

    def choose(self, variants: Sequence[Candidate], source: str) -> Choice:
        listed = "; ".join(f"{v.name} ({v.describe()})" for v in variants)
        detail = {"variants": [{"name": v.name, **v.selection()} for v in variants]}
        if self.variant is not None:
            for v in variants:
                if v.name == self.variant:
                    return Choice(v, Worded(Param("variant", v.name)), None, self.torch_version)
            raise UsageError(
                f"{source}: no variant {self.variant!r} in the bundle; variants: {listed}",
            )
        hits = [v for v in variants if self.matches(v)]
        machine = self.here()
        detail["machine"] = {**machine.summary(), "torch_version": self.torch_version}
        if not hits:
            raise IncompatibleError(
                Worded(
                    f"{source}: no variant matches this machine (",
                    self.describe_here(),
                    f"); variants: {listed}; pick one with ",
                    Param("variant", "NAME"),
                ),
                detail=detail,
            )
        if len(hits) > 1:
            hint = (
                Worded(Param("torch_version"), " or ", Param("variant"))
                if self.torch_version is None
                else Worded(Param("variant"))
            )
            raise UsageError(
                Worded(
                    f"{source}: {len(hits)} variants match this machine (",
                    self.describe_here(),
                    f"): {', '.join(v.name for v in hits)}; say which with ",
                    hint,
                ),
                detail=detail,
            )
        v = hits[0]
        why = Worded("this machine (", self.describe_here(), f") matches {v.describe()}")
        return Choice(v, why, machine, self.torch_version)

    def still_chosen(self, name: str, key: VariantKey) -> bool:
        """Whether the installed variant ``name`` (``key``) is what this selection picks, judged
        without the bundle: the no-op of a repeat restore. With ``--variant``, by name; else the
        variant must still match this machine."""
        if self.variant is not None:
            return self.variant == name
        return self.matches(key)


# --- extracting (restore) -----------------------------------------------------------------------


@dataclass
class Extracted:
    """What restore extracted from one stream: an artifact (``choice`` None) or a bundle's
    variant (``manifest`` None when the chosen variant is already installed: a no-op)."""

    manifest: Manifest | None
    choice: Choice | None = None
    variant_sha256: str | None = None


def extract_chosen(
    fh: IO[bytes],
    tree: Path,
    emit: EventSink,
    selector: Selector,
    source: str,
    installed: str | None,
) -> Extracted:
    """Extract the artifact, or the chosen variant of the bundle, read from ``fh`` into ``tree``
    (:func:`kiln.artifact.extract.extract` does the one, this the choosing around it).

    ``installed`` is the digest already in DEST: a bundle whose chosen variant has it unpacks
    nothing. The chosen member is hashed as the extractor reads it, and must have the index's
    size and sha256; the members before it must be listed, regular, at their listed sizes.
    """
    try:
        with naming(source), open_tar_stream(fh) as tar:
            first = first_member(tar)
            if first is None or first.name != INDEX_NAME:
                manifest = read_manifest_member(tar, first)
                if selector.variant is not None:
                    raise UsageError(
                        Worded(
                            f"{source}: ",
                            Param("variant", repr(selector.variant)),
                            ": not a bundle",
                        )
                    )
                return Extracted(extract_members(tar, manifest, tree, emit))
            index = read_index_member(tar, first)
            choice = selector.choose(index.variants, source)
            chosen = next(v for v in index.variants if v.name == choice.variant.name)
            if chosen.sha256 == installed:
                return Extracted(None, choice, chosen.sha256)
            member = _find(tar, index, chosen)
            src = tar.extractfile(member)
            assert src is not None
            reader = HashingReader(src)  # type: ignore[arg-type]
            manifest = extract(reader, tree, emit)
            digest = reader.finish()
    except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
        raise IntegrityError(f"bundle is corrupt or truncated: {exc}") from None
    if reader.size != chosen.size or digest != chosen.sha256:
        raise IntegrityError(
            f"variant {chosen.name!r}: its artifact differs from the bundle index "
            f"(sha256 {digest}, {reader.size} bytes; the index says {chosen.sha256}, "
            f"{chosen.size} bytes)"
        )
    check_variant(chosen, manifest)
    return Extracted(manifest, choice, digest)


def _find(tar: tarfile.TarFile, index: BundleIndex, chosen: Variant) -> tarfile.TarInfo:
    """Read headers up to ``chosen``'s member, checking the ones before it."""
    listed = {v.path: v for v in index.variants}
    seen: set[str] = set()
    while (member := tar.next()) is not None:
        name = safe_member_name(member.name)
        variant = listed_member(member, name, listed, seen, INDEX_NAME)
        if variant is chosen:
            return member
    raise IntegrityError(f"bundle is missing variant {chosen.name!r} ({chosen.path})")


def split_bundle(path: str | Path, into: Path) -> list[tuple[Variant, Path]]:
    """Every variant of the bundle at ``path`` as its own artifact file in ``into`` (which
    ``kiln push`` uploads to a registry one by one), each checked against the index."""
    out: list[tuple[Variant, Path]] = []
    try:
        with open(path, "rb") as fh, open_tar_stream(fh) as tar:
            first = first_member(tar)
            if first is None or first.name != INDEX_NAME:
                raise UsageError(f"{path}: not a bundle")
            index = read_index_member(tar, first)
            for variant in index.variants:
                member = _find(tar, index, variant)
                src = tar.extractfile(member)
                assert src is not None
                target = into / f"{variant.name}{ARTIFACT_SUFFIX}"
                with open(target, "xb") as dst:
                    digest = copy_hashing(src.read, dst)
                if digest != (variant.sha256, variant.size):
                    raise IntegrityError(
                        f"variant {variant.name!r}: its artifact differs from the bundle index"
                    )
                out.append((variant, target))
    except (tarfile.TarError, zstandard.ZstdError, EOFError) as exc:
        raise IntegrityError(f"bundle is corrupt or truncated: {exc}") from None
    return out
