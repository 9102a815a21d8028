"""How a traffic replay (``kiln verify --traffic``, ``kiln bench --traffic``) is shown."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from kiln.cli.output import esc, plain
from kiln.cli.render import factor, ms, print_table

if TYPE_CHECKING:
    from kiln.compiler.replay import ReplayReport


def replay_view(console: Console, report: ReplayReport) -> None:
    """One table of per-request figures (median, p99), then the verdict."""
    s = report.summary()
    table = Table(
        title=plain(f"{report.name}: {s['requests']} requests replayed"), title_justify="left"
    )
    for col in ("per request", "median", "p99"):
        table.add_column(col, justify="left" if col == "per request" else "right")

    def row(name: str, values: dict[str, Any], fmt: Any = ms) -> None:
        if values["median"] is not None:
            table.add_row(name, fmt(values["median"]), fmt(values["p99"]))

    row("served latency", s["latency_s"])
    row("padding overhead (host)", s["overhead_s"])
    row("unpadded eager", s["eager_s"])
    row("served / eager", s["latency_over_eager"], factor)
    print_table(console, table)
    waste = s["waste"]
    padding = f"padding waste {waste:.1%}" if waste is not None else "the spec pads no axis"
    console.print(
        f"in grid {s['in_grid']}, off grid {s['off_grid']} (on_miss: {esc(report.on_miss)}); "
        f"{padding}"
    )
    if report.off_grid:
        console.print(plain(off_grid_line(report)))
    if s["max_abs_diff"] is not None:
        console.print(f"served vs unpadded eager, real slice: max |diff| {s['max_abs_diff']:.3g}")
    if s["eager_new_files"]:  # not the served path's: a server makes no eager call
        console.print(
            f"the eager comparison wrote {s['eager_new_files']} file(s) (not counted against "
            "serving; --json lists them)"
        )
    if report.ok:
        console.print(f"[green]verified[/]: zero compiles over {s['in_grid']} in-grid requests")
    else:
        for reason in report.reasons():
            console.print(plain(reason))


def off_grid_line(report: ReplayReport) -> str:
    """What the off-grid requests did, in one line: refused (on_miss error, with the first
    refusal's reason), or served, eager or by compiling in the serving process (with the
    compiles and the seconds they took), so that a passing verdict never hides them."""
    off = report.off_grid
    shapes = len({r.key for r in off})
    refused = [r for r in off if r.latency_s is None]
    served = [r for r in off if r.latency_s is not None]
    parts = []
    if refused:
        why = f": {refused[0].why}" if refused[0].why else ""
        parts.append(f"{len(refused)} refused with OffGridError{why}")
    if served:
        how = "by the eager model" if report.on_miss == "eager" else "by compiling in the server"
        seconds = sum(r.latency_s or 0.0 for r in served)
        compiles = sum(r.compiles for r in served)
        parts.append(f"{len(served)} served {how} ({compiles} compile(s), {seconds:.1f} s)")
    return f"off the grid: {len(off)} request(s) of {shapes} shape(s): " + "; ".join(parts)
