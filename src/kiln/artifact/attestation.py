"""Signed provenance: an in-toto attestation for an artifact, made by ``kiln sign`` and checked by
``kiln restore --verify-key`` before a byte is unpacked.

A ``--sha256`` pin proves *which bytes* arrived, not *who built them from what*. The attestation
adds that: one DSSE envelope (payload type ``application/vnd.in-toto+json``) signed with a PEM key,
holding an in-toto Statement v1 whose subject is the artifact (file name and sha256) and whose
predicate is SLSA provenance v1 for the bake, all taken from the artifact's own manifest (so any
existing artifact can be signed):

- ``buildDefinition.buildType``: :data:`BUILD_TYPE`, kiln's bake (documented in the README);
- ``externalParameters``: the spec (canonical form) and its sha256 — what the user asked for;
- ``internalParameters``: the grid of buckets, its coverage (passes, compiles left, warnings),
  the serving environment and ``torch.compile`` arguments, the CI runner kind;
- ``resolvedDependencies``: the CI source commit when known, the model source (sha256), torch and
  Triton (package URLs, torch's git commit), and the whole environment fingerprint (sha256 of its
  canonical JSON, with torch/Triton/CUDA/GPU as annotations);
- ``runDetails.builder.id``: the CI job that signs (GitHub Actions, GitLab CI), else this host;
  ``builder.version``: the kiln that baked; ``metadata``: run URL, start and end of the bake.

The envelope is written as one JSON line to ``ARTIFACT.intoto.jsonl`` (the SLSA/in-toto bundle
convention), which standard tools read: the signature is over DSSE's PAE and the key id is the
key's OpenSSH fingerprint (:mod:`kiln.artifact.keys`), as cosign's verifier expects.

Torch-free. Signing and verifying import ``securesystemslib``/``cryptography`` (the ``[sign]``
extra) lazily; *showing* an attestation (``kiln inspect``) needs neither, and verifies nothing.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import os
import socket
import stat
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kiln.artifact.archive import (
    first_member,
    naming,
    open_tar_stream,
    read_manifest_member,
    sha256_of,
)
from kiln.artifact.keys import (
    SigningKey,
    VerifyKey,
    as_refs,
    load_signing_key,
    load_verify_keys,
    require_sign_extra,
)
from kiln.artifact.manifest import Manifest
from kiln.artifact.storage import DEFAULT_TIMEOUT, Deadline, read_small, scheme_of
from kiln.artifact.storage.base import ATTESTATION_SUFFIX, json_object
from kiln.errors import IntegrityError, KilnError, NotFoundError, Param, UsageError, Worded
from kiln.files import atomic_write

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://slsa.dev/provenance/v1"
# What a kiln bake is, as SLSA's buildType: a URN, since no page of kiln's own can be promised to
# resolve forever; docs/signing.md documents the parameters it implies.
BUILD_TYPE = "urn:torch-kiln:bake:v1"
MAX_ATTESTATION_BYTES = 16 << 20  # the spec is at most 1 MiB; the grid at most 4,096 keys
MAX_ENVELOPES = 64  # lines in one .intoto.jsonl

# Fingerprint keys summarised where people read provenance (annotations, restore's note).
_SUMMARY_KEYS = {
    "torch": "torch.version",
    "torch_git": "torch.git",
    "cuda": "torch.cuda",
    "triton": "triton.version",
    "gpu": "gpu.name",
    "gpu_capability": "gpu.capability",
    "gpu_driver": "gpu.driver",
    "device": "device.type",
    "cpu_isa": "cpu.isa",
    "python": "python",
    "platform": "platform",
}


def attestation_path(artifact: str | Path) -> Path:
    """Where an artifact's attestation lives: beside it, ``ARTIFACT.intoto.jsonl``."""
    p = Path(artifact)
    return p.with_name(p.name + ATTESTATION_SUFFIX)


def default_location(source: str) -> str:
    """``SOURCE.intoto.jsonl`` for any source whose URL can take a suffix (paths, ``file://``,
    ``http(s)://``, ``s3://``, ``gs://``: the suffix goes on the path, before any query).

    An ``oci://`` reference names a manifest, not a file: its attestation is an OCI 1.1 referrer
    of that manifest (``kiln push`` attaches it), so the location is the reference itself, read
    by :func:`kiln.artifact.oci_referrers.fetch_attestations`.
    """
    head, sep, _ = source.partition("://")
    if not sep:
        return source + ATTESTATION_SUFFIX
    if head.lower() == "oci":
        return source
    parts = urllib.parse.urlsplit(source)
    return urllib.parse.urlunsplit(parts._replace(path=parts.path + ATTESTATION_SUFFIX))


