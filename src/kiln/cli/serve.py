"""`kiln check`, `kiln verify`: the serving side's proof that caches will hit."""

from __future__ import annotations

import shlex
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from kiln.cli.options import DEVICE_INDEX, JSON, ORDER, QUIET, OnMissChoice
from kiln.cli.output import Output, esc
from kiln.cli.render import (
    NO_PLAIN,
    bucket_table,
    factor_table,
    ms,
    print_table,
    restart_note,
    verify_failure,
)
from kiln.errors import KilnError, VerificationError
from kiln.grid import Order
from kiln.installs import require_torch

if TYPE_CHECKING:
    from kiln.compiler.verify import VerifyReport


class Route(str, Enum):
    """The routes ``kiln verify --route`` serves (kiln.compiler.verify.ROUTES, or both)."""

    BOTH = "both"
    PLAIN = "plain"
    ACTIVATE = "activate"


def _reported(exc: KilnError) -> KilnError:
    exc.reported = True  # the JSON report is already on stdout
    return exc


def register(app: typer.Typer) -> None:
    app.command("check")(check_cmd)
    app.command("verify")(verify_cmd)


def check_cmd(
    target: Path = typer.Argument(..., help="Artifact file or restored folder."),
    device_index: int = DEVICE_INDEX,
    all_rows: bool = typer.Option(False, "--all", help="Show matching factors too."),
    json_: bool = JSON,
) -> None:
    """Compare the baked fingerprint with this environment; exit 5 if caches would miss."""
    require_torch("check")
    from kiln.compiler.check import check
    from kiln.compiler.location import FACTOR as LOCATION_FACTOR

    report = check(target, device_index=device_index)

    def human(c: Console) -> None:
        print_table(c, factor_table(report, all_rows=all_rows or report.ok))
        if report.ok and report.route == "aoti":  # packages, not caches: one route serves them
            folder = repr(str(target)) if target.is_dir() else "DIR"  # a file: not restored yet
            how = f"kiln.activate({folder}).compile(model)"
            c.print(
                f"[green]compatible[/]: {esc(report.name)} will serve here only through "
                f"{esc(how)} ({NO_PLAIN})"
            )
        elif report.ok:
            # Judged as a server has it after kiln.env: say so where this shell lacks it.
            unset = any(f.name == LOCATION_FACTOR and f.here is None for f in report.factors)
            env = shlex.quote(f"{target}/kiln.env")
            then = f" once the server sources {esc(env)} or calls kiln.activate()"
            c.print(
                f"[green]compatible[/]: {esc(report.name)} will hit here{then if unset else ''}"
            )
        else:
            c.print(f"[red]incompatible[/]: {esc(', '.join(f.name for f in report.misses))}")

    Output(json_).emit(report.to_dict(), human)
    if not report.ok:
        raise _reported(report.error())


def verify_cmd(
    spec: Path = typer.Argument(..., help="Model spec (YAML) the artifact was baked from."),
    cache: Path = typer.Option(..., "--cache", help="Restored folder (kiln restore --dest)."),
    order: Order = ORDER,
    seed: int = typer.Option(0, "--seed", help="Seed for --order shuffle."),
    ready_file: Path = typer.Option(None, "--ready-file", help="Written only on success (probes)."),
    device_index: int = DEVICE_INDEX,
    route: Route = typer.Option(
        Route.BOTH,
        "--route",
        help="Serve as plain torch.compile after `. kiln.env` (plain), through "
        "kiln.activate() (activate), or both, each in its own fresh process.",
    ),
    traffic: Path = typer.Option(
        None,
        "--traffic",
        help="Instead of the grid, serve this traffic log's shapes through the padding path "
        "(JSON lines or CSV); exit 6 if an in-grid request compiled.",
    ),
    on_miss: OnMissChoice = typer.Option(
        None, "--on-miss", help="With --traffic: off-grid requests [default: the spec's]."
    ),
    json_: bool = JSON,
    quiet: bool = QUIET,
) -> None:
    """Serve the grid from CACHE as the first process after a restore; exit 6 if anything
    compiled, tuned, built or wrote (CACHE itself is never written)."""
    require_torch("verify")
    from kiln.compiler.verify import ROUTES, verify

    o = Output(json_, quiet)
    if traffic is not None:
        _replay_traffic(o, spec, cache, traffic, on_miss, seed, device_index or 0)
        return
    with o.progress() as sink:
        report = verify(
            spec,
            cache,
            order=order.value,
            seed=seed,
            device_index=device_index or 0,
            ready_file=ready_file,
            routes=ROUTES if route is Route.BOTH else (route.value,),
            on_event=sink,
        )
    o.emit(report.to_dict(), lambda c: _verified_view(c, report, order))
    if not report.ok:
        raise _reported(VerificationError(verify_failure(report)))


def _replay_traffic(
    o: Output,
    spec: Path,
    cache: Path,
    traffic: Path,
    on_miss: OnMissChoice | None,
    seed: int,
    device_index: int,
) -> None:
    """``kiln verify --traffic``: serve the log's shapes through the padding path; exit 6 when
    an in-grid request compiled."""
    from kiln.cli.replay_view import replay_view
    from kiln.compiler.replay import replay

    with o.progress() as sink:
        replayed = replay(
            spec,
            cache,
            traffic,
            on_miss=on_miss.value if on_miss else None,
            seed=seed,
            device_index=device_index,
            on_event=sink,
        )
    o.emit(replayed.to_dict(), lambda c: replay_view(c, replayed))
    if not replayed.ok:
        raise _reported(VerificationError("; ".join(replayed.reasons())))


def _verified_view(c: Console, report: VerifyReport, order: Order) -> None:
    """``kiln verify`` for a person: every bucket's compiles and latency, time to ready, what
    loaded instead of compiling, and the factors that differ (a spec edited since the bake is
    said before serving: :class:`kiln.events.SpecDiffers`)."""
    title = f"verify {report.name} ({order.value} order, {' and '.join(report.routes)})"
    print_table(c, bucket_table(report.buckets, title, verify=True))
    c.print(f"ready in {ms(report.time_to_ready_s)} (process start → every bucket ran once)")
    if note := restart_note(report.buckets):
        c.print(note)
    if report.extra.get("precompile_load_s") is not None:
        loaded = ms(report.extra["precompile_load_s"])
        if report.extra.get("route") == "aoti":
            c.print(f"AOTInductor packages loaded in {loaded}: no Dynamo, no Inductor")
        else:
            c.print(f"precompiled forwards loaded in {loaded}: no Dynamo tracing")
    if report.check and not report.check.ok:
        print_table(c, factor_table(report.check, all_rows=False))
    if report.ok:
        c.print("[green]verified[/]: zero compiles over the grid")
