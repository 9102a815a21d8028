"""`kiln bake`, `kiln schema`, `kiln env`: the CI side."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console

from kiln.cli.options import DEVICE_INDEX, JSON, QUIET, Device
from kiln.cli.output import Output, esc
from kiln.cli.render import bucket_table, fingerprint_table, human_bytes, print_table
from kiln.spec import MAX_PASSES


def register(app: typer.Typer) -> None:
    app.command("bake")(bake_cmd)
    app.command("schema")(schema_cmd)
    app.command("env")(env_cmd)


def bake_cmd(
    spec: Path = typer.Argument(..., help="Model spec (YAML)."),
    out: Path = typer.Option(
        None, "--out", "-o", help="Artifact path [default: NAME.kiln.tar.zst]."
    ),
    passes: int = typer.Option(
        None, "--passes", min=1, max=MAX_PASSES, help="Fresh-process passes in other orders."
    ),
    json_: bool = JSON,
    quiet: bool = QUIET,
) -> None:
    """Compile SPEC's grid in an isolated cache root and write a deterministic artifact."""
    from kiln.compiler.bake import bake
    from kiln.spec import load_spec

    o = Output(json_, quiet)
    parsed = load_spec(spec)
    target = out or Path(f"{parsed.name}.kiln.tar.zst")
    with o.progress() as sink:
        result = bake(parsed, target, passes=passes, on_event=sink)

    def human(c: Console) -> None:
        m = result.manifest
        print_table(c, bucket_table(m.grid, f"{m.name}: {len(m.grid)} buckets baked"))
        c.print(
            f"wrote [bold]{esc(result.artifact)}[/] ({human_bytes(result.size)}, "
            f"{len(m.files)} files, "
            f"{human_bytes(m.total_bytes)} unpacked) in {result.wall_s:.1f}s"
        )
        c.print(f"sha256 {result.sha256}")

    for warning in result.manifest.warnings:
        o.warn(warning)
    o.emit(result.summary(), human)


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
    from kiln.compiler.fingerprint import fingerprint

    fp = fingerprint(device.value, device_index=device_index or 0)
    Output(json_).emit(fp, lambda c: print_table(c, fingerprint_table(fp, "this environment")))
