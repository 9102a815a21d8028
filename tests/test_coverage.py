"""What the bake covers: fresh inputs per warmup call, graph breaks reported with their place,
data-dependent breaks warned about and named by verify, and the bake's proof of its artifact.

The bakes are real torch.compile on CPU, in fresh processes (slow).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kiln
from kiln.artifact.manifest import BucketStats, GraphBreak
from kiln.compiler.dynamo_log import parse_graph_break
from kiln.compiler.verify import explain

RECORDING = """\
import torch


@torch.compiler.disable
def record(x):
    with open(PATH, "a") as fh:
        fh.write(f"{x.shape[0]} {float(x.double().sum())!r}\\n")


class M(torch.nn.Module):
    def forward(self, x):
        record(x)  # line 12: a plain graph break (a disabled function)
        return torch.relu(x) * 2


def make(path):
    global PATH
    PATH = path
    return M()
"""

BRANCHY = """\
import torch


class M(torch.nn.Module):
    def __init__(self, sign):
        super().__init__()
        self.register_buffer("sign", torch.tensor(float(sign)))

    def forward(self, x):
        y = x * self.sign
        if y.sum() > 0:  # line 11: a branch on tensor data
            return torch.relu(y) * 2
        return torch.tanh(y) - 1


def make(sign=1):
    return M(sign)
