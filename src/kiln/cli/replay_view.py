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
    console.print(
        f"in grid {s['in_grid']}, off grid {s['off_grid']} (on_miss: {esc(report.on_miss)}); "
        f"padding waste {waste:.1%}"
        if waste is not None
        else "no padding (the spec pads no axis)"
    )
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
