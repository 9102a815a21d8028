"""`kiln bake`, `kiln schema`, `kiln env`: the CI side."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console

from kiln.cli.options import DEVICE_INDEX, JSON, QUIET, Device
from kiln.cli.output import Output, esc, plain
from kiln.cli.render import (
    bucket_table,
    count,
    fingerprint_table,
    graph_break_table,
    human_bytes,
    print_table,
    proof_line,
)
from kiln.installs import require_torch
from kiln.spec import MAX_PASSES

if TYPE_CHECKING:
    from kiln.artifact.attestation import SignResult
    from kiln.artifact.keys import SigningKey
    from kiln.compiler.bake import BakeResult
    from kiln.grid import Shard
    from kiln.spec import Spec


def register(app: typer.Typer) -> None:
    app.command("bake")(bake_cmd)
    app.command("schema")(schema_cmd)
    app.command("env")(env_cmd)


def bake_cmd(
    spec: Path = typer.Argument(..., help="Model spec (YAML)."),
    out: Path = typer.Option(
        None,
        "--out",
        "-o",
        help="Artifact path, or a folder to write NAME.kiln.tar.zst into (a shard's: "
        "NAME.shard-I-of-N.kiln.tar.zst).",
        show_default="NAME.kiln.tar.zst",  # shown by typer, never read as markup
    ),
    passes: int = typer.Option(
        None, "--passes", min=1, max=MAX_PASSES, help="Fresh-process passes in other orders."
    ),
    prove: bool = typer.Option(
        True,
        "--prove/--no-prove",
        help="End with a fresh process serving the packed artifact restored elsewhere, and "
        "re-bake what it compiled.",
    ),
    strict: bool = typer.Option(
        False, "--strict", help="Exit 6, writing nothing, when the proof still compiles."
    ),
    sign_key: str = typer.Option(
        None,
        "--sign-key",
        help="Also write OUT.intoto.jsonl, signed provenance (PEM key path, env:NAME or fd:N; "
        "needs the sign extra).",
    ),
    shard: str = typer.Option(
        None,
        "--shard",
        metavar="I/N",
        help="Bake only slice I (0-based) of N of the grid, e.g. $(JOB_COMPLETION_INDEX)/4; "
        "combine the N artifacts with `kiln merge`.",
    ),
    json_: bool = JSON,
    quiet: bool = QUIET,
) -> None:
    """Compile SPEC's grid in an isolated cache root and write a deterministic artifact."""
    from kiln.grid import Shard
    from kiln.spec import load_spec

    o = Output(json_, quiet)
    sliced = Shard.parse(shard) if shard is not None else None  # exit 2 before the spec loads
    parsed = load_spec(spec)
    target = _bake_target(parsed, out, sliced)
    signing = _signing_key(sign_key)  # before compiling: a bad key costs a second, not a bake
    require_torch("bake")
    from kiln.compiler.bake import FollowerResult, bake

    with o.progress() as sink:
        result = bake(
            parsed, target, passes=passes, prove=prove, strict=strict, on_event=sink, shard=sliced
        )
    if isinstance(result, FollowerResult):  # a rank > 0 of the user's launch
        print(result.message, file=sys.stderr)
        return
    signed = _sign(result, signing) if signing is not None else None
    for warning in result.manifest.warnings:
        o.warn(warning)
    o.emit(_bake_summary(result, signed), lambda c: _baked_view(c, result, signed))


def _bake_target(spec: Spec, out: Path | None, sliced: Shard | None) -> Path:
    """Where the bake writes: OUT, else NAME[.shard-I-of-N].kiln.tar.zst (also inside OUT when
    it is a folder). A slice the grid cannot give, or an OUT that cannot be written, is refused
    here, before torch loads."""
    from kiln.artifact.archive import ARTIFACT_SUFFIX, artifact_target
    from kiln.grid import expand, shard_grid

    if sliced is not None:
        shard_grid(spec, expand(spec), sliced)
    suffix = sliced.suffix if sliced is not None else ""
    name = f"{spec.name}{suffix}{ARTIFACT_SUFFIX}"
    return artifact_target(out if out is not None else name, name)


def _bake_summary(result: BakeResult, signed: SignResult | None) -> dict[str, Any]:
    """``kiln bake --json``: the bake's summary, with its shard and attestation when it has them."""
    summary = result.summary()
    if result.manifest.shard is not None:
        summary["shard"] = result.manifest.shard.model_dump()
    if signed is not None:
        summary["attestation"] = str(signed.attestation)
    return summary


def _baked_view(c: Console, result: BakeResult, signed: SignResult | None) -> None:
    """``kiln bake`` for a person: the buckets, graph breaks, the proof, what was written."""
    m = result.manifest
    where = f" (shard {m.shard.label})" if m.shard is not None else ""
    print_table(c, bucket_table(m.grid, f"{m.name}: {count(len(m.grid), 'bucket')} baked{where}"))
    if m.graph_breaks:
        print_table(c, graph_break_table(m.graph_breaks))
    c.print(plain(proof_line(m)))
    c.print(
        f"wrote [bold]{esc(result.artifact)}[/] ({human_bytes(result.size)}, "
        f"{count(len(m.entries()), 'file')}, "
        f"{human_bytes(m.total_bytes)} unpacked) in {result.wall_s:.1f}s"
    )
    c.print(f"sha256 {result.sha256}")
    if signed is not None:
        c.print(f"signed {esc(signed.attestation)} (key {esc(signed.keyid)})")


def _signing_key(ref: str | None) -> SigningKey | None:
    if ref is None:
        return None
    from kiln.artifact.keys import load_signing_key  # needs torch-kiln[sign]: exit 2 without

    return load_signing_key(ref, "sign_key")


def _sign(result: BakeResult, signing: SigningKey) -> SignResult:
    """Sign right after the artifact is written, with the bake's own manifest, digest and times."""
    from kiln.artifact.attestation import sign

    finished = time.time()
    return sign(
        result.artifact,
        signing,
        manifest=result.manifest,
        sha256=result.sha256,
        started=finished - result.wall_s,
        finished=finished,
    )


def schema_cmd(
    json_: bool = typer.Option(
        False, "--json", help="Accepted like everywhere else: the schema is JSON either way."
    ),
) -> None:
    """Print the spec's JSON Schema (for editor completion via yaml-language-server)."""
    from kiln.spec import spec_json_schema

    typer.echo(json.dumps(spec_json_schema(), indent=2))


def env_cmd(
    device: Device = typer.Option(Device.CPU, "--device", help="Device to fingerprint."),
    device_index: int = DEVICE_INDEX,
    json_: bool = JSON,
) -> None:
    """Print this machine's fingerprint (the fields a manifest records)."""
    require_torch("env")
    from kiln.compiler.fingerprint import fingerprint
    from kiln.compiler.location import probe_inductor_dir

    o = Output(json_)
    with probe_inductor_dir():  # the ISA probes, as `kiln check` keeps them (not in DIR/$TMPDIR)
        fp = fingerprint(device.value, device_index=device_index or 0)
    if device is Device.CUDA and not fp.get("gpu.name"):
        o.warn(
            "--device cuda: torch sees no GPU here, so this fingerprint has no GPU, capability "
            "or driver, and its device index is only the one asked for (a bake would be exit 2)"
        )
    o.emit(fp, lambda c: print_table(c, fingerprint_table(fp, "this environment")))
