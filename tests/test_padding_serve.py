"""Serving by padding through real restored artifacts, in fresh processes (``kiln verify
--traffic``): random request shapes hit the baked buckets with 0 compiles, and the real slice
of each padded call equals the unpadded eager call, for a per-token MLP and a masked encoder."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from kiln.compiler.replay import replay
from tests.conftest import MODELS, bake_once

pytestmark = pytest.mark.slow

MLP = f"""name: per-token-mlp
model:
  factory: {MODELS}:tiny_mlp
  kwargs: {{dim: 16, hidden: 32}}
  call_kwargs: {{scale: 2.0}}
inputs:
  - {{name: x, shape: [batch, seq, 16], pad: 0.0}}
buckets:
  batch: [1, 4]
  seq: [8, 32]
warmup: {{calls: 1}}
"""

ENCODER = f"""name: masked-encoder
model:
  factory: {MODELS}:masked_encoder
  kwargs: {{vocab: 1000, dim: 32, layers: 2, heads: 4}}
inputs:
  - {{name: input_ids, shape: [batch, seq], dtype: int64, fill: randint, low: 1, high: 999,
     pad: 0}}
  - {{name: attention_mask, shape: [batch, seq], dtype: int64, fill: ones, pad: 0}}
buckets:
  batch: [1, 4]
  seq: [64]
warmup: {{calls: 1}}
"""


@pytest.fixture(scope="session")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The per-token MLP baked (unproven) and restored, once per run: read only."""
    spec, _ = bake_once(tmp_path_factory, "padded-mlp", MLP, restore=True, prove=False)
    return spec, spec.parent / "restored"


@pytest.fixture(scope="session")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The masked encoder baked (unproven) and restored, once per run: read only. One seq
    bucket: every request shorter than 64 is padded through the attention mask, and each bucket
    more is ~8 more kernels for g++ at bake time (4 buckets: 32 builds, 60 s on 2 cores)."""
    spec, _ = bake_once(tmp_path_factory, "padded-encoder", ENCODER, restore=True, prove=False)
    return spec, spec.parent / "restored"


def traffic(path: Path, largest: tuple[int, int], n: int, off: list[tuple[int, int]] = ()) -> Path:  # type: ignore[assignment]
    rng = random.Random(7)
    shapes = [(rng.randint(1, largest[0]), rng.randint(1, largest[1])) for _ in range(n)]
    lines = [json.dumps({"batch": b, "seq": s}) for b, s in [*shapes, *off]]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("model", ["mlp", "encoder"])
def test_random_shapes_are_served_padded_with_0_compiles_and_eager_outputs(
    model: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    spec, cache = request.getfixturevalue(model)
    largest = (4, 32) if model == "mlp" else (4, 64)
    log = traffic(tmp_path / "t.jsonl", largest, 30)
    report = replay(spec, cache, log, eager=True)
    s = report.summary()
    assert report.ok, report.reasons()
    assert s["in_grid"] == 30 and s["off_grid"] == 0
    assert s["compiles_in_grid"] == 0 and s["new_files"] == 0
    assert report.result.padding["padded"] >= 25  # most random shapes are no bucket
    # the real slice of every padded call equals the unpadded eager call
    assert s["max_abs_diff"] is not None and s["max_abs_diff"] < 1e-4
    assert all(r.eager_s is not None for r in report.result.records)
    assert report.result.eager_new_files == []  # the CPU's eager kernels are built in
    assert all(r.bucket is not None and r.overhead_s >= 0 for r in report.result.records)


def test_off_grid_policies(mlp: tuple[Path, Path], tmp_path: Path) -> None:
    spec, cache = mlp
    log = traffic(tmp_path / "t.jsonl", (4, 32), 4, off=[(2, 40), (5, 3), (2, 40)])
    refused = replay(spec, cache, log, on_miss="error")
    assert refused.ok and refused.summary()["off_grid"] == 3
    assert [r.latency_s for r in refused.off_grid] == [None, None, None]
    # Each refusal's record says why, in the words of the OffGridError a server's caller gets.
    seq = "batch=2,seq=40 is off the grid: seq=40 is larger than its largest bucket (32)"
    batch = "batch=5,seq=3 is off the grid: batch=5 is larger than its largest bucket (4)"
    assert [r.why for r in refused.off_grid] == [f"{w} (on_miss: error)" for w in (seq, batch, seq)]
    assert all(r.why is None for r in refused.in_grid)
    assert refused.result.padding["off_grid_shapes"] == {"batch=2,seq=40": 2, "batch=5,seq=3": 1}
    eager = replay(spec, cache, log, on_miss="eager", eager=True)
    assert eager.ok and eager.summary()["compiles_off_grid"] == 0
    assert all(r.max_abs_diff == 0 for r in eager.off_grid)  # the eager model itself
    compiled = replay(spec, cache, log, on_miss="compile")
    s = compiled.summary()
    assert compiled.ok and s["compiles_in_grid"] == 0
    assert s["compiles_off_grid"] >= 2  # each new shape compiled here, once


def test_a_replay_of_a_folder_a_server_wrote_into_fails(
    mlp: tuple[Path, Path], tmp_path: Path
) -> None:
    """As verify does: graphs a server compiled into the folder would serve the replay with 0
    compiles, passing what the bake never made; the folder's changes fail it (exit 6)."""
    from kiln.artifact.archive import read_manifest
    from kiln.artifact.drift import kiln_env

    spec, cache = mlp
    grown = tmp_path / "grown"
    shutil.copytree(cache, grown, symlinks=True)  # inductor/locks links to /tmp
    (grown / "kiln.env").write_text(kiln_env(grown, read_manifest(grown)))  # restored here
    (grown / "inductor" / "fxgraph" / "zz").mkdir(parents=True)
    (grown / "inductor" / "fxgraph" / "zz" / "entry").write_bytes(b"a server's graph")
    report = replay(spec, grown, traffic(tmp_path / "t.jsonl", (4, 32), 2))
    assert not report.ok and report.folder_changes == ["+inductor/fxgraph/zz/entry"]
    assert report.reasons()[0].startswith("the folder changed since it was restored (1 file(s)")


