"""`kiln plan`: bucket lists from a traffic log, printed as spec YAML (or written in place)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from kiln.cli.options import JSON
from kiln.cli.output import Output, esc, plain
from kiln.errors import UsageError

if TYPE_CHECKING:
    from kiln.plan import BakeTime, Plan


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_cmd)


def plan_cmd(
    spec: Path = typer.Argument(..., help="Model spec (YAML) whose padded axes to plan."),
    shapes: Path = typer.Option(
        ..., "--shapes", help="Traffic log: JSON lines or CSV of axis values, optional count."
    ),
    max_buckets: int = typer.Option(
        None, "--max-buckets", min=1, help="At most N buckets [default: as many as the spec has]."
    ),
    budget_s: float = typer.Option(
        None,
        "--budget-s",
        min=0.0,
        help="Estimated bake time at most S seconds (needs --artifact).",
    ),
    artifact: Path = typer.Option(
        None,
        "--artifact",
        help="An artifact or restored folder of this spec: its bucket timings estimate bake time.",
    ),
    weight: list[str] = typer.Option(
        [],
        "--weight",
        metavar="AXIS=W",
        help="Cost exponent of an axis (default 1; seq=2 for attention quadratic in length).",
    ),
    coverage: float = typer.Option(
        1.0, "--coverage", help="Share of the logged requests the grid must hold [default: all]."
    ),
    write: bool = typer.Option(
        False, "--write", help="Replace the bucket lists in SPEC in place, keeping its comments."
    ),
    json_: bool = JSON,
) -> None:
    """Choose bucket sizes that serve the logged shapes with the least padding."""
    from kiln.plan import plan
    from kiln.spec import load_spec
    from kiln.traffic import read_traffic

    o = Output(json_)
    weights = _weights(weight)
    if budget_s is not None and artifact is None:  # the library's `bake` is this --artifact
        raise UsageError(
            "--budget-s needs --artifact (an artifact or restored folder of this spec) to "
            "estimate each bucket's bake time"
        )
    parsed = load_spec(spec)
    traffic = read_traffic(shapes, tuple(parsed.buckets))
    result = plan(
        parsed,
        traffic,
        max_buckets=max_buckets,
        budget_s=budget_s,
        bake=_bake_time(artifact, weights),
        weights=weights,
        coverage=coverage,
    )
    if write:
        _write_buckets(spec, result)
    data = result.to_dict() | {"written": str(spec) if write else None}
    o.emit(data, lambda c: _plan_view(c, o, result, spec if write else None))


def _bake_time(artifact: Path | None, weights: dict[str, float]) -> BakeTime | None:
    """Each bucket's estimated bake time, from the timings of an artifact or restored folder."""
    if artifact is None:
        return None
    from kiln.artifact.archive import read_manifest
    from kiln.plan import BakeTime

    return BakeTime.from_manifest(read_manifest(artifact), weights)


def _write_buckets(spec: Path, result: Plan) -> None:
    """``--write``: the planned bucket lists replace SPEC's, its comments kept, atomically."""
    from kiln.files import atomic_write
    from kiln.plan import rewrite_buckets

    new = rewrite_buckets(spec.read_text(encoding="utf-8"), result.buckets, str(spec))
    with atomic_write(spec) as fh:
        fh.write(new.encode("utf-8"))


def _plan_view(c: Console, o: Output, result: Plan, written: Path | None) -> None:
    """``kiln plan`` for a person: the bucket lists as spec YAML on stdout, the numbers that
    chose them on stderr, and the spec ``--write`` rewrote."""
    for line in result.yaml().splitlines():  # axis names are identifiers, sizes numbers
        c.print(plain(line), highlight=False, soft_wrap=True)
    now, new = result.current, result.planned
    est = f", bake ≈ {new.bake_s:.0f} s (now {now.bake_s:.0f} s)" if new.bake_s else ""
    o.note(
        f"{result.requests} requests, {result.shapes} shapes; {result.method}: "
        f"{new.buckets} buckets, padding waste {new.waste:.1%} (now {now.waste:.1%} over "
        f"{now.buckets}), off the grid {new.off_grid:.1%} (now {now.off_grid:.1%}){est}"
    )
    for note in result.notes:
        o.note(note)
    if written is not None:
        c.print(f"wrote the bucket lists into [bold]{esc(written)}[/]")


def _weights(pairs: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for pair in pairs:
        axis, sep, value = pair.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = float("nan")
        if not sep or not axis or number != number:
            raise UsageError(f"--weight {pair!r}: expected AXIS=NUMBER, e.g. seq=2")
        out[axis.strip()] = number
    return out
