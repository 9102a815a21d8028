"""`kiln merge`: a sharded bake's artifacts, combined into one. Never imports torch."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from kiln.cli.options import JSON, QUIET
from kiln.cli.output import Output, esc
from kiln.cli.render import count, human_bytes


def register(app: typer.Typer) -> None:
    app.command("merge")(merge_cmd)


def merge_cmd(
    artifacts: list[Path] = typer.Argument(..., help="Shard artifacts (kiln bake --shard I/N)."),
    out: Path = typer.Option(..., "--out", "-o", help="The merged artifact to write."),
    partial: bool = typer.Option(
        False,
        "--partial",
        help="Allow missing shards: the artifact lacks their buckets (recorded as a warning).",
    ),
    json_: bool = JSON,
    quiet: bool = QUIET,
) -> None:
    """Combine shard artifacts of one spec and environment into one artifact, as one bake of
    the whole grid would have written it (exit 2: other spec or shards; 3: a file conflicts;
    5: another environment)."""
    from kiln.artifact.merge import merge

    o = Output(json_, quiet)
    with o.progress() as sink:
        result = merge(artifacts, out, partial=partial, on_event=sink)
    for warning in result.warnings:
        o.warn(warning)

    def human(c: Console) -> None:
        m = result.manifest
        shard = f", shards {m.shard.label}" if m.shard is not None else ""
        c.print(
            f"merged {count(len(result.inputs), 'artifact')} into [bold]{esc(result.artifact)}[/] "
            f"({count(len(m.grid), 'bucket')}{shard}; {count(len(m.files), 'file')}, "
            f"{result.shared_files} shared "
            f"and stored once; {human_bytes(result.size)}) in {result.wall_s:.1f}s"
        )
        c.print(f"sha256 {result.sha256}")

    o.emit(result.summary(), human)
