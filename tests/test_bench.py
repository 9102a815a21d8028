"""`kiln bench` on CPU: every mode runs in its own process; kiln compiles nothing, cold does."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kiln.compiler.bench import reusable_bake
from kiln.spec import load_spec
from tests.conftest import mlp_spec

pytestmark = pytest.mark.slow


def test_bench_modes_and_ratios(write_spec, cli, tmp_path: Path) -> None:
    # One bucket: every mode runs the whole grid either way; each bucket more is a graph that
    # the bake and the megacache mode each compile again.
    spec = write_spec(mlp_spec("bench-mlp", buckets="batch: [2]"))
    saved = tmp_path / "bench.json"
    tmp, work = tmp_path / "tmp", tmp_path / "work"
    tmp.mkdir()
    args = ("--json", "--save", saved, "--workdir", work)
    proc = cli("bench", spec, *args, env={"TMPDIR": str(tmp)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    # kiln leaves nothing in the temp dir but the bake's per-name lock. (torch writes C++
    # precompiled headers to its default folder whatever TORCHINDUCTOR_CACHE_DIR says.)
    left = [p for p in tmp.rglob("*") if p.is_file() and "torchinductor_" not in str(p)]
    assert all(p.suffix == ".lock" and p.stat().st_size == 0 for p in left), left
    report = json.loads(proc.stdout)
    assert report == json.loads(saved.read_text())
    assert report["bake_reused"] is False and (work / "bench.kiln.tar.zst").is_file()
    modes = report["modes"]
    assert set(modes) == {"eager", "cold", "kiln", "megacache", "copied"}
    assert modes["cold"]["compiles"] > 0
    assert modes["kiln"]["compiles"] == 0
    assert modes["copied"]["compiles"] == 0
    assert modes["eager"]["compiles"] == 0
    # The Mega-Cache blob carries no C++ .so: torch rebuilds them (the gap kiln closes).
    assert modes["megacache"]["compiles"] > 0
    for m in modes.values():
        assert m["time_to_ready_s"] > 0 and len(m["buckets"]) == 1
    assert report["ratios"]["kiln/cold"] > 0
    # Start-up, phase by phase (issue 13): eager imports no Inductor; the phases add up.
    eager, served = ([p["phase"] for p in modes[m]["startup_phases"]] for m in ("eager", "kiln"))
    assert eager[:3] == ["interpreter + kiln import", "import torch", "device init"]
    assert "model build" in eager and not any("Inductor" in p for p in eager)
    # kiln serves as a user's server on kiln.env does: no worker pool, nothing started early.
    assert "model build" in served and not any("pool" in phase for phase in served)
    for m in (modes["eager"], modes["kiln"]):
        assert abs(sum(p["s"] for p in m["startup_phases"]) - m["startup_s"]) < 0.05
    # Other modes in the same --workdir: the bake is reused (same spec, model and machine).
    modes = ("--modes", "kiln,kiln-blob,kiln-serial", "--repeat", "2")
    human = cli("bench", spec, *modes, "--save", saved, "--workdir", work)
    assert human.returncode == 0, human.stderr[-2000:]
    assert "time to ready" in human.stdout and "kiln-blob" in human.stdout
    assert "start-up, phase by phase" in human.stdout
    # Piped progress says which mode and which run each line belongs to (issue 17 item 4).
    assert f"bench: bake: reused from {work}" in human.stderr and "pass 1" not in human.stderr
    assert "bench: kiln-blob 2/2" in human.stderr
    assert "  kiln-serial 1/2 · batch=2: start (" in human.stderr
    both = json.loads(saved.read_text())
    assert both["bake_reused"] is True and both["bake_wall_s"] == report["bake_wall_s"]
    assert set(both["modes"]) == {"kiln", "kiln-blob", "kiln-serial"}
    # kiln-serial compiles with options instead of mode, plus compile_threads: same cache entries.
    assert [m["compiles"] for m in both["modes"].values()] == [0, 0, 0]
    # --repeat: two runs each, each in its own fresh restore, and the spread in the table.
    assert [len(m["ready_runs_s"]) for m in both["modes"].values()] == [2, 2, 2]
    assert both["modes"]["kiln"]["time_to_ready_s"] == min(both["modes"]["kiln"]["ready_runs_s"])
    assert " s (" in human.stdout
    assert both["ratios"]["kiln-blob/kiln"] > 0 and both["ratios"]["kiln-serial/kiln"] > 0
    bad = cli("bench", spec, "--modes", "kiln,warp", no_torch=True)
    assert bad.returncode == 2 and "warp" in bad.stderr
    # What a bake in the work folder is not reused for (each would bake again).
    other = write_spec(mlp_spec("bench-mlp", buckets="batch: [3]"), "other.yaml")
    assert reusable_bake(load_spec(other), work) == "baked from another spec"
    with pytest.MonkeyPatch.context() as mp:  # an image without torch's bytecode: ship it
        mp.setattr(sys, "pycache_prefix", str(tmp_path / "no-pycache"))
        found = reusable_bake(load_spec(spec), work)
    assert found == "baked on an image with torch's bytecode (none shipped; this image lacks it)"
    with (work / "bench.kiln.tar.zst").open("ab") as artifact:
        artifact.write(b"\0")
    assert reusable_bake(load_spec(spec), work) == "the artifact changed"
    assert reusable_bake(load_spec(spec), tmp_path) == "no bake in the work folder"


def test_bench_precompile_spec_compares_with_plain_compile_caches(
    write_spec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kiln serves the precompiled forwards; cold and the stock folder come from plain JIT. Its
    work folder, in $TMPDIR without --workdir, is removed with all it held."""
    import tempfile

    import kiln

    text = mlp_spec("bench-pre", buckets="batch: [2]").replace(
        "  dynamic: false", "  dynamic: false\n  fullgraph: true\n  precompile: true"
    )
    # two automatic passes: the forwards, then the plain route's entries (kiln.compiler.bake)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)
    report = kiln.bench(write_spec(text), modes=("cold", "kiln", "copied")).to_dict()
    # Nothing left in the temp dir but the bake's per-name lock (and torch's precompiled
    # headers, which go to its default folder whatever TORCHINDUCTOR_CACHE_DIR says).
    left = [p for p in tmp.rglob("*") if p.is_file() and "torchinductor_" not in str(p)]
    assert all(p.suffix == ".lock" and p.stat().st_size == 0 for p in left), left
    assert "bake_reused" not in report  # no --workdir: nothing to reuse
    modes = report["modes"]
    assert report["cold_source"] == "separate plain run"
    assert modes["cold"]["compiles"] > 0
    assert modes["copied"]["compiles"] == 0  # the plain run's folder: every graph hits
    assert modes["kiln"]["compiles"] == 0
    assert "precompiled" in modes["kiln"]["note"]
    assert sum(b["unique_graphs"] for b in modes["kiln"]["buckets"]) == 0  # no Dynamo trace
    assert 0 < modes["kiln"]["startup_s"] <= modes["kiln"]["time_to_ready_s"]
    assert [p["s"] for p in modes["kiln"]["startup_phases"] if p["phase"] == "precompiled load"]


