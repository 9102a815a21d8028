"""`kiln plan`: bucket lists from a traffic log, printed as spec YAML (or written in place)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from kiln.cli.options import JSON
from kiln.cli.output import Output, esc, plain
from kiln.errors import UsageError


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
    from kiln.files import atomic_write
    from kiln.plan import BakeTime, plan, rewrite_buckets
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
    bake = None
    if artifact is not None:
        from kiln.artifact.archive import read_manifest

        bake = BakeTime.from_manifest(read_manifest(artifact), weights)
    result = plan(
        parsed,
        traffic,
        max_buckets=max_buckets,
        budget_s=budget_s,
        bake=bake,
        weights=weights,
        coverage=coverage,
    )
    if write:
        text = spec.read_text(encoding="utf-8")
        new = rewrite_buckets(text, result.buckets, str(spec))
        with atomic_write(spec) as fh:
            fh.write(new.encode("utf-8"))
    data = result.to_dict() | {"written": str(spec) if write else None}

    def human(c: Console) -> None:
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
        if write:
            c.print(f"wrote the bucket lists into [bold]{esc(spec)}[/]")

    o.emit(data, human)


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