# --- what the statement says ----------------------------------------------------------------


@dataclass(frozen=True)
class Builder:
    """Who ran the signing job: ``id`` (a URI), the run, the source commit, the runner kind."""

    id: str
    invocation: str | None = None
    source: dict[str, Any] | None = None  # a resource descriptor: uri + gitCommit digest
    runner: str | None = None  # "github-hosted", "self-hosted", …


def ci_builder(environ: Mapping[str, str] | None = None) -> Builder:
    """The builder as the CI environment names it, else this host.

    Read where ``kiln sign`` runs: sign in the bake job (``bake --sign-key``) so it is the job
    that built the artifact. These variables are the CI's own, but the statement is only as true
    as the signer: whoever holds the key can write any of them.
    """
    env = os.environ if environ is None else environ
    if env.get("GITHUB_ACTIONS") == "true" and env.get("GITHUB_REPOSITORY"):
        server = env.get("GITHUB_SERVER_URL") or "https://github.com"
        repo = env["GITHUB_REPOSITORY"]
        workflow = env.get("GITHUB_WORKFLOW_REF")  # owner/repo/.github/workflows/x.yml@refs/…
        run, attempt = env.get("GITHUB_RUN_ID"), env.get("GITHUB_RUN_ATTEMPT") or "1"
        sha, ref = env.get("GITHUB_SHA"), env.get("GITHUB_REF")
        return Builder(
            id=f"{server}/{workflow}" if workflow else f"{server}/{repo}/actions",
            invocation=f"{server}/{repo}/actions/runs/{run}/attempts/{attempt}" if run else None,
            source={
                "uri": f"git+{server}/{repo}" + (f"@{ref}" if ref else ""),
                "digest": {"gitCommit": sha},
            }
            if sha
            else None,
            runner=env.get("RUNNER_ENVIRONMENT"),
        )
    if env.get("GITLAB_CI") == "true" and env.get("CI_PROJECT_URL"):
        project = env["CI_PROJECT_URL"]
        runner = env.get("CI_RUNNER_ID")
        sha, ref = env.get("CI_COMMIT_SHA"), env.get("CI_COMMIT_REF_NAME")
        return Builder(
            id=f"{project}/-/runners/{runner}" if runner else project,
            invocation=env.get("CI_JOB_URL"),
            source={
                "uri": f"git+{project}" + (f"@{ref}" if ref else ""),
                "digest": {"gitCommit": sha},
            }
            if sha
            else None,
            runner=env.get("CI_RUNNER_DESCRIPTION"),
        )
    host = urllib.parse.quote(socket.gethostname() or "localhost", safe="")
    return Builder(id=f"urn:torch-kiln:local:{host}")


def fingerprint_summary(fp: Mapping[str, Any]) -> dict[str, str]:
    return {label: str(fp[key]) for label, key in _SUMMARY_KEYS.items() if fp.get(key) is not None}


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _purl(name: str, version: str) -> str:
    return f"pkg:pypi/{name}@{urllib.parse.quote(version, safe='')}"


def _rfc3339(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_statement(
    manifest: Manifest,
    artifact_name: str,
    sha256: str,
    *,
    builder: Builder | None = None,
    started: float | None = None,
    finished: float | None = None,
) -> dict[str, Any]:
    """The in-toto Statement v1 (SLSA provenance v1 predicate) for one artifact.

    ``started``/``finished`` (epoch seconds) are the bake's, when the signer saw it run; without
    them ``finishedOn`` is the manifest's ``created`` (``SOURCE_DATE_EPOCH`` when that was set).
    """
    builder = builder or ci_builder()
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": artifact_name, "digest": {"sha256": sha256}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {
                    "spec": manifest.spec,
                    "spec_sha256": manifest.spec_sha256,
                },
                "internalParameters": _internal_parameters(manifest, builder),
                "resolvedDependencies": _dependencies(manifest, builder),
            },
            "runDetails": {
                "builder": {"id": builder.id, "version": {"torch-kiln": manifest.kiln_version}},
                "metadata": _run_metadata(manifest, builder, started, finished),
            },
        },
    }


