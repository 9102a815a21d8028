"""`kiln sign`: signed provenance for an artifact; also how attestations are shown elsewhere
(restore's note, inspect's section). Torch-free; the [sign] extra is imported only to sign."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from kiln.cli.options import JSON
from kiln.cli.output import Output, esc, plain

KEY_HELP = "PEM private key (Ed25519 or ECDSA P-256): a path, env:NAME or fd:N."


def register(app: typer.Typer) -> None:
    app.command("sign")(sign_cmd)


def sign_cmd(
    artifact: Path = typer.Argument(..., help="Artifact file."),
    key: str = typer.Option(..., "--key", "-k", help=KEY_HELP),
    out: Path = typer.Option(
        None, "--out", "-o", help="Attestation path (default: ARTIFACT.intoto.jsonl)."
    ),
    json_: bool = JSON,
) -> None:
    """Write ARTIFACT.intoto.jsonl: an in-toto SLSA provenance attestation, DSSE-signed with KEY."""
    from kiln.artifact.attestation import sign

    result = sign(artifact, key, out=out)
    Output(json_).emit(result.summary(), lambda c: signed_lines(c, result.summary()))


def signed_lines(c: Console, info: dict[str, Any]) -> None:
    c.print(f"signed [bold]{esc(info['artifact'])}[/] → {esc(info['attestation'])}")
    c.print(f"key {esc(info['keyid'])} · builder {esc(info.get('builder') or '?')}")
    c.print(f"subject sha256 {info['sha256']}")


def attestation_lines(c: Console, view: dict[str, Any]) -> None:
    """``kiln inspect``'s attestation section: what it claims, plainly marked unverified."""
    c.print(plain(f"attestation {view['path']}", "bold"))
    if "problem" in view:
        c.print(plain(f"  unreadable: {view['problem']}", "red"))
    for entry in view.get("envelopes", []):
        c.print(plain(f"  signer key ids: {', '.join(entry['keyids'])}"))
        if "problem" in entry:
            c.print(plain(f"  {entry['problem']}", "red"))
            continue
        match = "yes" if entry["subject_match"] else "NO (an attestation for another artifact)"
        c.print(plain(f"  subject matches this artifact: {match}"))
        c.print(plain(f"  builder: {entry.get('builder') or '?'}"))
        if entry.get("invocation"):
            c.print(plain(f"  run: {entry['invocation']}"))
        c.print(plain(f"  spec sha256: {entry.get('spec_sha256') or '-'}"))
        env = ", ".join(
            f"{label} {entry.get(key) or '-'}"
            for label, key in (("torch", "torch"), ("CUDA", "cuda"), ("GPU", "gpu"))
        )
        c.print(plain(f"  built with: {env}"))
    c.print(plain(f"  {view['note']}", "yellow"))