def test_a_spec_served_on_another_route_keeps_its_file(write_spec) -> None:
    """bench's route variants point errors and relative paths at the spec the user wrote."""
    from kiln.compiler.bench import with_route
    from kiln.spec import load_spec

    spec = load_spec(write_spec(mlp_spec()))
    for route in ("aoti", "compile"):
        variant = with_route(spec, route)
        assert variant.compile.route == route
        assert (variant.path, variant.base_dir) == (spec.path, spec.base_dir)
    assert with_route(spec, "aoti").compile.fullgraph and not spec.compile.fullgraph


EAGER_PASS = """\
import sys
from kiln.compiler import worker
from kiln.compiler.protocol import WorkerRequest
from kiln.spec import load_spec

spec = load_spec(sys.argv[1])
request = WorkerRequest(
    spec=spec.canonical(), spec_base=str(spec.base_dir), order=["batch=2", "batch=7"],
    torch_kwargs=None,
)
result = worker.run(request)
assert all(b.compiles == 0 for b in result.buckets)
print(sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules))
"""


def test_an_eager_pass_never_imports_dynamo(write_spec) -> None:
    """bench's eager baseline is a server without torch.compile: measuring compile counters,
    or importing the example models (one wraps a hook in torch.compiler.disable), must not
    import Dynamo, which costs seconds on a GPU host and would flatter every ratio to eager."""
    import subprocess
    import sys

    spec = write_spec(mlp_spec("eager-mlp", buckets="batch: [2, 7]"))
    proc = subprocess.run(
        [sys.executable, "-c", EAGER_PASS, str(spec)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