def _dependencies(manifest: Manifest, builder: Builder) -> list[dict[str, Any]]:
    """What the bake was built from: the source checkout, the model's code, torch, Triton, and
    the fingerprint of the machine it compiled on."""
    fp = manifest.fingerprint
    deps: list[dict[str, Any]] = []
    if builder.source is not None:
        deps.append({"name": "source", **builder.source})
    if manifest.model_source_sha256:
        deps.append({"name": "model-source", "digest": {"sha256": manifest.model_source_sha256}})
    if fp.get("torch.version"):
        torch: dict[str, Any] = {"name": "torch", "uri": _purl("torch", str(fp["torch.version"]))}
        if fp.get("torch.git"):
            torch["digest"] = {"gitCommit": str(fp["torch.git"])}
        if fp.get("torch.cuda"):
            torch["annotations"] = {"cuda": str(fp["torch.cuda"])}
        deps.append(torch)
    if fp.get("triton.version"):
        deps.append({"name": "triton", "uri": _purl("triton", str(fp["triton.version"]))})
    deps.append(
        {
            "name": "fingerprint",
            "digest": {"sha256": hashlib.sha256(_canonical(fp)).hexdigest()},
            "annotations": fingerprint_summary(fp),
        }
    )
    return deps


def _internal_parameters(manifest: Manifest, builder: Builder) -> dict[str, Any]:
    """What kiln decided and measured: the grid, what the artifact covers, the compile
    arguments and environment a server needs, and the CI runner."""
    last = manifest.passes[-1] if manifest.passes else None
    coverage = {
        "buckets": len(manifest.grid),
        "passes": len(manifest.passes),
        "last_pass_compiles": last.compiles if last else None,
        "files": len(manifest.files),
        "bytes": manifest.total_bytes,
        "megacache": manifest.megacache is not None,
        "precompiled": manifest.precompiled is not None,
        "warnings": list(manifest.warnings),
    }
    if manifest.aoti is not None:  # compile.route: aoti: its packages are the whole payload
        coverage["aoti_packages"] = len(manifest.aoti.programs)
    internal: dict[str, Any] = {
        "name": manifest.name,
        "grid": [b.key for b in manifest.grid],
        "coverage": coverage,
        "compile_kwargs": manifest.compile_kwargs,
        "env": dict(manifest.env),
        "manifest_format": manifest.format,
    }
    if builder.runner:
        internal["ci_runner"] = builder.runner
    return internal


def _run_metadata(
    manifest: Manifest, builder: Builder, started: float | None, finished: float | None
) -> dict[str, Any]:
    """The CI invocation and the bake's times (``finishedOn``: the manifest's ``created`` when
    the signer did not see the bake run)."""
    metadata: dict[str, Any] = {}
    if builder.invocation:
        metadata["invocationId"] = builder.invocation
    if started is not None:
        metadata["startedOn"] = _rfc3339(started)
    metadata["finishedOn"] = _rfc3339(finished) if finished is not None else manifest.created
    return metadata


def describe(statement: Mapping[str, Any]) -> dict[str, Any]:
    """Who and what built it, read from a statement defensively (it may come from anyone):
    every value a string or None, whatever the JSON held."""

    def get(obj: Any, *path: str) -> Any:
        for key in path:
            obj = obj.get(key) if isinstance(obj, Mapping) else None
        return obj

    def text(value: Any) -> str | None:
        return value if isinstance(value, str) else None

    predicate = get(statement, "predicate")
    deps = get(predicate, "buildDefinition", "resolvedDependencies")
    by_name = {
        d.get("name"): d
        for d in (deps if isinstance(deps, list) else [])
        if isinstance(d, Mapping) and isinstance(d.get("name"), str)
    }
    summary = get(by_name.get("fingerprint"), "annotations")
    version = get(predicate, "runDetails", "builder", "version", "torch-kiln")
    source = by_name.get("source")
    return {
        "builder": text(get(predicate, "runDetails", "builder", "id")),
        "invocation": text(get(predicate, "runDetails", "metadata", "invocationId")),
        "build_type": text(get(predicate, "buildDefinition", "buildType")),
        "source": text(get(source, "uri")),
        "source_commit": text(get(source, "digest", "gitCommit")),
        "name": text(get(predicate, "buildDefinition", "internalParameters", "name")),
        "spec_sha256": text(get(predicate, "buildDefinition", "externalParameters", "spec_sha256")),
        "model_source_sha256": text(get(by_name.get("model-source"), "digest", "sha256")),
        "torch": text(get(summary, "torch")),
        "triton": text(get(summary, "triton")),
        "cuda": text(get(summary, "cuda")),
        "gpu": text(get(summary, "gpu")),
        "kiln_version": text(version),
        "finished": text(get(predicate, "runDetails", "metadata", "finishedOn")),
    }


