"""`kiln bench`: eager vs cold vs kiln vs the stock alternatives, as a table to paste."""

from __future__ import annotations

from pathlib import Path

import typer

from kiln.cli.options import JSON, ORDER, QUIET
from kiln.cli.output import Output, save_json
from kiln.cli.render import bench_view
from kiln.grid import Order
from kiln.installs import require_torch


def register(app: typer.Typer) -> None:
    app.command("bench")(bench_cmd)


def bench_cmd(
    spec: Path = typer.Argument(..., help="Model spec (YAML)."),
    modes: str = typer.Option(
        "eager,cold,kiln,megacache,copied",
        "--modes",
        help="Comma-separated modes: eager, cold, kiln, megacache, copied, kiln-blob, kiln-serial, "
        "aoti (the spec baked again on compile.route: aoti, served from its packages).",
    ),
    order: Order = ORDER,
    cold_run: bool = typer.Option(
        False, "--cold-run", help="Time a separate bare compile (default: the bake's first pass)."
    ),
    repeat: int = typer.Option(
        1,
        "--repeat",
        min=1,
        help="Run each mode but cold N times (rotating order); report medians and the spread.",
    ),
    workdir: Path = typer.Option(
        None,
        "--workdir",
        help="Keep artifacts and caches here; a later bench there reuses each bake that still "
        "matches the spec, its model source and this machine.",
    ),
    save: Path = typer.Option(None, "--save", help="Also write the JSON report to this file."),
    traffic: Path = typer.Option(
        None,
        "--traffic",
        help="Instead of the modes: bake, restore, and serve this traffic log's shapes through "
        "the padding path against the unpadded eager call.",
    ),
    json_: bool = JSON,
    quiet: bool = QUIET,
) -> None:
    """Bake SPEC, then time every mode in its own fresh process and print the ratios."""
    from kiln.compiler.bench import bench, check_modes

    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    check_modes(chosen)  # a mode that does not exist is named before torch is looked for
    require_torch("bench")
    o = Output(json_, quiet)
    if traffic is not None:
        from kiln.cli.replay_view import replay_view
        from kiln.compiler.replay import bench_traffic

        with o.progress() as sink:
            replayed = bench_traffic(spec, traffic, workdir=workdir, on_event=sink)
        if save is not None:
            save_json(save, replayed.to_dict())
        o.emit(replayed.to_dict(), lambda c: replay_view(c, replayed))
        return
    with o.progress() as sink:
        report = bench(
            spec,
            modes=chosen,
            order=order.value,
            cold_run=cold_run,
            repeat=repeat,
            workdir=workdir,
            on_event=sink,
        )
    if save is not None:
        save_json(save, report.to_dict())
    o.emit(report.to_dict(), lambda c: bench_view(c, report))
