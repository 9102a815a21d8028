"""`kiln inspect`, `kiln restore`, `kiln push`, `kiln bundle`: artifact handling. Never imports
torch."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from kiln.artifact.storage import DEFAULT_TIMEOUT
from kiln.cli.options import JSON, QUIET
from kiln.cli.output import Output, esc, flagged
from kiln.cli.render import bundle_view, human_bytes, manifest_view, serve_hint

if TYPE_CHECKING:
    from kiln.artifact.restore import RestoreResult


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect_cmd)
    app.command("restore")(restore_cmd)
    app.command("push")(push_cmd)
    app.command("bundle")(bundle_cmd)


def inspect_cmd(
    artifact: Path = typer.Argument(..., help="Artifact file or restored folder."),
    json_: bool = JSON,
) -> None:
    """Show an artifact's manifest without unpacking it: fingerprint, grid, files by kind
    (and ARTIFACT.intoto.jsonl beside it, unverified)."""
    from kiln.artifact.attestation import show_attestation
    from kiln.artifact.bundle import BundleIndex, read_head
    from kiln.cli.sign import attestation_lines

    m = read_head(artifact)
    if isinstance(m, BundleIndex):
        index = m
        Output(json_).emit(
            {"bundle": True, "format": index.format, "variants": index.summary()},
            lambda c: bundle_view(c, index),
        )
        return
    data = m.model_dump(mode="json")
    seen = None if artifact.is_dir() else show_attestation(artifact)
    if seen is not None:
        data["attestation"] = seen

    def human(c: Console) -> None:
        manifest_view(c, m)
        if seen is not None:
            attestation_lines(c, seen)

    Output(json_).emit(data, human)


def restore_cmd(
    source: str = typer.Argument(
        ..., help="Artifact path or URL (http(s)://, s3://, gs://, oci://)."
    ),
    dest: Path = typer.Option(
        ..., "--dest", "-d", help="Folder to install into (replaced atomically)."
    ),
    sha256: str = typer.Option(
        None,
        "--sha256",
        help="Pinned artifact digest (64 hex digits, 'sha256:' optional), checked before "
        "unpacking and again over the bytes unpacked.",
    ),
    env_file: Path = typer.Option(None, "--env-file", help="Also write kiln.env here."),
    timeout: float = typer.Option(
        DEFAULT_TIMEOUT,
        "--timeout",
        help="Seconds the whole download may take (retries included); a connection idle for "
        "60 s, or a quarter of this if shorter, is retried.",
    ),
    verify_key: list[str] = typer.Option(
        None,
        "--verify-key",
        metavar="KEY",
        help="Trusted public key (PEM path, env:NAME or fd:N; repeat for rotation; default "
        "$KILN_VERIFY_KEY, comma-separated): require a signed attestation for these bytes.",
    ),
    attestation: str = typer.Option(
        None, "--attestation", help="Attestation path or URL (default: SOURCE.intoto.jsonl)."
    ),
    variant: str = typer.Option(
        None, "--variant", help="For a bundle: install this variant (see kiln inspect)."
    ),
    torch_version: str = typer.Option(
        None,
        "--torch-version",
        help="For a bundle: the serving image's torch (torch.__version__, e.g. 2.11.0+cu130); "
        "only variants baked with it match.",
        envvar="KILN_TORCH_VERSION",
    ),
    json_: bool = JSON,
    quiet: bool = QUIET,
) -> None:
    """Fetch and unpack an artifact into DEST safely, atomically and idempotently. A bundle
    installs the variant that matches this machine's GPU (and --torch-version), or --variant."""
    from kiln.artifact.attestation import describe_line
    from kiln.artifact.keys import verify_keys_from_env
    from kiln.artifact.restore import restore

    o = Output(json_, quiet)
    keys = verify_key or verify_keys_from_env()
    with o.progress() as sink:
        result = restore(
            source,
            dest,
            sha256=sha256,
            env_file=env_file,
            on_event=sink,
            timeout=timeout,
            verify_keys=keys,
            attestation=attestation,
            variant=variant,
            torch_version=torch_version,
        )
    if result.choice is not None:
        o.note(f"bundle: variant {result.choice.variant.name}: {flagged(result.choice.reason)}")
    if result.provenance is not None:
        o.note(f"attestation verified: {describe_line(result.provenance)}")
    o.emit(result.summary(), lambda c: _restored_view(c, result))


def _restored_view(c: Console, result: RestoreResult) -> None:
    """``kiln restore`` for a person: what is in DEST now, its digest, and how to serve it."""
    what = "already installed" if result.noop else "restored"
    c.print(
        f"{what} [bold]{esc(result.manifest.name)}[/] into {esc(result.dest)}: "
        f"{result.files} files, "
        f"{human_bytes(result.bytes)} in {result.seconds:.2f}s"
    )
    c.print(f"sha256 {result.sha256}")
    if result.replaced is not None:
        old = result.replaced
        c.print(f"replaced [bold]{esc(old['name'])}[/] (sha256 {old['sha256'][:12]}…)")
    c.print(f"serve with: {esc(serve_hint(result.manifest, result.dest, result.env_file))}")


def push_cmd(
    artifact: Path = typer.Argument(..., help="Artifact file."),
    dest: str = typer.Argument(
        ..., help="Destination: path, s3://, gs:// or oci://registry/repo:tag."
    ),
    json_: bool = JSON,
) -> None:
    """Upload an artifact (and ARTIFACT.intoto.jsonl beside it, if signed: as DEST.intoto.jsonl,
    or an OCI referrer); prints its digest so CI can pin the restore."""
    from kiln.artifact.publish import push

    result = push(artifact, dest)

    def human(c: Console) -> None:
        c.print(f"pushed {esc(result.dest)}\nsha256 {result.sha256}")
        if result.attestation is not None:
            c.print(f"attestation {esc(result.attestation)}")

    Output(json_).emit(result.summary(), human)


def bundle_cmd(
    artifacts: list[Path] = typer.Argument(
        ..., help="Artifacts baked on different GPUs or torch builds: one variant each."
    ),
    out: Path = typer.Option(..., "--out", "-o", help="Bundle file to write (atomically)."),
    json_: bool = JSON,
) -> None:
    """Make one release of several artifacts; kiln restore installs the variant matching the
    machine. Exit 2 if two share a GPU, capability and torch build (restore could not choose)."""
    from kiln.artifact.bundle import write_bundle

    result = write_bundle(artifacts, out)

    def human(c: Console) -> None:
        bundle_view(c, result.index)
        c.print(f"wrote {esc(result.path)}: {human_bytes(result.size)}\nsha256 {result.sha256}")

    Output(json_).emit(result.summary(), human)