def test_verify_traffic_cli_passes_and_fails_on_an_in_grid_compile(
    mlp: tuple[Path, Path], cli, tmp_path: Path
) -> None:
    spec, cache = mlp
    log = traffic(tmp_path / "t.jsonl", (4, 32), 6)
    ok = cli("verify", spec, "--cache", cache, "--traffic", log, "--json")
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout)
    assert report["ok"] and report["summary"]["compiles_in_grid"] == 0
    assert report["summary"]["overhead_s"]["p99"] is not None
    broken = tmp_path / "broken"
    shutil.copytree(cache, broken, symlinks=True)  # inductor/locks links to /tmp
    for kind in ("fxgraph", "aotautograd"):  # the graphs gone, and the blob that holds them
        shutil.rmtree(broken / "inductor" / kind, ignore_errors=True)
    manifest = json.loads((broken / "manifest.json").read_text())
    (broken / "manifest.json").write_text(json.dumps(manifest | {"megacache": None}))
    failed = cli("verify", spec, "--cache", broken, "--traffic", log, "--json")
    assert failed.returncode == 6, failed.stderr
    report = json.loads(failed.stdout)
    assert any("compile(s)" in line for line in report["failing"])
    # What the compiles wrote in the served copy is listed, by where it went.
    assert report["new_files"] and all(f.startswith("DIR/inductor/") for f in report["new_files"])


def test_a_spec_the_padded_grid_refuses_is_one_line_exit_2(
    mlp: tuple[Path, Path], cli, tmp_path: Path
) -> None:
    """The padding path's ShapeError in the served process (a fixed dimension the artifact's
    inputs do not have) is kiln's one-line refusal, exit 2: not a bug's exit 1 and traceback."""
    spec, cache = mlp
    other = tmp_path / "other.yaml"
    other.write_text(spec.read_text().replace("[batch, seq, 16]", "[batch, seq, 8]"))
    run = cli("verify", other, "--cache", cache, "--route", "activate")
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last == "kiln: error: input 'x' dimension 2 is 8, the spec fixes it at 16", last
