"""Rich renderings shared by commands (tables of buckets, fingerprints, factors, bench modes).

Everything shown here comes from a manifest or a spec, so it goes through
:func:`kiln.cli.output.plain` / :func:`kiln.cli.output.esc`, never straight into markup. Tables
are printed through :func:`print_table`, which never cuts a cell. Torch-free.
"""

from __future__ import annotations

import shlex
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from kiln.artifact.manifest import WORK_KINDS, BucketStats, GraphBreak, Manifest
from kiln.cli.output import esc, plain, visible
from kiln.factors import BAKED_HERE

if TYPE_CHECKING:
    from kiln.artifact.bundle import BundleIndex
    from kiln.compiler.bench import BenchReport
    from kiln.compiler.check import CheckReport
    from kiln.compiler.verify import VerifyReport

FINGERPRINT_ROWS = (
    ("torch", "torch.version"),
    ("torch git", "torch.git"),
    ("CUDA (torch)", "torch.cuda"),
    ("triton", "triton.version"),
    ("GPU", "gpu.name"),
    ("capability", "gpu.capability"),
    ("driver", "gpu.driver"),
    ("device index", "device.index"),
    ("CPU ISA", "cpu.isa"),
    ("C++ build", "cpp.paths"),
    ("CPU", "cpu.model"),
    ("python", "python"),
    ("platform", "platform"),
)


