"""``precompile: true`` on a model with a graph break: Dynamo's saved frames serve a restored
process with no tracing (kiln.compiler.frames), through verify and through kiln.activate().

Real bakes with torch.compile on CPU, in fresh processes (slow).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kiln
from kiln.compiler.check import compare_manifest
from kiln.errors import SpecError, UsageError
from kiln.grid import Shard, expand, shard_grid
from kiln.spec import load_spec
from tests.conftest import bake_once

ENCODER = """\
import torch
from torch import nn


@torch.compiler.disable
def hook(x):
    return None


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(100, 16)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, ids):
        x = torch.relu(self.a(self.embed(ids)))
        hook(x)  # line 20: a plain graph break
        return self.b(x).mean(dim=1)


def make():
    return Encoder()
"""

# A serving process as a user writes it: kiln.activate, build, compile, call under inference
# mode; prints what Dynamo traced and whether every output matched eager.
SERVE = """\
import json, sys
import torch
import kiln
from torch._dynamo.utils import counters

sys.path.insert(0, sys.argv[2])
act = kiln.activate(sys.argv[1])
import {module} as m
model = m.make().eval()
if sys.argv[3] == "plain":  # a server that compiles itself, on kiln.env's settings
    from kiln.serving import served_torch_kwargs
    compiled = torch.compile(model, **served_torch_kwargs(act.manifest))
else:  # off the grid, compiled in this process as the frames route allows (on_miss: compile)
    compiled = act.compile(model, on_miss="compile")
same = []
with torch.inference_mode():
    for shape in [(3, 8), (1, 8), (5, 6)]:  # the grid reordered, then off it
        ids = torch.randint(0, 100, shape)
        same.append(torch.allclose(compiled(ids), model(ids), atol=1e-5))
        if shape == (1, 8):
            grid_frames = counters["frames"]["total"]
            skips = counters["inductor"]["cudagraph_skips"]
            aot_misses = counters["aot_autograd"]["autograd_cache_miss"]
print(json.dumps({{"grid_frames": grid_frames, "all_frames": counters["frames"]["total"],
                  "same": same, "warnings": act.warnings, "cudagraph_skips": skips,
                  "grid_aot_misses": aot_misses}}))
