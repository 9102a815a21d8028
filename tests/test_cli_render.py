"""What the CLI prints: tables that never cut a number, and a failed verify one bucket a line.

The renderers are called directly with narrow consoles (``kiln bench`` itself bakes and runs
every mode: minutes); ``kiln inspect`` runs for real through a pipe, since it needs no torch.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console

from kiln.artifact.manifest import WORK_KINDS, BucketStats
from kiln.cli.output import report_error
from kiln.cli.render import bench_view, factor, ms, restart_note, verify_failure, work_cell
from kiln.compiler.bench import BenchReport, ModeResult
from kiln.compiler.verify import VerifyReport, explain
from kiln.errors import VerificationError

TIMES = {  # mode: time to ready over three repeats
    "eager": [3.2104, 3.3, 3.1],
    "cold": [45.61],
    "kiln": [4.1234, 4.5, 3.99],
    "megacache": [30.5, 31.0, 29.75],
    "copied": [12.25, 12.5, 12.0],
    "kiln-serial": [4.4, 4.6, 4.3],
}


def bench_report() -> BenchReport:
    bucket = BucketStats(
        key="batch=16,seq=2048",
        sizes={"batch": 16, "seq": 2048},
        first_call_s=1.23456,
        compile_s=0.0,
        steady_s=0.0012,
    )
    modes = {
        name: ModeResult(name, min(runs), min(runs), 0.1234, [bucket], ready_runs_s=runs)
        for name, runs in TIMES.items()
    }
    return BenchReport(
        name="llm-default",
        spec={},
        fingerprint={"gpu.name": "NVIDIA H200", "torch.version": "2.13.0", "triton.version": "3.6"},
        modes=modes,
        bake_wall_s=50.0,
        bare_compile_wall_s=45.0,
        artifact_bytes=123_456_789,
        restore_s=0.05,
        extra={"order": ["batch=16,seq=2048"], "cold_source": "the bake's first pass"},
    )


def render(width: int, *, terminal: bool) -> str:
    out = io.StringIO()
    console = Console(
        file=out, width=width, force_terminal=terminal, color_system=None, emoji=False
    )
    bench_view(console, bench_report())
    return out.getvalue()


def cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"[│┃]", line)[1:-1]]


def expected_rows() -> list[list[str]]:
    eager = min(TIMES["eager"])
    rows = []
    for mode, runs in TIMES.items():
        ready = ms(min(runs)) + (f" ({ms(min(runs))}–{ms(max(runs))})" if len(runs) > 1 else "")
        factor_ = factor(min(runs) / eager)
        rows.append([mode, ready, factor_, "123.4 ms", "1.23 s", "1.23 s", "1.2 ms", "0"])
    return rows


@pytest.mark.parametrize("width", [80, 40])
def test_bench_table_piped_keeps_every_cell_whole(width: int) -> None:
    """Piped (a CI log, `| tee`), the table takes the width it needs: one line per mode."""
    text = render(width, terminal=False)
    assert "…" not in text.replace("order ['batch=16,seq=2048']", "")
    for row in expected_rows():
        [line] = [x for x in text.splitlines() if cells(x)[:1] == row[:1]]
        assert cells(line) == row
    ratios = bench_report().ratios()
    assert f"kiln/cold {factor(ratios['kiln/cold'])} · kiln/megacache" in text


def test_bench_table_in_a_terminal_wraps_between_words() -> None:
    """80 columns cannot hold the table on one line per mode; cells wrap, numbers stay whole."""
    text = render(80, terminal=True)
    lines = text.splitlines()
    table = lines[: next(i for i, x in enumerate(lines) if x.startswith("└")) + 1]
    assert all(len(line) <= 80 for line in table)
    words = {word for line in table for cell in cells(line) for word in cell.split()}
    for row in expected_rows():
        for cell in row:
            assert set(cell.split()) <= words, cell


def test_bench_table_in_a_narrow_terminal_folds_and_never_cuts() -> None:
    """In a terminal the table keeps to its width: a long cell folds onto the next line, and
    read column by column every character is still there, in order."""
    text = render(50, terminal=True)
    assert "…" not in text.replace("order ['batch=16,seq=2048']", "")
    lines = text.splitlines()
    body = lines[
        next(i for i, x in enumerate(lines) if x.startswith("┡")) + 1 : next(
            i for i, x in enumerate(lines) if x.startswith("└")
        )
    ]
    assert body and all(len(line) <= 50 for line in lines[: lines.index(body[-1]) + 2])
    for i, column in enumerate(zip(*expected_rows(), strict=True)):
        shown = "".join(cells(line)[i] for line in body)
        assert re.sub(r"\s", "", shown) == re.sub(r"\s", "", "".join(column))


def test_inspect_through_a_pipe_keeps_bucket_keys_and_numbers_whole(cli, tmp_path: Path) -> None:
    from tests.archives import FILES, manifest_for, reg, write_archive

    key = "batch=16,seq=2048,heads=32,layers=48"
    grid = [
        BucketStats(
            key=key,
            sizes={"batch": 16, "seq": 2048, "heads": 32, "layers": 48},
            first_call_s=12.3456,
            compile_s=98.765,
            steady_s=0.0123,
            fx_hits=3,
        )
    ]
    artifact = write_archive(
        tmp_path / "a.kiln.tar.zst",
        manifest_for(FILES, grid=grid),
        [reg(p, d) for p, d in sorted(FILES.items())],
    )
    proc = cli("inspect", artifact, no_torch=True, env={"COLUMNS": "40"})
    assert proc.returncode == 0, proc.stderr
    [row] = [line for line in proc.stdout.splitlines() if key in line]
    assert cells(row) == [key, "12.35 s", "98.77 s", "12.3 ms", "3/0", "0"]


def verify_report() -> VerifyReport:
    base = {"first_call_s": 1.0, "compile_s": 0.0, "steady_s": 0.001}
    buckets = [
        BucketStats(key="batch=2", sizes={"batch": 2}, **base, fx_misses=1, aot_misses=1),
        BucketStats(key="batch=3", sizes={"batch": 3}, **base, fx_hits=1),
        BucketStats(key="batch=5", sizes={"batch": 5}, **base, new_native=2, fx_hits=1),
    ]
    return VerifyReport(
        name="tiny-mlp",
        order=[b.key for b in buckets],
        buckets=buckets,
        check=None,
        time_to_ready_s=1.0,
        time_to_warm_s=1.0,
        spec_matches=True,
    )


def test_a_failed_verify_is_a_header_and_one_line_per_bucket(capsys) -> None:
    report = verify_report()
    exc = VerificationError(verify_failure(report))
    exc.reported = True  # as verify_cmd raises it: the JSON report went to stdout already
    assert report_error(exc, json_mode=True) == 6
    captured = capsys.readouterr()
    assert captured.out == ""  # --json: stdout stays the one report document
    lines = captured.err.splitlines()
    assert lines == [
        "kiln: error: tiny-mlp: 2 of 3 buckets compiled against the restored cache:",
        "  " + explain(report.buckets[0]),
        "  " + explain(report.buckets[2]),
    ]
    assert json.loads(json.dumps(report.to_dict()))["failing"] == [
        explain(report.buckets[0]),
        explain(report.buckets[2]),
    ]


# --- issue 29, item 7: help and output a newcomer reads -----------------------------------------
def test_help_shows_defaults_and_names_not_placeholders(cli) -> None:
    """Every command's --help: no typer placeholders (``<bool>`` beside a flag, ``{spec}``,
    ``<list[Path]>``), arguments named as the README names them, and bake's defaults whole
    (rich markup once ate ``[default: NAME.kiln.tar.zst]``, leaving "Artifact path .")."""
    from kiln.cli import app

    commands = [c.name for c in app.registered_commands]
    for name in [None, *commands]:
        proc = cli(*([name] if name else []), "--help", no_torch=True)
        assert proc.returncode == 0, proc.stderr
        text = proc.stdout
        for placeholder in ("<bool>", "{", "<list[", "Artifact path ."):
            assert placeholder not in text, f"kiln {name} --help shows {placeholder}:\n{text}"
    bake = " ".join(cli("bake", "--help", no_torch=True).stdout.split())
    assert "Usage: kiln bake [OPTIONS] SPEC" in bake
    assert "[default: (NAME.kiln.tar.zst)]" in bake
    assert bake.count("[default: prove]") == 1
    merge = " ".join(cli("merge", "--help", no_torch=True).stdout.split())
    assert "Usage: kiln merge [OPTIONS] ARTIFACTS..." in merge
    missing = cli("verify", no_torch=True)
    assert "Missing argument 'SPEC'" in missing.stderr


def test_piped_lines_are_never_wrapped(cli, tmp_path: Path) -> None:
    """Piped (a CI log) with no COLUMNS, rich assumes 80 columns: a long path was cut in two and
    a grep for it failed. Lines now stay whole; tables take the width they need."""
    from tests.archives import good_archive

    art = good_archive(tmp_path / "a.kiln.tar.zst")
    dest = tmp_path / ("a-destination-folder-with-a-long-name-" * 3) / "cache"
    proc = cli("restore", art, "--dest", dest, env={"COLUMNS": ""}, no_torch=True)
    assert proc.returncode == 0, proc.stderr
    assert f"serve with: . {dest}/kiln.env" in proc.stdout.splitlines()


def test_counts_read_in_the_right_number(cli, write_spec, tmp_path: Path) -> None:
    """ "1 variants", "merged 1 artifacts", "1 files" read as typos."""
    from kiln.artifact.bundle import write_bundle
    from tests.archives import good_archive, variant_archive
    from tests.conftest import mlp_spec
    from tests.test_merge import shard_artifact

    bundle = write_bundle(
        [variant_archive(tmp_path / "v.kiln.tar.zst", {"device.type": "cpu"})],
        tmp_path / "release.kiln.tar.zst",
    ).path
    inspected = cli("inspect", bundle, no_torch=True)
    assert "bundle: 1 variant\n" in inspected.stdout, inspected.stdout
    one = shard_artifact(tmp_path, write_spec(mlp_spec()), 0, 1)
    merged = cli("merge", one, "-o", tmp_path / "m.kiln.tar.zst", no_torch=True)
    assert merged.returncode == 0, merged.stderr
    assert "merged 1 artifact into" in merged.stdout, merged.stdout
    single = good_archive(tmp_path / "one.kiln.tar.zst", {"inductor/a": b"a"})
    assert "\n1 file, " in cli("inspect", single, no_torch=True).stdout


def test_a_key_kind_takes_its_article(cli, tmp_path: Path) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    from tests.archives import good_archive

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = tmp_path / "rsa.pem"
    pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    art = good_archive(tmp_path / "a.kiln.tar.zst")
    proc = cli("sign", art, "--key", pem, no_torch=True)
    assert proc.returncode == 2 and ": an RSA key;" in proc.stderr, proc.stderr


def test_env_for_cuda_without_a_gpu_warns(cli) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: nothing to warn about")
    proc = cli("env", "--device", "cuda")
    assert proc.returncode == 0, proc.stderr
    assert "warning: --device cuda: torch sees no GPU here" in proc.stderr


def test_a_bucket_outside_the_baked_grid_is_named_as_such() -> None:
    """Not torch's guard ("expected 32, actual 64"): the axis value the bake never used."""
    from kiln.grid import off_grid

    baked = [{"batch": b, "seq": s} for b in (1, 4) for s in (32, 128)]
    assert off_grid({"batch": 1, "seq": 32}, baked) is None
    assert off_grid({"batch": 1, "seq": 64}, baked) == (
        "seq=64 is not in the baked grid (seq: 32, 128)"
    )
    assert off_grid({"batch": 4, "seq": 128}, baked[:3]) == (
        "batch=4,seq=128 is not in the baked grid (excluded, or another shard's)"
    )
    assert off_grid({"batch": 1}, baked) == (  # another model's grid: not "excluded"
        "batch=1 is not in the baked grid (its axes are batch, seq)"
    )
    bucket = BucketStats(
        key="batch=1,seq=64",
        sizes={"batch": 1, "seq": 64},
        first_call_s=1.0,
        steady_s=0.01,
        fx_misses=1,
        aot_misses=1,
        recompile_reasons=["- tensor 'input_ids' size mismatch at index 1. expected 32, actual 64"],
    )
    report = verify_report()
    report.buckets, report.baked_grid = [bucket], baked
    (line,) = report.reasons()
    assert "seq=64 is not in the baked grid (seq: 32, 128): the bake never compiled it" in line
    assert "expected 32" not in line