def count(n: int, noun: str, plural: str | None = None) -> str:
    """``1 variant``, ``2 variants``: a count with its noun in the right number."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def factor(value: float | None) -> str:
    """A ratio as printed beside timings: ``1.33×``, or ``-`` where it has no meaning."""
    return "-" if value is None else f"{value:.2f}×"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def print_table(console: Console, table: Table) -> None:
    """Print ``table`` with every cell whole: a number cut to ``megaca…`` or ``1234…`` is a
    wrong number.

    When the output is not a terminal (a CI log, ``| tee``, a file) rich would assume 80
    columns; there the table takes the width it needs, one line per row, ready to paste. In a
    terminal too narrow for it, cells wrap between words (``29.75 s`` over two lines, never
    ``29.7…``); only where even single words do not fit does a cell fold inside one.
    """
    for column in table.columns:
        column.no_wrap = False
        column.overflow = "fold"
    unbounded = console.options.update_width(1 << 16)
    needed = Measurement.get(console, unbounded, table).maximum
    if needed > console.width:
        if not console.is_terminal:
            table.width = needed
        else:
            _fit_words(console, table, needed)
    console.print(table, crop=False)


def _fit_words(console: Console, table: Table, needed: int) -> None:
    """Give each column at least its longest word and share what is left in proportion to what
    each would still take, so cells wrap between words. (rich's own squeeze takes width from
    the widest columns first, splitting a narrow column's words.) A header's words go first
    where not everything fits; where even the cells' words do not, the table is left to rich,
    which folds."""
    unbounded = console.options.update_width(1 << 16)

    def measure(cells: Iterable[Any]) -> list[Measurement]:
        return [Measurement.get(console, unbounded, cell) for cell in cells] or [Measurement(0, 0)]

    headers = [measure([column.header]) for column in table.columns]
    bodies = [measure(column.cells) for column in table.columns]
    most = [max(m.maximum for m in h + b) for h, b in zip(headers, bodies, strict=True)]
    room = console.width - (needed - sum(most))  # what borders and padding leave for content
    for with_headers in (True, False):
        least = [
            max(m.minimum for m in (h + b if with_headers else b))
            for h, b in zip(headers, bodies, strict=True)
        ]
        if sum(least) <= room:
            spare, wanted = room - sum(least), sum(most) - sum(least)
            for column, low, high in zip(table.columns, least, most, strict=True):
                column.width = low + (high - low) * spare // wanted
            return


def fingerprint_table(fp: dict[str, Any], title: str = "environment") -> Table:
    table = Table(title=plain(title), show_header=False, title_justify="left")
    for label, key in FINGERPRINT_ROWS:
        if key in fp and fp[key] is not None:
            table.add_row(label, plain(fp[key]))
    env = fp.get("env")
    for key, value in env.items() if isinstance(env, dict) else ():
        table.add_row(plain(f"env {key}"), plain(value))
    return table


def bucket_table(buckets: list[BucketStats], title: str, *, verify: bool = False) -> Table:
    table = Table(title=plain(title), title_justify="left")
    table.add_column("bucket", no_wrap=True)
    table.add_column("first call", justify="right")
    if verify:
        table.add_column("first request", justify="right")
    else:
        table.add_column("compile", justify="right")
    table.add_column("steady", justify="right")
    table.add_column("FX hit/miss", justify="right")
    table.add_column("compiles", justify="right")
    for b in buckets:
        third = ms(b.first_request_s) if verify else ms(b.compile_s)
        style = "red" if verify and b.compiles else None
        table.add_row(
            plain(b.key),
            ms(b.first_call_s),
            third,
            ms(b.steady_s),
            f"{b.fx_hits}/{b.fx_misses + b.fx_bypass}",
            str(b.compiles),
            style=style,
        )
    return table


def first_few(names: list[str], shown: int = 3) -> str:
    """``names`` as the first few and how many more: "a, b, c +4"."""
    more = f" +{len(names) - shown}" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def restart_note(buckets: list[BucketStats]) -> str | None:
    """Why a first call with nothing compiled took seconds: Dynamo traced it twice (ccache's
    rule: a cache says where the time went, not only whether it hit)."""
    restarted = [b.key for b in buckets if b.aot_restarts]
    if not restarted:
        return None
    return (
        f"traced twice, not compiled: {first_few(restarted)} (Dynamo restarted the trace to "
        "specialize a float constant, as `dynamic: true` does in every process; `dynamic: "
        "false` avoids it)"
    )


def graph_break_table(breaks: list[GraphBreak]) -> Table:
    """Every place Dynamo split the model, torch's reason, and whether it depends on data."""
    table = Table(title=count(len(breaks), "graph break"), title_justify="left")
    for col in ("where", "reason", "data-dependent", "buckets"):
        table.add_column(col)
    for b in breaks:
        flag = Text("yes", "yellow") if b.data_dependent else Text("no")
        table.add_row(plain(b.where), plain(b.reason), flag, plain(first_few(b.buckets)))
    return table


def proof_line(m: Manifest) -> str:
    """What the bake's own proof found (``kiln bake`` and ``kiln inspect`` print it)."""
    p = m.proof
    if p is None:
        return "not proven: baked with --no-prove (or by an older kiln)"
    rebaked = f" after {p.rebakes} re-bake(s)" if p.rebakes else ""
    verdict = "0 compiles" if p.compiles == 0 else f"{p.compiles} compile(s) remain"
    return f"proven: a fresh process served the packed artifact at another path: {verdict}{rebaked}"


def factor_table(report: CheckReport, *, all_rows: bool) -> Table:
    """The fingerprint factors that differ (all of them with ``all_rows``) and their effect."""
    table = Table(title="factors", title_justify="left")
    for col in ("factor", "baked", "here", "effect"):
        table.add_column(col)
    for f in report.factors:
        if f.matches and not all_rows:
            continue
        effect = (
            Text("ok")
            if f.matches
            else (
                Text.assemble(("MISS", "red"), " ", visible(f.note))
                if f.causes_miss
                else plain(f"differs: {f.note}")
            )
        )
        baked, here = f.baked, f.here
        if f.sides != BAKED_HERE:  # values that are not the artifact's and this process's
            baked = baked if baked is None else f"{f.sides[0]} {baked}"
            here = here if here is None else f"{f.sides[1]} {here}"
        table.add_row(plain(f.name), plain(baked), plain(here), effect)
    return table


def verify_failure(report: VerifyReport) -> str:
    """A failed verify as an error message: a header line, then one line per bucket that
    compiled, saying what compiled and why (:func:`kiln.compiler.verify.explain`)."""
    compiled = len(report.failing)
    header = (
        f"{report.name}: {compiled} of {len(report.buckets)} buckets compiled "
        "against the restored cache:"
        if compiled
        else f"{report.name}: no bucket compiled, but the restored folder cannot serve as is:"
    )
    return "\n".join([header, *report.reasons()])


def aoti_line(m: Manifest) -> str:
    """How a ``compile.route: aoti`` artifact serves, in one line."""
    assert m.aoti is not None
    a = m.aoti
    ranged = [p for p in a.programs if p.ranges]
    programs = f"{len(a.programs)} ranged program(s)" if ranged else f"{len(a.programs)} package(s)"
    weights = (
        f"weights from the model ({len(a.constants)} tensors)"
        if a.weights == "external"
        else "weights embedded"
    )
    return (
        f"route: aoti: {programs} on {a.device}, {weights}, off-grid inputs: {a.on_miss}; "
        "served by kiln.activate().compile() without Dynamo or Inductor"
    )


# What a plain torch.compile does with an AOT artifact (restore's hint and check's verdict).
NO_PLAIN = "a plain torch.compile of the model compiles every bucket"


def serve_hint(m: Manifest, dest: Path, env_file: Path) -> str:
    """How a server uses the folder restored at ``dest``, as a line to copy and paste: source
    ``env_file`` (shell-quoted); an AOT artifact's packages are no cache that a plain
    ``torch.compile`` could hit, so only ``kiln.activate(DIR).compile(model)`` serves them."""
    if m.route == "aoti":
        return f"kiln.activate({str(dest)!r}).compile(model) (AOTInductor packages: {NO_PLAIN})"
    return f". {shlex.quote(str(env_file))}"


def manifest_view(console: Console, m: Manifest, digest: str | None = None) -> None:
    console.print(
        f"[bold]{esc(m.name)}[/]  format {m.format} · kiln {esc(m.kiln_version)} · "
        f"created {esc(m.created)}"
    )
    if digest:
        console.print(f"sha256 {digest}")
    console.print(plain(f"spec sha256 {m.spec_sha256}"))
    if m.aoti is not None:
        console.print(plain(aoti_line(m)))
    elif m.compile_kwargs is not None:
        args = ", ".join(f"{k}={v!r}" for k, v in m.compile_kwargs.items())
        console.print(plain(f"serve with torch.compile({args})"))
    if m.precompiled or m.precompiled_frames:
        what = (
            f"Dynamo's saved frames of {m.precompiled_frames.module}.forward"
            if m.precompiled_frames
            else "AOT-compiled forwards"
        )
        console.print(
            plain(f"precompiled: {what}, served by kiln.activate().compile() under inference_mode")
        )
    if m.bytecode:
        console.print(
            plain(
                f"python bytecode: {m.bytecode.modules} modules ({m.bytecode.python}), imported "
                "from when the serving image has none cached"
            )
        )
    if m.workdir:
        keyed = count(m.workdir.keyed, "CUDA driver entry", "CUDA driver entries")
        console.print(
            plain(
                f"serve in {m.workdir.path}: {keyed} keyed by the folder they were JIT-compiled in"
            )
        )
    print_table(console, fingerprint_table(m.fingerprint, "baked on"))
    shard = f" (shard {m.shard.label})" if m.shard is not None else ""
    print_table(console, bucket_table(m.grid, f"grid: {count(len(m.grid), 'bucket')}{shard}"))
    if m.graph_breaks:
        print_table(console, graph_break_table(m.graph_breaks))
    console.print(plain(proof_line(m)))
    kinds = Table(
        title=f"{count(len(m.entries()), 'file')}, {human_bytes(m.total_bytes)}",
        title_justify="left",
    )
    kinds.add_column("kind")
    kinds.add_column("files", justify="right")
    kinds.add_column("bytes", justify="right")
    for kind, (n, size) in m.bytes_by_kind().items():
        kinds.add_row(plain(kind), str(n), human_bytes(size))
    print_table(console, kinds)
    if m.env:
        console.print(plain("serving env: " + " ".join(f"{k}={v}" for k, v in m.env.items())))


def bundle_view(console: Console, index: BundleIndex) -> None:
    """A bundle's variants, one row each: what selects it (GPU, capability, torch, CUDA) and
    the artifact it installs."""
    table = Table(title=f"bundle: {count(len(index.variants), 'variant')}", title_justify="left")
    for col in ("variant", "device", "GPU", "capability", "torch", "CUDA", "artifact", "size"):
        table.add_column(col, justify="right" if col == "size" else "left")
    table.add_column("sha256")
    for v in index.variants:
        table.add_row(
            plain(v.name),
            plain(v.device),
            plain(v.gpu or "-"),
            plain(v.capability or "-"),
            plain(v.torch or "-"),
            plain(v.cuda or "-"),
            plain(v.artifact),
            human_bytes(v.size),
            plain(v.sha256[:12]),
        )
    print_table(console, table)


BENCH_COLUMNS = (
    "mode",
    "time to ready",
    "vs eager",
    "start-up",
    "Σ first calls",
    "max first call",
    "steady (median)",
    "compiles",
)


def bench_table(report: BenchReport) -> Table:
    """One row per mode: time to ready (and its spread over repeats), the factor against eager,
    first calls, steady latency and compiles."""
    fp = report.fingerprint
    where = fp.get("gpu.name") or fp.get("cpu.model") or "cpu"
    table = Table(
        title=plain(
            f"{report.name} on {where} · torch {fp.get('torch.version')} · "
            f"triton {fp.get('triton.version')}"
        ),
        title_justify="left",
    )
    for col in BENCH_COLUMNS:
        table.add_column(col, justify="left" if col == "mode" else "right")
    eager = report.modes.get("eager")
    for m in report.modes.values():
        vs = m.time_to_ready_s / eager.time_to_ready_s if eager else None
        spread = (
            f" ({ms(min(m.ready_runs_s))}–{ms(max(m.ready_runs_s))})"
            if len(m.ready_runs_s) > 1
            else ""
        )
        table.add_row(
            plain(m.mode),
            ms(m.time_to_ready_s) + spread,
            factor(vs),
            ms(m.startup_s),
            ms(m.first_calls_s),
            ms(max(b.first_call_s for b in m.buckets)),
            ms(m.to_dict()["steady_median_s"]),
            work_cell(m.work()),
        )
    return table


def work_cell(work: dict[str, int]) -> str:
    """A mode's compile work: the total, then each kind that is not zero (``3: 2 gcc, 1 FX``)."""
    total = sum(work.values())
    kinds = ", ".join(f"{n} {WORK_KINDS[kind]}" for kind, n in work.items() if n)
    return f"{total}: {kinds}" if kinds else str(total)


def startup_table(report: BenchReport) -> Table:
    """Start-up phase by phase, a column per mode: where the time before the first call goes
    (interpreter, imports, CUDA, model, Inductor and its pool, precompiled forwards)."""
    modes = [m for m in report.modes.values() if m.startup_phases]
    table = Table(title="start-up, phase by phase", title_justify="left")
    table.add_column("phase")
    for m in modes:
        table.add_column(plain(m.mode), justify="right")
    phases = list(dict.fromkeys(name for m in modes for name in m.startup_phases))
    for name in phases:
        cells = [m.startup_phases.get(name) for m in modes]
        table.add_row(plain(name), *(ms(c) if c is not None else "—" for c in cells))
    table.add_row("total", *(ms(sum(m.startup_phases.values())) for m in modes), style="bold")
    return table


def bench_view(console: Console, report: BenchReport) -> None:
    """The bench table, the ratios that answer "what does kiln buy", and how the run was made."""
    print_table(console, bench_table(report))
    if any(m.startup_phases for m in report.modes.values()):
        print_table(console, startup_table(report))
    r = report.ratios()
    aoti = "aoti" in report.modes
    console.print(
        " · ".join(
            f"{label} {factor(r[key])}"
            for label, key in (
                ("kiln/cold", "kiln/cold"),
                ("kiln/megacache", "kiln/megacache"),
                ("kiln/copied", "kiln/copied"),
                ("kiln/eager", "kiln/eager"),
                *((("aoti/eager", "aoti/eager"), ("aoti/kiln", "aoti/kiln")) if aoti else ()),
                ("bake/bare compile", "bake/bare_compile"),
            )
        ),
        soft_wrap=True,
    )
    k = report.modes.get("kiln")
    if k and k.note:
        console.print(f"kiln = {esc(k.note)}", soft_wrap=True)
    if k and k.worst_first_request_ratio:
        console.print(
            "kiln: worst first real request after warmup = "
            f"{factor(k.worst_first_request_ratio)} steady",
            soft_wrap=True,
        )
    order = report.extra["order"]
    order_shown = f"{order[:4]}{'…' if len(order) > 4 else ''}"
    console.print(
        plain(
            f"artifact {human_bytes(report.artifact_bytes)} · restore {ms(report.restore_s)} · "
            f"order {order_shown} · cold = {report.extra['cold_source']}"
        ),
        soft_wrap=True,
    )
    if "aoti_artifact_bytes" in report.extra:
        compared = (
            f" (torch.compile route's: {human_bytes(report.artifact_bytes)})"
            if report.extra.get("compile_route_baked")
            else ""
        )
        console.print(
            plain(
                f"aoti = {report.modes['aoti'].note if aoti else 'route: aoti'} · artifact "
                f"{human_bytes(report.extra['aoti_artifact_bytes'])}{compared} · "
                f"bake {ms(report.extra['aoti_bake_wall_s'])}"
            ),
            soft_wrap=True,
        )
    for name, mode in report.modes.items():
        if name != "cold" and (note := restart_note(mode.buckets)):
            console.print(plain(f"{name}: {note}"), soft_wrap=True)
    if report.extra.get("bytecode"):
        console.print(f"note: {esc(report.extra['bytecode'])}", soft_wrap=True)