"""


# Two buckets, one graph each side of the break: each bucket more is two graphs compiled in
# each of the bake's passes (four buckets: 21 g++ builds, 72 s of this module on 2 cores).
SPEC = (
    "name: enc\n"
    "model:\n"
    "  factory: encmod.py:make\n"
    "compile:\n"
    "  mode: reduce-overhead\n"
    "  dynamic: false\n"
    "  precompile: true\n"
    "inputs:\n"
    "  - {name: ids, shape: [batch, seq], dtype: int64, fill: randint, low: 0, high: 100}\n"
    "buckets:\n"
    "  batch: [1, 3]\n"
    "  seq: [8]\n"
    "warmup: {calls: 2}\n"
)


@pytest.fixture(scope="session")
def enc_baked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """One bake of the encoder, shared by this module's slow tests: each restores it into its
    own folder (the spec's folder holds encmod.py, the module the frames name). Unproven: the
    first test serves both routes from a fresh restore, as the proof would (two processes)."""
    return bake_once(tmp_path_factory, "frames-enc", SPEC, {"encmod.py": ENCODER}, prove=False)


def _spec(tmp_path: Path) -> Path:
    (tmp_path / "encmod.py").write_text(ENCODER)
    spec = tmp_path / "enc.yaml"
    spec.write_text(SPEC)
    return spec


def _serve(cache: Path, models: Path, module: str, route: str = "activate") -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", SERVE.format(module=module), str(cache), str(models), route],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_graph_break_model_serves_its_saved_frames_without_tracing(enc_baked, tmp_path) -> None:
    spec, result = enc_baked
    artifact = result.artifact
    manifest = result.manifest
    assert manifest.precompiled_frames is not None
    assert manifest.precompiled_frames.module == "encmod"
    assert manifest.precompiled is None  # not the AOT route: the model has a graph break
    assert any(b.where == "encmod.py:20" for b in manifest.graph_breaks)

    cache = tmp_path / "elsewhere" / "cache"
    kiln.restore(artifact, cache)
    # The activate route, the one that loads the frames (the plain one is served below).
    report = kiln.verify(spec, cache=cache, routes=("activate",))
    assert report.ok, report
    # No bucket traced a frame: today's folder route traces 2 per bucket (before and after
    # the break), then finds the graphs.
    traced = [(b.frames, b.unique_graphs) for b in report.on_route("activate")]
    assert traced == [([], 0)] * 2, traced

    served = _serve(cache, spec.parent, "encmod")
    assert served["grid_frames"] == 0, served
    assert served["all_frames"] > 0  # (5, 6) is off the grid: compiled, no name clash
    assert served["same"] == [True] * 3 and served["warnings"] == []
    # The loaded graphs saw reduce-overhead's settings: each asked for CUDA graphs, which torch
    # skips on the CPU and counts (loaded under the global config, they would not ask: on a GPU
    # they would run without CUDA graphs).
    assert served["cudagraph_skips"] > 0, served

    # A server on kiln.env that compiles itself traces, but finds every graph: the bake ran a
    # plain pass, since the frames' own entries are keyed for their route only.
    assert len(manifest.passes) >= 2 and manifest.passes[-1].compiles == 0, manifest.passes
    plain = _serve(cache, spec.parent, "encmod", route="plain")
    assert plain["grid_frames"] > 0 and plain["grid_aot_misses"] == 0, plain

    # inspect says how the artifact serves; check makes a Python difference a miss for frames.
    shown = subprocess.run(
        [sys.executable, "-m", "kiln", "inspect", str(artifact)], capture_output=True, text=True
    )
    assert "Dynamo's saved frames of encmod.forward" in shown.stdout, shown.stdout
    here = {**manifest.fingerprint, "python": "3.0.1"}
    (python,) = [f for f in compare_manifest(manifest, here).factors if f.name == "python"]
    assert python.causes_miss and "bytecode" in python.note
    without = manifest.model_copy(update={"precompiled_frames": None})
    (python,) = [f for f in compare_manifest(without, here).factors if f.name == "python"]
    assert not python.causes_miss

    # Frames lost from the restored folder: verify fails and counts the traces as misses.
    for entry in (cache / "inductor" / "dynamo").glob("*/entry"):
        entry.unlink()
    lost = kiln.verify(spec, cache=cache, routes=("activate",))  # the route that loads them
    assert not lost.ok
    assert all(b.precompile_misses > 0 for b in lost.on_route("activate")), lost.buckets


@pytest.mark.slow
def test_frames_baked_for_another_module_fall_back_to_torch_compile(enc_baked, tmp_path) -> None:
    """torch resolves the frames' code by the baked module name: a forward from a module of
    another name would crash inside torch.compile, so kiln compiles as usual and says why."""
    _, result = enc_baked
    cache = tmp_path / "cache"
    kiln.restore(result.artifact, cache)
    (tmp_path / "renamed.py").write_text(ENCODER)
    served = _serve(cache, tmp_path, "renamed")
    assert served["same"] == [True] * 3
    (warning,) = served["warnings"]
    assert "encmod.forward" in warning and "renamed.forward" in warning


def test_precompile_with_breaks_is_unsharded_for_now(tmp_path: Path) -> None:
    """torch writes all of a forward's frames to one file: two shards would both write it."""
    spec = load_spec(_spec(tmp_path))
    with pytest.raises(UsageError, match=r"^shard=0/2: precompile: true with graph breaks"):
        shard_grid(spec, expand(spec), Shard(0, 2))


def test_precompile_with_breaks_is_single_rank_for_now(tmp_path: Path) -> None:
    spec = tmp_path / "tp.yaml"
    spec.write_text(
        "name: tp\n"
        "model: {factory: m.py:make}\n"
        "compile: {precompile: true}\n"
        "distributed: {world_size: 2, backend: gloo}\n"
        "inputs: [{name: x, shape: [batch, 4], dtype: float32}]\n"
        "buckets: {batch: [1]}\n"
    )
    with pytest.raises(SpecError, match=r"tp.yaml:3:\d+: .*single-rank"):
        load_spec(spec)


@pytest.mark.slow
def test_a_frames_bake_that_saved_nothing_says_so(tmp_path: Path, monkeypatch) -> None:
    """A bake in which Dynamo traced nothing (here TORCH_COMPILE_DISABLE, left set in a CI
    environment) has no frames to save: the manifest says so rather than shipping
    precompile: true that serves nothing."""
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    spec = _spec(tmp_path)
    # One pass: the frames are recorded by the first, and a pass that traces nothing has none.
    manifest = kiln.bake(spec, tmp_path / "s.kiln.tar.zst", prove=False, passes=1).manifest
    assert manifest.precompiled_frames is None
    assert any("torch saved no Dynamo frames" in w for w in manifest.warnings), manifest.warnings