def test_another_spec_is_named_by_its_differing_keys() -> None:
    from kiln.spec import differing_keys

    baked = {"name": "m", "buckets": {"seq": [32]}, "model": {"kwargs": {"dim": 64}}}
    given = {"name": "m", "buckets": {"seq": [32, 64]}, "model": {"kwargs": {"dim": 64}}, "x": 1}
    assert differing_keys(baked, given) == ["buckets.seq", "x"]
    assert differing_keys(baked, baked) == []


@pytest.mark.slow
def test_verify_with_another_spec_names_keys_and_off_grid_buckets(baked, tmp_path: Path, cli):
    import kiln
    from tests.conftest import mlp_spec

    _, result = baked
    dest = tmp_path / "cache"
    kiln.restore(result.artifact, dest)
    other = tmp_path / "other.yaml"
    other.write_text(mlp_spec(buckets="batch: [2, 7]"))
    # One route: the spec's difference and the off-grid bucket are the route's alike.
    proc = cli("verify", other, "--cache", dest, "--order", "grid", "--route", "plain", "--json")
    assert proc.returncode == 6, proc.stderr
    # Said before serving (a bucket never baked compiles first), on stderr beside --json.
    warning = " ".join(proc.stderr.split()).split("warning: ")[1]
    assert warning.startswith(
        f"{other} differs from the spec baked into this artifact at: buckets.batch; 1 bucket(s) "
        "will compile: batch=7 is not in the baked grid (batch: 2, 3, 5)"
    ), proc.stderr
    failing = json.loads(proc.stdout)["failing"]
    assert len(failing) == 1 and failing[0].startswith("batch=7: ")
    assert "batch=7 is not in the baked grid (batch: 2, 3, 5)" in failing[0]


