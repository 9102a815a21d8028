"""Rich renderings shared by commands (tables of buckets, fingerprints, factors). Torch-free.

Everything shown here comes from a manifest or a spec, so it goes through
:func:`kiln.output.plain` / :func:`kiln.output.esc`, never straight into markup.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from kiln.artifact.manifest import BucketStats, Manifest
from kiln.cli.output import esc, plain

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
    ("CPU", "cpu.model"),
    ("python", "python"),
    ("platform", "platform"),
)


def ms(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


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


def manifest_view(console: Console, m: Manifest, digest: str | None = None) -> None:
    console.print(
        f"[bold]{esc(m.name)}[/]  format {m.format} · kiln {esc(m.kiln_version)} · "
        f"created {esc(m.created)}"
    )
    if digest:
        console.print(f"sha256 {digest}")
    console.print(plain(f"spec sha256 {m.spec_sha256}"))
    if m.compile_kwargs is not None:
        args = ", ".join(f"{k}={v!r}" for k, v in m.compile_kwargs.items())
        console.print(plain(f"serve with torch.compile({args})"))
    console.print(fingerprint_table(m.fingerprint, "baked on"))
    console.print(bucket_table(m.grid, f"grid: {len(m.grid)} buckets"))
    kinds = Table(title=f"{len(m.files)} files, {human_bytes(m.total_bytes)}", title_justify="left")
    kinds.add_column("kind")
    kinds.add_column("files", justify="right")
    kinds.add_column("bytes", justify="right")
    for kind, (n, size) in m.bytes_by_kind().items():
        kinds.add_row(plain(kind), str(n), human_bytes(size))
    console.print(kinds)
    if m.env:
        console.print(plain("serving env: " + " ".join(f"{k}={v}" for k, v in m.env.items())))