def describe_line(info: Mapping[str, Any]) -> str:
    """One line for people: signer, builder, spec, torch/CUDA/GPU."""
    env = ", ".join(
        f"{label} {info.get(key) or '-'}"
        for label, key in (
            ("torch", "torch"),
            ("triton", "triton"),
            ("CUDA", "cuda"),
            ("GPU", "gpu"),
        )
    )
    run = f" (run {info['invocation']})" if info.get("invocation") else ""
    signer = f"signed by {info['key']} ({info['keyid']}); " if info.get("keyid") else ""
    spec = info.get("spec_sha256") or "-"
    return f"{signer}built by {info.get('builder') or '?'}{run}; spec sha256 {spec}; {env}"


# --- signing --------------------------------------------------------------------------------


@dataclass
class SignResult:
    artifact: Path
    attestation: Path
    sha256: str
    keyid: str
    statement: dict[str, Any] = field(repr=False)

    def summary(self) -> dict[str, Any]:
        return {
            "artifact": str(self.artifact),
            "attestation": str(self.attestation),
            "sha256": self.sha256,
            "keyid": self.keyid,
            "predicate_type": PREDICATE_TYPE,
            **describe(self.statement),
        }


def _open_artifact(artifact: Path) -> Any:
    try:
        fh = open(artifact, "rb")  # noqa: SIM115 - returned to a with block
    except FileNotFoundError:
        raise NotFoundError(f"{artifact}: no such artifact") from None
    except OSError as exc:
        raise UsageError(f"{artifact}: cannot open: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
        fh.close()
        raise UsageError(f"{artifact}: not an artifact file")
    return fh


def _read_artifact(artifact: Path) -> tuple[Manifest, str]:
    """The manifest and sha256 of one open file (a file swapped in between cannot mix them).
    A bundle is refused with what to do instead: its variants are what restore verifies."""
    from kiln.artifact.bundle import INDEX_NAME

    with _open_artifact(artifact) as fh, naming(artifact):
        digest = sha256_of(fh)
        fh.seek(0)
        with open_tar_stream(fh) as tar:
            first = first_member(tar)
            if first is not None and first.name == INDEX_NAME:
                raise UsageError(
                    f"{artifact}: a bundle: bundles are signed per variant "
                    "(kiln sign each artifact before kiln bundle)"
                )
            manifest = read_manifest_member(tar, first)
    return manifest, digest


def sign(
    artifact: str | Path,
    key: str | SigningKey,
    *,
    out: str | Path | None = None,
    manifest: Manifest | None = None,
    sha256: str | None = None,
    started: float | None = None,
    finished: float | None = None,
    environ: Mapping[str, str] | None = None,
) -> SignResult:
    """Write ``out`` (default ``ARTIFACT.intoto.jsonl``): one DSSE envelope over the artifact's
    provenance statement, signed with ``key`` (a reference, see :mod:`kiln.artifact.keys`).

    ``manifest``/``sha256`` may be passed by a caller that just wrote the artifact (bake);
    otherwise both are read from the file. The file is replaced atomically.
    """
    require_sign_extra()
    from securesystemslib.dsse import Envelope

    artifact = Path(artifact)
    target = Path(out) if out is not None else attestation_path(artifact)
    if target.absolute() == artifact.absolute():
        raise UsageError(f"-o {target}: is the artifact itself")
    if manifest is None or sha256 is None:  # before the key: "not an artifact" comes first
        manifest, sha256 = _read_artifact(artifact)
    signing = key if isinstance(key, SigningKey) else load_signing_key(str(key))
    statement = build_statement(
        manifest,
        artifact.name,
        sha256,
        builder=ci_builder(environ),
        started=started,
        finished=finished,
    )
    envelope = Envelope(_canonical(statement), PAYLOAD_TYPE, {})
    envelope.sign(signing.signer)
    line = json.dumps(envelope.to_dict(), sort_keys=True, separators=(",", ":")) + "\n"
    with atomic_write(target) as fh:  # mode 0666 less the umask: public, like the artifact
        fh.write(line.encode())
    return SignResult(artifact, target, sha256, signing.keyid, statement)


# --- reading and verifying ------------------------------------------------------------------


def _envelope_dicts(data: bytes, where: str) -> list[dict[str, Any]]:
    """The JSON objects of a ``.intoto.jsonl`` file (one envelope per non-empty line)."""
    if len(data) > MAX_ATTESTATION_BYTES:
        raise IntegrityError(f"{where}: more than {MAX_ATTESTATION_BYTES} bytes: refused")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise IntegrityError(f"{where}: not an attestation (not UTF-8 text)") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise IntegrityError(f"{where}: empty attestation")
    if len(lines) > MAX_ENVELOPES:
        raise IntegrityError(f"{where}: {len(lines)} envelopes, more than {MAX_ENVELOPES}")
    return [json_object(line, f"{where}: a DSSE envelope line") for line in lines]


def _b64(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise IntegrityError(f"not a DSSE envelope: {what} is not a string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise IntegrityError(f"not a DSSE envelope: {what} is not base64") from None


@dataclass(frozen=True)
class _Parsed:
    payload_type: str
    payload: bytes
    signatures: list[tuple[str, bytes]]  # (keyid hint, signature)


def _parse_envelope(doc: Mapping[str, Any]) -> _Parsed:
    """The DSSE JSON envelope's fields, checked for shape (strict base64: one encoding per
    payload, so what is shown is what was signed)."""
    payload_type = doc.get("payloadType")
    if not isinstance(payload_type, str):
        raise IntegrityError("not a DSSE envelope: no payloadType")
    payload = _b64(doc.get("payload"), "payload")
    sigs = doc.get("signatures")
    if not isinstance(sigs, list) or not sigs:
        raise IntegrityError("DSSE envelope without signatures")
    signatures = []
    for s in sigs[:MAX_ENVELOPES]:
        if not isinstance(s, Mapping):
            raise IntegrityError("not a DSSE envelope: a signature is not an object")
        keyid = s.get("keyid", "")
        signatures.append((keyid if isinstance(keyid, str) else "", _b64(s.get("sig"), "sig")))
    return _Parsed(payload_type, payload, signatures)


def _statement(payload: bytes) -> dict[str, Any]:
    try:
        statement = json.loads(payload)
    except (ValueError, RecursionError):  # signed or not, nesting too deep is not a statement
        raise IntegrityError("the signed payload is not JSON") from None
    if not isinstance(statement, dict) or statement.get("_type") != STATEMENT_TYPE:
        got = statement.get("_type") if isinstance(statement, dict) else None
        raise IntegrityError(f"statement type {got!r}, expected {STATEMENT_TYPE}")
    if statement.get("predicateType") != PREDICATE_TYPE:
        raise IntegrityError(
            f"predicate type {statement.get('predicateType')!r}, expected {PREDICATE_TYPE}"
        )
    return statement


def subjects(statement: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(name, sha256) of every well-formed subject; others are ignored, never matched."""
    out = []
    items = statement.get("subject")
    for s in items if isinstance(items, list) else []:
        digest = s.get("digest") if isinstance(s, Mapping) else None
        sha = digest.get("sha256") if isinstance(digest, Mapping) else None
        if isinstance(sha, str):
            name = s.get("name")
            out.append((name if isinstance(name, str) else "", sha.lower()))
    return out


@dataclass(frozen=True)
class Verified:
    """One envelope whose signature a trusted key made, holding a kiln-readable statement."""

    key: VerifyKey
    statement: dict[str, Any]


def _verify_envelope(doc: Mapping[str, Any], keys: list[VerifyKey]) -> Verified:
    parsed = _parse_envelope(doc)
    if parsed.payload_type != PAYLOAD_TYPE:
        raise IntegrityError(f"payloadType {parsed.payload_type!r}, expected {PAYLOAD_TYPE}")
    from securesystemslib.dsse import Envelope

    # DSSE's pre-authentication encoding, what the signature covers (securesystemslib's).
    data = Envelope(parsed.payload, parsed.payload_type, {}).pae()
    for _hint, sig in parsed.signatures:
        for key in keys:
            if key.verifies(sig.hex(), data):
                return Verified(key, _statement(parsed.payload))
    hints = sorted({hint or "(no keyid)" for hint, _ in parsed.signatures})
    trusted = ", ".join(k.keyid for k in keys)
    raise IntegrityError(
        Worded(
            "signature does not verify with any ",
            Param("verify_keys"),
            f" (signed as {', '.join(hints)}; trusted: {trusted}): wrong key or tampered envelope",
        )
    )


@dataclass
class AttestationCheck:
    """An attestation whose signature verified; :meth:`check_subject` finishes the check."""

    location: str
    verified: list[Verified]
    summary: dict[str, Any] | None = None

    def check_subject(self, sha256: str) -> dict[str, Any]:
        """Require that a verified statement names ``sha256`` (the bytes about to be unpacked)
        as its subject; :class:`IntegrityError` (exit 3) if it attests another artifact."""
        digest = sha256.lower()
        for v in self.verified:
            for name, sha in subjects(v.statement):
                if sha == digest:
                    self.summary = {
                        "verified": True,
                        "attestation": self.location,
                        "key": v.key.ref,
                        "keyid": v.key.keyid,
                        "subject": name,
                        "sha256": digest,
                        "predicate_type": PREDICATE_TYPE,
                        **describe(v.statement),
                    }
                    return self.summary
        named = [
            f"{n or '?'} (sha256 {s[:12]}…)"
            for v in self.verified
            for n, s in subjects(v.statement)
        ]
        raise IntegrityError(
            f"{self.location}: attests {', '.join(named) or 'no subject'}, not this artifact "
            f"(sha256 {digest}): an attestation for another artifact; nothing was changed"
        )


def _fetch_attestation(location: str, timeout: float) -> bytes:
    """The attestation's bytes through the same storage as artifacts, into a private temporary
    folder (not beside DEST: a restore that is a no-op in a read-only folder verifies too).
    For an ``oci://`` location, the attestations attached to it as OCI referrers."""
    if scheme_of(location) == "oci":
        from kiln.artifact.oci_referrers import fetch_attestations

        try:
            return fetch_attestations(location, Deadline(timeout))
        except NotFoundError:
            raise IntegrityError(
                Worded(
                    f"{location}: no attestation attached in the registry; ",
                    Param("verify_keys"),
                    " needs the artifact's signed attestation (kiln sign, then kiln push)",
                )
            ) from None
    try:
        return read_small(location, MAX_ATTESTATION_BYTES, timeout=timeout)
    except NotFoundError:
        raise IntegrityError(
            Worded(
                f"{location}: no attestation there; ",
                Param("verify_keys"),
                " needs the artifact's signed attestation (kiln sign), beside it or named by ",
                Param("attestation"),
            )
        ) from None
    except IntegrityError:
        raise
    except UsageError as exc:
        if scheme_of(location) != "file":
            raise  # not a location kiln can read (an invalid URL): the argument's fault
        raise _unreadable(location, exc) from None
    except KilnError as exc:  # HTTP 403 or 500, a redirect loop, --timeout: still unread
        raise _unreadable(location, exc) from None


def _unreadable(location: str, exc: KilnError) -> IntegrityError:
    """Exit 3 for an attestation that could not be read: restore never goes on without it."""
    if scheme_of(location) == "file":
        from kiln.artifact.storage.file import local_path  # imported only for a local path

        with contextlib.suppress(OSError):
            mode = local_path(location).stat().st_mode
            if not stat.S_ISREG(mode):
                kind = "a folder" if stat.S_ISDIR(mode) else "a special file"
                return IntegrityError(
                    f"{location}: not an attestation file ({kind}); nothing was changed"
                )
    why = exc.message.removeprefix(f"{location}: ")
    return IntegrityError(
        Worded(f"{location}: cannot read the attestation: ", why, "; nothing was changed")
    )


def verify_attestation(
    source: str,
    verify_keys: Any,
    attestation: str | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT,
) -> AttestationCheck | None:
    """Fetch and verify the attestation of ``source`` with any of ``verify_keys`` (threshold 1):
    payload type, signature, statement and predicate type. None without keys.

    The subject is checked later, against the digest of the bytes actually unpacked
    (:meth:`AttestationCheck.check_subject`). Every failure is :class:`IntegrityError` (exit 3)
    except unusable keys or arguments (exit 2).
    """
    refs = as_refs(verify_keys)
    if verify_keys is not None and not refs:
        raise UsageError("verify_keys is empty: name at least one public key, or pass None")
    if not refs:
        if attestation is not None:
            raise UsageError(
                Worded(
                    Param("attestation"),
                    " needs ",
                    Param("verify_keys"),
                    ": without a key nothing is verified",
                )
            )
        return None
    keys = load_verify_keys(refs)
    location = str(attestation) if attestation is not None else default_location(source)
    docs = _envelope_dicts(_fetch_attestation(location, timeout), location)
    verified, errors = [], []
    for doc in docs:
        try:
            verified.append(_verify_envelope(doc, keys))
        except IntegrityError as exc:
            errors.append(exc.message)
    if not verified:
        if len(errors) == 1:
            raise IntegrityError(Worded(f"{location}: ", errors[0], "; nothing was changed"))
        raise IntegrityError(
            Worded(
                f"{location}: none of its {len(errors)} envelopes verifies (",
                errors[0],
                "); nothing was changed",
            )
        )
    return AttestationCheck(location, verified)


def check_attests(attestation: Path, artifact: Path) -> None:
    """Refuse (exit 3) to push ``attestation`` with ``artifact`` unless one of its envelopes
    names the artifact's sha256 as subject: a stale ``.intoto.jsonl`` left from an earlier bake
    would otherwise travel with new bytes and fail every verifying restore. Unverified (push
    holds no key); the signature is checked where it matters, by restore."""
    with open(attestation, "rb") as fh:
        docs = _envelope_dicts(fh.read(MAX_ATTESTATION_BYTES + 1), str(attestation))
    with _open_artifact(artifact) as fh:
        digest = sha256_of(fh)
    for doc in docs:
        with contextlib.suppress(IntegrityError):
            statement = _statement(_parse_envelope(doc).payload)
            if any(sha == digest for _, sha in subjects(statement)):
                return
    raise IntegrityError(
        f"{attestation}: attests another artifact, not {artifact.name} (sha256 {digest}): "
        "sign it again (kiln sign) or remove it; nothing was pushed"
    )


def show_attestation(artifact: str | Path) -> dict[str, Any] | None:
    """What ``ARTIFACT.intoto.jsonl`` beside ``artifact`` claims, *unverified* (no key here):
    signer key ids, builder, spec, torch/GPU, and whether a subject matches the artifact's
    sha256. None when there is no such file. Needs no crypto library."""
    path = attestation_path(artifact)
    if not path.is_file():
        return None
    view: dict[str, Any] = {
        "path": str(path),
        "verified": False,
        "note": "not verified: inspect has no key (kiln restore --verify-key PUB verifies)",
    }
    try:
        with open(path, "rb") as fh:
            docs = _envelope_dicts(fh.read(MAX_ATTESTATION_BYTES + 1), str(path))
        with _open_artifact(Path(artifact)) as fh:
            digest = sha256_of(fh)
        envelopes = []
        for doc in docs:
            parsed = _parse_envelope(doc)
            entry: dict[str, Any] = {
                "payload_type": parsed.payload_type,
                "keyids": [hint or "(none)" for hint, _ in parsed.signatures],
            }
            try:
                statement = _statement(parsed.payload)
            except IntegrityError as exc:
                entry["problem"] = exc.message
            else:
                entry["subject_match"] = any(sha == digest for _, sha in subjects(statement))
                entry["subjects"] = [{"name": n, "sha256": s} for n, s in subjects(statement)]
                entry.update(describe(statement))
            envelopes.append(entry)
        view["sha256"] = digest
        view["envelopes"] = envelopes
    except (KilnError, OSError) as exc:
        view["problem"] = exc.message if isinstance(exc, KilnError) else str(exc)
    return view