@pytest.mark.slow
def test_verify_with_another_models_spec_is_refused_before_serving(
    baked, tmp_path: Path, cli
) -> None:
    """Other grid axes or input names than the artifact's: one line, exit 5 (as another
    number of ranks), before any process serves; not a compile and a ShapeError's traceback."""
    import kiln
    from tests.conftest import MODELS

    _, result = baked
    dest = tmp_path / "cache"
    kiln.restore(result.artifact, dest)
    other = tmp_path / "other.yaml"
    other.write_text(
        f"name: enc\nmodel:\n  factory: {MODELS}:masked_encoder\ninputs:\n"
        "  - {name: input_ids, shape: [batch, seq], dtype: int64, fill: randint, high: 1000}\n"
        "  - {name: attention_mask, shape: [batch, seq], dtype: int64, fill: ones}\n"
        "buckets:\n  batch: [2]\n  seq: [8]\n"
    )
    proc = cli("verify", other, "--cache", dest)
    assert proc.returncode == 5, proc.stderr
    assert proc.stderr == (
        "kiln: error: tiny-mlp was baked for grid axes batch and inputs (x); the spec has axes "
        "batch × seq and inputs (input_ids, attention_mask): it is another model's spec (serve "
        "the artifact with the spec it was baked from)\n"
    ), proc.stderr


