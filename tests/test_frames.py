"""``precompile: true`` on a model with a graph break: Dynamo's saved frames serve a restored
process with no tracing (kiln.compiler.frames), through verify and through kiln.activate().

Real bakes with torch.compile on CPU, in fresh processes (slow).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kiln
from kiln.spec import SpecError, load_spec

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
compiled = act.compile(model)
same = []
with torch.inference_mode():
    for shape in [(3, 8), (1, 4), (2, 8), (5, 6)]:  # the grid in another order, then off-grid
        ids = torch.randint(0, 100, shape)
        same.append(torch.allclose(compiled(ids), model(ids), atol=1e-5))
        if shape == (2, 8):
            grid_frames = counters["frames"]["total"]
print(json.dumps({{"grid_frames": grid_frames, "all_frames": counters["frames"]["total"],
                  "same": same, "warnings": act.warnings}}))
"""


def _spec(tmp_path: Path) -> Path:
    (tmp_path / "encmod.py").write_text(ENCODER)
    spec = tmp_path / "enc.yaml"
    spec.write_text(
        "name: enc\n"
        "model:\n"
        "  factory: encmod.py:make\n"
        "compile:\n"
        "  dynamic: false\n"
        "  precompile: true\n"
        "inputs:\n"
        "  - {name: ids, shape: [batch, seq], dtype: int64, fill: randint, low: 0, high: 100}\n"
        "buckets:\n"
        "  batch: [1, 2, 3]\n"
        "  seq: [4, 8]\n"
        "warmup: {calls: 2}\n"
    )
    return spec


def _serve(cache: Path, models: Path, module: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", SERVE.format(module=module), str(cache), str(models)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_graph_break_model_serves_its_saved_frames_without_tracing(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    artifact = tmp_path / "enc.kiln.tar.zst"
    result = kiln.bake(spec, artifact)
    manifest = result.manifest
    assert manifest.precompiled_frames is not None
    assert manifest.precompiled_frames.module == "encmod"
    assert manifest.precompiled is None  # not the AOT route: the model has a graph break
    assert manifest.proof is not None and manifest.proof.compiles == 0, manifest.proof
    assert any(b.where == "encmod.py:20" for b in manifest.graph_breaks)

    cache = tmp_path / "elsewhere" / "cache"
    kiln.restore(artifact, cache)
    report = kiln.verify(spec, cache=cache)
    assert report.ok, report
    # No bucket traced a frame: today's folder route traces 2 per bucket (before and after
    # the break), then finds the graphs.
    traced = [(b.frames, b.unique_graphs) for b in report.buckets]
    assert traced == [([], 0)] * 6, traced

    served = _serve(cache, tmp_path, "encmod")
    assert served["grid_frames"] == 0, served
    assert served["all_frames"] > 0  # (5, 6) is off the grid: compiled, no name clash
    assert served["same"] == [True] * 4 and served["warnings"] == []


@pytest.mark.slow
def test_frames_baked_for_another_module_fall_back_to_torch_compile(tmp_path: Path) -> None:
    """torch resolves the frames' code by the baked module name: a forward from a module of
    another name would crash inside torch.compile, so kiln compiles as usual and says why."""
    spec = _spec(tmp_path)
    artifact = tmp_path / "enc.kiln.tar.zst"
    kiln.bake(spec, artifact, prove=False)
    cache = tmp_path / "cache"
    kiln.restore(artifact, cache)
    (tmp_path / "renamed.py").write_text(ENCODER)
    served = _serve(cache, tmp_path, "renamed")
    assert served["same"] == [True] * 4
    (warning,) = served["warnings"]
    assert "encmod.forward" in warning and "renamed.forward" in warning


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
