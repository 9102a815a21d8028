"""`kiln bench`: eager vs cold vs kiln vs the stock alternatives, as a table to paste."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from kiln.cli.options import JSON, ORDER, QUIET
from kiln.cli.output import Output, esc, plain
from kiln.cli.render import human_bytes, ms
from kiln.grid import Order


def register(app: typer.Typer) -> None:
    app.command("bench")(bench_cmd)


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}×"


def bench_cmd(
    spec: Path = typer.Argument(..., help="Model spec (YAML)."),
    modes: str = typer.Option(
        "eager,cold,kiln,megacache,copied",
        "--modes",
        help="Comma-separated modes: eager, cold, kiln, megacache, copied, kiln-blob, kiln-serial.",
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
    workdir: Path = typer.Option(None, "--workdir", help="Keep artifacts and caches here."),
    save: Path = typer.Option(None, "--save", help="Also write the JSON report to this file."),
    json_: bool = JSON,
    quiet: bool = QUIET,
) -> None:
    """Bake SPEC, then time every mode in its own fresh process and print the ratios."""
    from kiln.compiler.bench import EXTRA_MODES, MODES, bench
    from kiln.errors import UsageError

    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    unknown = sorted(set(chosen) - {*MODES, *EXTRA_MODES})
    if unknown:
        raise UsageError(f"unknown bench mode(s): {', '.join(unknown)}")
    o = Output(json_, quiet)
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

    def human(c: Console) -> None:
        fp = report.fingerprint
        where = fp.get("gpu.name") or fp.get("cpu.model") or "cpu"
        table = Table(
            title=plain(
                f"{report.name} on {where} · torch {fp.get('torch.version')} · "
                f"triton {fp.get('triton.version')}"
            ),
            title_justify="left",
        )
        for col in (
            "mode",
            "time to ready",
            "vs eager",
            "start-up",
            "Σ first calls",
            "max first call",
            "steady (median)",
            "compiles",
        ):
            table.add_column(col, justify="left" if col == "mode" else "right")
        eager = report.modes.get("eager")
        for m in report.modes.values():
            vs = m.time_to_ready_s / eager.time_to_ready_s if eager else None
            d = m.to_dict()
            spread = (
                f" ({ms(min(m.ready_runs_s))}–{ms(max(m.ready_runs_s))})"
                if len(m.ready_runs_s) > 1
                else ""
            )
            table.add_row(
                m.mode,
                ms(m.time_to_ready_s) + spread,
                _x(vs),
                ms(m.startup_s),
                ms(m.first_calls_s),
                ms(max(b.first_call_s for b in m.buckets)),
                ms(d["steady_median_s"]),
                str(m.compiles),
            )
        c.print(table)
        r = report.ratios()
        c.print(
            "kiln/cold "
            + _x(r["kiln/cold"])
            + " · kiln/megacache "
            + _x(r["kiln/megacache"])
            + " · kiln/copied "
            + _x(r["kiln/copied"])
            + " · kiln/eager "
            + _x(r["kiln/eager"])
            + " · bake/bare compile "
            + _x(r["bake/bare_compile"])
        )
        k = report.modes.get("kiln")
        if k and k.note:
            c.print(f"kiln = {esc(k.note)}")
        if k and k.worst_first_request_ratio:
            c.print(
                "kiln: worst first real request after warmup = "
                f"{_x(k.worst_first_request_ratio)} steady"
            )
        order_shown = f"{report.extra['order'][:4]}{'…' if len(report.extra['order']) > 4 else ''}"
        c.print(
            plain(
                f"artifact {human_bytes(report.artifact_bytes)} · restore {ms(report.restore_s)} · "
                f"order {order_shown} · cold = {report.extra['cold_source']}"
            )
        )

    if save is not None:
        import json

        save.parent.mkdir(parents=True, exist_ok=True)
        save.write_text(json.dumps(report.to_dict(), indent=2, default=str) + "\n")
    o.emit(report.to_dict(), human)