"""


def _spec(tmp_path: Path, name: str, source: str, kwargs: str, fill: str, calls: int) -> Path:
    (tmp_path / f"{name}.py").write_text(source)
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(
        f"name: {name}\n"
        "model:\n"
        f"  factory: {name}.py:make\n"
        f"  kwargs: {kwargs}\n"
        "compile:\n"
        "  dynamic: false\n"
        "inputs:\n"
        f"  - {{name: x, shape: [batch, 8], dtype: float32, fill: {fill}}}\n"
        "buckets:\n"
        "  batch: [2, 3]\n"
        f"warmup: {{calls: {calls}}}\n"
    )
    return spec


@pytest.mark.slow
def test_warmup_calls_draw_fresh_inputs_and_plain_breaks_are_listed(tmp_path: Path) -> None:
    """Every warmup call of a bucket sees new data; a plain break is listed, not warned about."""
    calls = tmp_path / "calls.txt"
    spec = _spec(tmp_path, "recording", RECORDING, f"{{path: '{calls}'}}", "randn", calls=3)
    result = kiln.bake(spec, tmp_path / "rec.kiln.tar.zst", prove=False)
    seen: dict[str, list[str]] = {}
    for line in calls.read_text().splitlines():
        batch, total = line.split()
        seen.setdefault(batch, []).append(total)
    for batch in ("2", "3"):
        # the eager check before compiling calls each bucket on its first call's inputs; then
        # first pass: 1 call; warm pass: 2 more warmups, then steady calls on the first inputs
        checked, warmups = seen[batch][0], seen[batch][1:4]
        assert len(set(warmups)) == 3 and checked == warmups[0], (batch, seen[batch])
    (gb,) = result.manifest.graph_breaks
    assert gb.where == "recording.py:12" and not gb.data_dependent
    assert sorted(gb.buckets) == ["batch=2", "batch=3"]
    assert result.manifest.warnings == []
    assert result.manifest.proof is None


@pytest.mark.slow
def test_data_dependent_break_is_warned_about_and_verify_names_it(
    tmp_path: Path, cli, write_spec
) -> None:
    """The bake warns (stderr, --json, manifest) about a branch on tensor data; when serving
    data takes the other side, verify names that break instead of some guard."""
    spec = _spec(tmp_path, "branchy", BRANCHY, "{sign: 1}", "ones", calls=2)
    artifact = tmp_path / "branchy.kiln.tar.zst"
    # Unproven: the warning is the bake's own, and verify below serves (one process fewer).
    proc = cli("bake", spec, "-o", artifact, "--json", "--no-prove")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout)
    (warning,) = summary["warnings"]
    assert "depend on tensor data" in warning and "branchy.py:11" in warning
    assert "Data-dependent branching" in warning
    assert "warning:" in proc.stderr and "branchy.py:11" in proc.stderr
    manifest = kiln.read_manifest(artifact)
    assert manifest.warnings == [warning]
    (gb,) = [b for b in manifest.graph_breaks if b.data_dependent]
    assert gb.where == "branchy.py:11" and gb.reason == "Data-dependent branching"

    dest = tmp_path / "served" / "cache"
    kiln.restore(artifact, dest)
    # Serving data that takes the other side: the sign flips y's sum (a buffer's value is data).
    flipped = spec.with_name("flipped.yaml")
    flipped.write_text(spec.read_text().replace("{sign: 1}", "{sign: -1}"))
    # One route: the break is the model's, whichever way the server compiles it.
    proc = cli("verify", flipped, "--cache", dest, "--route", "plain")
    assert proc.returncode == 6, proc.stderr[-2000:]
    assert "data-dependent graph break at" in proc.stderr and "branchy.py:11" in proc.stderr
    assert "never did" in proc.stderr


@pytest.mark.slow
def test_strict_bake_whose_proof_keeps_compiling_is_exit_6_without_artifact(
    tmp_path: Path, cli
) -> None:
    """A model that differs per process can never be proven: once a re-bake changed nothing the
    proof missed, ``--strict`` makes that exit 6 and writes nothing (without it, a warning:
    test_roundtrip)."""
    source = "import random, torch\nSCALE = random.random()\n" + (
        "class M(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return torch.relu(x) * SCALE\n"
        "def make():\n    return M()\n"
    )
    spec = _spec(tmp_path, "perprocess", source, "{}", "randn", calls=1)
    # One bucket is enough to never hit; each of its four processes compiles once, not twice.
    spec.write_text(spec.read_text().replace("batch: [2, 3]", "batch: [2]"))
    strict = tmp_path / "strict.kiln.tar.zst"
    proc = cli("bake", spec, "-o", strict, "--strict")
    assert proc.returncode == 6, proc.stderr[-2000:]
    assert "--strict: the bake's proof" in proc.stderr
    assert "after 1 re-bake(s) (the last changed nothing it missed)" in proc.stderr
    assert not strict.exists()


def test_explain_prefers_the_data_dependent_break_over_a_guard() -> None:
    """Unit: a resume frame after a data-dependent break is named; otherwise the guard is."""
    seam = GraphBreak(
        where="/m/model.py:42", reason="Data-dependent branching", data_dependent=True
    )
    bucket = BucketStats(
        key="batch=4",
        sizes={"batch": 4},
        first_call_s=1.0,
        steady_s=0.1,
        fx_misses=1,
        recompile_reasons=["tensor 'x' size mismatch at index 0. expected 2, actual 4"],
        frames=["torch_dynamo_resume_in_forward_at_42 /m/model.py:42"],
    )
    assert "data-dependent graph break at /m/model.py:42" in explain(bucket, "", [seam])
    other = bucket.model_copy(update={"frames": ["forward /m/model.py:10"]})
    assert "size mismatch" in explain(other, "", [seam])
    assert "environment differs: torch" in explain(bucket, "torch", [seam])


@pytest.mark.parametrize(
    ("message", "where", "data_dependent"),
    [
        (
            "Graph break in user code at /a/m.py:7\nGraph Break Reason: Data-dependent branching\n"
            "  https://meta-pytorch.github.io/compile-graph-break-site/gb/gb0170.html",
            "/a/m.py:7",
            True,
        ),
        (
            "Graph break (user stack suppressed due to duplicate graph break) in user code at "
            "/a/m.py:9\nGraph Break Reason: Unsupported Tensor.item() call with "
            "capture_scalar_outputs=False",
            "/a/m.py:9",
            True,
        ),
        (
            "Graph break in user code at /a/m.py:3\nGraph Break Reason: Encountered graph break "
            "when attempting to trace CALL: a function call, e.g. f(x, y):\n\nFailed to trace "
            "builtin operator\n  Explanation: Dynamo does not know how to trace builtin `print`",
            "/a/m.py:3",
            False,
        ),
    ],
)
def test_graph_break_messages_parse(message: str, where: str, data_dependent: bool) -> None:
    gb = parse_graph_break(message)
    assert gb is not None and gb.where == where and gb.data_dependent is data_dependent
    assert parse_graph_break("Graph break: no place given") is None


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=400), st.text(max_size=40), st.integers(0, 10**6))
def test_graph_break_parser_never_raises(noise: str, path: str, line: int) -> None:
    """Whatever torch prints, parsing gives a bounded break or None (never an exception)."""
    for message in (noise, f"Graph break in user code at {path}:{line}\n{noise}"):
        gb = parse_graph_break(message)
        assert gb is None or (len(gb.where) <= 500 and len(gb.reason) <= 500)