@pytest.mark.slow
def test_verify_names_a_changed_model_source_with_the_miss(baked, tmp_path: Path, cli) -> None:
    """The factory's file differs from the one baked (model_source_sha256): that is named as
    the likely cause of the miss, before torch's guard (a shape that reads like a cache fault)."""
    import kiln
    from tests.conftest import MODELS, mlp_spec

    _, result = baked
    dest = tmp_path / "cache"
    kiln.restore(result.artifact, dest)
    source = MODELS.read_text()
    edited = "return self.fc2(torch.relu(self.fc1(x))) * scale * 2"
    (tmp_path / "models.py").write_text(
        source.replace("return self.fc2(torch.relu(self.fc1(x))) * scale", edited)
    )
    assert edited in (tmp_path / "models.py").read_text()
    spec = tmp_path / "spec.yaml"
    spec.write_text(mlp_spec().replace(str(MODELS), "models.py"))
    proc = cli("verify", spec, "--cache", dest, "--route", "plain", "--json")
    assert proc.returncode == 6, proc.stderr
    report = json.loads(proc.stdout)
    line = "the model's source (models.py) changed since the bake: a changed model compiles anew"
    assert report["failing"][0].startswith(line), report["failing"]
    assert report["model_source_changed"].startswith(line)


def test_a_work_cell_names_each_kind_of_compile_work_by_its_word() -> None:
    """What ``compiles`` adds up and what bench's table names come from one list (WORK_KINDS):
    a kind of work counted is a kind shown, in the list's order, zeros left out."""
    work = dict.fromkeys(WORK_KINDS, 0) | {"launchers": 2, "fx_misses": 1, "written": 4}
    assert work_cell(work) == "7: 1 FX, 2 gcc, 4 written"
    assert work_cell(dict.fromkeys(WORK_KINDS, 0)) == "0"
    bucket = BucketStats(key="b=1", sizes={"b": 1}, first_call_s=0, steady_s=0, **work)
    assert bucket.compiles == 7


def test_a_first_call_traced_twice_is_explained_not_counted() -> None:
    """A bucket whose trace Dynamo restarted compiled nothing, and verify says where its first
    call's time went; buckets without a restart add no line."""
    base = {"sizes": {"b": 1}, "first_call_s": 9.6, "steady_s": 0.001}
    twice = BucketStats(key="b=16", aot_restarts=1, aot_hits=1, **base)
    once = BucketStats(key="b=4", aot_hits=1, **base)
    assert twice.compiles == 0
    note = restart_note([once, twice])
    assert note is not None and note.startswith("traced twice, not compiled: b=16 (")
    assert "dynamic: true" in note and restart_note([once]) is None
    # bench says it under the table, per mode that traced twice
    report = bench_report()
    report.modes["kiln"].buckets = [twice]
    out = io.StringIO()
    bench_view(Console(file=out, width=200, color_system=None), report)
    lines = [x for x in out.getvalue().splitlines() if "traced twice" in x]
    assert lines == [f"kiln: {note}"]
